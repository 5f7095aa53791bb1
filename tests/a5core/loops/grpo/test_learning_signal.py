"""A GRPO run that cannot learn says so (a5core.loops.grpo.learning_signal): greedy sampling is warned of, and steps
without a learning signal are named, a run of them warned of."""

from __future__ import annotations

import logging

import pytest
from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, make_model, parity_reward, small_config

from a5core.loops.grpo import grpo
from a5core.loops.grpo.learning_signal import LearningSignal, warn_if_groups_are_uniform

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_greedy_grpo_warns_that_every_group_is_uniform(tokenizer, caplog):
    model = make_model(tokenizer)
    with caplog.at_level(logging.WARNING, logger="a5core.loops.grpo"):
        grpo(model, tokenizer, RecordingEngine(model, tokenizer), PROBLEMS, TEMPLATE, parity_reward, small_config())
        assert not caplog.records
        config = small_config(temperature=0.0)
        history = grpo(model, tokenizer, RecordingEngine(model, tokenizer), PROBLEMS, TEMPLATE, parity_reward, config)
    (warning,) = caplog.records
    assert "GRPO at temperature 0 samples the 4 rollouts of a question alike" in warning.getMessage()
    assert history[-1]["grad_norm"] == 0  # what it warned of: nothing to learn from
    warn_if_groups_are_uniform(0.0, 1)  # (a group of one is refused before; nothing to say)


def test_grpo_steps_without_a_learning_signal_are_said_and_a_run_of_them_warned_of(caplog):
    signal = LearningSignal(uses_advantages=True, patience=3)
    uniform, varied = {"frac_groups_all_equal": 1.0, "reward_max": 1.0}, {"frac_groups_all_equal": 0.5}
    with caplog.at_level(logging.INFO, logger="a5core"):
        notes = [signal.observe(step, 9, m) for step, m in enumerate([uniform, varied, *[uniform] * 4], start=1)]
    assert notes[0] == notes[2] == "no learning signal (every group's rewards equal)" and notes[1] == ""
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("GRPO steps 3-5 of 9: no learning signal in 3 steps in a row"), warning
    # a loss on the raw rewards (no_baseline) still learns from a uniform group, unless its rewards are all 0
    raw = LearningSignal(uses_advantages=False)
    assert raw.observe(1, 2, uniform) == "" and raw.observe(2, 2, {**uniform, "reward_max": 0.0})
