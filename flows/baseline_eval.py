"""Flow ``baseline_eval``: zero-shot evaluation of a model on MATH (or GSM8K) with a prompt template.

load data → generate (cached on model, data, prompt and sampling) → grade → write records, summary
and case report → one MLflow run in experiment ``baseline_eval``. A5 defaults: r1_zero prompt,
temperature 1.0, top_p 1.0, max_tokens 1024, stop ``</answer>``, MATH validation (5,000 problems).

    python -m flows.baseline_eval --help
    python -m flows.baseline_eval --config params.yaml --limit 20
"""

from __future__ import annotations

import sys

from prefect import flow

from a5core.data import PROBLEM_LOADERS
from a5core.prompts import load_prompt
from a5core.rollout import SamplingSettings
from flows.cli import flow_main, print_paths
from flows.params import BaselineEvalParams
from tasks.checks import check_outputs, check_prompts_fit
from tasks.evaluation import generate, grade, load_problems, log_evaluation_run, model_fingerprint, write_outputs
from tasks.tracking import UI_COMMAND, ui_address


@flow(name="baseline_eval")
def baseline_eval(params: BaselineEvalParams = BaselineEvalParams()) -> dict:
    """Zero-shot evaluation; returns the summary, output paths and the MLflow run id."""
    template = load_prompt(params.prompt)
    problems = load_problems(params.data, params.data_format, params.limit)
    prompts = [template.format(p.problem) for p in problems]
    sampling = SamplingSettings(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop=template.stop if params.stop is None else tuple(params.stop),
        seed=params.seed,
    )
    completions = generate(
        params.model, model_fingerprint(params.model), params.backend, params.dtype, prompts, sampling
    )
    records = grade(problems, prompts, completions, params.grader)
    outputs = write_outputs(records, params.output_dir, params.metrics_path)
    run_name = f"{params.model.rstrip('/').split('/')[-1]}-{params.prompt}-{len(problems)}"
    run_id = log_evaluation_run(params.experiment, run_name, params.tracking_uri, params.model_dump(), records, outputs)
    return {**outputs, "mlflow_run_id": run_id, "tracking_uri": params.tracking_uri}


def check_inputs(params: BaselineEvalParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the problems,
    prompts within the model's context, outputs that cannot be written."""
    problems = PROBLEM_LOADERS[params.data_format](params.data)[: params.limit]
    check_prompts_fit(params, {params.data: problems}, params.max_tokens)
    check_outputs(params)


def show(params: BaselineEvalParams, result: dict) -> None:
    summary = result["summary"]
    print(
        f"\naccuracy {summary['accuracy']:.3f} · format rate {summary['format_rate']:.3f} · "
        f"categories (F1A1 / F1A0 / F0A0): {summary['count_format1_answer1']} / {summary['count_format1_answer0']} / "
        f"{summary['count_format0_answer0']}"
    )
    print_paths(result["paths"])
    print(
        f"mlflow   run {result['mlflow_run_id']} in {result['tracking_uri']}: "
        f"{UI_COMMAND.format(tracking_uri=result['tracking_uri'])}, then open "
        f"{ui_address(params.experiment, params.tracking_uri)}"
    )


main = flow_main(baseline_eval, BaselineEvalParams, "baseline_eval", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
