"""Flow ``baseline_eval``: zero-shot evaluation of a model on MATH (or GSM8K) with a prompt template.

load data → generate (cached on model, data, prompt and sampling) → grade → write records, summary
and case report → one MLflow run in experiment ``baseline_eval``. With ``n`` samples a problem the summary
adds avg@n, pass@k (k = 1, 2, 4, … n) and maj@n; every figure has its standard error over problems
(``…_se``). ``extra_sets`` evaluates more sets in the same run (e.g. MATH500 beside the validation set).
A5 defaults: r1_zero prompt, temperature 1.0, top_p 1.0, max_tokens 1024, stop ``</answer>``, MATH
validation (5,000 problems).

    python -m flows.baseline_eval --help
    python -m flows.baseline_eval --config params.yaml --limit 20
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow

from a5core.data.prompts import load_prompt
from a5core.evaluation.records import CATEGORIES
from flows.cli import flow_main, print_paths
from flows.params import BaselineEvalParams
from flows.served import check_served_inputs
from tasks.checks import check_outputs, check_prompts_fit
from tasks.evaluation import generate, grade, load_problems, log_evaluation_run, write_outputs
from tasks.experiments import UI_COMMAND, ui_address
from tasks.flow_summary import publish
from tasks.mlflow_runs import flow_run
from tasks.outputs import outputs_held
from tasks.provenance import log_provenance


@flow(name="baseline_eval")
def baseline_eval(params: BaselineEvalParams = BaselineEvalParams()) -> dict:
    """Zero-shot evaluation; returns the summary, output paths and the MLflow run id (and each extra set's
    summary and paths under ``sets``). Its MLflow run spans the whole evaluation (generation included)."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    with outputs_held(params):  # claimed, and no other flow writes there meanwhile
        template = load_prompt(params.prompt)
        sampling = params.sampling_for(template)
        evaluated = {}
        model_name = params.model.rstrip("/").split("/")[-1]
        with flow_run(params.experiment, f"{model_name}-{params.prompt}", params.tracking_uri) as run:
            if run.info.run_id is not None:
                log_provenance(params)
            for name, source in {"": params.data, **params.extra_sets}.items():
                problems = load_problems(source, params.data_format, params.limit)
                prompts = [template.format(p.problem) for p in problems]
                completions = generate(params.model, params.backend, params.dtype, prompts, sampling)
                records = grade(problems, prompts, completions, params.grader)
                output_dir = str(Path(params.output_dir) / name) if name else params.output_dir
                evaluated[name] = (records, write_outputs(records, output_dir, None if name else params.metrics_path))
            run_name = f"{model_name}-{params.prompt}-{len(evaluated[''][0]) // params.n}"
            run_id = log_evaluation_run(params.experiment, run_name, params.tracking_uri, params.flat(), evaluated)
        sets = {name: outputs for name, (_, outputs) in evaluated.items() if name}
        publish(
            "baseline_eval",
            "Zero-shot evaluation",
            [
                {
                    "set": name or Path(params.data).name,
                    "problems": outputs["summary"]["n_problems"],
                    "accuracy": outputs["summary"]["accuracy"],
                    "accuracy_se": outputs["summary"]["accuracy_se"],
                    "format_rate": outputs["summary"]["format_rate"],
                }
                for name, (_, outputs) in evaluated.items()
            ],
            experiment=params.experiment,
            tracking_uri=params.tracking_uri,
            mlflow_run_id=run_id,
            output_dir=params.output_dir,
            paths=evaluated[""][1]["paths"],
        )
        return {**evaluated[""][1], "sets": sets, "mlflow_run_id": run_id, "tracking_uri": params.tracking_uri}


def check_inputs(params: BaselineEvalParams) -> None:
    """Fail on bad input before an engine starts, with the error naming what and where: the problems of
    every set, prompts within the model's context, outputs that cannot be written."""
    sources = (params.data, *params.extra_sets.values())
    sets = {source: load_problems.fn(source, params.data_format, params.limit) for source in sources}
    check_prompts_fit(params, sets, params.max_tokens)
    check_outputs(params)


def show(params: BaselineEvalParams, result: dict) -> None:
    for name, outputs in {"": result, **result["sets"]}.items():
        summary = outputs["summary"]
        passes = "".join(
            f" · {k.replace('_at_', '@')} {summary[k]:.3f} ± {summary[k + '_se']:.3f}"
            for k in summary
            if k.startswith(("pass_at_", "maj_at_")) and not k.endswith("_se") and k != "pass_at_1"
        )
        counts = " / ".join(str(summary[f"count_{c}"]) for c in CATEGORIES)
        print(
            f"\n{name + ': ' if name else ''}accuracy {summary['accuracy']:.3f} ± {summary['accuracy_se']:.3f}"
            f"{passes} · format rate {summary['format_rate']:.3f} · categories (F1A1 / F1A0 / F0A0): {counts}"
        )
        print_paths(outputs["paths"])
    print(
        f"mlflow   run {result['mlflow_run_id']} in {result['tracking_uri']}: "
        f"{UI_COMMAND.format(tracking_uri=result['tracking_uri'])}, then open "
        f"{ui_address(params.experiment, params.tracking_uri)}"
    )


main = flow_main(baseline_eval, BaselineEvalParams, "baseline_eval", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
