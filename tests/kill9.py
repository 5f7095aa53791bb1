"""Kill -9 for the resume tests: run a target script until it reaches its freezing point, then SIGKILL it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kill_when_frozen(script: str, *args: str, marker: Path) -> None:
    """Run ``tests/<script> args...`` (the repository and tests/ importable); once it creates ``marker``
    (its freezing point), SIGKILL it. Fails the test if the child exits or hangs before."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / script), *args],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300  # a guard against a hung child, not a timing assertion
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"child exited ({child.returncode}) before freezing:\n{child.stdout.read().decode()}")
            if time.monotonic() > deadline:
                pytest.fail("child never reached its freezing point")
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
