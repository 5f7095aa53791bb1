"""The project's checkout: its folder, ``git`` run there, and the tracked files a run's commit is compared with."""

from __future__ import annotations

from pathlib import Path

# The project's root (its git work tree, when it is one).
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# What a run's commit is compared with: every tracked file but dvc.lock, which records what the stages made (DVC
# rewrites it as a pipeline runs) and decides nothing a stage computes.
NOT_DVC_RECORDS = ("--", ".", ":(exclude)dvc.lock")


def git(*args: str) -> str | None:
    """``git ARGS`` in the project's folder: its output, or None where git fails (no repository, no git)."""
    import subprocess

    try:
        done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()
