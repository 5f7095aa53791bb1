"""flows.difficulty: the pass-rate table a training run then samples its questions by."""

from __future__ import annotations

import csv
import json

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_table_counts_each_questions_correct_samples_and_grpo_samples_by_it(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    import mlflow

    from a5core.data import problem_sets
    from a5core.grading import rewards
    from a5core.grading.rewards import arithmetic_reward_fn
    from flows.difficulty import DifficultyParams, difficulty

    graded = []

    def recording(response, truth):
        graded.append(response)
        return arithmetic_reward_fn(response, truth)

    monkeypatch.setitem(rewards.REWARD_FNS, "arithmetic", recording)
    params = DifficultyParams(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:30:1",
        reward_fn="arithmetic",
        limit=6,
        n=3,
        max_tokens=8,
        table=str(tmp_path / "rates.csv"),
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    result = difficulty(params)
    rows = list(csv.DictReader((tmp_path / "rates.csv").read_text().splitlines()))
    assert len(rows) == 6 and len(graded) == 18
    for row in rows:
        assert int(row["samples"]) == 3 and float(row["pass_rate"]) == pytest.approx(int(row["correct"]) / 3)
        assert row["level"] == "1" and row["unique_id"].startswith("arithmetic/train/")
    summary = result["summary"]
    assert summary["difficulty_unsolved"] + summary["difficulty_learnable"] + summary["difficulty_solved"] == 1
    assert (tmp_path / "out/pass_rate_histogram.png").stat().st_size > 0
    assert json.loads((tmp_path / "out/summary.json").read_text()) == summary  # the metrics file: its headline
    headline = {"accuracy": summary["mean_pass_rate"], "learnable": summary["difficulty_learnable"]}
    assert json.loads((tmp_path / "metrics.json").read_text()) == headline
    run = mlflow.MlflowClient(params.tracking_uri).get_run(result["mlflow_run_id"])
    assert run.data.metrics["questions"] == 6

    # A GRPO run samples only the learnable questions: a table that calls every training question solved
    # but two (the table's first two, which the flow measured).
    from a5core.loops.question_sampling import load_pass_rates
    from flows.grpo import GRPOParams, grpo_flow

    first_two = list(load_pass_rates(tmp_path / "rates.csv"))[:2]
    train = {p.unique_id: p.answer for p in problem_sets.load_problem_set("arithmetic:30:1", "math", 0, "train")}
    table = tmp_path / "learnable.csv"
    lines = [f"{uid},{0.5 if uid in first_two else 1.0}" for uid in train]
    table.write_text("unique_id,pass_rate\n" + "\n".join(lines) + "\n")
    asked = []

    def asking(response, truth):
        asked.append(truth)
        return arithmetic_reward_fn(response, truth)

    monkeypatch.setitem(rewards.REWARD_FNS, "arithmetic", asking)
    grpo = GRPOParams(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:4:1",
        reward_fn="arithmetic",
        difficulty_table=str(table),
        question_sampling="learnable",
        difficulty_refresh_every=0,
        val_subset=2,
        val_limit=2,
        eval_every=0,
        n_grpo_steps=1,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=8,
        min_tokens=1,
        output_dir=str(tmp_path / "grpo"),
        metrics_path=None,
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    grpo_flow(grpo)
    assert set(asked[:4]) == {train[uid] for uid in first_two}  # the step's 2 questions × 2 rollouts


def test_a_table_of_other_questions_is_refused_before_starting(tmp_path):
    from flows.grpo import GRPOParams
    from tasks.checks import check_grpo_run

    table = tmp_path / "other.csv"
    table.write_text("unique_id,pass_rate\nsomething/else,0.5\n")
    params = GRPOParams(
        train_data="arithmetic:30:1", validation_data="arithmetic:4:1", reward_fn="arithmetic",
        difficulty_table=str(table), rollout_batch_size=4, group_size=2, train_batch_size=4,
        gradient_accumulation_steps=2, model="smollm2-135m-instruct", output_dir=str(tmp_path / "out"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", max_tokens=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"difficulty_table .*other.csv: none of its 1 questions is in train_data"):
        check_grpo_run(params)
    table.write_text("unique_id,pass_rate\narithmetic/train/0,1.5\n")
    with pytest.raises(ValueError, match=r"other.csv:2: pass_rate 1.5 is not between 0 and 1"):
        check_grpo_run(params)
