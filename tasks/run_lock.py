"""One process at a time in a run's folder: two identical runs started together would otherwise train into
the same checkpoint and log into the same MLflow run.

:func:`run_lock` holds an exclusive ``flock`` on ``FOLDER/run.lock`` while a run (or a sweep's parent run)
works there, and writes the holder's pid, host and command into the file. A second process is refused at
once with :class:`RunInUseError` naming the folder and the holder. The kernel drops the lock when its holder
dies, however it dies, so a lock is never stale: a pid left in the file by a killed run is overwritten by
the next one. Under torchrun only the tracking rank locks (the ranks of one launch are one run).

:func:`lock_file` is the lock itself, which an output folder's is too (:func:`tasks.outputs.outputs_held`: one
flow at a time writes into a folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from tasks.tracking_rank import tracking_rank

LOCK_FILE = "run.lock"


class RunInUseError(ValueError):
    """Another process is running in this run's folder (or writing into this output folder)."""


def _command(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    return command if len(command) <= 160 else command[:157] + "..."


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold ``folder``'s run lock (the folder made if missing) for the ``with`` block; RunInUseError when
    another process holds it."""
    folder = Path(folder)

    def in_use(holder: str) -> str:
        return (
            f"run folder {folder} is in use by {holder}: a run with the same settings is running there; "
            "wait for it to end (or stop it), then run again to continue it"
        )

    with lock_file(folder / LOCK_FILE, in_use):
        yield


@contextlib.contextmanager
def lock_file(path: Path, in_use: Callable[[str], str]) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (made, with its folder, if missing) for the ``with`` block, this
    process named in it; RunInUseError with ``in_use(holder)`` when another process holds it. Off the tracking
    rank: nothing (the ranks of one launch are one run)."""
    if not tracking_rank():
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ValueError(
            f"{path}: cannot be opened as the run's lock file ({error.strerror}); a lock file is an ordinary file "
            "that the run creates: remove what is there, or make the folder writable"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            raise RunInUseError(in_use(holder)) from None
        command = _command(os.getpid())
        holder = f"process {os.getpid()} on {socket.gethostname()}" + (f" ({command})" if command else "")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder + "\n").encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
