"""Flow ``grpo`` (one GRPO run) and the A5 ablation flows (a parent MLflow run with a child per setting).

A run trains the policy with :func:`a5core.grpo.grpo`, logging every step to MLflow (rewards, advantage
statistics, entropy, lengths, loss, gradient norm, clip fraction, phase times, tokens/s), validation
accuracy every ``eval_every`` steps on a fixed random subset (against step, and against wall-clock
seconds as ``val_accuracy_by_wall_seconds``), a table of example rollouts at each validation, and the
full validation set at the end. A killed run resumes from its checkpoint and continues its MLflow run.

The ablations (each also a flow of that name, for the Prefect UI; ``--ablation NAME`` on the CLI and
``grpo.ablation`` in params.yaml for ``dvc exp run -S grpo.ablation=NAME``):

- ``grpo_lr_sweep``: ``sweep_learning_rates``;
- ``grpo_baseline_ablation``: no_baseline vs reinforce_with_baseline;
- ``grpo_length_norm_ablation``: masked_mean vs masked_normalize (see docs/length_normalization.md);
- ``grpo_std_norm_ablation``: advantages divided by the group std or not;
- ``grpo_off_policy_sweep``: on-policy against grpo_clip at each epochs_per_rollout_batch ×
  train_batch_size of the sweep (micro-batch size kept), by step and by wall-clock, with entropy
  and length trends;
- ``grpo_clip_ablation``: grpo_clip vs grpo_no_clip at ``clip_epochs_per_rollout_batch`` ×
  ``clip_train_batch_size`` (set them to the off-policy sweep's best);
- ``grpo_prompt_ablation``: r1_zero vs question_only, each with its own reward function.

Each writes accuracy-by-step and by-wall-clock plots, entropy/length/reward trend plots, curves as
csv and a summary table (setting → final accuracy, format rate, wall seconds) into the parent run.

    python -m flows.grpo --help
    python -m flows.grpo --config params.yaml                                   # one run
    python -m flows.grpo --config params.yaml --ablation grpo_baseline_ablation  # an ablation
    torchrun --nproc-per-node 4 -m flows.grpo --config params.yaml                # on 4 GPUs (FSDP2)
    python -m flows.grpo --config params.yaml --engine-device cuda:1            # the engine on a GPU of its own

Under torchrun every rank trains (see :func:`flows.cli.run_flow`) and has its own engine with a full
copy of the weights: in its process (hf) or, with ``engine_device``, a RemoteEngine on a device of its
own; rank 0 alone logs to MLflow and writes the outputs.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import ValidationError

from a5core.data import write_text_atomic
from flows.cli import check_outputs, cli_main, run_flow
from a5core.grpo import grpo
from a5core.models import check_context, resolve_model
from a5core.policy import load_policy
from a5core.prompts import load_prompt
from a5core.settings import describe
from a5core.problem_sets import REWARD_FNS, load_problem_set
from a5core.rollout import Engine, SamplingSettings
from flows.params import GRPOParams
from tasks.engines import closing_engine, parse_engine_devices, rollout_engine
from tasks.fanout import run_children_on_ray
from tasks.tracking import ensure_experiment, log_params_flat
from tasks.training import (
    reopen_run,
    RUN_KEY_IGNORED,
    log_comparison,
    mlflow_logger,
    model_path,
    params_key,
    start_resumable_run,
    tracked,
    tracking_rank,
    validation_hook,
)

TREND_METRICS = ("reward_mean", "token_entropy", "response_tokens_mean")


def with_overrides(params: GRPOParams, overrides: dict[str, Any]) -> GRPOParams:
    """``params`` with ``overrides``, validated: ValueError in one line for an invalid combination."""
    try:
        return type(params)(**{**params.model_dump(), **overrides})
    except ValidationError as error:
        raise ValueError(describe(error)) from None


# ---------------------------------------------------------------------------------- the ablations


def _off_policy(params: GRPOParams, epochs: int, train_batch_size: int, loss_type: str) -> dict[str, Any]:
    """An off-policy setting that keeps the micro-batch size (so memory per forward stays the same)."""
    micro = params.train_batch_size // params.gradient_accumulation_steps
    return {"epochs_per_rollout_batch": epochs, "train_batch_size": train_batch_size,
            "gradient_accumulation_steps": max(1, train_batch_size // micro), "loss_type": loss_type}


def _off_policy_sweep(p: GRPOParams) -> dict[str, dict[str, Any]]:
    settings = {"on_policy": {**_off_policy(p, 1, p.rollout_batch_size, "reinforce_with_baseline")}}
    for epochs in p.sweep_epochs_per_rollout_batch:
        for size in p.sweep_train_batch_sizes:
            settings[f"E{epochs}_tb{size}"] = _off_policy(p, epochs, size, "grpo_clip")
    return settings


ABLATIONS: dict[str, tuple[str, Callable[[GRPOParams], dict[str, dict[str, Any]]]]] = {
    "grpo_lr_sweep": ("learning rate", lambda p: {f"lr_{lr:g}": {"learning_rate": lr} for lr in p.sweep_learning_rates}),
    "grpo_baseline_ablation": ("baseline", lambda p: {t: {"loss_type": t} for t in ("no_baseline", "reinforce_with_baseline")}),
    "grpo_length_norm_ablation": ("length normalisation", lambda p: {
        n: {"length_normalization": n} for n in ("masked_mean", "masked_normalize")}),
    "grpo_std_norm_ablation": ("std normalisation", lambda p: {
        "std_normalization": {"use_std_normalization": True}, "no_std_normalization": {"use_std_normalization": False}}),
    "grpo_off_policy_sweep": ("off-policy", _off_policy_sweep),
    "grpo_clip_ablation": ("clipping", lambda p: {
        t: _off_policy(p, p.clip_epochs_per_rollout_batch, p.clip_train_batch_size, t) for t in ("grpo_clip", "grpo_no_clip")}),
    "grpo_prompt_ablation": ("prompt", lambda p: {name: {"prompt": name, "reward_fn": None} for name in ("r1_zero", "question_only")}),
}


def ablation_settings(name: str, params: GRPOParams) -> dict[str, GRPOParams]:
    """The children of ablation ``name``: setting name → validated parameters (an invalid one fails
    before anything runs)."""
    _, build = ABLATIONS[name]
    return {setting: with_overrides(params, {**overrides, "ablation": None}) for setting, overrides in build(params).items()}


# ----------------------------------------------------------------------------------------- a run


def accuracy_by_wall_clock(run_id: str) -> Callable[[float, int, float], None]:
    """``log(val_accuracy, step, wall_seconds)`` for run ``run_id``: the metric ``val_accuracy_by_wall_seconds``
    at MLflow step int(wall-clock seconds), one point per validated GRPO step, resumes included.

    A resumed run replays the steps after its checkpoint and validates them again, later in wall-clock
    time: logged as is, a replayed validation would be a second point at a new x. A step's point belongs
    at the second the run first recorded for that step (its ``wall_seconds``, which the resume-safe
    logger keeps from the first time): among the validated steps whose first second is that one, this
    step is the k-th, and the point is written only if the run holds fewer than k points there (so a
    kill between the step's metrics and its point still gets the point written, once).
    Off the tracking rank (torchrun rank > 0) it logs nothing.
    """
    import mlflow

    if not tracking_rank():
        return lambda accuracy, step, wall_seconds: None
    client = mlflow.MlflowClient()
    second_of = {m.step: int(m.value) for m in client.get_metric_history(run_id, "wall_seconds")}
    validated = {m.step for m in client.get_metric_history(run_id, "val_accuracy")}
    held = Counter(m.step for m in client.get_metric_history(run_id, "val_accuracy_by_wall_seconds"))

    def log(accuracy: float, step: int, wall_seconds: float) -> None:
        second = second_of.setdefault(step, int(wall_seconds))
        validated.add(step)
        if sum(second_of.get(s) == second for s in validated if s <= step) > held[second]:
            mlflow.log_metrics({"val_accuracy_by_wall_seconds": accuracy}, step=second)
            held[second] += 1

    return log


@task(cache_policy=NO_CACHE)
def run_grpo(name: str, params: GRPOParams, engine: Engine, parent_run_id: str | None) -> dict:
    """One GRPO run in its own resumable MLflow run; returns its summary row, curve and trends."""
    import torch

    run_dir = Path(params.output_dir) / f"runs-{run_key(params)}" / name
    if (run_dir / "done.json").is_file():
        return json.loads((run_dir / "done.json").read_text())
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    template, reward_fn = load_prompt(params.prompt), REWARD_FNS[params.grader]
    eval_sampling = SamplingSettings(temperature=params.temperature, max_tokens=params.max_tokens,
                                     stop=template.stop, seed=params.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with start_resumable_run(run_dir / "mlflow_run_id", params.experiment, f"grpo-{name}", params.tracking_uri,
                             parent_run_id) as run:
        _log_params({**params.model_dump(exclude={"ablation"}), "setting": name})
        model, tokenizer = load_policy(params.model, dtype=getattr(torch, params.policy_dtype), device=device)
        hook = validation_hook(engine, tokenizer, validation, template, reward_fn, eval_sampling, params.val_subset)
        to_mlflow, by_wall_clock = mlflow_logger(), accuracy_by_wall_clock(run.info.run_id)

        def log(metrics: dict[str, float], step: int) -> None:
            to_mlflow(metrics, step)
            if "val_accuracy" in metrics:
                by_wall_clock(metrics["val_accuracy"], step, metrics["wall_seconds"])

        history = grpo(model, tokenizer, engine, train, template, reward_fn, params, checkpoint_dir=run_dir / "checkpoint",
                       evaluate=hook, log=log)
        model.eval()
        full = validation_hook(engine, tokenizer, validation, template, reward_fn, eval_sampling, params.val_limit)(
            model, params.n_grpo_steps)
        log({f"final_{k}": v for k, v in full.items()}, params.n_grpo_steps)
        start = history[0] if history and history[0]["step"] == 0 else {}  # the starting policy's evaluation
        row = {
            "setting": name, "initial_accuracy": start.get("val_accuracy"), "initial_format_rate": start.get("val_format_rate"),
            "final_accuracy": full["val_accuracy"], "final_format_rate": full["val_format_rate"],
            "wall_seconds": history[-1]["wall_seconds"],
            "curve": [{"step": h["step"], "wall_seconds": h["wall_seconds"], "val_accuracy": h["val_accuracy"]}
                      for h in history if "val_accuracy" in h],
            "trends": [{"step": h["step"], **{k: h[k] for k in TREND_METRICS}} for h in history if "reward_mean" in h],
            "mlflow_run_id": run.info.run_id,
        }
    if tracking_rank():
        write_text_atomic(run_dir / "done.json", json.dumps(row))
    return row


def _log_params(values: dict[str, Any]) -> None:
    """The run's parameters into the active MLflow run (tracking rank only); ``engine_device`` as a tag,
    as it may change when a run resumes (MLflow refuses a parameter's second value)."""
    import mlflow

    if tracking_rank():
        engine_device = values.pop("engine_device", None)
        log_params_flat(values)
        mlflow.set_tag("engine_device", str(engine_device))
        mlflow.set_tag("model_path", model_path(values.get("model")))


def engine_for(params: GRPOParams) -> Engine:
    """The run's rollout engine (on every rank its own), started through the retried ``start_engine``
    task: in this process, or with ``engine_device`` a RemoteEngine in a process of its own on that
    device (:func:`tasks.engines.rollout_engine`). Close it with :func:`tasks.engines.closing_engine`."""
    return rollout_engine(resolve_model(params.model), params.backend, dtype=params.engine_dtype,
                          memory_fraction=params.engine_memory_fraction, engine_device=params.engine_device)


def _report(params: GRPOParams, rows: list[dict], title: str) -> tuple[list[dict], dict[str, str]]:
    """Summary table, curves and plots of ``rows`` into output_dir and the active MLflow run."""
    curves = [{"setting": r["setting"], **point} for r in rows for point in r["curve"]]
    trends = [{"setting": r["setting"], **point} for r in rows for point in r["trends"]]
    summary = [{k: r.get(k) for k in ("setting", "initial_accuracy", "initial_format_rate", "final_accuracy",
                                      "final_format_rate", "wall_seconds")} for r in rows]
    paths = log_comparison(Path(params.output_dir), curves, summary, "setting", title, trends=trends)
    if params.metrics_path:
        write_text_atomic(Path(params.metrics_path), json.dumps(summary, indent=2) + "\n")
    return summary, paths


def run_key(params: GRPOParams) -> str:
    """The folder key of a run: its parameters, less where results go, where the engine runs and how
    children are scheduled."""
    return params_key(params, ignore=(*RUN_KEY_IGNORED, "engine_device", "runner", "ray_address", "ray_gpus_per_child",
                                      "ray_cpus_per_child"))


def _run_with_own_engine(setting: str, params: GRPOParams, parent_run_id: str) -> dict:
    """One child on a Ray worker: engines are process-local, so it starts its own."""
    with closing_engine(engine_for(params)) as engine:
        return run_grpo.fn(setting, params, engine, parent_run_id)


def run_ablation(name: str, params: GRPOParams) -> dict:
    """Ablation ``name`` as a parent MLflow run with one child run per setting; resumable."""
    import mlflow

    children = ablation_settings(name, params)
    parent_params = params.model_copy(update={"ablation": name})
    run_id_file = Path(params.output_dir) / f"runs-{run_key(parent_params)}" / "mlflow_run_id"
    with start_resumable_run(run_id_file, params.experiment, name, params.tracking_uri) as parent:
        _log_params(parent_params.model_dump())
        if params.runner == "ray":
            rows = run_children_on_ray(
                children, functools.partial(_run_with_own_engine, parent_run_id=parent.info.run_id),
                address=params.ray_address, gpus_per_child=params.ray_gpus_per_child,
                cpus_per_child=params.ray_cpus_per_child,
            )
        else:
            with closing_engine(engine_for(params)) as engine:
                rows = [tracked(run_grpo)(setting, child, engine, parent.info.run_id) for setting, child in children.items()]
        if not tracking_rank():
            return {"summary": None, "paths": None, "mlflow_run_id": None}
        summary, paths = _report(params, rows, f"GRPO {ABLATIONS[name][0]} ablation: validation accuracy")
        mlflow.set_tag("ablation", name)
    return {"summary": summary, "paths": paths, "mlflow_run_id": parent.info.run_id}


@flow(name="grpo")
def grpo_flow(params: GRPOParams = GRPOParams()) -> dict:
    """One GRPO run, or (``ablation`` set) that ablation."""
    if params.ablation is not None:
        return run_ablation(params.ablation, params)
    with closing_engine(engine_for(params)) as engine:
        row = tracked(run_grpo)("single", params, engine, None)
    if not tracking_rank():
        return {"summary": None, "paths": None, "mlflow_run_id": None}
    with reopen_run(row["mlflow_run_id"], ensure_experiment(params.experiment, params.tracking_uri)):
        summary, paths = _report(params, [row], "GRPO: validation accuracy")
    return {"summary": summary, "paths": paths, "mlflow_run_id": row["mlflow_run_id"]}


def _ablation_flow(name: str) -> Any:
    def run(params: GRPOParams = GRPOParams()) -> dict:
        return run_ablation(name, params)

    run.__doc__ = f"The {ABLATIONS[name][0]} ablation: a parent MLflow run with one child per setting."
    run.__name__ = run.__qualname__ = name  # the module attribute it is bound to: a valid deployment entrypoint
    return flow(name=name)(run)


grpo_lr_sweep = _ablation_flow("grpo_lr_sweep")
grpo_baseline_ablation = _ablation_flow("grpo_baseline_ablation")
grpo_length_norm_ablation = _ablation_flow("grpo_length_norm_ablation")
grpo_std_norm_ablation = _ablation_flow("grpo_std_norm_ablation")
grpo_off_policy_sweep = _ablation_flow("grpo_off_policy_sweep")
grpo_clip_ablation = _ablation_flow("grpo_clip_ablation")
grpo_prompt_ablation = _ablation_flow("grpo_prompt_ablation")


def check_inputs(params: GRPOParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the settings
    (each ablation setting's too), the model path, the prompt, the data files, prompts that do not fit
    the model's context, where the engines run, outputs that cannot be written."""
    try:
        if params.ablation is not None:
            ablation_settings(params.ablation, params)
    except ValueError as error:
        raise ValueError(f"invalid GRPO settings: {error}") from None
    check_placement(params)
    model = resolve_model(params.model)
    template = load_prompt(params.prompt)
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    if len(train) < params.prompts_per_step:
        raise ValueError(f"train_data {params.train_data}: {len(train)} problems, fewer than the "
                         f"{params.prompts_per_step} questions a step samples (rollout_batch_size / group_size)")
    sources = [(params.train_data, p) for p in train] + [(params.validation_data, p) for p in validation]
    check_context(model, [template.format(p.problem) for _, p in sources], params.max_tokens,
                  [f"{source} problem {p.unique_id}" for source, p in sources])
    check_outputs(params)


def check_placement(params: GRPOParams) -> None:
    """Refuse what cannot run under torchrun's ranks (read from the environment, before the process
    group exists): Ray children (each would be a training job of its own), engines on Ray with an
    ``engine_device``, and an ``engine_device`` list that does not give each rank one device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if params.ablation is not None and params.runner == "ray" and (world > 1 or params.engine_device is not None):
        raise ValueError("runner ray: the children run on Ray workers, each with an engine of its own; it does not "
                         "combine with torchrun or engine_device (use runner local)")
    if params.engine_device is not None:
        devices, local_world = parse_engine_devices(params.engine_device), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if len(devices) not in (1, local_world):
            raise ValueError(f"engine_device {params.engine_device!r}: {len(devices)} devices for {local_world} ranks; "
                             "give one device, or one per rank")


@cli_main("flows.grpo")
def main(argv: list[str] | None = None) -> None:
    from flows.cli import parse_params

    params = parse_params(GRPOParams, "grpo", argv, __doc__)
    check_inputs(params)
    result = run_flow(grpo_flow, params)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
    for row in result["summary"]:
        print(f"{row['setting']:>24}: accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}, "
              f"{row['wall_seconds']:.0f} s")
    print("\n".join(f"{k:16} {v}" for k, v in result["paths"].items()))
    print(f"mlflow run {result['mlflow_run_id']}")


if __name__ == "__main__":
    main(sys.argv[1:])
