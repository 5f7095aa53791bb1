"""Runs read back from an MLflow store: those a command names (ids, a parent's children, an experiment's filter),
their labels, their metrics' curves, the tables and parameters they logged, their artifact files, and the newest
run of each GRPO ablation."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlflow

from tasks.mlflow_store import sqlite_database


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


def run_params(tracking_uri: str, run_id: str) -> dict[str, str] | None:
    """The parameters run ``run_id`` of store ``tracking_uri`` recorded, or None when the store does not hold
    it; the process's own store (``mlflow.set_tracking_uri``) is left as it is."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(mlflow.MlflowClient(tracking_uri).get_run(run_id).data.params)
    except MlflowException:
        return None


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


def artifact_paths(tracking_uri: str, run_id: str) -> list[str]:
    """Every artifact file of run ``run_id``, by its path in the run, sorted."""
    client = mlflow.MlflowClient(tracking_uri)
    found, folders = [], [None]
    while folders:
        for info in client.list_artifacts(run_id, folders.pop()):
            (folders if info.is_dir else found).append(info.path)
    return sorted(found)


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
