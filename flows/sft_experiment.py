"""Flow ``sft_experiment``: SFT on {128, 256, 512, 1024, full} examples and on the filtered set.

One parent MLflow run (experiment ``sft_experiment``) with a child run per setting. Each child fine-tunes
a fresh copy of the base model with the SFT loop, evaluates on the selection split every
``eval_every`` steps (weights pushed into one shared engine) and on the score split at the end.
The parent gets the comparison plot (validation accuracy against step, one line per setting), a table
(setting → final accuracy, format rate) and the curves as csv; the same files are DVC plots/metrics.
A killed run resumes: each child continues its checkpoint and its MLflow run; finished children are
not trained again. Each child's run records ``trace_prompts``, the prompt templates its traces were written with
(``question_only,r1_zero`` for a set rendered with both), so verdicts can tell which prompts its model favours.

The curves start at step 0, the base model, so each setting's row holds its accuracy and format rate
before and after (``initial_*``, ``final_*``). ``train_data`` may be ``arithmetic:N:DIGITS``: N
generated arithmetic problems as r1_zero traces (validate on ``arithmetic:M:DIGITS`` with
``reward_fn: arithmetic``), the format a small model learns from a few dozen examples, as the cpu
profile does. With ``save_models`` each setting's final weights are saved as a Hugging Face folder and
``output_dir/best_model`` links the best setting's, for a later stage to start from (the cpu profile's
EI and GRPO do). The best is chosen apart from the score: the validation set is split in two disjoint parts
(:func:`a5core.data.problem_sets.split_validation`): the curve's evaluations run on the last ``val_subset``
problems (at most half), the selection split that chooses the best setting; the final evaluation, the
reported score, on the first ``val_limit`` of the others. The parent run's tags ``chosen_on`` and
``scored_on`` say which. With one setting there is nothing to choose: every evaluation, the curve's
included, scores the first ``val_limit`` problems, so the curve ends at the final score (the problems EI
and GRPO score when they validate on the same set).

    python -m flows.sft_experiment --help
    python -m flows.sft_experiment --config params.yaml
    torchrun --nproc-per-node 4 -m flows.sft_experiment --config params.yaml --backend hf   # on 4 GPUs (FSDP2)

Under torchrun every rank trains each setting (see :func:`flows.cli.launched_rank`) and evaluates its share
of the problems with its own hf engine (a full copy of the weights on its GPU); rank 0 alone logs to
MLflow and writes the outputs.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from prefect import flow
from transformers import AutoTokenizer

from a5core.data.files import Trace
from a5core.data.problem_sets import load_trace_set, load_validation_set, split_validation
from a5core.data.prompts import load_prompt, prompt_forms
from a5core.engines import Engine
from a5core.loops.sft import check_cut, token_lengths, train_sft
from a5core.policy.model_specs import resolve_model
from flows.cli import flow_main, print_paths
from flows.fanout import children_on_ray
from flows.params import SFTExperimentParams
from flows.seeds import check_seeds, run_seeded, seeded, show_verdicts, with_verdicts
from flows.served import check_served_inputs
from tasks.checks import check_outputs, check_prompts_fit
from tasks.engines import closing_engine, engine_for
from tasks.evaluation import validation_hook
from tasks.model_registry import REGISTERED_MODELS
from tasks.outputs import link_model
from tasks.parent_run import Parent, Summary, parent_run
from tasks.runs import FINAL_SCORE, STARTING_SCORE, curve, run_key, save_model_folder, training_run, training_task
from tasks.tracking_rank import tracked, tracking_rank


def subsets(traces: list[Trace], sizes: list[int | str], seed: int) -> dict[str, list[Trace]]:
    """Seeded random subsets (MATH train is ordered by subject, so never the first n)."""
    shuffled = random.Random(seed).sample(traces, len(traces))
    return {str(size): shuffled if size == "full" else shuffled[: int(size)] for size in sizes}


@training_task
def train_setting(
    name: str, traces: list[Trace], engine: Engine, parent_run_id: str, params: SFTExperimentParams, alone: bool
) -> dict:
    """One setting (:func:`tasks.runs.training_run`, a child of the sweep's run); its row adds the number of
    examples and steps and the validation curve, and with ``save_models`` its final model is saved. Its MLflow run
    records, beside the settings, ``n_examples`` and ``trace_prompts``: the built-in templates its traces' prompts
    were written with (:func:`a5core.data.prompts.prompt_forms`, joined by ``,``), which verdicts read to tell the
    prompts its model was trained for. ``alone``: the only setting, so nothing is chosen: the curve evaluates the
    score split too, and its last point is the final score (evaluated once)."""
    logged = {"n_examples": len(traces), "trace_prompts": ",".join(prompt_forms(t.prompt for t in traces))}
    with training_run(name, f"sft-{name}", params, engine, parent_run_id, logged=logged) as run:
        if run.finished:  # trained before: its row, not trained again
            return run.row
        if alone:
            selection = score = run.validation_problems[: params.val_limit]
        else:
            selection, score = split_validation(run.validation_problems, params.val_subset, params.val_limit)

        def hook(problems: list, subset: int | None):
            return validation_hook(
                run.engine, run.tokenizer, problems, run.template, run.reward_fn, run.sampling, subset
            )

        trained = train_sft(
            run.model,
            run.tokenizer,
            traces,
            params.sft,
            checkpoint_dir=run.folder / "checkpoint",
            evaluate=hook(selection, len(selection)),  # the curve: the selection split
            log=run.log,
            release_memory=run.engine.release_memory,  # the curve's engine, kept between evaluations
        )
        row = {"n_examples": len(traces), "steps": int(trained.get("step", 0)), "curve": curve(run.run_id)}
        if params.save_models:
            save_model_folder(run.model, run.tokenizer, run.folder / "model")
            row["model_dir"] = str(run.folder / "model")
        if alone and "val_accuracy" in trained:  # the last evaluation was on the score split, at the last step
            run.trained(row["steps"], row, final={k: v for k, v in trained.items() if k.startswith("val_")})
        else:
            last = (curve(run.run_id, "val_format_rate") or [{}])[-1]  # the last evaluation on the selection split
            row |= {
                "selection_accuracy": last.get("val_accuracy"),
                "selection_format_rate": last.get("val_format_rate"),
            }
            final = hook(score, None)(run.model, row["steps"])  # the score split, at the end
            run.trained(row["steps"], row, final=final)
    return run.row


@training_task
def run_setting(name: str, params: SFTExperimentParams, engine: Engine, parent_run_id: str | None) -> dict:
    """Setting ``name`` of the sweep alone (a child run side by side, :mod:`flows.seeds`): its traces drawn as the
    whole sweep draws them (:func:`training_sets`), trained by :func:`train_setting`."""
    settings = training_sets(params)
    return train_setting.fn(name, settings[name], engine, parent_run_id, params, len(settings) == 1)


def training_sets(params: SFTExperimentParams) -> dict[str, list[Trace]]:
    """The sweep's settings, each its traces: a seeded subset per size, and the filtered set where given."""
    template = load_prompt(params.prompt)
    settings = subsets(load_trace_set(params.train_data, template, params.seed), params.sizes, params.seed)
    if params.filtered_data:
        settings["filtered"] = load_trace_set(params.filtered_data, template, params.seed)
    return settings


# Which problems choose the best setting and which score it (the validation set split by split_validation);
# with one setting, nothing is chosen and every evaluation scores the first val_limit problems.
SELECTION_SPLIT = "the last val_subset validation problems, at most half (the curve's evaluations)"
SCORE_SPLIT = "the first val_limit of the other validation problems (the final evaluation)"
ALONE_CHOSEN, ALONE_SCORED = (
    "one setting: nothing to choose",
    "the first val_limit validation problems (every evaluation)",
)


def choose_best(rows: list[dict]) -> dict:
    """The best setting by its last evaluation on the selection split (accuracy, then format rate): the final
    evaluations, on the score split, are read by nothing here."""
    return max(rows, key=lambda r: (r.get("selection_accuracy") or 0.0, r.get("selection_format_rate") or 0.0))


# A setting's row in the summary (summary.json, summary.md, the report's table).
SUMMARY_KEYS = ("setting", "n_examples", "steps", *STARTING_SCORE, "selection_accuracy", *FINAL_SCORE)


def keep_best(params: SFTExperimentParams, parent: Parent, alone: bool) -> None:
    """With ``save_models``, the best setting's model (:func:`choose_best`, on the selection split, never the
    score's) is linked as ``output_dir/best_model`` (on the tracking rank), registered (``a5-sft``) and named in the
    parent run's tags, with which problems chose it and which scored it."""
    best = parent.best
    folder = Path(params.output_dir) / f"runs-{run_key(params)}" / best["setting"]
    model = Path(best.get("model_dir") or folder / "model")  # a child over seeds: its own run's folder
    if tracking_rank():
        link_model(model, Path(params.output_dir) / "best_model")
    chosen_on, scored_on = (ALONE_CHOSEN, ALONE_SCORED) if alone else (SELECTION_SPLIT, SCORE_SPLIT)
    parent.registered = [{**best, "model_dir": str(model)}]
    parent.tags = {"best_setting": best["setting"], "chosen_on": chosen_on, "scored_on": scored_on}


@flow(name="sft_experiment")
def sft_experiment(params: SFTExperimentParams = SFTExperimentParams()) -> dict:
    """Run every setting as a child of one parent run (with ``seeds``, once per seed, side by side); returns the
    summary rows and output paths."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    settings = training_sets(params)
    alone = len(settings) == 1
    plot_title = "SFT: validation accuracy by training-set size"
    summary = Summary("sft_experiment", "SFT sweep", plot_title, SUMMARY_KEYS, REGISTERED_MODELS["sft_experiment"])
    with parent_run(params, "sft_experiment", summary) as parent:
        if seeded(params):  # each setting once per seed, side by side (a process or a Ray worker each)
            run_seeded(dict.fromkeys(settings, params), run_setting, params, parent, "sft_experiment")
        elif params.runner == "ray":  # at once, each setting on a Ray worker, an engine each
            parent.rows = children_on_ray(dict.fromkeys(settings, params), run_setting, params, parent.run_id)
        else:  # one after another, on the flow's one engine
            with closing_engine(engine_for(params)) as engine:
                for name, traces in settings.items():
                    parent.rows.append(tracked(train_setting)(name, traces, engine, parent.run_id, params, alone))
        parent.best = choose_best(parent.rows)
        parent.registered = []
        if params.save_models:
            keep_best(params, parent, alone)
        parent.metrics = {f"final_accuracy_{r['setting']}": r["final_accuracy"] for r in parent.rows}
    return with_verdicts(params, parent, "sft_experiment")


def check_inputs(params: SFTExperimentParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the trace sets (and,
    for a model folder, that max_seq_len leaves their responses a token to train on), the validation problems,
    prompts within the model's context, the outputs."""
    template = load_prompt(params.prompt)
    model = resolve_model(params.model)
    tokenizer = AutoTokenizer.from_pretrained(model) if Path(model).is_dir() else None  # a hub id: read later
    for source in (params.train_data, params.filtered_data):
        if source:
            traces = load_trace_set(source, template, params.seed)
            if tokenizer is not None:
                try:
                    check_cut(*token_lengths(traces, tokenizer, params.append_eos), params.max_seq_len, warn=False)
                except ValueError as error:
                    raise ValueError(f"{source}: {error}") from None
    check_seeds(params, [*map(str, params.sizes), *(["filtered"] if params.filtered_data else [])])
    validation = load_validation_set(params.validation_data, params.validation_format)
    if len(params.sizes) + bool(params.filtered_data) > 1:  # settings to choose from: two splits
        split_validation(validation, params.val_subset, params.val_limit)  # two problems at least
    check_prompts_fit(params, {params.validation_data: validation}, params.max_tokens)
    check_outputs(params)


def show(params: SFTExperimentParams, result: dict) -> None:
    for row in result["summary"]:
        print(
            f"{row['setting']:>9}: {row['n_examples']:>5} examples, {row['steps']:>4} steps, "
            + (f"selection accuracy {row['selection_accuracy']:.3f}; " if row["selection_accuracy"] is not None else "")
            + f"score: accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}"
        )
    print_paths(result["paths"])
    print(f"mlflow parent run {result['mlflow_run_id']}")
    show_verdicts(result)


main = flow_main(sft_experiment, SFTExperimentParams, "sft_experiment", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
