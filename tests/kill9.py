"""Kill -9 for the resume tests: run a target until it reaches its freezing point, then SIGKILL it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kill_at_marker(
    child: subprocess.Popen,
    marker: Path,
    output: Callable[[], str],
    *,
    group: bool = False,
    before_kill: Callable[[], None] = lambda: None,
) -> None:
    """Once ``child`` creates ``marker`` (its freezing point), call ``before_kill()`` and SIGKILL it (its whole
    process group with ``group``). Fails the test, showing the end of ``output()``, if the child exits or
    hangs before; the child never outlives the call."""

    def kill() -> None:
        os.killpg(child.pid, signal.SIGKILL) if group else child.kill()

    try:
        deadline = time.monotonic() + 300  # a guard against a hung child, not a timing assertion
        while not marker.exists():
            if child.poll() is not None:
                pytest.fail(f"the child exited ({child.returncode}) before its freezing point:\n{output()[-5000:]}")
            if time.monotonic() > deadline:
                pytest.fail("the child never reached its freezing point")
            time.sleep(0.05)
        before_kill()
        kill()
        assert child.wait() == -signal.SIGKILL
    finally:
        if child.poll() is None:
            kill()
            child.wait()


def kill_when_frozen(script: str, *args: str, marker: Path) -> None:
    """Run ``tests/<script> args...`` (the repository and tests/ importable) and kill it at ``marker``."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / script), *args],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    with child.stdout:
        kill_at_marker(child, marker, lambda: child.stdout.read().decode())
