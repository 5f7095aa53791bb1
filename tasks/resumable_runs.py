"""Training runs that resume: a killed run, started again, continues its MLflow run (:func:`start_resumable_run`:
its id is kept in a file beside the checkpoint) and logs each step once (:func:`mlflow_logger`). Off the tracking
rank (:mod:`tasks.tracking_rank`) no run is opened and nothing is logged."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow

from a5core.runtime.writing import write_text_atomic
from tasks.experiments import ensure_experiment
from tasks.mlflow_runs import system_metrics_logging
from tasks.run_tags import run_tags
from tasks.tracking_rank import UNTRACKED_RUN, tracking_rank


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


def reopen_run(run_id: str, experiment_id: str, **kwargs: Any) -> Any:
    """Continue run ``run_id`` of experiment ``experiment_id``. MLflow refuses to reopen a run while
    another experiment is the process's active one (a long-lived process, e.g. a Prefect worker,
    that ran other flows), so that experiment is made active first. Off the tracking rank: no run."""
    if not tracking_rank():
        return contextlib.nullcontext(UNTRACKED_RUN)
    mlflow.set_experiment(experiment_id=experiment_id)
    return mlflow.start_run(run_id=run_id, **kwargs)


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
