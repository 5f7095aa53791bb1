"""The cpu profile a newcomer's `make pipeline` runs shows learning: its SFT, EI and GRPO stages, run through
their command lines with params.yaml's own cpu settings and the embedded SmolLM2-135M, move their metrics.

SmolLM2 writes no r1_zero format zero-shot; SFT on 64 generated one-digit sums and differences teaches it
(format rate 0 → 1.0, accuracy 0 → ~0.3 on 16 held-out problems, measured here), and EI and GRPO start
from that model, where some of their rollouts are right. The bounds are far from what was measured, so
another CPU's float path (or sampling) does not decide them: format rate from at most 0.2 to at least 0.5;
at least one correct rollout among EI's 32 and among GRPO's 32 (at ~0.3 accuracy, all 32 wrong has a
probability of about 1e-5).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
        flows.grpo.main([*common, "--metrics-path", "metrics/grpo.json"])
    finally:
        os.chdir(here)
    return folder


def test_sft_teaches_the_format(cpu_profile_run):
    (row,) = json.loads((cpu_profile_run / "metrics/sft_experiment.json").read_text())
    assert row["initial_format_rate"] <= 0.2 and row["final_format_rate"] >= 0.5, row
    assert row["final_accuracy"] > row["initial_accuracy"], row
    assert (cpu_profile_run / "outputs/sft_experiment/best_model/config.json").is_file()


def test_expert_iteration_starts_from_the_sft_model_and_keeps_correct_rollouts(cpu_profile_run):
    rounds = sorted(
        (cpu_profile_run / "outputs/expert_iteration").glob("runs-*/single/checkpoint/round-0/rollouts.json")
    )
    assert rounds, "EI wrote no round"
    rollouts = json.loads(rounds[0].read_text())["metrics"]  # and the outcomes the question sampler read
    assert rollouts["kept"] >= 1 and rollouts["rollout_format_rate"] >= 0.5, rollouts


def test_grpo_starts_from_the_sft_model_and_gets_rewards(cpu_profile_run):
    with open(cpu_profile_run / "outputs/grpo/train_curves.csv") as f:
        steps = list(csv.DictReader(f))
    assert len(steps) == 2 and max(float(s["reward_mean"]) for s in steps) > 0, steps
    (row,) = json.loads((cpu_profile_run / "metrics/grpo.json").read_text())
    assert row["initial_format_rate"] >= 0.5, row  # it starts from the SFT model, which has the format
