"""Stores moved or unpacked elsewhere: a local store records each run's artifact folder as an absolute path of the
machine that made it; :func:`moved_artifacts` finds the folder where the store is now (beside or above the
database, or in another ``mlruns`` folder of the archive the store came in)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tasks.mlflow_store import DEFAULT_ARTIFACT_ROOT, sqlite_database


def moved_artifacts(tracking_uri: str, artifact_uri: str) -> Path | None:
    """Where a run's artifact folder is on this machine when its store was moved or unpacked elsewhere: an
    ``sqlite:///`` store records the folder as an absolute path of the machine that made it
    (``/work/x/mlruns/grpo/<run id>/artifacts``); its trailing part, from a folder named ``mlruns`` or else from
    the run's own folder, is looked for under the database's folder and each folder above it, and then in the
    other ``mlruns`` folders of the archive the store came in (:func:`archive_folders`: another store's folder of
    it may hold the run's files). The recorded folder when it exists; None when the store is not a local database
    or the folder is in none of those places."""
    from urllib.parse import urlparse

    database = sqlite_database(tracking_uri)
    parsed = urlparse(artifact_uri)
    if database is None or parsed.scheme not in ("", "file"):
        return None
    recorded = Path(parsed.path)
    if recorded.is_dir():
        return recorded
    parts = recorded.parts
    at_mlruns = [i for i, part in enumerate(parts) if part == DEFAULT_ARTIFACT_ROOT]
    start = max(at_mlruns, default=max(len(parts) - 2, 0))
    tail = Path(*parts[start:]) if parts[start:] else None
    if tail is None:
        return None
    bases = [database.resolve().parent, *database.resolve().parent.parents]
    found = next((base / tail for base in bases if (base / tail).is_dir()), None)
    if found is None and at_mlruns:
        below = Path(*tail.parts[1:])  # the part below mlruns/
        found = next((folder / below for folder in archive_folders(database) if (folder / below).is_dir()), None)
    return found


# Where the mlruns folders of an archive a store came in are looked for: below the store's folder and the
# ARCHIVE_LEVELS folders above it, at most ARCHIVE_DEPTH levels down and ARCHIVE_FOLDERS folders in all (a search
# that never walks a whole disk), never in a virtual environment or NOT_ARCHIVE_FOLDERS.
ARCHIVE_LEVELS, ARCHIVE_DEPTH, ARCHIVE_FOLDERS = 2, 6, 20_000
NOT_ARCHIVE_FOLDERS = {".git", ".dvc", "__pycache__", "node_modules", ".a5-cache"}


def archive_top(database: Path) -> Path:
    """The highest folder :func:`archive_folders` searches for a store's archive."""
    folder = database.resolve().parent
    return ([folder, *folder.parents])[: ARCHIVE_LEVELS + 1][-1]


def archive_folders(database: Path) -> Iterator[Path]:
    """The folders named ``mlruns`` near store ``database`` (see :data:`ARCHIVE_LEVELS`), nearest first."""
    folder = database.resolve().parent
    walked: set[Path] = set()
    budget = ARCHIVE_FOLDERS
    for base in [folder, *folder.parents][: ARCHIVE_LEVELS + 1]:
        level = [base]
        for _ in range(ARCHIVE_DEPTH + 1):
            below = []
            for current in level:
                if current in walked or budget <= 0:
                    continue
                walked.add(current)
                budget -= 1
                try:
                    entries = sorted(e for e in current.iterdir() if e.is_dir() and not e.is_symlink())
                except OSError:
                    continue
                for entry in entries:
                    if entry.name == DEFAULT_ARTIFACT_ROOT:
                        yield entry
                    elif entry.name not in NOT_ARCHIVE_FOLDERS and not (entry / "pyvenv.cfg").is_file():
                        below.append(entry)
            level = below
