"""The loops' guards: a diverged run stops before its update with the step named, GRPO refuses groups of one
and warns when greedy sampling makes every group uniform."""

from __future__ import annotations

import json
import logging

import pytest
from test_bad_input import flags, inputs, user_error  # noqa: F401  (inputs: a fixture)
from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, make_model, parity_reward, small_config

from a5core.loops.grpo import GRPOConfig, grpo
from a5core.loops.grpo.learning_signal import warn_if_groups_are_uniform
from a5core.runtime.guards import DivergenceError, DivergenceGuard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_vanishing_gradient_under_a_nonzero_loss_stops_the_run():
    guard = DivergenceGuard(fixed_scale=False)
    guard.check("GRPO step 1 of 3", 0.0, 0.0)  # nothing to learn from (uniform groups): fine
    guard.check("GRPO step 1 of 3", -0.4, 2.0)
    with pytest.raises(DivergenceError, match=r"^GRPO step 2 of 3: the run diverged \(gradient norm 0 under a loss"):
        guard.check("GRPO step 2 of 3", 267.0, 0.0)
    DivergenceGuard(fixed_scale=False, vanishing_gradient=False).check("a clipped loss", 0.3, 0.0)


def test_a_fixed_scale_loss_may_fall_and_wobble_but_not_explode():
    guard = DivergenceGuard(fixed_scale=True)
    for loss in (35.0, 20.0, 60.0, 3.0, 349.0):  # under 10 times the first
        guard.check("SFT", loss, 1.0)
    with pytest.raises(DivergenceError, match=r"loss 351, over 10 times the first step's 35"):
        guard.check("SFT step 6 of 8", 351.0, 1.0)
    DivergenceGuard(fixed_scale=False).check("GRPO", 351.0 * 1000, 1.0)  # a signed loss has no such scale


def test_an_exploding_sft_loss_stops_the_command_before_the_update(inputs, prefect_harness, tmp_path, monkeypatch):  # noqa: F811
    """The loss grows 100-fold from step 3 on (a patched train step): the command ends naming step 3, whose
    update was not applied; step 2's checkpoint is the last."""
    import a5core.loops.sft

    real, calls = a5core.loops.sft.sft_microbatch_train_step, []

    def exploding_from_step_3(*args, **kwargs):  # one micro-batch a step
        loss, meta = real(*args, **kwargs)
        calls.append(1)
        return (loss * 100 if len(calls) > 2 else loss), meta

    monkeypatch.setattr(a5core.loops.sft, "sft_microbatch_train_step", exploding_from_step_3)
    argv = flags("sft_experiment", inputs, tmp_path, eval_every=0, checkpoint_every=1, lr_schedule="constant")
    message = user_error("sft_experiment", argv)
    assert message.startswith("flows.sft_experiment: error: SFT step 3 of 8: the run diverged (loss ")
    assert "lower learning_rate (a new run) rather than resume it" in message
    (checkpoint,) = (tmp_path / "out").glob("runs-*/full/checkpoint")
    assert json.loads((checkpoint / "latest/state.json").read_text())["step"] == 2


def test_a_group_of_one_is_refused(inputs, tmp_path, capsys):  # noqa: F811
    from test_bad_input import parameter_error

    err = parameter_error(
        "grpo", [*flags("grpo", inputs, tmp_path), "--group-size", "1", "--rollout-batch-size", "4"], capsys
    )
    assert "--group-size 1: Input should be greater than or equal to 2" in err
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1, rollout_batch_size=4, train_batch_size=4, gradient_accumulation_steps=1)


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
