"""Files read: only regular files, never the system's own (``/proc``, ``/sys``, ``/dev``), and never more than a
cap where a file is read whole.

A FIFO blocks its reader until something writes into it (for ever, deaf to a timeout), a device or
``/proc/self/pagemap`` is read for as long as there is memory, and ``/proc/self/environ`` holds the process's
secrets: an input that names one of them is refused before it is opened (:func:`not_a_file_to_read`), with one
line naming it (:func:`check_file_to_read`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# The operating system's own files: what they hold is the machine's (its processes, memory, devices), not data.
SYSTEM_FILES = (Path("/proc"), Path("/sys"), Path("/dev"))
_KINDS = {
    stat.S_ISFIFO: "a FIFO (a named pipe: reading it waits for a writer)",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a device",
    stat.S_ISBLK: "a device",
    stat.S_ISDIR: "a folder",
}


def not_a_file_to_read(path: str | os.PathLike) -> str | None:
    """Why ``path`` is no file to read as an input (links followed), or None for a regular file outside the
    system's folders (and for a path that does not exist: the caller says it is missing)."""
    path = Path(path).expanduser()
    try:
        resolved = path.resolve()
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as error:  # a loop of links, a name too long, no permission
        return f"cannot be read ({error.strerror or error})"
    system = next((s for s in SYSTEM_FILES if resolved == s or s in resolved.parents), None)
    if system is not None:
        return f"a file of the operating system ({system}), not an input; not read"
    for test, kind in _KINDS.items():
        if test(mode):
            return f"{kind}, not a regular file; not read"
    return None if stat.S_ISREG(mode) else "not a regular file; not read"


def check_file_to_read(path: str | os.PathLike, what: str) -> None:
    """ValueError ``WHAT PATH: why`` when ``path`` is no file to read (:func:`not_a_file_to_read`)."""
    problem = not_a_file_to_read(path)
    if problem is not None:
        raise ValueError(f"{what} {path}: {problem}")


def read_text_capped(path: str | os.PathLike, what: str, most_bytes: int) -> str:
    """The text of a file read whole, once it is checked (:func:`check_file_to_read`) and holds at most
    ``most_bytes`` bytes; ValueError naming ``what`` and the file otherwise (also for text that is not UTF-8)."""
    check_file_to_read(path, what)
    path = Path(path).expanduser()
    with open(path, "rb") as f:
        data = f.read(most_bytes + 1)
    if len(data) > most_bytes:
        raise ValueError(f"{what} {path}: larger than {most_bytes:,} bytes; not the file meant here, not read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} {path}: not UTF-8 text (byte {error.start})") from None
