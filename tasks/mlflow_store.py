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

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import mlflow

from a5core.runtime.reading import not_a_file_to_read
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
        path = unquote(path.removeprefix("file:"))
    return None if path in ("", ":memory:") else Path(path).expanduser()


# What a5 takes for an MLflow store's address: MLflow 3.17 keeps no runs in a folder (``mlruns/``, ``file://``).
NOT_A_STORE = (
    "not the address of an MLflow store (MLflow keeps no runs in a folder such as mlruns/): give "
    "sqlite:///PATH/mlflow.db, a database file, or a tracking server's http://HOST:PORT"
)


def address_problem(tracking_uri: str) -> str | None:
    """Why ``tracking_uri`` is no address of an MLflow store (a folder, ``file://``; a SQLite address whose file is
    no file to read: a FIFO, a device, ``/dev/null``), or None."""
    if "://" not in tracking_uri or tracking_uri.startswith("file:"):
        return NOT_A_STORE
    database = sqlite_database(tracking_uri)
    if database is not None and database.exists():
        problem = not_a_file_to_read(database)
        if problem is not None:
            return f"{database}: {problem}"
    return None


# The tables every MLflow database has: a file without them is no MLflow store, and MLflow, opening it, would write
# its sixty-odd tables into it.
MLFLOW_TABLES = ("alembic_version", "experiments", "runs")


def check_mlflow_database(database: Path, shown: str) -> None:
    """ValueError starting with ``shown`` unless ``database`` is an MLflow store MLflow can read without writing to
    it: an existing regular file (not a FIFO, a device, ``/proc``), an SQLite database holding MLflow's tables
    (:data:`MLFLOW_TABLES`), of the schema this MLflow reads, with its Default experiment (which MLflow otherwise
    creates as it opens a store). The file is opened read-only to check this: it is left exactly as it was."""
    import sqlite3

    if not database.exists():
        raise ValueError(f"{shown}: no such database file ({database.resolve()}); name the store that holds the runs")
    problem = not_a_file_to_read(database)
    if problem is not None:
        raise ValueError(f"{shown}: {database}: {problem}")
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{quote(str(database.resolve()))}?mode=ro", uri=True, timeout=10)
        ) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not set(MLFLOW_TABLES) <= tables:
                held = f"its tables: {', '.join(sorted(tables)[:5])}{' ...' if len(tables) > 5 else ''}"
                raise ValueError(
                    f"{shown}: not an MLflow store ({held if tables else 'an empty database'}); left as it is: "
                    "name the mlflow.db that holds the runs"
                )
            (version,) = db.execute("SELECT version_num FROM alembic_version").fetchone() or (None,)
            default = db.execute("SELECT 1 FROM experiments WHERE experiment_id = 0").fetchone()
    except sqlite3.DatabaseError as error:
        raise ValueError(f"{shown}: not an SQLite database, so no MLflow store ({error}); left as it is") from None
    head = _schema_head()
    if head is not None and version != head:
        raise ValueError(
            f"{shown}: an MLflow store of another MLflow version (its schema {version}, this MLflow's {head}); left "
            f"as it is: read it with the MLflow that made it, or upgrade a copy (mlflow db upgrade)"
        )
    if default is None:
        raise ValueError(
            f"{shown}: an MLflow store without its Default experiment, which MLflow would write into it to read "
            "it; left as it is"
        )


def foreign_database(database: Path) -> str | None:
    """For a store about to take runs: a message when ``database`` is an SQLite database of something else (it
    holds tables, none of them MLflow's), which MLflow would fill with its own; None for an MLflow store, an empty
    or new file, and a file that is no database (:func:`store_problem` names that one when it is opened)."""
    import sqlite3

    if not database.is_file() or database.stat().st_size == 0:
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(database.resolve()))}?mode=ro", uri=True)) as db:
            tables = sorted(row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    except sqlite3.DatabaseError:
        return None
    if not tables or set(MLFLOW_TABLES) & set(tables):
        return None
    return (
        f"{database} is a database of something else (its tables: {', '.join(tables[:5])}"
        f"{' ...' if len(tables) > 5 else ''}), not an MLflow store; left as it is: give another store"
    )


def _schema_head() -> str | None:
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:  # an MLflow that moved it: the schema is not checked here (MLflow's own check still is)
        return None


def read_only_uri(tracking_uri: str, what: str) -> str:
    """The address through which store ``tracking_uri`` (of setting ``what``) is read and never written: a SQLite
    store, once :func:`check_mlflow_database` passes, as a read-only SQLite URI (a file that is not an MLflow store
    is refused untouched, a missing one is never created); a tracking server, once it answers as MLflow does
    (:func:`tasks.servers.check_server`). ValueError naming ``what`` and the store otherwise."""
    shown = f"{what} {shown_uri(tracking_uri)}"
    problem = address_problem(tracking_uri)
    if problem is not None:
        raise ValueError(f"{shown}: {problem}")
    database = sqlite_database(tracking_uri)
    if database is None:
        check_server(tracking_uri, what)
        return tracking_uri
    check_mlflow_database(database, shown)
    # SQLite reads a URI's percent-escapes; MLflow makes the "parent folders" of what follows sqlite:///, which
    # without a "/" is the working directory
    return f"sqlite:///file:{quote(str(database.resolve()), safe='')}?mode=ro&uri=true"


def reading_client(tracking_uri: str, what: str = "tracking_uri") -> Any:
    """A client that reads store ``tracking_uri`` and cannot write to it (:func:`read_only_uri`): for the flows
    that only read a store (verdicts, compare, reproduce's record)."""
    return mlflow.MlflowClient(tracking_uri=read_only_uri(tracking_uri, what))


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
