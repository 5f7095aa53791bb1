"""Files written whole or not at all, and folders checked before a run writes into them: what every room that
writes a file uses (records, checkpoints, reports), so a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_UMASK = os.umask(0o022)  # read once at import (setting it is process-wide, so not from worker threads)
os.umask(_UMASK)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write text (UTF-8) to a temporary file beside ``path``, fsync it, then rename it into place
    (:func:`write_bytes_atomic`)."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes to a temporary file beside ``path``, fsync it, then rename it into place: a crash or a full disk
    leaves any previous file at ``path`` untouched and no temporary behind, and a link at ``path`` is replaced by
    the file, never written through."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_writable_folder(path: str | os.PathLike, what: str) -> None:
    """Create folder ``path`` if needed and check a file can be written in it; ValueError naming ``what``
    and the path otherwise (before a run spends its time, not at its end)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"{what} {folder}: cannot write there ({error.strerror or error})") from None


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> Path:
    """Write records as jsonl, atomically (see write_text_atomic)."""
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
