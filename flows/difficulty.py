"""Flow ``difficulty``: each training question's pass rate under a model, from ``n`` samples — the table
GRPO and Expert Iteration sample their questions by (``question_sampling``, ``difficulty_table``; see
:mod:`a5core.loops.question_sampling`).

load the training questions (``train_data``; the first ``limit`` after the run's seeded shuffle) →
generate ``n`` samples each (cached, as the evaluation's) → grade → ``table`` (csv: unique_id, level,
samples, correct, pass_rate; DVC versions it), the pass-rate histogram (``pass_rate_histogram.png``, and
the shares unsolved / learnable / solved as metrics) → one MLflow run in experiment ``difficulty``.

    python -m flows.difficulty --help
    python -m flows.difficulty --config params.yaml
    python -m flows.grpo --config params.yaml --question-sampling learnable \\
        --difficulty-table data/difficulty/pass_rates.csv
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

from a5core.data.problem_sets import load_problem_set
from a5core.data.prompts import load_prompt
from a5core.loops.question_sampling import pass_rate_table
from a5core.runtime.writing import write_text_atomic
from flows.cli import flow_main, print_paths
from flows.params import DifficultyParams
from flows.served import check_served_inputs
from tasks.checks import check_outputs, check_prompts_fit
from tasks.evaluation import generate, grade
from tasks.flow_summary import publish
from tasks.mlflow_runs import flow_run, log_files_run
from tasks.outputs import outputs_held, write_output_file
from tasks.plots import plot_histogram
from tasks.provenance import log_provenance

BINS = (0.0, 0.25, 0.5, 0.75, 1.0)  # histogram edges; 0 and 1 get bins of their own


@flow(name="difficulty")
def difficulty(params: DifficultyParams = DifficultyParams()) -> dict:
    """Estimate the pass rates; returns the summary, the paths and the MLflow run id. Its MLflow run spans the
    whole estimate (generation included)."""
    check_served_inputs(params)  # started from a deployment: it reads inside the project and its data folders
    with outputs_held(params):  # claimed, and no other flow writes there meanwhile
        with flow_run(
            params.experiment, f"{params.model.rstrip('/').split('/')[-1]}-difficulty", params.tracking_uri
        ) as run:
            if run.info.run_id is not None:
                log_provenance(params)
            template = load_prompt(params.prompt)
            problems = load_problem_set(params.train_data, params.train_format, params.seed, "train")[: params.limit]
            prompts = [template.format(p.problem) for p in problems]
            sampling = params.sampling_for(template)
            completions = generate(params.model, params.backend, params.dtype, prompts, sampling)
            records = grade(problems, prompts, completions, params.grader)
            rewards = [float(r["answer_reward"]) for r in records]  # n consecutive samples a question
            correct = [rewards[i * params.n : (i + 1) * params.n] for i in range(len(problems))]
            rates = [sum(c) / len(c) for c in correct]
            summary = {
                "questions": len(problems),
                "samples_per_question": params.n,
                "mean_pass_rate": sum(rates) / len(rates),
                "difficulty_unsolved": sum(r == 0 for r in rates) / len(rates),
                "difficulty_learnable": sum(0 < r < 1 for r in rates) / len(rates),
                "difficulty_solved": sum(r == 1 for r in rates) / len(rates),
            }
            out = Path(params.output_dir)
            paths = {
                "table": write_output_file(params.table, pass_rate_table(problems, correct)),
                "summary": write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n"),
                "histogram": plot_histogram(
                    out / "pass_rate_histogram.png", rates, BINS, "pass rate", f"pass rates of {len(rates)} questions"
                ),
            }
            if (
                params.metrics_path
            ):  # the headline (dvc metrics show): the mean pass rate, and the share still learnable
                headline = {"accuracy": summary["mean_pass_rate"], "learnable": summary["difficulty_learnable"]}
                paths["metrics"] = write_output_file(params.metrics_path, json.dumps(headline, indent=2) + "\n")
            run_id = log_files_run(
                params.experiment,
                f"{params.model.rstrip('/').split('/')[-1]}-{len(problems)}x{params.n}",
                params.tracking_uri,
                [paths["table"], paths["summary"], paths["histogram"]],
                params={k: str(v)[:6000] for k, v in params.flat().items()},
                metrics={k: float(v) for k, v in summary.items()},
            )
        publish(
            "difficulty",
            "Pass rates by question",
            [summary],
            experiment=params.experiment,
            tracking_uri=params.tracking_uri,
            mlflow_run_id=run_id,
            output_dir=params.output_dir,
            paths={k: str(v) for k, v in paths.items()},
        )
        return {"summary": summary, "paths": {k: str(v) for k, v in paths.items()}, "mlflow_run_id": run_id}


def check_inputs(params: DifficultyParams) -> None:
    """Fail on bad input before an engine starts: the questions, prompts within the context, the outputs."""
    problems = load_problem_set(params.train_data, params.train_format, params.seed, "train")[: params.limit]
    check_prompts_fit(params, {params.train_data: problems}, params.max_tokens)
    check_outputs(params)


def show(params: DifficultyParams, result: dict) -> None:
    s = result["summary"]
    print(
        f"{s['questions']} questions × {s['samples_per_question']} samples: mean pass rate {s['mean_pass_rate']:.3f}; "
        f"unsolved {s['difficulty_unsolved']:.2f}, learnable {s['difficulty_learnable']:.2f}, "
        f"solved {s['difficulty_solved']:.2f}"
    )
    print_paths(result["paths"])


main = flow_main(difficulty, DifficultyParams, "difficulty", __doc__, check_inputs, show)

if __name__ == "__main__":
    main(sys.argv[1:])
