"""What a flow run did, told where its users look, however it was started (command line, a deployment's form,
``dvc repro``): :func:`publish` at the end of every flow.

- Prefect: the headline in the flow run's logs, and a Markdown artifact (key ``<flow>-summary``) on the run's
  page: the headline table, the MLflow run's address, the registered model, where the outputs are.
- MLflow: the run already carries the Prefect flow run's id and page (:func:`tasks.run_tags.run_tags`).
- ``run.json`` in the flow's output folder: the MLflow run (id, experiment, address) and the Prefect flow
  run, for the report to link each stage's run.

The flows' own log records (the loops' line per step) reach the Prefect run's logs too: ``flows/__init__``
names the project's loggers in ``PREFECT_LOGGING_EXTRA_LOGGERS``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from a5core.runtime.writing import write_text_atomic
from tasks.experiments import UI_COMMAND, ui_address
from tasks.prefect_run import prefect_flow_run
from tasks.tables import markdown_table
from tasks.tracking_rank import tracking_rank

RUN_FILE = "run.json"
logger = logging.getLogger(__name__)


def publish(
    flow: str,
    title: str,
    rows: Sequence[dict[str, Any]],
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    mlflow_run_id: str | None = None,
    output_dir: str | Path | None = None,
    paths: dict[str, str] | None = None,
    models: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Tell Prefect (logs, artifact) and the output folder (``run.json``) what flow ``flow`` did: ``rows``,
    its headline table (a row a setting), the MLflow run ``mlflow_run_id`` of ``experiment`` (if any), ``paths`` it
    wrote and the ``models`` it registered (:func:`tasks.model_registry.register_model`'s results). Returns what
    ``run.json`` holds. Nothing off the tracking rank."""
    if not tracking_rank():
        return {}
    address = ui_address(experiment, tracking_uri, mlflow_run_id) if mlflow_run_id and experiment else None
    flow_run = prefect_flow_run()
    record = {
        "flow": flow,
        "experiment": experiment,
        "tracking_uri": tracking_uri,
        "mlflow_run_id": mlflow_run_id,
        "mlflow_run_url": address,
        "prefect_flow_run_id": flow_run.get("id"),
        "prefect_flow_run_url": flow_run.get("url"),
        "models": [dict(m) for m in models],
    }
    log = logger
    if flow_run:  # the flow run's logger: its records reach the run's logs wherever Prefect was set up
        from prefect.logging import get_run_logger

        log = get_run_logger()
    for row in rows:
        log.info("%s: %s", title, ", ".join(f"{k} {_cell(v)}" for k, v in row.items()))
    if address:
        log.info("MLflow run %s: %s", mlflow_run_id, address)
    if paths:  # a project logger's record: in the run's logs through PREFECT_LOGGING_EXTRA_LOGGERS
        logger.info("outputs: %s", ", ".join(f"{k} {v}" for k, v in paths.items()))
    if output_dir is not None:
        write_text_atomic(Path(output_dir) / RUN_FILE, json.dumps(record, indent=2) + "\n")
    if flow_run:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(
            markdown=summary_markdown(title, rows, record, paths or {}),
            key=f"{flow.replace('_', '-')}-summary",
            description=f"{title}: the headline, the MLflow run, the outputs",
        )
    return record


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(title: str, rows: Sequence[dict[str, Any]], record: dict[str, Any], paths: dict[str, str]) -> str:
    """The artifact's Markdown: the headline table, the MLflow run, the registered models and the outputs."""
    lines = [f"# {title}", ""]
    if rows:
        lines += [markdown_table(rows), ""]
    if record["mlflow_run_url"]:
        lines += [
            f"**MLflow run** [{record['mlflow_run_id']}]({record['mlflow_run_url']}) in experiment "
            f"`{record['experiment']}`, store `{record['tracking_uri']}` (serve it with "
            f"`{UI_COMMAND.format(tracking_uri=record['tracking_uri'])}`).",
            "",
        ]
    for model in record["models"]:
        lines += [f"**Registered model** `{model['name']}` version {model['version']} ({model['setting']}).", ""]
    if paths:
        lines += ["**Outputs**", "", markdown_table([{"output": k, "path": v} for k, v in paths.items()])]
    return "\n".join(lines)
