"""What the report reads of the project folder the pipeline ran in (``--root``): each stage's files under
``outputs/<stage>/`` and ``metrics/`` (its summary, a training stage's rows, its plots, the record of its MLflow
run) and the settings that run recorded. A root that holds none of them is refused (:func:`check_root`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Plots in this order first (those a stage wrote), then any other PNG of the stage's folder by name.
PLOT_ORDER = (
    "accuracy_vs_step.png",
    "accuracy_vs_wall_clock.png",
    "reward_mean_vs_step.png",
    "token_entropy_vs_step.png",
    "response_tokens_mean_vs_step.png",
)
# The stage folders under outputs/ the report reads (with metrics/, what a root that ran the pipeline holds).
STAGE_OUTPUTS = ("baseline_eval", "sft_experiment", "expert_iteration", "grpo", "leaderboard")


def check_root(root: Path) -> None:
    """Refuse a root that does not exist or holds no pipeline outputs: a report of it would say
    "not run" everywhere, hiding a mistyped ``--root``."""
    shown = str(root) if root.is_absolute() else f"{root} ({root.resolve()})"
    if not root.is_dir():
        raise FileNotFoundError(
            f"--root {shown} does not exist or is not a folder: pass --root the project folder the pipeline ran in"
        )
    if not (root / "metrics").is_dir() and not any((root / "outputs" / stage).is_dir() for stage in STAGE_OUTPUTS):
        raise ValueError(
            f"{shown} holds no pipeline outputs (metrics/, outputs/): run `make pipeline` first or "
            "pass --root the project folder the pipeline ran in"
        )


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it is absent or empty; ValueError naming a file that is not JSON (or nests
    too deeply to read: no stage writes such a file)."""
    if not path.is_file() or not path.read_text().strip():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as error:
        detail = "nested too deeply" if isinstance(error, RecursionError) else error
        raise ValueError(f"{path}: not the JSON a stage writes ({detail}); run that stage again") from None


def first_json(*paths: Path) -> Any:
    """The JSON of the first of ``paths`` that holds some (a stage's full summary before its metrics file, which
    a run made before metrics files were flat mappings filled with the same), None if none does."""
    return next((value for value in map(read_json, paths) if value is not None), None)


def stage_run(root: Path, stage: str) -> dict[str, Any] | None:
    """What ``outputs/<stage>/run.json`` says (the stage's MLflow run, its Prefect flow run, the models it
    registered: :func:`tasks.flow_summary.publish`), None when the stage wrote none."""
    record = read_json(root / "outputs" / stage / "run.json")
    return record if isinstance(record, dict) and record.get("mlflow_run_id") else None


def recorded_settings(root: Path, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The settings the stage's MLflow run recorded (its parameters, "None" read as None), or None when its
    store is not at hand (a relative SQLite store is looked for under ``root``; none is created)."""
    if record is None:
        return None
    from tasks.mlflow_store import sqlite_database
    from tasks.run_reading import run_params

    uri = record["tracking_uri"]
    database = sqlite_database(uri)
    if database is not None:
        database = database if database.is_absolute() else root / database
        if not database.is_file():
            return None
        uri = f"sqlite:///{database.resolve()}"
    params = run_params(uri, record["mlflow_run_id"])
    return None if params is None else {k: None if v == "None" else v for k, v in params.items()}


def stage_rows(root: Path, stage: str) -> list[dict[str, Any]] | None:
    """A training stage's per-setting rows: ``outputs/<stage>/summary.json`` (the metrics file of a run made
    before metrics files were flat mappings held them too); None where the stage has not run."""
    for path in (root / "outputs" / stage / "summary.json", root / "metrics" / f"{stage}.json"):
        value = read_json(path)
        if isinstance(value, list) and value:
            return value
    return None


def stage_plots(folder: Path) -> list[Path]:
    """The PNGs a stage wrote at the top of its output folder, the usual ones first."""
    found = {p.name: p for p in sorted(folder.glob("*.png"))} if folder.is_dir() else {}
    return [found[n] for n in PLOT_ORDER if n in found] + [p for n, p in found.items() if n not in PLOT_ORDER]
