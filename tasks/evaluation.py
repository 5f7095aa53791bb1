"""Evaluation as the flows run it: the Prefect tasks of the shared generate → grade → record path (the
baseline evaluation), and :func:`validation_hook`, the training loops' ``evaluate(model, step)``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlflow
import torch
from prefect import task
from prefect.cache_policies import NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy
from prefect.utilities.hashing import hash_objects

from a5core.data.files import PROBLEM_LOADERS, Problem
from a5core.data.problem_sets import load_validation_set
from a5core.data.prompts import PromptTemplate
from a5core.engines import Completion, Engine, SamplingSettings, full_weights, make_engine
from a5core.evaluation.case_report import case_report
from a5core.evaluation.generations import log_generations
from a5core.evaluation.records import evaluate, grade_completions, per_problem_table, summarize
from a5core.grading.rewards import REWARD_FNS
from a5core.policy.model_specs import resolve_model
from a5core.runtime import distributed
from a5core.runtime.writing import write_jsonl_atomic, write_text_atomic
from tasks.engines import closing_engine, retry_unless_deterministic, start_engine
from tasks.fingerprints import model_fingerprint
from tasks.outputs import write_output_file
from tasks.tracking_rank import tracking_rank

# Cached results stay with the folder a flow runs in (beside outputs/ and mlflow.db), not in Prefect's
# storage under the home folder, which every clone on the machine shares.
RESULTS = Path(".a5-cache/prefect-results")


@task(cache_policy=NO_CACHE)
def load_problems(source: str, data_format: str, limit: int | None) -> list[Problem]:
    """The first ``limit`` problems (all if None) of a MATH or GSM8K source, in the file's order, or of
    ``arithmetic:N:DIGITS``: its validation problems in the order the training flows validate on them, so an
    evaluation scores the problems they score. Not cached: a key on the file's contents would read the file
    anyway, and a key on its path would miss an edit."""
    if source.startswith("arithmetic:"):
        return load_validation_set(source, data_format)[:limit]
    return PROBLEM_LOADERS[data_format](source)[:limit]


def generation_key(context: Any, inputs: dict[str, Any]) -> str:
    """:func:`generate`'s cache key: its inputs with the model counted by its weights
    (:func:`tasks.fingerprints.model_fingerprint`), not its name or path; the prompts are their text."""
    return hash_objects({**inputs, "model": model_fingerprint(inputs["model"])}, raise_on_failure=True)


@task(
    cache_policy=TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=generation_key),
    persist_result=True,
    result_storage=RESULTS,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_deterministic,
)
def generate(
    model: str, backend: str, dtype: str, prompts: list[str], sampling: SamplingSettings
) -> list[list[Completion]]:
    """Completions for every prompt; cached on the model's weights, the prompts' text and the sampling
    (:func:`generation_key`).

    Retried once unless the cause is deterministic (a bad setting or path): starting an engine is the
    flaky step (device memory, a busy port).
    """
    with closing_engine(start_engine(make_engine, resolve_model(model), backend, dtype=dtype)) as engine:
        return engine.generate(prompts, sampling)


@task
def grade(
    problems: list[Problem], prompts: list[str], completions: list[list[Completion]], reward_fn: str
) -> list[dict[str, Any]]:
    return grade_completions(problems, prompts, completions, REWARD_FNS[reward_fn])


# What an evaluation writes at the top of its output folder (and of its MLflow run's artifacts), beside the run's
# record (tasks.flow_summary.RUN_FILE): no extra set's folder may take one of these names.
EVALUATION_FILES = ("records.jsonl", "summary.json", "report.md", "generations.json")


@task
def write_outputs(records: list[dict[str, Any]], output_dir: str, metrics_path: str | None) -> dict[str, Any]:
    """Write records.jsonl, summary.json, report.md (and the DVC metrics file: the headline accuracy, its
    standard error and the format rate, a flat mapping), each atomically."""
    out = Path(output_dir)
    summary = summarize(records)
    paths = {
        "records": write_jsonl_atomic(out / "records.jsonl", records),
        "summary": write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n"),
        "report": write_text_atomic(out / "report.md", case_report(records)),
    }
    if metrics_path:
        headline = {key: summary[key] for key in ("accuracy", "accuracy_se", "format_rate")}
        paths["metrics"] = write_output_file(metrics_path, json.dumps(headline, indent=2) + "\n")
    return {"summary": summary, "paths": {k: str(v) for k, v in paths.items()}}


@task
def log_evaluation_run(
    experiment: str,
    run_name: str,
    tracking_uri: str,
    params: dict[str, Any],
    evaluated: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]],
) -> str:
    """One MLflow run: params, each set's summary metrics, generations table, summary and report.

    ``evaluated``: set name → (records, :func:`write_outputs`'s result); the set named "" is the run's
    own (metrics and artifacts at the top), the others' metrics are ``<name>/…`` and their artifacts
    under ``<name>/``."""
    import mlflow

    from tasks.mlflow_runs import log_params_flat, mlflow_run

    with mlflow_run(experiment, run_name, tracking_uri) as run:
        log_params_flat(params)
        for name, (records, outputs) in evaluated.items():
            prefix, folder = (f"{name}/", name) if name else ("", None)
            mlflow.log_metrics({f"{prefix}{k}": float(v) for k, v in outputs["summary"].items()})
            mlflow.log_table(
                {k: [r[k] for r in records] for k in records[0]}, artifact_file=f"{prefix}generations.json"
            )
            mlflow.log_artifact(outputs["paths"]["summary"], folder)
            mlflow.log_artifact(outputs["paths"]["report"], folder)
        return run.info.run_id


def validation_hook(
    engine: Engine,
    tokenizer: Any,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    sampling: SamplingSettings,
    subset: int | None,
    table_samples: int = 16,
) -> Callable[[torch.nn.Module, int], dict[str, float]]:
    """``evaluate(model, step)`` for the loops: push weights, evaluate, log a generations table (``table_samples``
    sampled problems) and the per-problem table (``per_problem/``: every problem's id, sample and rewards).

    Evaluates the first ``subset`` problems (all if None), ``sampling.n`` samples each; returns ``val_*``
    metrics (accuracy and its standard error over problems, format rate, lengths of correct/incorrect
    responses, token entropy; with several samples, avg@n, pass@k and maj@n with their standard errors).

    Under several ranks every rank calls it (as the loops do): each pushes the whole weights
    (:func:`a5core.engines.full_weights`, a collective) into its own engine, evaluates its block
    of the problems, and all get every record (gathered in problem order), so all return the same
    metrics; the entropies of the table's sample are a forward pass of the (sharded) model on every
    rank. The tracking rank alone logs the table.
    """

    def run(model: torch.nn.Module, step: int) -> dict[str, float]:
        engine.load_weights(full_weights(model))
        chosen = list(problems[:subset])
        mine = chosen[distributed.rank_slice(len(chosen))]
        records = distributed.gather_lists(evaluate(engine, mine, template, reward_fn, sampling)[0] if mine else [])
        summary = summarize(records)
        rows, generation_metrics = log_generations(model, tokenizer, records, table_samples, seed=step)
        if tracking_rank():  # the sampled generations, and every problem's outcome (for paired comparisons)
            name = f"{'full' if subset is None else f'subset{subset}'}_step_{step:06d}.json"
            _log_table(rows, "generations", name)
            _log_table(per_problem_table(records), "per_problem", name)
        metrics = {
            "accuracy": summary["accuracy"],
            "accuracy_se": summary["accuracy_se"],
            "format_rate": summary["format_rate"],
            "n_problems": summary["n_problems"],
            **generation_metrics,
        }
        if sampling.n > 1:  # several samples a problem: pass@k, maj@n and their standard errors
            metrics.update({k: v for k, v in summary.items() if k.startswith(("pass_at_", "maj_at_", "avg_at_"))})
        return {f"val_{k}": v for k, v in metrics.items()}

    return run


def _log_table(rows: list[dict[str, Any]] | dict[str, list[Any]], folder: str, name: str) -> None:
    """The table ``<folder>/<name>`` of the active run (rows, or columns), unless it holds one already.

    Named by the problems evaluated: the last subset evaluation of a run and its final evaluation share
    a step. log_table appends to an existing table, so a step evaluated again (a resumed run repeating
    it) keeps its first table.
    """
    table = f"{folder}/{name}"
    run_id = mlflow.active_run().info.run_id
    if table not in {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, folder)}:
        columns = rows if isinstance(rows, dict) else {k: [r[k] for r in rows] for k in rows[0]}
        mlflow.log_table(columns, artifact_file=table)
