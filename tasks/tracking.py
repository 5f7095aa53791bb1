"""MLflow conventions: one store (``sqlite:///mlflow.db``) with artifacts under ``mlruns/``.

MLflow 3.17 refuses a plain ``./mlruns`` file store, so runs live in SQLite and artifacts in files.
Experiments are created as model-training experiments (tag ``mlflow.experimentKind``). MLflow 3.17's
UI ignores that tag, though: it opens an experiment in the view its "GenAI | Model training" switch last
chose in the browser (GenAI at first) unless the address says ``workflowType=machine_learning``, so the
addresses the flows print (:func:`ui_address`) say so, and land on the runs. For a user who starts at the
UI's home page, each experiment's description (shown there beside it) says which switch to pick. The
runs table opens sorted by the stage's headline metric, shown as a column with its standard error: a shared
view (MLflow's ``mlflow.sharedViewState.<key>`` experiment tag, which the address names). A new store is created, and an
experiment looked up or created, under a file lock: runs started together on a new ``mlflow.db`` each
race to create its tables (and the same experiment) otherwise, and all but one failed.

Training runs are resumable (:func:`start_resumable_run`, :func:`mlflow_logger`). Under torchrun every rank
runs a training flow's code (see :func:`flows.cli.launched_rank`), and one of them tracks: rank 0
(:func:`tracking_rank`). On the other ranks :func:`start_resumable_run` and :func:`reopen_run` open no
MLflow run (``run.info.run_id`` is None) and :func:`mlflow_logger` logs nothing.

Every run the project starts carries :func:`run_tags`: the Prefect flow run it belongs to (id, name, UI
address), the git commit it ran and whether the tree had uncommitted changes, the versions of the packages that
decide a result, and the device. A run lasts as long as the work it records (:func:`flow_run` holds it open
around a flow's whole body, with system metrics); its settings are parameters (:func:`log_settings`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A tracking server that stops answering mid-run fails a call in seconds, not after MLflow's default 7 retries
# with growing waits (minutes): two retries, 1 and 2 s apart, each request given 30 s.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar for each small table read back

import mlflow  # noqa: E402

from a5core.runtime import distributed  # noqa: E402
from a5core.runtime.writing import write_text_atomic  # noqa: E402
from tasks.fingerprints import file_digests  # noqa: E402

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACT_ROOT = "mlruns"
# What an experiment says it is: a model-training experiment (MLflow's kinds), not a GenAI application's.
EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT = "mlflow.experimentKind", "custom_model_development"
# Each experiment's runs table as the printed addresses open it: MLflow's shared view ``VIEW_KEY`` (an experiment
# tag), sorted by the stage's headline metric (HEADLINE_METRICS; the training stages': final_val_accuracy) and
# showing it and its standard error (columns off the screen's width are not drawn: these come first).
VIEW_KEY, VIEW_TAG = "a5", "mlflow.sharedViewState.a5"
HEADLINE_METRICS = {"baseline_eval": "accuracy", "difficulty": "mean_pass_rate", "report": "grpo_best_accuracy"}
TRAINING_HEADLINE = "final_val_accuracy"
DESCRIPTION_TAG = "mlflow.note.content"
DESCRIPTION = (
    "Runs of the {name} stage. From MLflow's home page, pick Model training (top left, once in a browser) before "
    "opening it: MLflow shows an experiment's GenAI view until then, and its runs after."
)
# The MLflow UI as a user starts it, and the address it serves (port 5000).
UI_COMMAND = "mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1"
UI_ROOT = "http://127.0.0.1:5000"


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


SERVER_DEADLINE_S = 10  # a tracking server's /health must answer within it before a run starts


def shown_uri(tracking_uri: str) -> str:
    """A store's address as messages show it: a password in it masked."""
    scheme, sep, rest = tracking_uri.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return tracking_uri
    return f"{scheme}{sep}{credentials.partition(':')[0]}:***@{host}"


def http_get(url: str, deadline_s: float) -> tuple[int, bytes] | str:
    """What a server answers a GET of ``url`` with within ``deadline_s`` seconds: its status and the start of its
    body; or, a string, why it does not answer (refused, unreachable, timed out, no such host)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=deadline_s) as reply:
            return reply.status, reply.read(4096)
    except urllib.error.HTTPError as error:  # it answered
        return error.code, b""
    except (OSError, ValueError) as error:
        return str(getattr(error, "reason", None) or error)


# The statuses of a server that asks for credentials: it is left to the client, which sends them, to say more.
CREDENTIALS_WANTED = (401, 403)


def check_server(tracking_uri: str) -> None:
    """For a tracking server (``http(s)://``): ValueError naming it unless it answers within
    :data:`SERVER_DEADLINE_S` seconds (MLflow's own client would retry for minutes), and answers as MLflow does
    (``/health``: ``OK``; a server that answers otherwise, a web page say, gave tracebacks). Other stores:
    nothing."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    reply = http_get(tracking_uri.rstrip("/") + "/health", SERVER_DEADLINE_S)
    if isinstance(reply, str):
        raise ValueError(
            f"MLflow tracking server {shown_uri(tracking_uri)}: no answer within {SERVER_DEADLINE_S} s ({reply}); "
            "start it, or pass another --tracking-uri"
        )
    status, body = reply
    if status not in CREDENTIALS_WANTED and (status, body.strip()) != (200, b"OK"):
        raise ValueError(
            f"MLflow tracking server {shown_uri(tracking_uri)}: a server answers there, but not as MLflow does (GET "
            f"/health: status {status}, {body.strip()[:40]!r}); check the address, or pass another --tracking-uri"
        )


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


def ui_address(
    experiment: str, tracking_uri: str = DEFAULT_TRACKING_URI, run_id: str | None = None, root: str = UI_ROOT
) -> str:
    """The MLflow UI's page of ``experiment`` (its runs, in the shared view :data:`VIEW_KEY` where the experiment
    holds it: the headline metric as a column) or of one of its runs, in the model-training view
    (``workflowType=machine_learning``; without it MLflow 3.17 opens its GenAI view). The experiment list
    if the store has no such experiment."""
    found = mlflow.MlflowClient(tracking_uri).get_experiment_by_name(experiment)
    page = f"{root}/#/experiments" + (f"/{found.experiment_id}" if found else "")
    if found and run_id:
        return f"{page}/runs/{run_id}?workflowType=machine_learning"
    if found:
        view = f"viewStateShareKey={VIEW_KEY}&" if VIEW_TAG in found.tags else ""
        return f"{page}/runs?{view}workflowType=machine_learning"
    return page + "?workflowType=machine_learning"


def landing(tracking_uri: str = DEFAULT_TRACKING_URI, root: str = UI_ROOT) -> str:
    """Where a user finds the runs in the MLflow UI: the home page (and the switch to pick there), then each
    experiment's runs table, as addresses to open."""
    experiments = mlflow.MlflowClient(tracking_uri).search_experiments(order_by=["creation_time ASC"])
    lines = [f"MLflow UI: {root} (pick Model training at the top left; its experiments then open on their runs)"]
    lines += [
        f"  {e.name:<17} {ui_address(e.name, tracking_uri, root=root)}" for e in experiments if e.name != "Default"
    ]
    return "\n".join(lines)


def experiment_tags(name: str) -> dict[str, str]:
    """What every experiment of the project carries: its kind (model training), a description that tells a
    user at the UI's home page how to reach its runs, and the runs table's shared view (:data:`VIEW_KEY`)."""
    import json

    metric = HEADLINE_METRICS.get(name, TRAINING_HEADLINE)
    columns = [f"metrics.`{metric}`", f"metrics.`{metric}_se`"]
    view = {"orderByKey": columns[0], "orderByAsc": False, "selectedColumns": columns, "columnOrder": columns}
    return {
        EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT,
        DESCRIPTION_TAG: DESCRIPTION.format(name=name),
        VIEW_TAG: json.dumps(view),
    }


def find_runs(client: Any, params: Any) -> list[Any]:
    """The runs ``params`` name (``mlflow.entities.Run``): ``runs`` (ids, in the order given), the children
    of ``parent`` (oldest first), or those of ``experiment`` matching ``filter`` (newest first, at most
    ``max_runs``). ValueError naming it for a run id the store does not hold and for a filter MLflow
    cannot parse."""
    if params.runs:
        return [_get_run(client, run_id, params.tracking_uri, "--runs") for run_id in dict.fromkeys(params.runs)]
    if params.parent:
        parent = _get_run(client, params.parent, params.tracking_uri, "--parent")
        experiment_ids = [parent.info.experiment_id]
        filter_string = f"tags.mlflow.parentRunId = '{params.parent}'"
        order = ["attributes.start_time ASC"]
    else:
        experiment = client.get_experiment_by_name(params.experiment)
        if experiment is None:
            raise ValueError(f"no MLflow experiment named {params.experiment!r} in {params.tracking_uri}")
        experiment_ids, filter_string, order = (
            [experiment.experiment_id],
            params.filter or "",
            ["attributes.start_time DESC"],
        )
    from mlflow.exceptions import MlflowException

    try:
        runs = client.search_runs(
            experiment_ids, filter_string=filter_string, max_results=params.max_runs, order_by=order
        )
    except MlflowException as error:
        raise ValueError(f"--filter {params.filter!r}: {error.message}") from None
    return list(runs)


def _get_run(client: Any, run_id: str, tracking_uri: str, flag: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"{flag}: no run {run_id!r} in {tracking_uri}") from None


def run_labels(runs: list[Any]) -> list[str]:
    """Run names, with a short id added where two runs share a name."""
    names = [r.info.run_name or r.info.run_id[:8] for r in runs]
    return [f"{n} ({r.info.run_id[:8]})" if names.count(n) > 1 else n for n, r in zip(names, runs, strict=True)]


def metric_points(client: Any, runs: list[Any], metric: str, labels: list[str] | None = None) -> list[dict[str, Any]]:
    """Every logged value of ``metric`` for each run that has it: rows of run label (``labels``, or
    :func:`run_labels`), step, value."""
    points = []
    for label, run in zip(labels or run_labels(runs), runs, strict=True):
        if metric in run.data.metrics:
            points += [
                {"run": label, "step": m.step, metric: m.value}
                for m in client.get_metric_history(run.info.run_id, metric)
            ]
    return points


def system_metrics_logging() -> bool | None:
    """Whether training runs log MLflow system metrics (``system/*``: CPU, memory, disk, network, and GPU
    utilisation/memory where ``nvidia-ml-py`` is installed; sampled every 10 s,
    ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` changes that).

    On wherever psutil is installed; ``A5_SYSTEM_METRICS=0`` turns it off. None (no psutil) leaves it to
    MLflow's own switch, ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``.
    """
    import importlib.util

    if os.environ.get("A5_SYSTEM_METRICS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return True if importlib.util.find_spec("psutil") is not None else None


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


def ensure_experiment(
    name: str, tracking_uri: str = DEFAULT_TRACKING_URI, artifact_root: str = DEFAULT_ARTIFACT_ROOT
) -> str:
    """Point MLflow at the store and return the experiment's id, creating it (artifacts under mlruns/,
    tagged as a training experiment) if needed. The store's creation and the lookup-or-create hold
    :func:`store_lock`, so concurrent first runs on a new store all succeed."""
    mlflow.set_tracking_uri(tracking_uri)
    with store_lock(tracking_uri):
        client = mlflow.MlflowClient(tracking_uri)
        experiment = client.get_experiment_by_name(name)
        tags = experiment_tags(name)
        if experiment is None:
            location = (Path(artifact_root).resolve() / name).as_uri()
            return client.create_experiment(name, artifact_location=location, tags=tags)
        for key, value in tags.items():  # an experiment made before a tag was set gets it (a user's own kept)
            if key not in experiment.tags:
                client.set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id


def check_store(tracking_uri: str, experiment: str) -> None:
    """Before a run spends its time: a tracking server answers (:func:`check_server`) and the store takes
    writes (the experiment is looked up or created now). ValueError with :func:`store_problem`'s message
    otherwise."""
    check_server(tracking_uri)
    try:
        ensure_experiment(experiment, tracking_uri)
    except Exception as error:
        problem = store_problem(error)
        if problem is None:
            raise
        raise ValueError(problem) from None


# The project's root (its git work tree, when it is one) and the packages whose versions a run records.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "peft", "mlflow", "prefect", "dvc")


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


def importable_module(module: str) -> str:
    """The name ``module`` is imported by elsewhere: ``module`` itself, except for ``__main__``, the module of a
    flow started as a command. ``python -m flows.grpo`` (and torchrun's ``-m``) names the module it ran in
    ``__main__.__spec__``; a script run by its path inside the project (``python flows/grpo.py``) is named by
    that path (``flows.grpo``). ``__main__`` when neither says (a script outside the project, a notebook)."""
    if module != "__main__":
        return module
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name
    script = getattr(main, "__file__", None)
    if script:
        path = Path(script).resolve()
        try:
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        except ValueError:
            return module
        if path.suffix == ".py" and parts and all(part.isidentifier() for part in parts):
            return ".".join(parts)
    return module


def prefect_flow_run() -> dict[str, str]:
    """The Prefect flow run this code runs in: ``id``, ``name``, ``flow`` and the UI's ``url`` of its page
    (where the server has a UI); {} outside a flow run."""
    try:
        from prefect.runtime import flow_run
    except ImportError:  # pragma: no cover - prefect is a dependency
        return {}
    if not flow_run.id:
        return {}
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_UI_URL

    found = {"id": str(flow_run.id), "name": flow_run.name or "", "flow": flow_run.flow_name or ""}
    context = FlowRunContext.get()
    if context is not None and context.flow is not None:  # the module that defines the flow, and the function
        found["module"] = importable_module(context.flow.fn.__module__)  # flows.grpo under python -m flows.grpo
        found["entrypoint"] = f"{found['module']}:{context.flow.fn.__name__}"
    if PREFECT_UI_URL.value():  # the UI's page of a flow run (runtime's ui_url is an older route)
        found["url"] = f"{PREFECT_UI_URL.value().rstrip('/')}/runs/flow-run/{found['id']}"
    return found


def run_tags() -> dict[str, str]:
    """The tags every MLflow run of the project carries (the "Any run, again" provenance, and the way back to
    the Prefect run that started it):

    - ``prefect.flow_run_id``, ``prefect.flow_run_name``, ``prefect.flow``, ``prefect.flow_run_url`` (the
      Prefect UI's page of the flow run), when it runs inside one; then also the run's description
      (``mlflow.note.content``) links that page, and its source (``mlflow.source.name``) is the flow's module;
    - ``mlflow.source.git.commit`` (shown by MLflow as the run's commit; MLflow records none for a run that
      Prefect's engine starts), ``git.dirty`` (``true``: the tree had uncommitted changes to tracked files,
      other than ``dvc.lock``: DVC's record of what the pipeline's stages made, which it rewrites as they run);
    - ``versions.python``, ``versions.a5`` and ``versions.<package>`` of :data:`VERSIONED_PACKAGES` installed;
    - ``device``: ``cuda`` with the GPUs' names and count, or ``cpu``.

    The run's full record, to run it again (settings, inputs' hashes, seeds), is :mod:`tasks.provenance`'s.
    """
    tags: dict[str, str] = {}
    flow_run = prefect_flow_run()
    for key in ("id", "name", "flow", "url"):
        if flow_run.get(key):
            tags[f"prefect.flow_run_{key}" if key != "flow" else "prefect.flow"] = flow_run[key]
    if flow_run.get("module", "").startswith("flows."):  # not Prefect's engine, which MLflow would name
        tags["mlflow.source.name"] = flow_run["module"].replace(".", "/") + ".py"
        tags["mlflow.source.type"] = "LOCAL"
    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit
        tags["git.dirty"] = str(bool(git("status", "--porcelain", "--untracked-files=no", *NOT_DVC_RECORDS))).lower()
    if flow_run.get("url"):  # the run's description: a link back to the Prefect flow run
        tags["mlflow.note.content"] = (
            f"Started by Prefect flow run [{flow_run['name']}]({flow_run['url']}) of flow `{flow_run['flow']}`"
            + (f" at commit `{commit[:12]}`" + (" (uncommitted changes)" if tags["git.dirty"] == "true" else ""))
            * bool(commit)
            + "."
        )
    tags.update({f"versions.{name}": version for name, version in versions().items()})
    tags["device"] = device_name()
    return tags


def versions() -> dict[str, str]:
    """The versions of Python, the project (``a5``) and each of :data:`VERSIONED_PACKAGES` installed."""
    import importlib.metadata
    import platform

    found = {"python": platform.python_version()}
    for package in ("a5", *VERSIONED_PACKAGES):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def device_name() -> str:
    """The GPUs this process sees, by kind (``cuda: 2 × NVIDIA H200``), or ``cpu``."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    names = Counter(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return "cuda: " + ", ".join(f"{count} × {name}" for name, count in names.items())


def log_settings(settings: dict[str, Any]) -> None:
    """A run's settings as MLflow parameters of the active run (values as strings, cut to MLflow's limit).
    A run continued by a later attempt (a resumed training run) keeps the values it started with: MLflow
    refuses a parameter's second value, so a setting the new attempt changed (where results go, how fast it
    runs) is recorded as the tag ``changed_on_resume.<name>`` instead."""
    run_id = mlflow.active_run().info.run_id
    held = mlflow.MlflowClient().get_run(run_id).data.params
    values = {k: str(v)[:6000] for k, v in settings.items()}
    new = {k: v for k, v in values.items() if k not in held}
    if new:
        mlflow.log_params(new)
    changed = {f"changed_on_resume.{k}": v for k, v in values.items() if k in held and held[k] != v}
    if changed:
        mlflow.set_tags(changed)


@contextmanager
def mlflow_run(experiment: str, run_name: str, tracking_uri: str = DEFAULT_TRACKING_URI, **tags: Any) -> Iterator[Any]:
    """One MLflow run in ``experiment`` with :func:`run_tags` and ``tags``: a new one, ended on exit; or,
    inside :func:`flow_run` of the same experiment, the flow's own run (named ``run_name`` and tagged, and left
    open for it)."""
    experiment_id = ensure_experiment(experiment, tracking_uri)
    active = mlflow.active_run()
    if active is not None and active.info.experiment_id == experiment_id:
        mlflow.set_tags({"mlflow.runName": run_name, **{k: str(v) for k, v in tags.items()}})
        yield active
        return
    with mlflow.start_run(
        experiment_id=experiment_id,
        run_name=run_name,
        tags={**run_tags(), **{k: str(v) for k, v in tags.items()}},
    ) as run:
        yield run


@contextmanager
def flow_run(experiment: str, run_name: str, tracking_uri: str = DEFAULT_TRACKING_URI) -> Iterator[Any]:
    """The MLflow run of a flow that is not a training run (an evaluation, the difficulty table, the report),
    open for the flow's whole body: its duration is the work's, and its system metrics (CPU, memory, GPU)
    cover it. What the body logs with :func:`mlflow_run` in the same experiment goes into it. Off the
    tracking rank: no run."""
    if not tracking_rank():
        yield UNTRACKED_RUN
        return
    experiment_id = ensure_experiment(experiment, tracking_uri)
    with mlflow.start_run(
        experiment_id=experiment_id, run_name=run_name, tags=run_tags(), log_system_metrics=system_metrics_logging()
    ) as run:
        yield run


def log_files_run(
    experiment: str,
    run_name: str,
    tracking_uri: str,
    files: list[str | Path],
    *,
    tags: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    skip: tuple[str, ...] = (),
) -> str:
    """One finished MLflow run holding ``files`` (a file, or a folder's contents, less the entries named in
    ``skip``) as artifacts, with its tags, parameters and metrics; returns its id. The comparison and the
    report are logged so (inside :func:`flow_run`: into the flow's run)."""
    with mlflow_run(experiment, run_name, tracking_uri, **(tags or {})) as run:
        if params:
            log_settings(params)
        if metrics:
            mlflow.log_metrics(metrics)
        for path in map(Path, files):
            entries = sorted(p for p in path.iterdir() if p.name not in skip) if path.is_dir() else [path]
            for entry in entries:
                if entry.is_dir():
                    mlflow.log_artifacts(str(entry), entry.name if path.is_dir() else None)
                else:
                    mlflow.log_artifact(str(entry))
        return run.info.run_id


def store_client(tracking_uri: str) -> Any:
    """A client reading ``tracking_uri`` (and the fluent API pointed there too); a tracking server must answer
    first (:func:`check_server`)."""
    check_server(tracking_uri)
    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.MlflowClient(tracking_uri=tracking_uri)


def latest_ablations(tracking_uri: str, experiment: str) -> dict[str, tuple[Any, list[Any]]]:
    """For each ablation name: its newest parent run (tag ``ablation``, set once all children finished)
    and that run's children, oldest first. Empty when the store or the experiment does not exist."""
    database = sqlite_database(tracking_uri)
    if database is not None and not database.is_file():
        return {}  # do not create an empty store just to find nothing in it
    reader = mlflow.MlflowClient(tracking_uri=tracking_uri)
    found = reader.get_experiment_by_name(experiment)
    if found is None:
        return {}
    parents = reader.search_runs(
        [found.experiment_id],
        filter_string="tags.ablation != ''",
        order_by=["attributes.start_time DESC"],
        max_results=500,
    )
    latest: dict[str, tuple[Any, list[Any]]] = {}
    for parent in parents:
        name = parent.data.tags["ablation"]
        if name not in latest:
            children = reader.search_runs(
                [found.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                order_by=["attributes.start_time ASC"],
            )
            latest[name] = (parent, list(children))
    return latest


def run_records(
    reader: Any, run: Any, artifact: str = "generations.json", folder: str | None = None
) -> list[dict[str, Any]] | None:
    """The graded records a run logged as the table ``artifact`` (an evaluation run's every sample; in
    ``folder`` of the run's artifacts), or None when it holds no such table."""
    import json

    if artifact not in {a.path for a in reader.list_artifacts(run.info.run_id, folder)}:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = reader.download_artifacts(run.info.run_id, artifact, folder)
        table = json.loads(Path(path).read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


def final_per_problem(reader: Any, run: Any) -> list[dict[str, Any]] | None:
    """A training run's final evaluation, problem by problem: the ``per_problem/`` table at its last step, the
    full set's (``full_step_*``) else the largest subset's (the final evaluation is never smaller than the
    curve's); None when the run logged none (runs made before per-problem tables were logged)."""
    import re

    found = []
    for artifact in reader.list_artifacts(run.info.run_id, "per_problem"):
        if match := re.fullmatch(r"per_problem/(full|subset(\d+))_step_(\d+)\.json", artifact.path):
            size = float("inf") if match[1] == "full" else int(match[2])
            found.append((int(match[3]), size, artifact.path))
    return run_records(reader, run, max(found)[2], folder="per_problem") if found else None


def run_params(tracking_uri: str, run_id: str) -> dict[str, str] | None:
    """The parameters run ``run_id`` of store ``tracking_uri`` recorded, or None when the store does not hold
    it; the process's own store (``mlflow.set_tracking_uri``) is left as it is."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(mlflow.MlflowClient(tracking_uri).get_run(run_id).data.params)
    except MlflowException:
        return None


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


def artifact_paths(tracking_uri: str, run_id: str) -> list[str]:
    """Every artifact file of run ``run_id``, by its path in the run, sorted."""
    client = mlflow.MlflowClient(tracking_uri)
    found, folders = [], [None]
    while folders:
        for info in client.list_artifacts(run_id, folders.pop()):
            (folders if info.is_dir else found).append(info.path)
    return sorted(found)


def tag_active_run(**tags: Any) -> None:
    """Set tags on the active MLflow run (values as strings)."""
    mlflow.set_tags({k: str(v) for k, v in tags.items()})


def log_params_flat(params: dict[str, Any]) -> None:
    """Log a (possibly nested) parameter dict (keys ``a.b``) with :func:`log_settings`."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = str(value)[:6000]

    walk("", params)
    log_settings(flat)


# What the ranks that do not track get for an MLflow run: a run id of None.
UNTRACKED_RUN = SimpleNamespace(info=SimpleNamespace(run_id=None))


def tracking_rank() -> bool:
    """Whether this process tracks (MLflow runs, output and metrics files, Prefect runs): a plain
    process does, and of a torchrun launch rank 0; the other ranks train alongside, untracked."""
    return distributed.rank_and_world()[0] == 0


def tracked(prefect_object: Any) -> Any:
    """A Prefect task or flow as this rank calls it: itself on the tracking rank (a task or flow run),
    its plain function (``.fn``) on the other ranks, which run the same code without Prefect."""
    return prefect_object if tracking_rank() else prefect_object.fn


def reopen_run(run_id: str, experiment_id: str, **kwargs: Any) -> Any:
    """Continue run ``run_id`` of experiment ``experiment_id``. MLflow refuses to reopen a run while
    another experiment is the process's active one (a long-lived process, e.g. a Prefect worker,
    that ran other flows), so that experiment is made active first. Off the tracking rank: no run."""
    if not tracking_rank():
        return contextlib.nullcontext(UNTRACKED_RUN)
    mlflow.set_experiment(experiment_id=experiment_id)
    return mlflow.start_run(run_id=run_id, **kwargs)


def start_resumable_run(
    run_id_file: Path, experiment: str, run_name: str, tracking_uri: str, parent_run_id: str | None = None
) -> Any:
    """Start an MLflow run, or continue the one whose id ``run_id_file`` holds (a resumed training run).

    The id is written as soon as the run exists, so a kill at any later point resumes the same run.
    Off the tracking rank (torchrun rank > 0): no run, ``run.info.run_id`` is None.
    """
    if not tracking_rank():
        return contextlib.nullcontext(UNTRACKED_RUN)
    experiment_id = ensure_experiment(experiment, tracking_uri)
    system_metrics = system_metrics_logging()  # system/* metrics (CPU, memory, GPU) where psutil is installed
    if run_id_file.is_file():  # this attempt's provenance replaces the last one's
        return reopen_run(
            stored_run_id(run_id_file, tracking_uri),
            experiment_id,
            nested=parent_run_id is not None,
            log_system_metrics=system_metrics,
            tags=run_tags(),
        )
    tags = {**run_tags(), **({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})}
    run = mlflow.start_run(
        experiment_id=experiment_id,
        run_name=run_name,
        nested=parent_run_id is not None,
        tags=tags,
        log_system_metrics=system_metrics,
    )
    write_text_atomic(run_id_file, run.info.run_id)
    return run


def stored_run_id(run_id_file: Path, tracking_uri: str) -> str:
    """The MLflow run id ``run_id_file`` holds, which must name a run of the store; ValueError naming the
    file and what to do otherwise (a damaged file, or a store replaced since the run began)."""
    from mlflow.exceptions import MlflowException

    run_id = run_id_file.read_text(encoding="utf-8", errors="replace").strip()
    try:
        if run_id.isalnum():
            mlflow.MlflowClient(tracking_uri).get_run(run_id)
            return run_id
    except MlflowException:
        pass
    raise ValueError(
        f"{run_id_file}: names MLflow run {run_id[:40]!r}, which {tracking_uri} does not hold (a damaged file, or a "
        "store replaced since the run began); delete the file to log the run as a new MLflow run (its checkpoint "
        "still resumes)"
    )


def mlflow_logger(prefix: str = "") -> Callable[[dict[str, float], int], None]:
    """A ``log(metrics, step)`` callback for the a5core loops that writes to the active MLflow run.

    Resume-safe: a resumed run repeats what it did between its last checkpoint and the kill, and MLflow
    keeps every value logged (a step logged twice is in the history, the curves and the plots twice).
    So the first call counts the values the run already holds per (metric, step), and the n-th value
    this logger is given for a (metric, step) is only written if the run held fewer than n: a replayed
    step is dropped, the rest of the run is logged. A new run holds nothing, so nothing is dropped.
    Off the tracking rank it logs nothing.
    """
    if not tracking_rank():
        return lambda metrics, step: None
    held: Counter[tuple[str, int]] | None = None
    given: Counter[tuple[str, int]] = Counter()

    def log(metrics: dict[str, float], step: int) -> None:
        nonlocal held
        if held is None:
            client, run_id = mlflow.MlflowClient(), mlflow.active_run().info.run_id
            held = Counter(
                (key, m.step)
                for key in client.get_run(run_id).data.metrics
                for m in client.get_metric_history(run_id, key)
            )
        finite = {f"{prefix}{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
        given.update((k, step) for k in finite)
        new = {k: v for k, v in finite.items() if given[(k, step)] > held[(k, step)]}
        if new:
            mlflow.log_metrics(new, step=step)

    return log


# The registered models' names: one a kind of trained policy, its versions the runs that trained one.
REGISTERED_MODELS = {
    "sft_experiment": "a5-sft",
    "expert_iteration": "a5-expert-iteration",
    "grpo": "a5-grpo",
    "leaderboard": "a5-leaderboard",
}
REGISTERED_TAG = "registered_model"  # on a run whose model is registered: "NAME/VERSION"


def register_model(
    model_dir: str | Path,
    name: str,
    run_id: str,
    setting: str,
    metrics: dict[str, float] | None = None,
    tracking_uri: str | None = None,
) -> dict[str, Any]:
    """Log the Hugging Face folder ``model_dir`` as the MLflow model ``model`` of run ``run_id`` and register it
    as a version of ``name`` (weights not copied: :mod:`tasks.hf_folder_model` loads them from the folder, and
    refuses it once its files differ from the digests recorded here), in the store ``tracking_uri`` (None: the
    process's).
    The version's description is the run's final metrics (``metrics``, else the run's ``final_*``), its tags
    the setting and the run. Done once a run: a run already registered returns its version (tag
    :data:`REGISTERED_TAG`). Returns ``name``, ``version``, ``setting``, ``run_id``, ``model_dir``."""
    if tracking_uri is not None:
        mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient()
    run = client.get_run(run_id)
    found = {"name": name, "setting": setting, "run_id": run_id, "model_dir": str(Path(model_dir).resolve())}
    if REGISTERED_TAG in run.data.tags:
        return {**found, "version": run.data.tags[REGISTERED_TAG].rpartition("/")[2]}
    if metrics is None:
        metrics = {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith("final_")}
    description = (
        f"The policy of run `{run.info.run_name}` (setting `{setting}`, experiment run {run_id}), saved at "
        f"`{found['model_dir']}`.\n\n"
        + "\n".join(f"- {k}: {v:.4g}" for k, v in metrics.items())
        + '\n\nLoad it: `mlflow.pyfunc.load_model("models:/NAME/VERSION").predict([prompt])`.'
    )
    active = mlflow.active_run()
    nested = active is not None and active.info.run_id != run_id
    reopen = contextlib.nullcontext() if active is not None and not nested else None
    with reopen or reopen_run(run_id, run.info.experiment_id, nested=nested):
        logged = mlflow.pyfunc.log_model(
            name="model",
            python_model=str(Path(__file__).with_name("hf_folder_model.py")),
            model_config={"model_dir": found["model_dir"], "file_sha256": file_digests(found["model_dir"])},
            pip_requirements=["mlflow", "torch", "transformers"],
            registered_model_name=name,
            tags={"setting": setting},
        )
        version = str(logged.registered_model_version)
        client.update_model_version(name, version, description=description.replace("NAME/VERSION", f"{name}/{version}"))
        client.set_model_version_tag(name, version, "setting", setting)
        client.set_model_version_tag(name, version, "mlflow_run_id", run_id)
        mlflow.set_tag(REGISTERED_TAG, f"{name}/{version}")
    client.update_registered_model(name, description=f"a5's {name.removeprefix('a5-')} policies, one version a run.")
    return {**found, "version": version}
