"""Flow ``leaderboard``: the A5 leaderboard run — the best MATH validation accuracy within a wall-clock budget.

Rules (fixed, as the A5 leaderboard states them): train on MATH train only; the budget (default 4 h)
counts everything from the flow's start, evaluation included; the score is the accuracy on all 5,000
MATH validation problems with the r1_zero prompt, temperature 1.0, top_p 1.0, max_tokens 1024, stop
``</answer>``, graded by the project's ``r1_zero_reward_fn``.

The recipe: an optional SFT phase (``sft_data``: a trace file, or ``arithmetic:N:DIGITS[:columns]`` generated
traces as ``sft_experiment`` takes them; ``sft_max_steps``), then GRPO until the budget, less
the time the final evaluation will take, runs out. The checkpoint is chosen on a split apart from the one
that scores it: the last ``val_subset`` problems (at most half) of the (shuffled) train set are held out of
training (any whose question is also a scored validation problem dropped), their accuracy is logged against
wall-clock seconds throughout, and every new best on them is saved as a Hugging Face folder in the run's own
folder (``output_dir/best`` links to it once the run ends; the registered model version names it); the final
score is computed with that checkpoint on the validation problems, which take no part in the choice (the A5
leaderboard forbids tuning on the scored set). The summary names both (``selection_split``, ``score_split``).
The final-evaluation reserve is the larger of ``final_eval_reserve_s`` and 1.25× the time the subset
evaluations took per problem (scaled from the run's max_tokens to 1,024; the engine is called once before, so
its first-call compilation is not counted), times the number of final problems. A run that hits its budget
stops after the current step, still evaluates and reports; ``within_budget`` says whether the whole flow kept
to it.

Smoke runs with small models use the generated arithmetic task (``arithmetic:N:DIGITS``, as the cpu
profile does) with ``reward_fn: arithmetic``: the MATH grader accepts a copy of the question ("12 + 34")
as the answer, and GRPO learns exactly that (``docs/learning_runs.md``). Such runs are never ``official``.

The default GRPO settings follow the public leaderboard's best entries: GRPO at lr 3e-5 (they used
2–5e-5), group size 8, masked_normalize length normalisation (every token weighted alike), on-policy.

    python -m flows.leaderboard --help
    python -m flows.leaderboard --config params.yaml                  # the A5 setting (GPU)
    python -m flows.leaderboard --config params.yaml --profile cpu    # a 6-minute smoke run on a CPU
    torchrun --nproc-per-node 4 -m flows.leaderboard --config params.yaml --backend hf   # on 4 GPUs (FSDP2)

Under torchrun every rank trains and evaluates its share with its own engine (see :mod:`flows.grpo`);
rank 0 alone logs to MLflow, saves the best checkpoint and writes the summary.

The run is a :func:`tasks.runs.training_run` like the other training flows': its MLflow run id,
checkpoints and ``done.json`` live in ``output_dir/runs-<key>/leaderboard/``, the key a hash of its
settings; a killed run resumes when started again with the same settings (the best checkpoint it had chosen
still the one to beat), a finished one returns its summary without training again, and changed settings start
a new run rather than reopen the old one (MLflow refuses a parameter's second value).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from prefect import flow

from a5core.data.problem_sets import hold_out, load_problem_set, load_trace_set, load_validation_set
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.grading.grader import r1_zero_reward_fn
from a5core.loops.grpo import grpo
from a5core.loops.sft import SFTConfig, train_sft
from a5core.policy.causal_lm import load_policy
from a5core.runtime.writing import write_text_atomic
from flows.cli import flow_main
from flows.params import LeaderboardParams
from flows.served import check_served_inputs
from tasks.checks import check_grpo_run, check_prompts_fit
from tasks.engines import closing_engine, engine_for
from tasks.evaluation import validation_hook
from tasks.flow_summary import publish
from tasks.model_registry import REGISTERED_MODELS, register_model
from tasks.outputs import link_model, outputs_held, write_output_file
from tasks.runs import Run, save_model_folder, training_run
from tasks.tracking_rank import tracking_rank

# What the flow returns and writes to summary.json (the run's row holds these and the skeleton's columns).
SUMMARY_KEYS = (
    "final_score",
    "final_format_rate",
    "n_final_problems",
    "official",
    "best_step",
    "best_subset_accuracy",
    "selection_split",
    "n_selection_problems",
    "score_split",
    "grpo_steps",
    "stopped_by_budget",
    "wall_seconds",
    "budget_seconds",
    "within_budget",
    "mlflow_run_id",
)
# The leaderboard's evaluation, not a parameter.
FINAL_SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=1024, stop=load_prompt("r1_zero").stop, seed=0)
OFFICIAL_VALIDATION_SIZE = 5000
# In the best checkpoint's folder: its step and accuracy on the selection split (a resumed run keeps its best).
CHOSEN_FILE = "selection.json"


@flow(name="leaderboard")
def leaderboard(params: LeaderboardParams = LeaderboardParams()) -> dict:
    """Train within the budget, keep the best checkpoint, score it on the validation set."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    start = time.monotonic()
    with outputs_held(params):  # claimed, and no other flow writes there meanwhile
        out = Path(params.output_dir)
        if Path(params.train_data).resolve() == Path(params.validation_data).resolve():
            raise ValueError("leaderboard: train_data and validation_data are the same file; train on MATH train only")
        with closing_engine(engine_for(params)) as engine:
            with training_run("leaderboard", "leaderboard", params, engine, None) as run:
                if not run.finished:  # else trained before: its row
                    train_within_budget(start, run)
            row = run.row
        summary = {k: row[k] for k in SUMMARY_KEYS}
        if tracking_rank():
            write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
            if params.metrics_path:
                write_output_file(params.metrics_path, json.dumps(summary, indent=2) + "\n")
            models = []
            # The checkpoint the score was computed with (a run finished before it stayed in the run's own folder saved
            # it as output_dir/best itself: nothing to link then).
            best = Path(row.get("best_model", out / "best"))
            if best.is_dir():
                if best != out / "best":
                    link_model(best, out / "best")
                models.append(
                    register_model(
                        best,
                        REGISTERED_MODELS["leaderboard"],
                        row["mlflow_run_id"],
                        "leaderboard",
                        tracking_uri=params.tracking_uri,
                    )
                )
            publish(
                "leaderboard",
                "Leaderboard run",
                [{k: v for k, v in summary.items() if k != "mlflow_run_id"}],
                experiment=params.experiment,
                tracking_uri=params.tracking_uri,
                mlflow_run_id=row["mlflow_run_id"],
                output_dir=out,
                models=models,
            )
    return summary


def train_within_budget(start: float, run: Run) -> None:
    """The budgeted training and the final score (see the module docstring) of the training run ``run``."""
    params, model, tokenizer, engine, template = run.params, run.model, run.tokenizer, run.engine, run.template
    budget = params.budget_hours * 3600
    validation = run.validation_problems
    final_problems = validation[: params.final_eval_limit]  # the score split
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    train, selection = hold_out(train, params.val_subset, final_problems)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The best checkpoint so far: a resumed run's, saved with its weights, else none yet.
    chosen = run.folder / "best" / CHOSEN_FILE
    best = json.loads(chosen.read_text()) if chosen.is_file() else {"val_accuracy": -1.0, "step": None}
    seconds_per_problem: list[float] = []
    clock = {"last": start, "step_seconds": 0.0}  # the previous step's length: the next one will be alike

    def reserve() -> float:
        estimate = 1.25 * max(seconds_per_problem, default=0.0) * len(final_problems)
        return max(params.final_eval_reserve_s, estimate)

    if params.sft_max_steps and params.sft_data:
        traces = load_trace_set(params.sft_data, template, params.seed)
        train_sft(
            model,
            tokenizer,
            traces,
            SFTConfig(
                learning_rate=params.sft_learning_rate,
                batch_size=params.sft_batch_size,
                microbatch_size=params.sft_microbatch_size,
                epochs=1,
                max_steps=params.sft_max_steps,
                seed=params.seed,
                checkpoint_every=50,
                compile_layers=params.compile_layers,
                fsdp_reshard_after_forward=params.fsdp_reshard_after_forward,
            ),
            checkpoint_dir=run.folder / "sft_checkpoint",
            log=lambda m, s: run.log({f"sft/{k}": v for k, v in m.items()}, s),
        )
    # The curve's evaluations sample like the final one (temperature and top_p 1.0) with the run's
    # max_tokens; their cost per problem, scaled to the final evaluation's 1,024 tokens, sizes its reserve.
    curve_sampling = SamplingSettings(
        temperature=1.0, top_p=1.0, max_tokens=params.max_tokens, stop=template.stop, seed=0
    )
    subset_eval = validation_hook(engine, tokenizer, selection, template, run.reward_fn, curve_sampling, len(selection))
    token_ratio = FINAL_SAMPLING.max_tokens / params.max_tokens
    # An engine's first call compiles (the hf engine: most of a minute on a GPU); made here, it stays out of
    # the evaluations' cost per problem, which would otherwise inflate the reserve and end the run early.
    engine.generate([template.format(selection[0].problem)], curve_sampling)

    def evaluate(model, step: int) -> dict[str, float]:
        began = time.monotonic()
        metrics = subset_eval(model, step)
        per_problem = (time.monotonic() - began) / max(1, len(selection))
        seconds_per_problem.append(per_problem * max(1.0, token_ratio))
        if metrics["val_accuracy"] > best["val_accuracy"]:
            best.update(val_accuracy=metrics["val_accuracy"], step=step)
            save_model_folder(model, tokenizer, run.folder / "best", {CHOSEN_FILE: json.dumps(best) + "\n"})
        elapsed = time.monotonic() - start
        run.log({"val_accuracy_by_wall_seconds": metrics["val_accuracy"]}, int(elapsed))
        return {**metrics, "budget_used": elapsed / budget, "final_eval_reserve_s": reserve()}

    def should_stop(step: int) -> bool:
        now = time.monotonic()
        clock["step_seconds"], clock["last"] = now - clock["last"], now
        return now - start + reserve() + clock["step_seconds"] >= budget

    clock["last"] = time.monotonic()
    history = grpo(
        model,
        tokenizer,
        engine,
        train,
        template,
        run.reward_fn,
        params.grpo,
        checkpoint_dir=run.folder / "grpo_checkpoint",
        evaluate=evaluate,
        log=run.log,
        should_stop=should_stop,
        pass_rates=run.pass_rates,
    )
    last_step = history[-1]["step"]
    if best["step"] is not None and best["step"] != last_step:
        model, _ = load_policy(run.folder / "best", dtype=getattr(torch, params.policy_dtype), device=device)
    model.eval()
    final = validation_hook(engine, tokenizer, final_problems, template, run.reward_fn, FINAL_SAMPLING, None)(
        model, last_step
    )
    wall = time.monotonic() - start
    summary = {
        "final_score": final["val_accuracy"],
        "final_format_rate": final["val_format_rate"],
        "n_final_problems": len(final_problems),
        "official": params.final_eval_limit is None
        and len(final_problems) == OFFICIAL_VALIDATION_SIZE
        and run.reward_fn is r1_zero_reward_fn
        and not params.validation_data.startswith("arithmetic:"),
        "best_step": best["step"],
        "best_subset_accuracy": best["val_accuracy"],
        "selection_split": f"{params.train_data}: {len(selection)} of its last train problems, held out of training",
        "n_selection_problems": len(selection),
        "score_split": f"{params.validation_data}: the first {len(final_problems)} validation problems",
        "grpo_steps": last_step,
        "stopped_by_budget": last_step < params.n_grpo_steps,
        "wall_seconds": wall,
        "budget_seconds": budget,
        "within_budget": wall <= budget,
    }
    run.log({k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and v is not None}, last_step)
    run.trained(last_step, {**summary, "best_model": str(run.folder / "best")}, final=final)


def check_inputs(params: LeaderboardParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: a GRPO run's
    checks (:func:`tasks.checks.check_grpo_run`), the SFT traces, the final evaluation's 1,024 tokens in the
    model's context."""
    check_grpo_run(params)
    if params.sft_data is not None:
        load_trace_set(params.sft_data, load_prompt(params.prompt), params.seed)
    validation = load_validation_set(params.validation_data, params.validation_format)
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    hold_out(train, params.val_subset, validation[: params.final_eval_limit])  # a selection split is left
    check_prompts_fit(
        params, {params.validation_data: validation[: params.final_eval_limit]}, FINAL_SAMPLING.max_tokens
    )


def show(params: LeaderboardParams, summary: dict) -> None:
    print(json.dumps({k: v for k, v in summary.items() if k != "mlflow_run_id"}, indent=2))
    print(f"mlflow run {summary['mlflow_run_id']}")


main = flow_main(leaderboard, LeaderboardParams, "leaderboard", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
