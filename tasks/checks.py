"""What every flow checks before an engine starts, each failure a ValueError (or DataError,
FileNotFoundError) naming what and where: a flow then ends with one message instead of failing after
minutes of loading and generating.

- :func:`check_prompts_fit`: the model path, the prompt template, and every problem's prompt plus
  ``max_tokens`` within the model's context;
- :func:`check_outputs`: the output folder, the metrics file's folder and the MLflow store take writes
  (what they may replace is checked as the parameters are read: :mod:`tasks.outputs`);
- :func:`check_grpo_run`: a GRPO run's problems, placement and all of the above (the grpo and leaderboard
  flows).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from a5core.data.files import Problem
from a5core.data.problem_sets import load_problem_set, load_validation_set
from a5core.data.prompts import load_prompt
from a5core.loops.question_sampling import load_pass_rates
from a5core.policy.model_specs import check_context, resolve_model
from a5core.runtime.writing import check_writable_folder
from tasks.engines import parse_engine_devices
from tasks.experiments import check_store
from tasks.fanout import check_ray_address
from tasks.outputs import claim_outputs


def check_prompts_fit(params: Any, problem_sets: dict[str, list[Problem]], max_tokens: int) -> None:
    """``params.model`` resolves, ``params.prompt`` loads, and each problem's prompt (the sets keyed by
    their source) leaves room for ``max_tokens`` in the model's context."""
    model, template = resolve_model(params.model), load_prompt(params.prompt)
    problems = [(source, problem) for source, problems in problem_sets.items() for problem in problems]
    check_context(
        model,
        [template.format(p.problem) for _, p in problems],
        max_tokens,
        [f"{source} problem {p.unique_id}" for source, p in problems],
    )


def check_outputs(params: Any) -> None:
    """The run's ``output_dir``, the folder of its ``metrics_path`` and its MLflow store (``tracking_uri``,
    ``experiment``) take writes; the output folder is marked as this kind of run's
    (:func:`tasks.outputs.claim_output_dir`)."""
    if getattr(params, "output_dir", None):
        check_writable_folder(params.output_dir, "output_dir")
        claim_outputs(params)
    if getattr(params, "metrics_path", None):
        check_writable_folder(Path(params.metrics_path).parent, "the folder of metrics_path")
    if getattr(params, "tracking_uri", None):
        check_store(params.tracking_uri, params.experiment)


def check_placement(params: Any) -> None:
    """Refuse what cannot run under torchrun's ranks (read from the environment, before the process
    group exists): Ray children (each would be a training job of its own), engines on Ray with an
    ``engine_device``, and an ``engine_device`` list that does not give each rank one device. And a
    pipelined GRPO run (``pipeline_depth`` 1) without an engine in a process of its own. And a Ray cluster's
    address that takes no connection (:func:`tasks.fanout.check_ray_address`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fans_out = getattr(params, "ablation", None) is not None or getattr(params, "sweep", False)
    if fans_out and params.runner == "ray" and (world > 1 or getattr(params, "engine_device", None) is not None):
        raise ValueError(
            "runner ray: the children run on Ray workers, each with an engine of its own; it does not "
            "combine with torchrun or engine_device (use runner local)"
        )
    if fans_out and params.runner == "ray":
        check_ray_address(params.ray_address)
    if getattr(params, "pipeline_depth", 0) and params.engine_device is None:
        raise ValueError(
            "pipeline_depth 1 generates the next step's rollouts while this one trains: give the engine a "
            "process of its own with engine_device (another GPU, e.g. cuda:1; this one, cuda:0; or cpu)"
        )
    if getattr(params, "engine_device", None) is not None:
        devices, local_world = parse_engine_devices(params.engine_device), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if len(devices) not in (1, local_world):
            raise ValueError(
                f"engine_device {params.engine_device!r}: {len(devices)} devices for {local_world} ranks; "
                "give one device, or one per rank"
            )


def check_grpo_run(params: Any) -> None:
    """A GRPO run's inputs: where its engines run, its problems (enough for a step), prompts within the
    context, its outputs."""
    check_placement(params)
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    validation = load_validation_set(params.validation_data, params.validation_format)
    if len(train) < params.prompts_per_step:
        raise ValueError(
            f"train_data {params.train_data}: {len(train)} problems, fewer than the "
            f"{params.prompts_per_step} questions a step samples (rollout_batch_size / group_size)"
        )
    check_prompts_fit(params, {params.train_data: train, params.validation_data: validation}, params.max_tokens)
    check_difficulty(params, train)
    check_outputs(params)


def check_difficulty(params: Any, train: list[Problem]) -> None:
    """A ``difficulty_table`` that reads as a pass-rate table and holds at least one of the training
    questions (a table of another set would sample as if it had none); a curriculum over leveled problems."""
    if params.difficulty_table:
        rates = load_pass_rates(params.difficulty_table)
        if not any(p.unique_id in rates for p in train):
            raise ValueError(
                f"difficulty_table {params.difficulty_table}: none of its {len(rates)} questions is in "
                f"train_data {params.train_data}"
            )
    if params.question_sampling == "curriculum" and not any(p.level is not None for p in train):
        raise ValueError(f"question_sampling curriculum: train_data {params.train_data} has no levels")
