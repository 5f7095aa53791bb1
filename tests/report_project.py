"""A project folder as the pipeline's stages leave it (their metrics, tables, curves and plots), for the report's
tests and the browser's.
"""

import json

import yaml

from tasks.plots import plot_curves

BASELINE = {
    "n_records": 8,
    "n_problems": 8,
    "accuracy": 0.25,
    "format_rate": 0.5,
    "mean_response_tokens": 41.5,
    "count_format1_answer1": 2,
    "count_format1_answer0": 2,
    "count_format0_answer0": 4,
    "finish_length": 3,
    "finish_stop": 5,
}


CASES = (
    "# Evaluation case analysis\n\n8 responses to 8 problems: accuracy 0.250.\n\n"
    "Of the 4 format-0 responses, 1 contain a correct answer that the r1_zero format rules rejected "
    "(format/parser failures); the rest hold no correct answer (model failures).\n\n## format1_answer1 (2)\n\n"
    "**Response**\n\n````\nx <script>alert(7)</script>\n```\nstill inside\n````\n\n**Ground truth:** `4`\n"
)


DIFFICULTY = {
    "questions": 16,
    "samples_per_question": 4,
    "mean_pass_rate": 0.4,
    "difficulty_unsolved": 0.25,
    "difficulty_learnable": 0.5,
    "difficulty_solved": 0.25,
}


SFT = [
    {"setting": "128", "n_examples": 128, "steps": 8, "final_accuracy": 0.1, "final_format_rate": 0.9},
    {
        "setting": "filtered",
        "n_examples": 60,
        "steps": 4,
        "initial_accuracy": 0.0,
        "initial_format_rate": 0.1,
        "final_accuracy": 0.3,
        "final_format_rate": 0.95,
    },
]


EI = [{"setting": "single", "final_accuracy": 0.35, "final_format_rate": 0.97}]


GRPO = [
    {
        "setting": "single",
        "initial_accuracy": 0.2,
        "initial_accuracy_se": 0.1,
        "initial_format_rate": 0.5,
        "final_accuracy": 0.45,
        "final_accuracy_se": 0.11,
        "final_format_rate": 0.99,
        "accuracy_change": 0.25,
        "accuracy_change_se": 0.09,
        "paired_problems": 20,
        "wall_seconds": 321.0,
    }
]


# GRPO's steps: the share of groups whose rewards were all equal (1: no learning signal)
GRPO_STEPS = "setting,step,reward_mean,frac_groups_all_equal\nsingle,1,0.0,1.0\nsingle,2,0.5,0.5\n"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if isinstance(text, str) else json.dumps(text))


def plot(path):
    plot_curves(path, [{"setting": "a", "step": s, "v": s / 10} for s in range(3)], "step", "v", "setting", path.stem)


def project(root, stages=("baseline", "sft", "ei", "grpo", "difficulty")):
    """A project folder holding what the named stages write."""
    params = {
        "profile": "cpu",
        "baseline_eval": {"model": "Qwen/Qwen2.5-Math-1.5B"},
        "grpo": {"n_grpo_steps": 200, "validation_data": "../shared/data/math/validation.jsonl"},
        "report": {"title": "Test report"},
        "profiles": {"cpu": {"baseline_eval": {"model": "smollm2-135m-instruct"}, "grpo": {"n_grpo_steps": 2}}},
    }
    write(root / "params.yaml", yaml.safe_dump(params))
    if "baseline" in stages:
        write(root / "metrics/baseline_eval.json", {"accuracy": 0.25, "format_rate": 0.5})
        write(root / "outputs/baseline_eval/summary.json", BASELINE)
        write(root / "outputs/baseline_eval/report.md", CASES)
    if "sft" in stages:
        write(root / "metrics/sft_data.json", {"traces": 6})
        write(
            root / "data/sft/sizes.json",
            {"teacher": {"raw": 10, "duplicates": 0, "filtered": 6, "kept_fraction": 0.6, "format_rate": 0.8}},
        )
        write(root / "outputs/sft_experiment/summary.json", SFT)
        write(root / "metrics/sft_experiment.json", {"accuracy": 0.3, "format_rate": 0.95})
        plot(root / "outputs/sft_experiment/accuracy_vs_step.png")
    if "ei" in stages:
        write(root / "outputs/expert_iteration/summary.json", EI)
        write(root / "metrics/expert_iteration.json", {"accuracy": 0.35, "format_rate": 0.97})
        plot(root / "outputs/expert_iteration/accuracy_vs_step.png")
    if "difficulty" in stages:
        write(root / "outputs/difficulty/summary.json", DIFFICULTY)
        write(root / "metrics/difficulty.json", {"accuracy": 0.4, "learnable": 0.5})
        plot(root / "outputs/difficulty/pass_rate_histogram.png")
    if "grpo" in stages:
        write(root / "outputs/grpo/summary.json", GRPO)
        write(root / "outputs/grpo/train_curves.csv", GRPO_STEPS)
        write(root / "metrics/grpo.json", {"accuracy": 0.45, "change": 0.25})
        for name in ("token_entropy_vs_step", "accuracy_vs_wall_clock", "accuracy_vs_step"):
            plot(root / f"outputs/grpo/{name}.png")
        plot(root / "outputs/grpo/runs-abc/single/ignored.png")  # only a stage folder's top level is shown
