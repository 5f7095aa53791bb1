"""The loops' guards through the commands: a diverged SFT run stops before its update with the step named; GRPO
refuses groups of one."""

from __future__ import annotations

import json

import pytest
from test_bad_input import flags, inputs, user_error  # noqa: F401  (inputs: a fixture)

from a5core.loops.grpo import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
