"""Shared pieces of the training flows: resumable MLflow runs, the validation hook, curves and plots.

Under torchrun every rank runs a training flow's code (see :func:`flows.cli.run_flow`), and one of them
tracks: rank 0 (:func:`tracking_rank`). The run helpers here know it: on the other ranks
:func:`start_resumable_run` and :func:`reopen_run` open no MLflow run (``run.info.run_id`` is None),
:func:`mlflow_logger` logs nothing and :func:`validation_hook` evaluates its share of the problems but
logs no table; the flows write their output files on the tracking rank only.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import torch

from a5core import distributed
from a5core.data import Problem, write_text_atomic
from a5core.evaluation import evaluate, log_generations, summarize
from a5core.prompts import PromptTemplate
from a5core.rollout import Engine, SamplingSettings
from tasks.tables import csv_text, markdown_table
from tasks.tracking import ensure_experiment, system_metrics_logging

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
    if run_id_file.is_file():
        return reopen_run(
            run_id_file.read_text().strip(),
            experiment_id,
            nested=parent_run_id is not None,
            log_system_metrics=system_metrics,
        )
    tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else None
    run = mlflow.start_run(
        experiment_id=experiment_id,
        run_name=run_name,
        nested=parent_run_id is not None,
        tags=tags,
        log_system_metrics=system_metrics,
    )
    write_text_atomic(run_id_file, run.info.run_id)
    return run


# Where results go and how fast they come, not what runs: changing these keeps a run's folder (and resumes it).
RUN_KEY_IGNORED = (
    "output_dir",
    "metrics_path",
    "experiment",
    "tracking_uri",
    "compile_layers",
    "fsdp_reshard_after_forward",
)


def params_key(params: Any, ignore: tuple[str, ...] = RUN_KEY_IGNORED) -> str:
    """A short hash of a flow's parameters: runs with other settings get other folders (and MLflow runs),
    so a resumed run never picks up a checkpoint or a 'done' marker written under different settings.
    A ``model`` that is a local folder counts by its files too (:func:`tasks.evaluation.model_fingerprint`):
    a stage that starts from another stage's saved model runs again when that model was trained again."""
    import hashlib

    from tasks.evaluation import model_fingerprint

    values = params.model_dump(exclude=set(ignore))
    if isinstance(values.get("model"), str) and Path(values["model"]).expanduser().is_dir():
        values["model_files"] = model_fingerprint(values["model"])
    dump = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(dump.encode()).hexdigest()[:10]


def model_path(model: str | None) -> str:
    """A starting model as a run records it (tag ``model_path``): a local folder by its real path (a link
    such as the SFT stage's ``best_model`` resolved to the setting it points at), a hub id as it is."""
    path = Path(str(model)).expanduser()
    return str(path.resolve()) if path.is_dir() else str(model)


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
    """``evaluate(model, step)`` for the loops: push weights, evaluate, log a generations table.

    Evaluates the first ``subset`` problems (all if None); returns ``val_*`` metrics (accuracy,
    format rate, lengths of correct/incorrect responses, token entropy).

    Under several ranks every rank calls it (as the loops do): each pushes the whole weights
    (:func:`a5core.distributed.full_weights`, a collective) into its own engine, evaluates its block
    of the problems, and all get every record (gathered in problem order), so all return the same
    metrics; the entropies of the table's sample are a forward pass of the (sharded) model on every
    rank. The tracking rank alone logs the table.
    """

    def run(model: torch.nn.Module, step: int) -> dict[str, float]:
        engine.load_weights(distributed.full_weights(model))
        chosen = list(problems[:subset])
        mine = chosen[distributed.rank_slice(len(chosen))]
        records = distributed.gather_lists(evaluate(engine, mine, template, reward_fn, sampling)[0] if mine else [])
        summary = summarize(records)
        rows, generation_metrics = log_generations(model, tokenizer, records, table_samples, seed=step)
        if tracking_rank():
            _log_table(rows, f"{'full' if subset is None else f'subset{subset}'}_step_{step:06d}.json")
        metrics = {
            "accuracy": summary["accuracy"],
            "format_rate": summary["format_rate"],
            "n_problems": summary["n_problems"],
            **generation_metrics,
        }
        return {f"val_{k}": v for k, v in metrics.items()}

    return run


def _log_table(rows: list[dict[str, Any]], name: str) -> None:
    """The generations table ``generations/<name>`` of the active run, unless it holds one already.

    Named by the problems evaluated: the last subset evaluation of a run and its final evaluation share
    a step. log_table appends to an existing table, so a step evaluated again (a resumed run repeating
    it) keeps its first table.
    """
    table = f"generations/{name}"
    run_id = mlflow.active_run().info.run_id
    if table not in {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "generations")}:
        mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, artifact_file=table)


def save_model_folder(model: torch.nn.Module, tokenizer: Any, directory: Path) -> None:
    """Replace ``directory`` with a Hugging Face folder of ``model`` and ``tokenizer`` (written beside it,
    then renamed: never half a folder). Every rank calls it (:func:`a5core.distributed.write_whole`: the
    weights are gathered whole, rank 0 writes, the others wait)."""
    import shutil

    def write(state: dict[str, torch.Tensor]) -> None:
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=state)
        tokenizer.save_pretrained(partial)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)

    distributed.write_whole(model, write)


def write_curves(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """A csv of learning-curve points (DVC plots read it), written atomically."""
    return write_text_atomic(path, csv_text(rows))


def plot_curves(path: Path, rows: Sequence[dict[str, Any]], x: str, y: str, series: str, title: str) -> Path:
    """One line per ``series`` value of ``y`` against ``x``, saved as a PNG.

    Axes that read the same from plot to plot:

    - y is a 0–1 metric when a word of its name (split at ``_``, ``/``, ...) is ``accuracy``, ``rate``,
      ``reward`` or ``fraction`` (``val_accuracy``, ``format_rate``, ``reward_mean``, ``clip_fraction``;
      not ``learning_rate``, not ``generated_tokens``) and every value lies in [0, 1] (rewards here do):
      its axis is fixed to -0.02..1.02, so points at 0 and 1 show and an all-zero curve sits at the
      bottom instead of mid-plot. Any other y (or one with a value outside [0, 1]) is autoscaled.
    - x gets integer ticks when it is ``step`` or ``round`` or every value is an integer (steps, rounds):
      no tick at step 0.25.
    """
    import numbers
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(str(r[series]) for r in rows):
        points = sorted((r[x], r[y]) for r in rows if str(r[series]) == name)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    axes.set(xlabel=x, ylabel=y, title=title)
    ys = [r[y] for r in rows if isinstance(r[y], numbers.Real)]
    words = re.split(r"[^a-z0-9]+", y.lower())
    unit_metric = bool({"accuracy", "rate", "reward", "fraction"} & set(words)) and "learning_rate" not in y.lower()
    if unit_metric and all(0 <= v <= 1 for v in ys):
        axes.set_ylim(-0.02, 1.02)
    integer_x = all(isinstance(r[x], numbers.Integral) and not isinstance(r[x], bool) for r in rows)
    if x in ("step", "round") or integer_x:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(title=series)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def log_comparison(
    output_dir: Path,
    curves: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    series: str,
    title: str,
    *,
    trends: list[dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Write curves.csv, summary.md/json and the comparison plot; log them to the active (parent) run.

    curves: validation points (``series``, step, val_accuracy[, wall_seconds]); with wall_seconds a
    second plot shows accuracy against wall-clock time. trends: per-step training points (``series``,
    step, then any metrics), written as train_curves.csv with one plot per metric against step.
    """
    paths = {
        "curves": write_curves(output_dir / "curves.csv", curves),
        "summary_md": write_text_atomic(output_dir / "summary.md", markdown_table(summary)),
        "summary_json": write_text_atomic(output_dir / "summary.json", json.dumps(summary, indent=2) + "\n"),
        "plot": plot_curves(output_dir / "accuracy_vs_step.png", curves, "step", "val_accuracy", series, title),
    }
    if "wall_seconds" in curves[0]:
        paths["plot_wall_clock"] = plot_curves(
            output_dir / "accuracy_vs_wall_clock.png",
            curves,
            "wall_seconds",
            "val_accuracy",
            series,
            f"{title} (wall-clock)",
        )
    if trends:
        paths["trends"] = write_curves(output_dir / "train_curves.csv", trends)
        for metric in [k for k in trends[0] if k not in (series, "step", "wall_seconds")]:
            paths[f"plot_{metric}"] = plot_curves(
                output_dir / f"{metric}_vs_step.png", trends, "step", metric, series, f"{metric} by step"
            )
    for path in paths.values():
        mlflow.log_artifact(str(path))
    return {k: str(v) for k, v in paths.items()}
