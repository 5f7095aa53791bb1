"""Flows ``expert_iteration`` (one EI run) and ``ei_sweep`` (a grid of runs as children of one parent).

Each EI run samples D_b training questions per round, G rollouts each, keeps the correct ones, SFTs
the policy on them for E epochs and evaluates on a validation subset (full set after the last round);
every round is logged to MLflow (validation accuracy, kept fraction, entropy, lengths). The sweep
covers any subset of G × E × D_b and writes one comparison plot and table into the parent run. Killed
runs resume from their checkpoints and continue their MLflow runs.

    python -m flows.expert_iteration --help
    python -m flows.expert_iteration --config params.yaml                 # one run
    python -m flows.expert_iteration --config params.yaml --sweep true    # the grid
    torchrun --nproc-per-node 4 -m flows.expert_iteration --config params.yaml --backend hf   # on 4 GPUs

Under torchrun every rank runs each round (see :func:`flows.cli.run_flow`): it samples its share of
the questions with its own hf engine (a full copy of the weights on its GPU), all ranks grade and keep
the same rollouts, and the SFT loop trains on them with FSDP2; rank 0 alone logs to MLflow and writes
the outputs and checkpoints.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import ValidationError

from a5core.data import write_text_atomic
from a5core.expert_iteration import expert_iteration
from a5core.models import check_context, resolve_model
from a5core.policy import load_policy
from a5core.problem_sets import REWARD_FNS, load_problem_set
from a5core.prompts import load_prompt
from a5core.settings import describe
from a5core.rollout import Engine, SamplingSettings
from flows.cli import check_outputs, cli_main, run_flow
from flows.params import EIParams
from tasks.engines import closing_engine, rollout_engine
from tasks.tracking import log_params_flat
from tasks.training import (
    model_path,
    log_comparison,
    mlflow_logger,
    params_key,
    start_resumable_run,
    tracked,
    tracking_rank,
    validation_hook,
)


@task(cache_policy=NO_CACHE)
def run_ei(name: str, params: EIParams, engine: Engine, parent_run_id: str | None) -> dict:
    """One EI run in its own resumable MLflow run; returns its summary row."""
    import mlflow
    import torch

    run_dir = Path(params.output_dir) / f"runs-{params_key(params)}" / name
    if (run_dir / "done.json").is_file():
        return json.loads((run_dir / "done.json").read_text())
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    template, reward_fn = load_prompt(params.prompt), REWARD_FNS[params.grader]
    eval_sampling = SamplingSettings(temperature=params.temperature, max_tokens=params.max_tokens, stop=template.stop,
                                     seed=params.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with start_resumable_run(run_dir / "mlflow_run_id", params.experiment, f"ei-{name}", params.tracking_uri, parent_run_id) as run:
        if tracking_rank():
            log_params_flat({**params.model_dump(exclude={"sweep_rollouts_per_question", "sweep_epochs",
                                                          "sweep_questions_per_step"}), "setting": name})
            mlflow.set_tag("model_path", model_path(params.model))
        model, tokenizer = load_policy(params.model, dtype=getattr(torch, params.policy_dtype), device=device)
        hook = validation_hook(engine, tokenizer, validation, template, reward_fn, eval_sampling, params.val_subset)
        log = mlflow_logger()
        history = expert_iteration(model, tokenizer, engine, train, template, reward_fn, params,
                                   checkpoint_dir=run_dir / "checkpoint", evaluate=hook, log=log)
        full = validation_hook(engine, tokenizer, validation, template, reward_fn, eval_sampling, params.val_limit)(model, params.n_ei_steps)
        log({f"final_{k}": v for k, v in full.items()}, params.n_ei_steps)
        start = {}  # the starting policy's evaluation, step 0 (logged by the loop when the run began)
        if tracking_rank():
            client = mlflow.MlflowClient()
            start = {key: m.value for key in ("val_accuracy", "val_format_rate")
                     for m in client.get_metric_history(run.info.run_id, key) if m.step == 0}
        row = {"setting": name, "initial_accuracy": start.get("val_accuracy"), "initial_format_rate": start.get("val_format_rate"),
               "final_accuracy": full["val_accuracy"], "final_format_rate": full["val_format_rate"],
               "curve": [{"step": round_ + 1, "val_accuracy": h["val_accuracy"], "kept_fraction": h["kept_fraction"]}
                         for round_, h in enumerate(history)],
               "mlflow_run_id": run.info.run_id}
    if tracking_rank():
        write_text_atomic(run_dir / "done.json", json.dumps(row))
    return row


SUMMARY_KEYS = ("setting", "initial_accuracy", "initial_format_rate", "final_accuracy", "final_format_rate")


def grid(params: EIParams) -> dict[str, EIParams]:
    """The sweep's settings, named G{g}_E{e}_Db{d}, each validated."""
    try:
        return {
            f"G{g}_E{e}_Db{d}": EIParams(**{**params.model_dump(), "rollouts_per_question": g, "epochs": e,
                                            "questions_per_step": d})
            for g, e, d in itertools.product(params.sweep_rollouts_per_question, params.sweep_epochs,
                                             params.sweep_questions_per_step)
        }
    except ValidationError as error:
        raise ValueError(describe(error)) from None


@flow(name="expert_iteration")
def expert_iteration_flow(params: EIParams = EIParams()) -> dict:
    """One EI run, or (``sweep``) the grid as children of one parent run with a comparison plot."""
    out = Path(params.output_dir)
    engine = rollout_engine(resolve_model(params.model), params.backend, dtype=params.engine_dtype,
                            memory_fraction=params.engine_memory_fraction)
    with closing_engine(engine):
        if not params.sweep:
            row = tracked(run_ei)("single", params, engine, None)
            summary = [{k: row.get(k) for k in SUMMARY_KEYS}]
            paths: dict[str, str] = {}
            run_id = row["mlflow_run_id"]
        else:
            with start_resumable_run(out / f"runs-{params_key(params)}" / "mlflow_run_id", params.experiment,
                                     "ei_sweep", params.tracking_uri) as parent:
                if tracking_rank():
                    log_params_flat(params.model_dump())
                rows = [tracked(run_ei)(name, setting, engine, parent.info.run_id) for name, setting in grid(params).items()]
                curves = [{"setting": r["setting"], **point} for r in rows for point in r["curve"]]
                summary = [{k: r.get(k) for k in SUMMARY_KEYS} for r in rows]
                if tracking_rank():
                    paths = log_comparison(out, curves, summary, "setting", "Expert Iteration: validation accuracy by round")
                run_id = parent.info.run_id
    if not tracking_rank():  # a torchrun rank other than 0 trained along; rank 0 reports
        return {"summary": None, "paths": None, "mlflow_run_id": None}
    if params.metrics_path:
        write_text_atomic(Path(params.metrics_path), json.dumps(summary, indent=2) + "\n")
    return {"summary": summary, "paths": paths, "mlflow_run_id": run_id}


def check_inputs(params: EIParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the settings
    (each sweep setting's too), the model path, the prompt, the data files, prompts that do not fit the
    model's context, outputs that cannot be written."""
    try:
        if params.sweep:
            grid(params)
    except ValueError as error:
        raise ValueError(f"invalid Expert Iteration settings: {error}") from None
    model = resolve_model(params.model)
    template = load_prompt(params.prompt)
    train = load_problem_set(params.train_data, params.train_format, params.seed, "train")
    validation = load_problem_set(params.validation_data, params.validation_format, params.seed, "validation")
    sources = [(params.train_data, p) for p in train] + [(params.validation_data, p) for p in validation]
    check_context(model, [template.format(p.problem) for _, p in sources], params.max_tokens,
                  [f"{source} problem {p.unique_id}" for source, p in sources])
    check_outputs(params)


@cli_main("flows.expert_iteration")
def main(argv: list[str] | None = None) -> None:
    from flows.cli import parse_params

    params = parse_params(EIParams, "expert_iteration", argv, __doc__)
    check_inputs(params)
    result = run_flow(expert_iteration_flow, params)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
    for row in result["summary"]:
        print(f"{row['setting']:>14}: accuracy {row['final_accuracy']:.3f}, format {row['final_format_rate']:.3f}")
    print("\n".join(f"{k:12} {v}" for k, v in result["paths"].items()))
    print(f"mlflow run {result['mlflow_run_id']}")


if __name__ == "__main__":
    main(sys.argv[1:])
