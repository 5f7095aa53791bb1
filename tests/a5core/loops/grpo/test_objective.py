"""The objective of a GRPO micro-batch (a5core.loops.grpo.objective): for every loss type, token weight, KL
estimator and length normalisation, the value and gradient of the handout's formulas (a5core.policy.losses) composed
by hand from the run's settings; the clip range each loss type reads; the divisor of each sequence's token sums."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest
import torch

from a5core.loops.grpo import GRPOConfig
from a5core.loops.grpo.batch import MicroBatch
from a5core.loops.grpo.objective import loss_metrics, microbatch_loss, token_sum_divisor_for
from a5core.policy.losses import (
    LossType,
    compute_kl_penalty,
    compute_policy_gradient_loss,
    masked_mean,
    masked_normalize,
)

OFF_POLICY = dict(epochs_per_rollout_batch=2)
LENGTHS = (6, 4, 2, 5)
# Each loss type's clip range, as a test gives it: grpo_clip's own settings, gspo's own (far smaller).
CLIP_SETTINGS = {
    "grpo_clip": dict(cliprange=0.05, cliprange_high=0.08),
    "gspo": dict(gspo_cliprange=0.02, gspo_cliprange_high=None),
}


def microbatch(seed: int = 0) -> tuple[torch.Tensor, MicroBatch]:
    """Log-probs (4, 6) with gradients and the micro-batch: rows of LENGTHS response tokens, the third rollout
    cut at max_tokens, old/engine/reference log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(4, 6, generator=g) * 2).requires_grad_()
    near = lambda: log_probs.detach() + 0.3 * torch.randn(4, 6, generator=g)  # noqa: E731
    mb = MicroBatch(
        torch.arange(6) < torch.tensor(LENGTHS).view(-1, 1),
        advantages=torch.tensor([[1.0], [-0.5], [2.0], [-1.5]]),
        raw_rewards=torch.tensor([[1.0], [0.0], [1.0], [0.0]]),
        truncated=torch.tensor([[False], [False], [True], [False]]),
        old_log_probs=near(),
        engine_log_probs=near(),
        ref_log_probs=near(),
    )
    return log_probs, mb


def by_hand(
    config: GRPOConfig, clip: tuple, log_probs: torch.Tensor, mb: MicroBatch, divisor: float | None, mean_divisor: float
) -> torch.Tensor:
    """The handout's per-token loss at clip range ``clip``, times the token weights, plus kl_coef times the KL
    estimate, reduced per sequence and averaged: each piece a5core.policy.losses' function."""
    mask = mb.response_mask
    per_token, _ = compute_policy_gradient_loss(
        log_probs, config.loss_type, mb.raw_rewards, mb.advantages, mb.old_log_probs, *clip, mask
    )
    if config.tis_cap is not None:
        per_token = per_token * torch.exp(mb.old_log_probs - mb.engine_log_probs).clamp(max=config.tis_cap)
    if config.mask_truncated:
        per_token = per_token * (~mb.truncated).float()
    if config.kl_coef:
        per_token = per_token + config.kl_coef * compute_kl_penalty(log_probs, mb.ref_log_probs, config.kl_estimator)
    if config.length_normalization == "masked_mean":
        return masked_mean(per_token, mask, dim=-1).mean() / mean_divisor
    return masked_normalize(per_token, mask, divisor, dim=-1).mean() / mean_divisor


OPTIONS = [
    dict(),
    dict(tis_cap=1.2),
    dict(mask_truncated=True),
    dict(kl_coef=0.1, kl_estimator="k1"),
    dict(kl_coef=0.1, kl_estimator="k2"),
    dict(kl_coef=0.05, kl_estimator="k3", tis_cap=2.0, mask_truncated=True),
]


@pytest.mark.parametrize(
    "loss_type, options, length_normalization",
    list(itertools.product(get_args(LossType), OPTIONS, ("masked_mean", "masked_normalize", "token_mean"))),
)
def test_the_objective_is_the_handouts_formulas_composed(loss_type, options, length_normalization):
    clip = CLIP_SETTINGS.get(loss_type, {})
    config = GRPOConfig(
        loss_type=loss_type, length_normalization=length_normalization, max_tokens=8, **clip, **options, **OFF_POLICY
    )
    log_probs, mb = microbatch()
    divisor = token_sum_divisor_for(config, list(LENGTHS), [False, False, True, False])
    loss, meta = microbatch_loss(config, log_probs, mb, divisor, 2.0)
    loss.backward()
    direct = log_probs.detach().clone().requires_grad_()
    expected = by_hand(config, tuple(clip.values()) or (None, None), direct, mb, divisor, 2.0)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(log_probs.grad, direct.grad)
    assert log_probs.grad.abs().sum() > 0
    assert set(meta) == {"loss", *loss_metrics(config)}
    if "kl" in meta:
        kl = compute_kl_penalty(log_probs.detach(), mb.ref_log_probs, config.kl_estimator)
        torch.testing.assert_close(meta["kl"], masked_mean(kl, mb.response_mask))


def test_each_clipped_loss_reads_its_own_clip_range():
    """gspo clips at gspo_cliprange, whatever grpo_clip's cliprange, and grpo_clip the other way round."""
    log_probs, mb = microbatch(3)

    def clipped(loss_type: str, **settings) -> float:
        config = GRPOConfig(loss_type=loss_type, **settings, **OFF_POLICY)
        return microbatch_loss(config, log_probs, mb, None, 1.0)[1]["clip_fraction"].item()

    assert clipped("grpo_clip", cliprange=0.05) == clipped("grpo_clip", cliprange=0.05, gspo_cliprange=0.9)
    assert clipped("grpo_clip", cliprange=0.05) > clipped("grpo_clip", cliprange=0.9)
    gspo = dict(gspo_cliprange_high=None)
    assert clipped("gspo", gspo_cliprange=0.02, **gspo) == clipped("gspo", gspo_cliprange=0.02, cliprange=0.9, **gspo)
    assert clipped("gspo", gspo_cliprange=0.02, **gspo) > clipped("gspo", gspo_cliprange=0.9, **gspo)


def test_clip_fraction_is_the_share_of_response_tokens_whose_clipped_term_was_chosen():
    config = GRPOConfig(loss_type="grpo_clip", cliprange=0.05, **OFF_POLICY)
    log_probs, mb = microbatch(1)
    _, meta = microbatch_loss(config, log_probs, mb, None, 1.0)
    ratio, mask = torch.exp(log_probs.detach() - mb.old_log_probs), mb.response_mask
    a = mb.advantages
    chosen = (torch.clamp(ratio, 0.95, 1.05) * a < ratio * a) & mask
    assert 0 < chosen.sum() < mask.sum(), "the test needs some tokens clipped and some not"
    assert meta["clip_fraction"].item() == pytest.approx(chosen.sum().item() / mask.sum().item())


def test_an_empty_share_has_no_kl_term_so_its_gradient_is_zero():
    """A rank with no rollout left runs stand-ins at advantage 0 (FSDP2's collectives need the pass): not
    ``live``, the KL term is left out too, and nothing moves the weights."""
    config = GRPOConfig(kl_coef=0.1)
    log_probs, mb = microbatch(2)
    mb = mb._replace(advantages=torch.zeros_like(mb.advantages))
    loss, meta = microbatch_loss(config, log_probs, mb, None, 1.0, live=False)
    loss.backward()
    assert (log_probs.grad == 0).all() and "kl" not in meta
    live, _ = microbatch_loss(config, log_probs, mb, None, 1.0)
    assert live.item() > 0  # live, the same stand-ins would carry a KL term


def test_the_divisor_of_each_sequences_token_sums():
    lengths, truncated = [6, 4, 2, 5], [False, True, False, False]
    assert token_sum_divisor_for(GRPOConfig(), lengths, truncated) is None  # masked_mean: each sequence's own length
    masked_normalize = GRPOConfig(length_normalization="masked_normalize", max_tokens=16)
    assert token_sum_divisor_for(masked_normalize, lengths, truncated) == 16.0
    token_mean = GRPOConfig(length_normalization="token_mean")
    assert token_sum_divisor_for(token_mean, lengths, truncated) == 17 / 4
    masked = GRPOConfig(length_normalization="token_mean", mask_truncated=True)
    assert token_sum_divisor_for(masked, lengths, truncated) == 13 / 4  # a masked rollout's tokens do not train
    assert token_sum_divisor_for(masked, [3, 3], [True, True]) == 1 / 2  # none trains: no division by 0
