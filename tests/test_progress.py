"""Progress: the A5_PROGRESS switch, the per-step status line, and bars drawn by the loops, the engine and
the grader when switched on."""

from __future__ import annotations

import logging
import sys

import pytest

from a5core import progress
from a5core.data import Problem
from a5core.grading import grade_batch
from a5core.prompts import load_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "value, tty, expected",
    [
        (None, False, False),
        (None, True, True),
        ("0", True, False),
        ("off", True, False),
        ("1", False, True),
    ],
)
def test_bars_show_on_a_terminal_unless_switched(value, tty, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, value)
    monkeypatch.setattr(sys, "stderr", type("Stream", (), {"isatty": lambda self: tty})())
    assert progress.enabled() is expected


def test_status_line_names_the_step_and_the_finite_metrics():
    metrics = {"loss": 0.012345, "reward_mean": 0.25, "grad_norm": float("nan"), "wall_seconds": 41.23, "other": 1}
    assert progress.status_line("GRPO step", 3, 200, metrics, ("reward_mean", "loss", "grad_norm", "val_accuracy")) == (
        "GRPO step 3/200: reward_mean 0.25, loss 0.01235 (41.2 s)"
    )


def test_grpo_logs_a_line_per_step_and_draws_bars_when_on(tiny_tokenizer, monkeypatch, caplog, capsys):
    from test_sft import make_model

    from a5core.grpo import GRPOConfig, grpo
    from a5core.rollout.hf import HFEngine

    monkeypatch.setenv(progress.ENV, "1")
    model = make_model(tiny_tokenizer)
    config = GRPOConfig(
        n_grpo_steps=2,
        learning_rate=1e-3,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        temperature=1.0,
        min_tokens=1,
        max_tokens=8,
    )
    problems = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(4)]

    def reward(response, truth):  # a plain callable: graded through grade_batch's own bar
        return {"reward": float(len(response) % 2), "format_reward": 1.0, "answer_reward": 0.0}

    with caplog.at_level(logging.INFO, logger="a5core"):
        grpo(model, tiny_tokenizer, HFEngine(model, tiny_tokenizer), problems, load_prompt("r1_zero"), reward, config)
    lines = [r.getMessage() for r in caplog.records if r.name == "a5core.grpo"]
    assert [line.split(":")[0] for line in lines] == ["GRPO step 1/2", "GRPO step 2/2"]
    assert "reward_mean" in lines[0] and "loss" in lines[0]
    err = capsys.readouterr().err
    assert "GRPO: 100%" in err and "generate" in err and "grade" in err


def test_sft_logs_a_line_per_step(tiny_tokenizer, caplog, monkeypatch, capsys):
    from test_sft import make_model

    from a5core.data import Trace
    from a5core.sft import SFTConfig, train_sft

    monkeypatch.setenv(progress.ENV, "0")
    traces = [Trace(f"What is {i} + 1?", f" {i + 1} </answer>", str(i + 1)) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="a5core"):
        train_sft(
            make_model(tiny_tokenizer), tiny_tokenizer, traces, SFTConfig(batch_size=2, microbatch_size=2, epochs=1)
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SFT step")]
    assert [line.split(":")[0] for line in lines] == ["SFT step 1/2", "SFT step 2/2"]
    assert "SFT:" not in capsys.readouterr().err  # A5_PROGRESS=0: no bar


def test_grade_batch_of_a_plain_callable_is_unchanged():
    rewards = grade_batch(lambda r, t: {"reward": float(r == t)}, ["1", "2"], ["1", "3"])
    assert [r["reward"] for r in rewards] == [1.0, 0.0]
