"""Flows ``expert_iteration`` (one EI run) and ``ei_sweep`` (a grid of runs as children of one parent).

Each EI run samples D_b training questions per round, G rollouts each, keeps the correct ones, SFTs
the policy on them for E epochs and evaluates on a validation subset (full set after the last round);
every round is logged to MLflow (validation accuracy, kept fraction, entropy, lengths). The sweep
covers any subset of G × E × D_b and writes one comparison plot and table into the parent run. Killed
runs resume from their checkpoints and continue their MLflow runs; a finished run's policy is saved as a
Hugging Face folder, ``output_dir/runs-<key>/<name>/model``.

    python -m flows.expert_iteration --help
    python -m flows.expert_iteration --config params.yaml                 # one run
    python -m flows.expert_iteration --config params.yaml --sweep true    # the grid
    python -m flows.expert_iteration --config params.yaml --sweep true --runner ray --ray-gpus-per-child 0.25
                                                                          # its children at once on Ray
    torchrun --nproc-per-node 4 -m flows.expert_iteration --config params.yaml --backend hf   # on 4 GPUs

Under torchrun every rank runs each round (see :func:`flows.cli.launched_rank`): it samples its share of
the questions with its own hf engine (a full copy of the weights on its GPU), all ranks grade and keep
the same rollouts, and the SFT loop trains on them with FSDP2; rank 0 alone logs to MLflow and writes
the outputs and checkpoints.
"""

from __future__ import annotations

import itertools
import sys

from prefect import flow
from pydantic import ValidationError

from a5core.data.problem_sets import load_problem_set, load_validation_set
from a5core.engines import Engine
from a5core.loops.expert_iteration import check_round_size, expert_iteration
from a5core.runtime.settings import describe
from flows.cli import flow_main, print_paths
from flows.fanout import children_on_ray
from flows.params import EIParams
from flows.seeds import check_seeds, run_seeded, seeded, show_verdicts, with_verdicts
from flows.served import check_served_inputs
from tasks.checks import check_difficulty, check_outputs, check_placement, check_prompts_fit
from tasks.engines import closing_engine, engine_for
from tasks.model_registry import REGISTERED_MODELS
from tasks.parent_run import Summary, child_curves, parent_run
from tasks.runs import FINAL_SCORE, STARTING_SCORE, save_model_folder, training_run, training_task
from tasks.tracking_rank import tracked

SUMMARY_KEYS = ("setting", *STARTING_SCORE, *FINAL_SCORE)


@flow(name="expert_iteration")
def expert_iteration_flow(params: EIParams = EIParams()) -> dict:
    """One EI run, or (``sweep``) the grid, as the children of one parent run (``expert_iteration`` or
    ``ei_sweep``) with the comparison plot, the children's curves and each child's policy registered."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    name, children = ("ei_sweep", grid(params)) if params.sweep else ("expert_iteration", {"single": params})
    plot_title = "Expert Iteration: validation accuracy by round"
    registered = REGISTERED_MODELS["expert_iteration"]
    summary = Summary("expert_iteration", "Expert Iteration", plot_title, SUMMARY_KEYS, registered)
    with parent_run(params, name, summary) as parent:
        if seeded(params):  # each setting once per seed, side by side (a process or a Ray worker each)
            run_seeded(children, run_ei, params, parent, name)
        elif params.sweep and params.runner == "ray":  # at once, each child on a Ray worker, an engine each
            parent.rows = children_on_ray(children, run_ei, params, parent.run_id)
        else:  # one after another, on the flow's one engine
            with closing_engine(engine_for(params)) as engine:
                for setting, child in children.items():
                    parent.rows.append(tracked(run_ei)(setting, child, engine, parent.run_id))
        parent.curves = with_starting_points(parent.rows)
    return with_verdicts(params, parent, name)


@training_task
def run_ei(name: str, params: EIParams, engine: Engine, parent_run_id: str | None) -> dict:
    """One EI run (:func:`tasks.runs.training_run`), a child of ``parent_run_id``: its row adds the curve by round
    (step k: after k rounds) with each round's kept fraction."""
    with training_run(name, f"ei-{name}", params, engine, parent_run_id) as run:
        if run.finished:  # trained before: its row, not trained again
            return run.row
        problems = load_problem_set(params.train_data, params.train_format, params.seed, "train")
        history = expert_iteration(
            run.model,
            run.tokenizer,
            engine,
            problems,
            run.template,
            run.reward_fn,
            params.ei,
            checkpoint_dir=run.folder / "checkpoint",
            evaluate=run.validation(params.val_subset),
            log=run.log,
            pass_rates=run.pass_rates,
        )
        save_model_folder(run.model, run.tokenizer, run.folder / "model")
        run.trained(
            params.n_ei_steps,
            {
                "curve": [
                    {"step": round_ + 1, "val_accuracy": h["val_accuracy"], "kept_fraction": h["kept_fraction"]}
                    for round_, h in enumerate(history)
                ],
                "model_dir": str(run.folder / "model"),
            },
            final=run.final_from(history[-1]) if history else None,
        )
    return run.row


def grid(params: EIParams) -> dict[str, EIParams]:
    """The sweep's settings, named G{g}_E{e}_Db{d}, each validated."""
    try:
        return {
            f"G{g}_E{e}_Db{d}": params.replace(rollouts_per_question=g, epochs=e, questions_per_step=d)
            for g, e, d in itertools.product(
                params.sweep_rollouts_per_question, params.sweep_epochs, params.sweep_questions_per_step
            )
        }
    except ValidationError as error:
        raise ValueError(describe(error)) from None


def with_starting_points(rows: list[dict]) -> list[dict]:
    """The children's curves by round, each from step 0: its starting model's accuracy (the row's
    ``initial_accuracy``, where the run evaluated it)."""
    starts = [
        {"setting": r["setting"], "step": 0, "val_accuracy": r["initial_accuracy"], "kept_fraction": None}
        for r in rows
        if r.get("initial_accuracy") is not None
    ]
    return starts + child_curves(rows)


def check_inputs(params: EIParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: each sweep
    setting, the problems, prompts within the model's context, the outputs."""
    try:
        if params.sweep:
            grid(params)
    except ValueError as error:
        raise ValueError(f"invalid Expert Iteration settings: {error}") from None
    check_placement(params)
    check_seeds(params, grid(params) if params.sweep else ["single"])
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    for setting, child in (grid(params) if params.sweep else {"": params}).items():
        try:
            check_round_size(child.ei, len(train))
        except ValueError as error:
            raise ValueError(
                f"train_data {params.train_data}{f', setting {setting}' if setting else ''}: {error}"
            ) from None
    validation = load_validation_set(params.validation_data, params.validation_format)
    check_prompts_fit(params, {params.train_data: train, params.validation_data: validation}, params.max_tokens)
    check_difficulty(params, train)
    check_outputs(params)


def show(params: EIParams, result: dict) -> None:
    for row in result["summary"]:
        print(f"{row['setting']:>14}: accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}")
    print_paths(result["paths"])
    print(f"mlflow run {result['mlflow_run_id']}")
    show_verdicts(result)


main = flow_main(expert_iteration_flow, EIParams, "expert_iteration", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
