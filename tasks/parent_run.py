"""A sweep's parent run, as every flow with child runs runs it: GRPO (one run or an ablation), Expert Iteration
(one run or the grid), the SFT sweep. Each child is a :func:`tasks.runs.training_run`; this is the run around
them.

:func:`parent_run` does, in this order:

1. claims the output folder and holds it (:func:`tasks.outputs.outputs_held`: no other flow writes there meanwhile);
2. locks the parent's folder, ``output_dir/runs-<key>`` (:func:`tasks.run_lock.run_lock`: a second process
   with the same settings is refused), and starts its MLflow run or continues the one ``mlflow_run_id`` there
   names (a killed sweep resumes into the same run);
3. logs the flow's parameters (:func:`tasks.runs.log_run_params`);
4. runs the children, one after another on one engine (:func:`in_turn`) or as the flow's ``runner`` fans them
   out; a finished child returns its row without training again;
5. on the tracking rank, into the parent run: the summary table (the :class:`Comparison`'s ``columns`` of each
   child's row), the curves and comparison plots (:func:`tasks.plots.log_comparison`), the registered
   policies, the flow's own tags and metrics, and the DVC metrics file (``metrics_path``: the best row's
   headline, :func:`tasks.tables.headline_metrics`);
6. ends the MLflow run, releases the lock, and publishes the summary (:func:`tasks.flow_summary.publish`).

A failure in any step leaves what was written (each finished child's ``done.json``, the MLflow run marked
FAILED) and releases the lock: the next attempt continues. Under torchrun every rank runs the children (the
loops are collective); only rank 0 tracks and reports.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.engines import closing_engine, engine_for
from tasks.flow_summary import publish
from tasks.model_registry import register_model
from tasks.outputs import outputs_held, write_output_file
from tasks.plots import log_comparison
from tasks.resumable_runs import start_resumable_run
from tasks.run_lock import run_lock
from tasks.runs import log_run_params, run_key
from tasks.tables import headline_metrics
from tasks.tracking_rank import tracking_rank

Row = dict[str, Any]  # a child's row (tasks.runs.training_run's)
# ``run_child(name, child, engine, parent_run_id)``: one child as the flow runs it; its row.
RunChild = Callable[[str, Any, Any, str], Row]
# ``runner(children, run_child, params, parent_run_id)``: every child's row, in the children's order.
Runner = Callable[[dict[str, Any], RunChild, Any, str], list[Row]]


def child_curves(rows: list[Row]) -> list[Row]:
    """Each child's validation curve (its row's ``curve`` points), the points named by the child's setting."""
    return [{"setting": r["setting"], **point} for r in rows for point in r["curve"]]


def most_accurate(rows: list[Row]) -> Row:
    """The row of the highest final accuracy (the first of a tie)."""
    return max(rows, key=lambda r: r["final_accuracy"])


def register_each(name: str) -> Callable[[list[Row]], list[dict]]:
    """``register(rows)``: every child's saved policy (its row's ``model_dir``, where that folder exists) as a
    version of registered model ``name``; their versions (:func:`tasks.tracking.register_model`)."""

    def register(rows: list[Row]) -> list[dict]:
        return [
            register_model(r["model_dir"], name, r["mlflow_run_id"], r["setting"])
            for r in rows
            if Path(r.get("model_dir") or "").is_dir()
        ]

    return register


def _nothing_more(rows: list[Row]) -> None:
    """No tags or metrics of the flow's own."""


@dataclass(frozen=True)
class Comparison:
    """What a flow's parent run makes of its children's rows, and the name it publishes them under."""

    published_as: str  # the flow's name in run.json and the Prefect artifact ``<published_as>-summary``
    headline: str  # the published summary's title
    plot_title: str  # the comparison plot's
    columns: tuple[str, ...]  # a child's row in the summary (summary.json, summary.md, the published table)
    register: Callable[[list[Row]], list[dict]]  # the policies worth registering; their versions
    curves: Callable[[list[Row]], list[Row]] = child_curves  # the validation points the plots draw
    best: Callable[[list[Row]], Row] = most_accurate  # the row the metrics file's headline is read from
    annotate: Callable[[list[Row]], None] = _nothing_more  # the flow's own tags and metrics on the parent run


def in_turn(children: dict[str, Any], run_child: RunChild, params: Any, parent_run_id: str) -> list[Row]:
    """Every child's row, one after another on one engine built from ``params`` (closed after the last)."""
    with closing_engine(engine_for(params)) as engine:
        return [run_child(name, child, engine, parent_run_id) for name, child in children.items()]


def parent_run(
    params: Any,
    run_name: str,
    children: dict[str, Any],
    run_child: RunChild,
    comparison: Comparison,
    runner: Runner = in_turn,
) -> dict:
    """``children`` (name → what ``run_child`` takes: a child's parameters, a setting's traces) as the child runs
    of one parent MLflow run named ``run_name``, then their comparison (see the module docstring). Returns the
    summary rows, the output paths, the parent's MLflow run id and the registered models; off the tracking
    rank, None for the first three."""
    folder = Path(params.output_dir) / f"runs-{run_key(params)}"
    with outputs_held(params):
        with (
            run_lock(folder),
            start_resumable_run(folder / "mlflow_run_id", params.experiment, run_name, params.tracking_uri) as parent,
        ):
            log_run_params(params)
            rows = runner(children, run_child, params, parent.info.run_id)
            if not tracking_rank():  # a torchrun rank other than 0 trained along; rank 0 reports
                return {"summary": None, "paths": None, "mlflow_run_id": None}
            summary, paths, models = _compare(params, rows, comparison)
        publish(
            comparison.published_as,
            comparison.headline,
            summary,
            experiment=params.experiment,
            tracking_uri=params.tracking_uri,
            mlflow_run_id=parent.info.run_id,
            output_dir=params.output_dir,
            paths=paths,
            models=models,
        )
    return {"summary": summary, "paths": paths, "mlflow_run_id": parent.info.run_id, "models": models}


def _compare(params: Any, rows: list[Row], comparison: Comparison) -> tuple[list[Row], dict[str, str], list[dict]]:
    """The summary, plots, registered policies, the flow's own marks and the metrics file (into the active
    parent run and ``output_dir``); the summary rows, the paths written and the registered versions."""
    summary = [{k: r.get(k) for k in comparison.columns} for r in rows]
    trends = [{"setting": r["setting"], **point} for r in rows for point in r.get("trends", ())]  # GRPO's
    paths = log_comparison(
        Path(params.output_dir), comparison.curves(rows), summary, "setting", comparison.plot_title, trends=trends
    )
    models = comparison.register(rows)
    comparison.annotate(rows)
    if params.metrics_path:
        headline = headline_metrics(comparison.best(rows))
        write_output_file(params.metrics_path, json.dumps(headline, indent=2) + "\n")
    return summary, paths, models
