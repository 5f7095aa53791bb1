"""The cpu profile a newcomer's `make pipeline` runs shows learning: its SFT, EI and GRPO stages, run through
their command lines with params.yaml's own cpu settings (GRPO's first GRPO_STEPS steps: its learning is measured
through the pipeline, README) and the embedded SmolLM2-135M, move their metrics, each scored on the same 32
problems.

SmolLM2 writes no r1_zero format zero-shot; two SFT steps on 64 generated one-digit sums and differences start
it (format rate 0 → ~0.6, accuracy 0 → ~0.16 on the 32 scored problems, measured), and EI and GRPO start from
that model, where some of their rollouts are right and their groups' rewards differ. The bounds are far from
what was measured, so another CPU's float path (or sampling) does not decide them: format rate from at most 0.2
to at least 0.3; at least one correct rollout among EI's 32 and a GRPO step with a learning signal.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GRPO_STEPS = 3


@pytest.fixture(scope="module")
def cpu_profile_run(tmp_path_factory, prefect_harness):
    """The three training stages, one after another as the pipeline runs them, in a fresh folder."""
    import os

    import flows.expert_iteration
    import flows.grpo
    import flows.sft_experiment

    folder = tmp_path_factory.mktemp("cpu_profile")
    here = os.getcwd()
    os.chdir(folder)  # the profile's paths (outputs/sft_experiment/best_model) are relative, as under DVC
    try:
        common = [
            "--config",
            str(ROOT / "params.yaml"),
            "--profile",
            "cpu",
            "--tracking-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
        ]
        flows.sft_experiment.main([*common, "--metrics-path", "metrics/sft_experiment.json"])
        flows.expert_iteration.main([*common, "--metrics-path", "metrics/expert_iteration.json"])
        flows.grpo.main([*common, "--metrics-path", "metrics/grpo.json", "--n-grpo-steps", str(GRPO_STEPS)])
    finally:
        os.chdir(here)
    return folder


def rows(folder: Path, stage: str) -> list[dict]:
    return json.loads((folder / "outputs" / stage / "summary.json").read_text())


def last_curve_point(folder: Path, stage: str) -> float:
    with open(folder / "outputs" / stage / "curves.csv") as f:
        return float(list(csv.DictReader(f))[-1]["val_accuracy"])


def test_sft_teaches_the_format(cpu_profile_run):
    (row,) = rows(cpu_profile_run, "sft_experiment")
    assert row["initial_format_rate"] <= 0.2 and row["final_format_rate"] >= 0.3, row
    assert row["final_accuracy"] > row["initial_accuracy"], row
    assert (cpu_profile_run / "outputs/sft_experiment/best_model/config.json").is_file()


def test_every_stage_is_scored_on_the_same_problems_and_its_curve_ends_at_its_score(cpu_profile_run):
    """One setting of SFT, so nothing chosen: its curve runs on the scored problems, as EI's and GRPO's do; each
    curve's last point is the final score, and each stage starts where the previous one's model stands."""
    sft, ei, grpo = (rows(cpu_profile_run, stage)[0] for stage in ("sft_experiment", "expert_iteration", "grpo"))
    for stage, row in (("sft_experiment", sft), ("expert_iteration", ei), ("grpo", grpo)):
        assert last_curve_point(cpu_profile_run, stage) == row["final_accuracy"], stage
        assert row["paired_problems"] == 32 and row["accuracy_change_se"] > 0, (stage, row)
    assert ei["initial_accuracy"] == grpo["initial_accuracy"]  # the SFT model, the same problems, seeded sampling


def test_expert_iteration_starts_from_the_sft_model_and_keeps_correct_rollouts(cpu_profile_run):
    rounds = sorted(
        (cpu_profile_run / "outputs/expert_iteration").glob("runs-*/single/checkpoint/round-0/rollouts.json")
    )
    assert rounds, "EI wrote no round"
    rollouts = json.loads(rounds[0].read_text())["metrics"]  # and the outcomes the question sampler read
    assert rollouts["kept"] >= 1 and rollouts["rollout_format_rate"] >= 0.3, rollouts


def test_grpo_starts_from_the_sft_model_and_gets_rewards(cpu_profile_run):
    with open(cpu_profile_run / "outputs/grpo/train_curves.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == GRPO_STEPS and max(float(s["reward_mean"]) for s in steps) > 0, steps
    assert min(float(s["frac_groups_all_equal"]) for s in steps) < 1, steps  # some step had a learning signal
    (row,) = rows(cpu_profile_run, "grpo")
    assert row["initial_format_rate"] >= 0.3, row  # it starts from the SFT model, which has some of the format
