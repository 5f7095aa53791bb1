"""The MLflow store: one database (``sqlite:///mlflow.db``) with artifacts under ``mlruns/``, its file lock, a
client reading it, and what its failures mean for a user.

MLflow 3.17 refuses a plain ``./mlruns`` file store, so runs live in SQLite and artifacts in files. A new store is
created, and an experiment looked up or created, under a file lock (:func:`store_lock`): runs started together on
a new ``mlflow.db`` each race to create its tables (and the same experiment) otherwise, and all but one failed. A
store that cannot take writes or cannot be read (read-only, full, deleted while a run logs into it, not a
database, its driver not installed) ends a command with one line saying so and what to do (:func:`store_problem`),
not MLflow's three chained tracebacks.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow

from tasks.servers import check_server, shown_uri

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACT_ROOT = "mlruns"


def sqlite_database(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store, in either of SQLAlchemy's forms: a path
    (``sqlite:///mlflow.db``), or a SQLite URI (``sqlite:///file:PATH?mode=ro&uri=true``); the query is not
    part of the path. None for other stores and an in-memory database."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path, _, query = tracking_uri.removeprefix("sqlite:///").partition("?")
    if "uri=true" in query.split("&"):
        path = path.removeprefix("file:")
    return None if path in ("", ":memory:") else Path(path).expanduser()


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """An exclusive lock on a SQLite store across this machine's processes: the file ``DATABASE.lock``
    beside the database (its folder made if missing), which stays there with the store; no lock for other
    stores (a server serialises its own)."""
    database = sqlite_database(tracking_uri)
    if database is None:
        yield
        return
    database = database.resolve()
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(f"{database.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store_client(tracking_uri: str) -> Any:
    """A client reading ``tracking_uri`` (and the fluent API pointed there too); a tracking server must answer
    first (:func:`check_server`)."""
    check_server(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.MlflowClient(tracking_uri=tracking_uri)


# What SQLite says when a store cannot take writes or be read, what it means for the user, and what to do.
_INTACT = "what was logged before is intact: fix the store, or pass another --tracking-uri, and run again"
_DAMAGED = (
    "its runs cannot be read back: move the file aside (keep it for a recovery tool) and run again to start a "
    "new store; runs resumed from their checkpoints then say which MLflow run they cannot find"
)
_VANISHED = (
    "the run's checkpoints and outputs are intact: put the file back, or run again (a new store, created there, "
    "takes the runs from then on; a resumed run then says which MLflow run it cannot find)"
)
_STORE_PROBLEMS = {
    "readonly database": ("it is read-only", _INTACT),
    "database or disk is full": ("the disk holding it is full", _INTACT),
    "unable to open database file": ("it cannot be opened (its folder is missing or not writable)", _INTACT),
    "file is not a database": (
        "the file is not an SQLite database",
        "if the address names the wrong file, fix it; if the store was overwritten, " + _DAMAGED,
    ),
    "database disk image is malformed": ("the database is damaged (truncated?)", _DAMAGED),
    # SQLite makes an empty file where a deleted database was, when the run next opens it
    "no such table": ("it holds no MLflow tables: its file was deleted, or emptied, while the run logged", _VANISHED),
}


def exception_chain(error: BaseException) -> list[BaseException]:
    """``error`` and the exceptions it was raised from or during (``__cause__``, ``__context__``)."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def store_problem(error: BaseException) -> str | None:
    """A message for an MLflow store that cannot take writes or cannot be read, found in the error's chain
    (MLflow wraps SQLite's errors): among them a database deleted while a run logs into it (SQLite then finds
    it read-only) and a database whose driver is not installed; else None."""
    uri = mlflow.get_tracking_uri()
    for cause in exception_chain(error):
        if isinstance(cause, ModuleNotFoundError) and "://" in uri and not uri.startswith(("sqlite", "http", "file")):
            return (
                f"MLflow store {shown_uri(uri)}: the database driver it needs is not installed ({cause}); "
                "install it (pip install ...) or pass another --tracking-uri"
            )
        for needle, (meaning, advice) in _STORE_PROBLEMS.items():
            if needle in str(cause):
                database = sqlite_database(uri)
                if needle == "readonly database" and database is not None and not database.exists():
                    meaning, advice = "its database file is gone (deleted or moved while the run logged)", _VANISHED
                return f"MLflow store {shown_uri(uri)}: {meaning} (SQLite: {needle}); {advice}"
    return None


class _QuietStoreErrors(logging.Filter):
    """On MLflow's SQL store logger: drop its record of a database error that :func:`store_problem` reports in
    one line (it logs each with three chained tracebacks first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and store_problem(record.exc_info[1]))


logging.getLogger("mlflow.store.db.utils").addFilter(_QuietStoreErrors())
