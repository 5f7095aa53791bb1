"""What a cache key holds for a file or a model: its contents, never its path alone.

A path says where bytes were, not which: a data file edited in place, a ``dvc pull`` of a new version, the
same relative path in another folder, a model folder trained again behind the same link. So the keys of
the cached tasks and of a training run's folder (:func:`tasks.runs.params_key`) take:

- a file: the sha256 of its bytes (:func:`file_digest`);
- a model folder: the sha256 over its files' relative paths and digests (:func:`folder_digest`); the
  embedded model by its converted folder; a hub id by the revision the local Hugging Face cache holds for
  it (the id alone before it is downloaded).

Hashing gigabytes of weights on every run would cost seconds, so a file's digest is remembered, in
``~/.cache/a5/digests/``, under its identity and change time (device, inode, size, mtime, ctime, all in
ns): any write to the file changes its ctime, which no tool can set back, so a remembered digest is that
of the bytes now there. A memo that cannot be written is skipped (the digest is computed each time).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath

from a5core.runtime.reading import check_file_to_read
from a5core.runtime.writing import write_text_atomic

DIGEST_MEMO = Path("~/.cache/a5/digests")


def file_digest(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes, remembered under the file's identity and change time; ValueError for
    no file to read (a FIFO, a device, the system's ``/proc``: :func:`a5core.runtime.reading.check_file_to_read`),
    which would be read for ever."""
    check_file_to_read(path, "hashing")
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    identity = [str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    memo = DIGEST_MEMO.expanduser() / hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    try:
        remembered = memo.read_text().strip()
    except OSError:
        remembered = ""
    if len(remembered) == 64:
        return remembered
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(memo, digest)
    except OSError:
        pass
    return digest


def file_digests(folder: str | os.PathLike) -> dict[str, str]:
    """Every file under ``folder`` (links followed), sorted: its path relative to ``folder`` → :func:`file_digest`."""
    root = Path(folder).expanduser().resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): file_digest(p) for p in files}


def folder_digest(folder: str | os.PathLike) -> str:
    """The sha256 over :func:`file_digests`: the same files with the same bytes give the same digest wherever
    they are."""
    return digest_of_files(file_digests(folder))


def digest_of_files(digests: dict[str, str]) -> str:
    """:func:`folder_digest` of a folder whose files' digests (relative path → sha256) are ``digests``: a
    registered model's recorded digests name the folder it saved without the folder at hand."""
    in_order = sorted(digests.items(), key=lambda item: PurePosixPath(item[0]))  # file_digests' order
    return hashlib.sha256(json.dumps(in_order).encode()).hexdigest()


def model_fingerprint(model: str) -> str:
    """A model's weights for a cache key: ``folder:<digest>`` for a local folder or the embedded model (its
    converted folder); ``hub:<id>@<revision>`` for a hub id the local Hugging Face cache holds (the
    revision its ``main`` points at), ``hub:<id>`` before it is downloaded."""
    from a5core.policy.model_specs import EMBEDDED_DEFAULT, resolve_model

    path = Path(model).expanduser()
    if path.is_dir() or model == EMBEDDED_DEFAULT:
        return f"folder:{folder_digest(resolve_model(model))}"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid hub id: loading it fails with its own message
        cached = None
    return f"hub:{model}@{Path(cached).parent.name}" if isinstance(cached, str) else f"hub:{model}"
