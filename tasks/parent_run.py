"""A sweep's parent run, as every flow with child runs runs it: GRPO (one run or an ablation), Expert Iteration
(one run or the grid), the SFT sweep. Each child is a :func:`tasks.runs.training_run`; this is the run around
them.

``with parent_run(params, run_name, summary) as parent:`` does, in this order:

1. claims the output folder and holds it (:func:`tasks.outputs.outputs_held`: no other flow writes there meanwhile);
2. locks the parent's folder, ``output_dir/runs-<key>`` (:func:`tasks.run_lock.run_lock`: a second process
   with the same settings is refused), and starts its MLflow run or continues the one ``mlflow_run_id`` there
   names (a killed sweep resumes into the same run);
3. logs the flow's parameters (:func:`tasks.runs.log_run_params`);

then the flow's block runs the children (each a child of ``parent.run_id``; a finished child returns its row
without training again) and puts their rows in ``parent.rows``, with what it makes of them where it has its own
(:class:`Parent`: the curves to plot, the row the metrics file reads, the policies to register, its tags and
metrics); and, leaving the block:

4. on the tracking rank, into the parent run: the summary table (the :class:`Summary`'s ``columns`` of each
   child's row), the curves and comparison plots (:func:`tasks.plots.log_comparison`), the registered
   policies, the flow's own tags and metrics, and the DVC metrics file (``metrics_path``: the best row's
   headline, :func:`tasks.tables.headline_metrics`);
5. ends the MLflow run, releases the lock, and publishes the summary (:func:`tasks.flow_summary.publish`);
   ``parent.result``: the summary rows, the output paths, the parent's MLflow run id and the registered models.

A failure in any step leaves what was written (each finished child's ``done.json``, the MLflow run marked
FAILED) and releases the lock: the next attempt continues. Under torchrun every rank runs the children (the
loops are collective); only rank 0 tracks and reports.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.flow_summary import publish
from tasks.mlflow_runs import tag_active_run
from tasks.model_registry import register_model
from tasks.outputs import outputs_held, write_output_file
from tasks.plots import log_comparison
from tasks.resumable_runs import mlflow_logger, start_resumable_run
from tasks.run_lock import run_lock
from tasks.runs import log_run_params, run_key
from tasks.tables import headline_metrics
from tasks.tracking_rank import tracking_rank

Row = dict[str, Any]  # a child's row (tasks.runs.training_run's)


@dataclass(frozen=True)
class Summary:
    """How a flow's parent run reports its children, and the name it publishes them under."""

    published_as: str  # the flow's name in run.json and the Prefect artifact ``<published_as>-summary``
    headline: str  # the published summary's title
    plot_title: str  # the comparison plot's
    columns: tuple[str, ...]  # a child's row in the summary (summary.json, summary.md, the published table)
    registered_as: str | None = None  # the registered model the children's saved policies are versions of


@dataclass
class Parent:
    """The open parent run (``run_id``: None off the tracking rank) and what the flow's block puts there."""

    run_id: str | None
    rows: list[Row] = field(default_factory=list)  # each child's row, in the children's order
    curves: list[Row] | None = None  # the validation points the plots draw (None: each child's curve)
    best: Row | None = None  # the row the metrics file's headline is read from (None: the most accurate)
    registered: list[Row] | None = None  # the rows whose saved policy is registered (None: every child's)
    tags: dict[str, Any] = field(default_factory=dict)  # the flow's own, on the parent run
    metrics: dict[str, float] = field(default_factory=dict)  # the flow's own, on the parent run at step 0
    result: dict[str, Any] = field(default_factory=dict)  # set on leaving: summary, paths, mlflow_run_id, models


def child_curves(rows: list[Row]) -> list[Row]:
    """Each child's validation curve (its row's ``curve`` points), the points named by the child's setting."""
    return [{"setting": r["setting"], **point} for r in rows for point in r["curve"]]


def most_accurate(rows: list[Row]) -> Row:
    """The row of the highest final accuracy (the first of a tie)."""
    return max(rows, key=lambda r: r["final_accuracy"])


@contextmanager
def parent_run(params: Any, run_name: str, summary: Summary) -> Iterator[Parent]:
    """``with parent_run(params, run_name, summary) as parent:`` the parent MLflow run named ``run_name`` of a
    flow's children (see the module docstring)."""
    folder = Path(params.output_dir) / f"runs-{run_key(params)}"
    with outputs_held(params):
        with (
            run_lock(folder),
            start_resumable_run(folder / "mlflow_run_id", params.experiment, run_name, params.tracking_uri) as run,
        ):
            log_run_params(params)
            parent = Parent(run.info.run_id)
            yield parent
            if not tracking_rank():  # a torchrun rank other than 0 trained along; rank 0 reports
                parent.result = {"summary": None, "paths": None, "mlflow_run_id": None}
                return
            rows, paths, models = _report(params, parent, summary)
        publish(
            summary.published_as,
            summary.headline,
            rows,
            experiment=params.experiment,
            tracking_uri=params.tracking_uri,
            mlflow_run_id=parent.run_id,
            output_dir=params.output_dir,
            paths=paths,
            models=models,
        )
    parent.result = {"summary": rows, "paths": paths, "mlflow_run_id": parent.run_id, "models": models}


def _report(params: Any, parent: Parent, summary: Summary) -> tuple[list[Row], dict[str, str], list[dict]]:
    """The summary, plots, registered policies, the flow's own marks and the metrics file (into the active
    parent run and ``output_dir``); the summary rows, the paths written and the registered versions."""
    rows = parent.rows
    table = [{k: r.get(k) for k in summary.columns} for r in rows]
    trends = [{"setting": r["setting"], **point} for r in rows for point in r.get("trends", ())]  # GRPO's
    curves = child_curves(rows) if parent.curves is None else parent.curves
    paths = log_comparison(Path(params.output_dir), curves, table, "setting", summary.plot_title, trends=trends)
    models = []
    if summary.registered_as is not None:
        models = [  # each saved policy (its row's ``model_dir``, where that folder exists) a version
            register_model(r["model_dir"], summary.registered_as, r["mlflow_run_id"], r["setting"])
            for r in (rows if parent.registered is None else parent.registered)
            if r.get("model_dir") and Path(r["model_dir"]).is_dir()
        ]
    if parent.tags:
        tag_active_run(**parent.tags)
    if parent.metrics:
        mlflow_logger()(parent.metrics, 0)
    if params.metrics_path:
        headline = headline_metrics(most_accurate(rows) if parent.best is None else parent.best)
        write_output_file(params.metrics_path, json.dumps(headline, indent=2) + "\n")
    return table, paths, models
