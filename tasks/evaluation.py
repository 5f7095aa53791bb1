"""Prefect tasks of the shared generate → grade → record path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from a5core.data import PROBLEM_LOADERS, Problem, write_jsonl_atomic, write_text_atomic
from a5core.evaluation import case_report, grade_completions, summarize
from a5core.models import resolve_model
from a5core.problem_sets import REWARD_FNS
from a5core.rollout import Completion, SamplingSettings, make_engine
from tasks.engines import retry_unless_deterministic, start_engine


def model_fingerprint(model: str) -> str:
    """Identify a model's weights for caching: a hub id as is; a local folder by its files' sizes and mtimes."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return model
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    return hashlib.sha256(json.dumps([str(path.resolve()), files]).encode()).hexdigest()


@task(cache_policy=INPUTS + TASK_SOURCE, persist_result=True)
def load_problems(source: str, data_format: str, limit: int | None) -> list[Problem]:
    """The first ``limit`` problems (all if None) of a MATH or GSM8K source."""
    return PROBLEM_LOADERS[data_format](source)[:limit]


@task(
    cache_policy=INPUTS + TASK_SOURCE,
    persist_result=True,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_deterministic,
)
def generate(
    model: str, fingerprint: str, backend: str, dtype: str, prompts: list[str], sampling: SamplingSettings
) -> list[list[Completion]]:
    """Completions for every prompt; cached on the model (and its weights' fingerprint), prompts and sampling.

    Retried once unless the cause is deterministic (a bad setting or path): starting an engine is the
    flaky step (device memory, a busy port).
    """
    engine = start_engine(make_engine, resolve_model(model), backend, dtype=dtype)
    return engine.generate(prompts, sampling)


@task
def grade(
    problems: list[Problem], prompts: list[str], completions: list[list[Completion]], reward_fn: str
) -> list[dict[str, Any]]:
    return grade_completions(problems, prompts, completions, REWARD_FNS[reward_fn])


@task
def write_outputs(records: list[dict[str, Any]], output_dir: str, metrics_path: str | None) -> dict[str, Any]:
    """Write records.jsonl, summary.json, report.md (and the DVC metrics file), each atomically."""
    out = Path(output_dir)
    summary = summarize(records)
    paths = {
        "records": write_jsonl_atomic(out / "records.jsonl", records),
        "summary": write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n"),
        "report": write_text_atomic(out / "report.md", case_report(records)),
    }
    if metrics_path:
        paths["metrics"] = write_text_atomic(metrics_path, json.dumps(summary, indent=2) + "\n")
    return {"summary": summary, "paths": {k: str(v) for k, v in paths.items()}}


@task
def log_evaluation_run(
    experiment: str,
    run_name: str,
    tracking_uri: str,
    params: dict[str, Any],
    records: list[dict[str, Any]],
    outputs: dict[str, Any],
) -> str:
    """One MLflow run: params, summary metrics, the generations as a table, summary and report as artifacts."""
    import mlflow

    from tasks.tracking import log_params_flat, mlflow_run

    with mlflow_run(experiment, run_name, tracking_uri) as run:
        log_params_flat(params)
        mlflow.log_metrics({k: float(v) for k, v in outputs["summary"].items()})
        mlflow.log_table({k: [r[k] for r in records] for k in records[0]}, artifact_file="generations.json")
        mlflow.log_artifact(outputs["paths"]["summary"])
        mlflow.log_artifact(outputs["paths"]["report"])
        return run.info.run_id
