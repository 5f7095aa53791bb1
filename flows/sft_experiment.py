"""Flow ``sft_experiment``: SFT on {128, 256, 512, 1024, full} examples and on the filtered set.

One parent MLflow run (experiment ``sft_experiment``) with a child run per setting. Each child fine-tunes
a fresh copy of the base model with the SFT loop, evaluates on a validation subset every
``eval_every`` steps (weights pushed into one shared engine) and on the full validation set at the end.
The parent gets the comparison plot (validation accuracy against step, one line per setting), a table
(setting → final accuracy, format rate) and the curves as csv; the same files are DVC plots/metrics.
A killed run resumes: each child continues its checkpoint and its MLflow run; finished children are
not trained again.

The curves start at step 0, the base model, so each setting's row holds its accuracy and format rate
before and after (``initial_*``, ``final_*``). ``train_data`` may be ``arithmetic:N:DIGITS``: N
generated arithmetic problems as r1_zero traces (validate on ``arithmetic:M:DIGITS`` with
``reward_fn: arithmetic``), the format a small model learns from a few dozen examples, as the cpu
profile does. With ``save_models`` each setting's final weights are saved as a Hugging Face folder and
``output_dir/best_model`` links the best setting's, for a later stage to start from (the cpu profile's
EI and GRPO do).

    python -m flows.sft_experiment --help
    python -m flows.sft_experiment --config params.yaml
    torchrun --nproc-per-node 4 -m flows.sft_experiment --config params.yaml --backend hf   # on 4 GPUs (FSDP2)

Under torchrun every rank trains each setting (see :func:`flows.cli.run_flow`) and evaluates its share
of the problems with its own hf engine (a full copy of the weights on its GPU); rank 0 alone logs to
MLflow and writes the outputs.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from a5core.data import Problem, Trace, write_text_atomic
from a5core.models import check_context, resolve_model
from a5core.policy import load_policy
from a5core.problem_sets import REWARD_FNS, load_problem_set, load_trace_set
from a5core.prompts import load_prompt
from a5core.rollout import Engine, SamplingSettings
from a5core.sft import train_sft
from flows.cli import check_outputs, cli_main, run_flow
from flows.params import SFTExperimentParams
from tasks.engines import closing_engine, rollout_engine
from tasks.tracking import log_params_flat
from tasks.training import (
    log_comparison,
    mlflow_logger,
    params_key,
    save_model_folder,
    start_resumable_run,
    tracked,
    tracking_rank,
    validation_hook,
)


def subsets(traces: list[Trace], sizes: list[int | str], seed: int) -> dict[str, list[Trace]]:
    """Seeded random subsets (MATH train is ordered by subject, so never the first n)."""
    shuffled = random.Random(seed).sample(traces, len(traces))
    return {str(size): shuffled if size == "full" else shuffled[: int(size)] for size in sizes}


@task(cache_policy=NO_CACHE)
def train_setting(name: str, traces: list[Trace], problems: list[Problem], params: SFTExperimentParams, engine: Engine,
                  parent_run_id: str) -> dict:
    """Train and evaluate one setting in its own (resumable) child run; returns its summary row."""
    import mlflow
    import torch

    run_dir = Path(params.output_dir) / f"runs-{params_key(params)}" / name
    done = run_dir / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    template, reward_fn = load_prompt(params.prompt), REWARD_FNS[params.grader]
    sampling = SamplingSettings(temperature=params.temperature, max_tokens=params.max_tokens, stop=template.stop,
                                seed=params.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with start_resumable_run(run_dir / "mlflow_run_id", params.experiment, f"sft-{name}", params.tracking_uri, parent_run_id) as run:
        if tracking_rank():
            log_params_flat({**params.model_dump(), "setting": name, "n_examples": len(traces)})
        model, tokenizer = load_policy(params.model, dtype=getattr(torch, params.policy_dtype), device=device)
        hook = validation_hook(engine, tokenizer, problems, template, reward_fn, sampling, params.val_subset)
        log = mlflow_logger()
        final = train_sft(model, tokenizer, traces, params, checkpoint_dir=run_dir / "checkpoint", evaluate=hook, log=log)
        step = int(final.get("step", 0))
        full = validation_hook(engine, tokenizer, problems, template, reward_fn, sampling, params.val_limit)(model, step)
        log({f"final_{k}": v for k, v in full.items()}, step)
        if params.save_models:
            save_model_folder(model, tokenizer, run_dir / "model")
        client = mlflow.MlflowClient() if tracking_rank() else None
        history = {key: sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step) if client else []
                   for key in ("val_accuracy", "val_format_rate")}
        start = {key: points[0].value for key, points in history.items() if points and points[0].step == 0}
        row = {"setting": name, "n_examples": len(traces), "steps": step,
               "initial_accuracy": start.get("val_accuracy"), "initial_format_rate": start.get("val_format_rate"),
               "final_accuracy": full["val_accuracy"], "final_format_rate": full["val_format_rate"],
               "curve": [{"step": m.step, "val_accuracy": m.value} for m in history["val_accuracy"]]}
    del model
    if tracking_rank():
        write_text_atomic(done, json.dumps(row))
    return row


def link_best_model(model: Path, link: Path) -> None:
    """Point ``link`` (a symlink, replaced atomically) at the best setting's saved ``model`` folder."""
    partial = link.with_name(link.name + ".partial")
    partial.unlink(missing_ok=True)
    partial.symlink_to(model.resolve(), target_is_directory=True)
    if link.is_dir() and not link.is_symlink():  # a folder put there by hand: not ours to keep
        raise ValueError(f"{link} is a folder, not the link to the best model this flow writes; move it away")
    os.replace(partial, link)


@flow(name="sft_experiment")
def sft_experiment(params: SFTExperimentParams = SFTExperimentParams()) -> dict:
    """Run every setting as a child of one parent run; returns the summary rows and output paths."""
    import mlflow

    out = Path(params.output_dir)
    template = load_prompt(params.prompt)
    settings = subsets(load_trace_set(params.train_data, template, params.seed), params.sizes, params.seed)
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    if params.filtered_data:
        settings["filtered"] = load_trace_set(params.filtered_data, template, params.seed)
    engine = rollout_engine(resolve_model(params.model), params.backend, dtype=params.engine_dtype,
                            memory_fraction=params.engine_memory_fraction)
    with start_resumable_run(out / f"runs-{params_key(params)}" / "mlflow_run_id", params.experiment, "sft_experiment",
                             params.tracking_uri) as parent, closing_engine(engine):
        if tracking_rank():
            log_params_flat(params.model_dump())
        rows = [tracked(train_setting)(name, traces, validation, params, engine, parent.info.run_id)
                for name, traces in settings.items()]
        if not tracking_rank():  # a torchrun rank other than 0 trained along; rank 0 reports
            return {"summary": None, "paths": None, "mlflow_run_id": None}
        curves = [{"setting": r["setting"], **point} for r in rows for point in r["curve"]]
        summary = [{k: r.get(k) for k in ("setting", "n_examples", "steps", "initial_accuracy", "initial_format_rate",
                                          "final_accuracy", "final_format_rate")} for r in rows]
        if params.save_models:  # the best by accuracy, a tie broken by format rate; named in the parent run
            best = max(rows, key=lambda r: (r["final_accuracy"], r["final_format_rate"]))
            link_best_model(out / f"runs-{params_key(params)}" / best["setting"] / "model", out / "best_model")
            mlflow.set_tag("best_setting", best["setting"])
        paths = log_comparison(out, curves, summary, "setting", "SFT: validation accuracy by training-set size")
        mlflow_logger()({f"final_accuracy_{r['setting']}": r["final_accuracy"] for r in rows}, 0)
        if params.metrics_path:
            write_text_atomic(Path(params.metrics_path), json.dumps(summary, indent=2) + "\n")
    return {"summary": summary, "paths": paths, "mlflow_run_id": parent.info.run_id}


def check_inputs(params: SFTExperimentParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the settings,
    the model path, the prompt, the data files, prompts that do not fit the model's context, outputs
    that cannot be written."""
    model = resolve_model(params.model)
    template = load_prompt(params.prompt)
    for source in (params.train_data, params.filtered_data):
        if source:
            load_trace_set(source, template, params.seed)
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    check_context(model, [template.format(p.problem) for p in validation], params.max_tokens,
                  [f"{params.validation_data} problem {p.unique_id}" for p in validation])
    check_outputs(params)


@cli_main("flows.sft_experiment")
def main(argv: list[str] | None = None) -> None:
    from flows.cli import parse_params

    params = parse_params(SFTExperimentParams, "sft_experiment", argv, __doc__)
    check_inputs(params)
    result = run_flow(sft_experiment, params)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
    for row in result["summary"]:
        print(f"{row['setting']:>9}: {row['n_examples']:>5} examples, {row['steps']:>4} steps, "
              f"accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}")
    print("\n".join(f"{k:12} {v}" for k, v in result["paths"].items()))
    print(f"mlflow parent run {result['mlflow_run_id']}")


if __name__ == "__main__":
    main(sys.argv[1:])
