"""The settings of a GRPO run (a5core.loops.grpo.config): the handout's defaults, what each loss type needs and
reports, the combinations refused with the setting named, and what a checkpoint must match to be resumed."""

from __future__ import annotations

from typing import get_args

import pytest
from tiny_loops import PROBLEMS, small_config

from a5core.loops.grpo import GRPOConfig, run_fingerprint
from a5core.loops.grpo.config import ONE_STEP_OFF_TIS_CAP
from a5core.loops.grpo.objective import loss_metrics
from a5core.policy.losses import POLICY_GRADIENT_INPUTS, LossType

OFF_POLICY = dict(epochs_per_rollout_batch=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rollout_batch_size=10, group_size=4), "rollout_batch_size must be a multiple of group_size"),
        (
            dict(train_batch_size=8, gradient_accumulation_steps=3),
            "train_batch_size must be a multiple of gradient_accumulation_steps",
        ),
        (
            dict(rollout_batch_size=8, train_batch_size=6, gradient_accumulation_steps=2),
            "rollout_batch_size must be a multiple of train_batch_size",
        ),
        (
            dict(group_size=8, rollout_batch_size=16, train_batch_size=4, gradient_accumulation_steps=2),
            "train_batch_size must be >= group_size",
        ),
        (dict(loss_type="grpo_clip"), "every ratio is 1"),
        (
            dict(loss_type="ppo"),
            r"loss_type\n  Input should be 'no_baseline', 'reinforce_with_baseline', 'grpo_clip', 'grpo_no_clip' or",
        ),
        (
            dict(length_normalization="sum"),
            r"length_normalization\n  Input should be 'masked_mean', 'masked_normalize' or 'token_mean'",
        ),
        (dict(learning_rate=-1.0), r"learning_rate\n  Input should be greater than 0"),
        (dict(cliprange_high=0.3), "cliprange_high must be None, or a number > 0 with loss_type grpo_clip"),
        (dict(tis_cap=0.0), r"tis_cap\n  Input should be greater than 0"),
        (dict(n_grpo_steps=0), r"n_grpo_steps\n  Input should be greater than or equal to 1"),
        (dict(min_tokens=20), r"min_tokens \(20\) must not exceed max_tokens \(12\)"),
        (dict(compile_layers="yes"), r"compile_layers must be true, false or auto"),
    ],
)
def test_invalid_settings_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_a5_defaults():
    config = GRPOConfig()
    assert (config.n_grpo_steps, config.learning_rate, config.rollout_batch_size, config.group_size) == (
        200,
        1e-5,
        256,
        8,
    )
    assert (config.train_batch_size, config.gradient_accumulation_steps, config.microbatch_size) == (256, 128, 2)
    assert (config.loss_type, config.use_std_normalization, config.betas, config.cliprange) == (
        "reinforce_with_baseline",
        True,
        (0.9, 0.95),
        0.2,
    )
    assert (config.temperature, config.min_tokens, config.max_tokens) == (1.0, 4, 1024)
    assert not config.off_policy and not config.needs_old_log_probs


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(loss_type="gspo"), "gspo' weighs each token by π/π_old"),
        (dict(overlong_buffer=12), r"overlong_buffer must be below max_tokens \(12\)"),
        (dict(dynamic_sampling=True, drop_uniform_groups=True), "drop_uniform_groups must be false with dynamic"),
        (dict(pipeline_depth=1), "tis_cap must be set .* with pipeline_depth 1"),
        (dict(pipeline_depth=1, tis_cap=2.0, dynamic_sampling=True), "dynamic_sampling must be false with pipeline"),
        (dict(pipeline_depth=2, tis_cap=2.0), r"pipeline_depth\n  Input should be less than or equal to 1"),
        (dict(kl_estimator="k4"), r"kl_estimator\n  Input should be 'k1', 'k2' or 'k3'"),
        (dict(kl_coef=-0.1), r"kl_coef\n  Input should be greater than or equal to 0"),
    ],
)
def test_invalid_combinations_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


@pytest.mark.parametrize("loss_type", get_args(LossType))
def test_what_each_loss_type_needs_and_reports(loss_type):
    config = GRPOConfig(loss_type=loss_type, **OFF_POLICY)
    assert config.weighs_by_ratio == config.needs_old_log_probs == (loss_type in ("grpo_clip", "grpo_no_clip", "gspo"))
    assert config.clips == (loss_type in ("grpo_clip", "gspo"))
    assert loss_metrics(config) == (("clip_fraction",) if config.clips else ())
    assert config.uses_advantages == (loss_type != "no_baseline")
    assert set(POLICY_GRADIENT_INPUTS) == set(get_args(LossType))
    with_kl = GRPOConfig(loss_type=loss_type, kl_coef=0.1, tis_cap=2.0, **OFF_POLICY)
    assert with_kl.needs_old_log_probs  # the importance weight needs them too
    assert loss_metrics(with_kl)[-1] == "kl"


def test_cliprange_high_is_refused_where_the_loss_does_not_read_it():
    with pytest.raises(ValueError, match="cliprange_high must be None, or a number > 0 with loss_type grpo_clip"):
        GRPOConfig(loss_type="gspo", cliprange_high=0.3, **OFF_POLICY)


def test_one_step_off_is_refused_without_a_cap_and_the_refusal_suggests_the_ablations():
    with pytest.raises(ValueError, match=rf"tis_cap must be set \(e.g. {ONE_STEP_OFF_TIS_CAP}\) with pipeline_depth 1"):
        small_config(pipeline_depth=1)
    assert small_config(pipeline_depth=1, tis_cap=ONE_STEP_OFF_TIS_CAP).tis_cap == ONE_STEP_OFF_TIS_CAP


def test_a_checkpoint_matches_what_is_trained_not_how_fast_or_how_often():
    """The fingerprint changes with a setting that changes the training (the learning rate), the problems or the
    pass-rate table; not with how often the run checkpoints or evaluates, nor how a step runs."""
    base = run_fingerprint(small_config(), PROBLEMS)
    assert run_fingerprint(small_config(checkpoint_every=5, eval_every=2, compile_layers=False), PROBLEMS) == base
    assert run_fingerprint(small_config(max_tokens_per_microbatch=512), PROBLEMS) == base
    assert run_fingerprint(small_config(learning_rate=2e-3), PROBLEMS) != base
    assert run_fingerprint(small_config(), PROBLEMS[::-1]) != base
    assert run_fingerprint(small_config(), PROBLEMS, {"p0": 0.5}) != base
