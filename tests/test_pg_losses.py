"""The policy-gradient loss objects: built from a config's settings, what each needs, the same values as the
handout's dispatcher."""

from __future__ import annotations

import pytest
import torch

from a5core.grpo import GRPOConfig
from a5core.losses import compute_policy_gradient_loss
from a5core.pg_losses import GSPO, POLICY_GRADIENT_LOSSES, GRPOClip, policy_gradient_loss, users_of

OFF_POLICY = dict(epochs_per_rollout_batch=2)


@pytest.mark.parametrize("loss_type", list(POLICY_GRADIENT_LOSSES))
def test_each_loss_is_the_handout_dispatchers(loss_type):
    generator = torch.Generator().manual_seed(0)
    log_probs, old = -torch.rand(3, 5, generator=generator), -torch.rand(3, 5, generator=generator)
    mask = torch.arange(5) < torch.tensor([[5], [3], [1]])
    inputs = dict(advantages=torch.randn(3, 1, generator=generator), raw_rewards=torch.rand(3, 1, generator=generator))
    inputs |= dict(old_log_probs=old, response_mask=mask)
    config = GRPOConfig(loss_type=loss_type, gspo_cliprange=0.05, **OFF_POLICY)
    loss = config.policy_loss
    ranges = (config.gspo_cliprange, config.gspo_cliprange_high) if loss_type == "gspo" else (config.cliprange, None)
    expected, meta = compute_policy_gradient_loss(log_probs, loss_type, *_args(inputs), *ranges, mask)
    got, got_meta = loss.per_token(log_probs, inputs)
    assert torch.equal(got, expected) and got_meta.keys() == meta.keys()
    assert loss.needs_old_log_probs == (loss_type in ("grpo_clip", "grpo_no_clip", "gspo"))
    assert loss.metrics == (("clip_fraction",) if loss_type in ("grpo_clip", "gspo") else ())


def _args(inputs):
    return inputs["raw_rewards"], inputs["advantages"], inputs["old_log_probs"]


def test_a_loss_carries_the_clip_ranges_it_reads():
    config = GRPOConfig(loss_type="grpo_clip", cliprange=0.1, cliprange_high=0.3, **OFF_POLICY)
    assert policy_gradient_loss(config) == GRPOClip(0.1, 0.3)
    gspo = GRPOConfig(loss_type="gspo", gspo_cliprange=1e-3, gspo_cliprange_high=None, **OFF_POLICY)
    assert gspo.policy_loss == GSPO(1e-3, None)
    assert users_of("cliprange_high") == ["grpo_clip"] and users_of("gspo_cliprange") == ["gspo"]
