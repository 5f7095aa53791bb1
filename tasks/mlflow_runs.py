"""A flow's MLflow runs and what they hold: a run lasts as long as the work it records (:func:`flow_run` holds it
open around a flow's whole body, with system metrics), carries :func:`tasks.run_tags.run_tags`, and holds its
settings as parameters (:func:`log_settings`: a resumed run keeps those it started with) and its files as
artifacts (:func:`log_files_run`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow

from tasks.experiments import ensure_experiment
from tasks.mlflow_store import DEFAULT_TRACKING_URI
from tasks.run_tags import run_tags
from tasks.tracking_rank import UNTRACKED_RUN, tracking_rank


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


def tag_active_run(**tags: Any) -> None:
    """Set tags on the active MLflow run (values as strings)."""
    mlflow.set_tags({k: str(v) for k, v in tags.items()})


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
