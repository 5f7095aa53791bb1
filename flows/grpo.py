"""Flow ``grpo`` (one GRPO run) and the A5 ablation flows (a parent MLflow run with a child per setting).

A run trains the policy with :func:`a5core.loops.grpo.grpo`, logging every step to MLflow (rewards, advantage
statistics, entropy, lengths, loss, gradient norm, clip fraction, phase times, tokens/s), validation
accuracy every ``eval_every`` steps on a fixed random subset (against step, and against wall-clock
seconds as ``val_accuracy_by_wall_seconds``), a table of example rollouts at each validation, and the
full validation set at the end. A killed run resumes from its checkpoint and continues its MLflow run.
A finished run's policy is saved as a Hugging Face folder, ``output_dir/runs-<key>/<name>/model`` (``name``
``single`` for one run, the setting in an ablation): any flow's ``--model`` takes it.

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
- ``grpo_prompt_ablation``: r1_zero vs question_only, each with its own reward function (on the arithmetic
  task, the task's grader for each prompt's format).

Beyond the handout, the same way:

- ``grpo_dapo_ablation``: today's GRPO, DAPO's dynamic sampling, token-level loss (``token_mean``) and
  overlong shaping with truncation masking, each alone, and all three;
- ``grpo_gspo_ablation``: grpo_clip vs GSPO's sequence-level ratio at the clip ablation's off-policy setting;
- ``grpo_kl_ablation``: no KL penalty and each of ``sweep_kl_coefs``;
- ``grpo_question_sampling_ablation``: questions drawn uniformly vs only those still learnable (pass rate
  strictly between 0 and 1, from ``difficulty_table`` and refreshed from the rollouts; unknown ones allowed);
- ``grpo_async_ablation``: synchronous vs one-step-off (``pipeline_depth`` 1, the engine on
  ``engine_device``), both with truncated importance sampling (``tis_cap``, 2.0 unless set).

Each writes accuracy-by-step and by-wall-clock plots, entropy/length/reward trend plots, curves as
csv and a summary table (setting → final accuracy, format rate, wall seconds) into the parent run.

    python -m flows.grpo --help
    python -m flows.grpo --config params.yaml                                   # one run
    python -m flows.grpo --config params.yaml --ablation grpo_baseline_ablation  # an ablation
    torchrun --nproc-per-node 4 -m flows.grpo --config params.yaml                # on 4 GPUs (FSDP2)
    python -m flows.grpo --config params.yaml --engine-device cuda:1            # the engine on a GPU of its own

Under torchrun every rank trains (see :func:`flows.cli.launched_rank`) and has its own engine with a full
copy of the weights: in its process (hf) or, with ``engine_device``, a RemoteEngine on a device of its
own; rank 0 alone logs to MLflow and writes the outputs.
"""

from __future__ import annotations

import sys
from typing import Any

from prefect import flow

from a5core.data.problem_sets import load_problem_set
from a5core.engines import Engine
from a5core.loops.grpo import grpo
from flows.ablations import ABLATIONS, ablation_settings
from flows.cli import flow_main, print_paths
from flows.fanout import children_on_ray
from flows.params import GRPOParams
from flows.seeds import check_seeds, run_seeded, seeded, show_verdicts, with_verdicts
from flows.served import check_served_inputs
from tasks.checks import check_grpo_run, check_placement
from tasks.engines import closing_engine, engine_for
from tasks.model_registry import REGISTERED_MODELS
from tasks.parent_run import Summary, parent_run
from tasks.runs import (
    FINAL_SCORE,
    STARTING_SCORE,
    accuracy_by_wall_clock,
    save_model_folder,
    training_run,
    training_task,
)
from tasks.tracking_rank import tracked

# A setting's row in the summary (summary.json, summary.md, the report's table).
SUMMARY_KEYS = ("setting", *STARTING_SCORE, *FINAL_SCORE, "wall_seconds")
TREND_METRICS = ("reward_mean", "token_entropy", "response_tokens_mean", "frac_groups_all_equal")


@flow(name="grpo")
def grpo_flow(params: GRPOParams = GRPOParams()) -> dict:
    """One GRPO run (the child ``single`` of a parent run ``grpo``), or (``ablation`` set) that ablation: a parent
    MLflow run with a child per setting, their comparison, each child's final policy registered (``a5-grpo``)."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    name = params.ablation or "grpo"
    children = ablation_settings(params.ablation, params) if params.ablation else {"single": params}
    title = f"GRPO {ABLATIONS[name][0]} ablation" if params.ablation else "GRPO"
    summary = Summary(name, title, f"{title}: validation accuracy", SUMMARY_KEYS, REGISTERED_MODELS["grpo"])
    with parent_run(params, name, summary) as parent:
        if seeded(params):  # each setting once per seed, side by side (a process or a Ray worker each)
            run_seeded(children, run_grpo, params, parent, name)
        elif params.ablation and params.runner == "ray":  # at once, each child on a Ray worker, an engine each
            parent.rows = children_on_ray(children, run_grpo, params, parent.run_id)
        else:  # one after another, on the flow's one engine
            with closing_engine(engine_for(params)) as engine:
                for setting, child in children.items():
                    parent.rows.append(tracked(run_grpo)(setting, child, engine, parent.run_id))
        if params.ablation:
            parent.tags = {"ablation": params.ablation}
    return with_verdicts(params, parent, name)


@training_task
def run_grpo(name: str, params: GRPOParams, engine: Engine, parent_run_id: str | None) -> dict:
    """One GRPO run (:func:`tasks.runs.training_run`), a child of ``parent_run_id``: its row adds wall_seconds,
    the validation curve by step and wall-clock, and the trends of reward, entropy and length."""
    with training_run(name, f"grpo-{name}", params, engine, parent_run_id) as run:
        if run.finished:  # trained before: its row, not trained again
            return run.row
        by_wall_clock = accuracy_by_wall_clock(run.run_id)

        def log(metrics: dict[str, float], step: int) -> None:
            run.log(metrics, step)
            if "val_accuracy" in metrics:
                by_wall_clock(metrics["val_accuracy"], step, metrics["wall_seconds"])

        problems = load_problem_set(params.train_data, params.train_format, params.seed, "train")
        history = grpo(
            run.model,
            run.tokenizer,
            engine,
            problems,
            run.template,
            run.reward_fn,
            params.grpo,
            checkpoint_dir=run.folder / "checkpoint",
            evaluate=run.validation(params.val_subset),
            log=log,
            pass_rates=run.pass_rates,
        )
        save_model_folder(run.model, run.tokenizer, run.folder / "model")
        run.trained(
            params.n_grpo_steps,
            {
                "wall_seconds": history[-1]["wall_seconds"],
                "curve": [
                    {"step": h["step"], "wall_seconds": h["wall_seconds"], "val_accuracy": h["val_accuracy"]}
                    for h in history
                    if "val_accuracy" in h
                ],
                "trends": [  # a step that trained on nothing (every group dropped) has no entropy: left blank
                    {"step": h["step"], **{k: h.get(k) for k in TREND_METRICS}} for h in history if "reward_mean" in h
                ],
                "model_dir": str(run.folder / "model"),
            },
            final=run.final_from(history[-1]),
        )
    return run.row


def _ablation_flow(name: str) -> Any:
    def run(params: GRPOParams = GRPOParams()) -> dict:
        return grpo_flow.fn(params.replace(ablation=name))

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
grpo_dapo_ablation = _ablation_flow("grpo_dapo_ablation")
grpo_gspo_ablation = _ablation_flow("grpo_gspo_ablation")
grpo_kl_ablation = _ablation_flow("grpo_kl_ablation")
grpo_question_sampling_ablation = _ablation_flow("grpo_question_sampling_ablation")
grpo_async_ablation = _ablation_flow("grpo_async_ablation")


def check_inputs(params: GRPOParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: each ablation
    setting, and a GRPO run's problems, placement, context and outputs (:func:`tasks.checks.check_grpo_run`)."""
    try:
        children = ablation_settings(params.ablation, params) if params.ablation is not None else {}
    except ValueError as error:
        raise ValueError(f"invalid GRPO settings: {error}") from None
    for setting, child in children.items():
        try:
            check_placement(child)
        except ValueError as error:
            raise ValueError(f"{params.ablation}, setting {setting}: {error}") from None
    check_seeds(params, children or ["single"])
    check_grpo_run(params)


def show(params: GRPOParams, result: dict) -> None:
    for row in result["summary"]:
        print(
            f"{row['setting']:>24}: accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}, "
            f"{row['wall_seconds']:.0f} s"
        )
    print_paths(result["paths"])
    print(f"mlflow run {result['mlflow_run_id']}")
    show_verdicts(result)


main = flow_main(grpo_flow, GRPOParams, "grpo", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
