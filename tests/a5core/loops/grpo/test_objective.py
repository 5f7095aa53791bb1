"""The objective of a GRPO micro-batch (a5core.loops.grpo.objective): for every loss type, token weight, KL
estimator and length normalisation, the value and gradient of the handout's formulas (a5core.policy.losses) composed
by hand; the settings a GRPOConfig gives it; the length normalisation's divisor."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest
import torch

from a5core.loops.grpo import GRPOConfig
from a5core.loops.grpo.objective import Objective, microbatch_loss, normalizer
from a5core.policy.losses import (
    POLICY_GRADIENT_INPUTS,
    LossType,
    compute_kl_penalty,
    compute_policy_gradient_loss,
    masked_mean,
    masked_normalize,
)

OFF_POLICY = dict(epochs_per_rollout_batch=2)
LENGTHS = (6, 4, 2, 5)


def microbatch(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs (4, 6) with gradients and the micro-batch's tensors: rows of LENGTHS response tokens, the third
    rollout cut at max_tokens, old/engine/reference log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    log_probs = (-torch.rand(4, 6, generator=g) * 2).requires_grad_()
    near = lambda: log_probs.detach() + 0.3 * torch.randn(4, 6, generator=g)  # noqa: E731
    t = {
        "response_mask": torch.arange(6) < torch.tensor(LENGTHS).view(-1, 1),
        "advantages": torch.tensor([[1.0], [-0.5], [2.0], [-1.5]]),
        "raw_rewards": torch.tensor([[1.0], [0.0], [1.0], [0.0]]),
        "truncated": torch.tensor([[False], [False], [True], [False]]),
        "old_log_probs": near(),
        "engine_log_probs": near(),
        "ref_log_probs": near(),
    }
    return log_probs, t


def by_hand(o: Objective, log_probs: torch.Tensor, t: dict, divisor: float | None, share: float) -> torch.Tensor:
    """The handout's per-token loss, times the token weights, plus kl_coef times the KL estimate, reduced per
    sequence and averaged: each piece a5core.policy.losses' function."""
    mask, old = t["response_mask"], t["old_log_probs"]
    rewards, advantages = t["raw_rewards"], t["advantages"]
    per_token, _ = compute_policy_gradient_loss(
        log_probs, o.loss_type, rewards, advantages, old, o.cliprange, o.cliprange_high, mask
    )
    if o.tis_cap is not None:
        per_token = per_token * torch.exp(t["old_log_probs"] - t["engine_log_probs"]).clamp(max=o.tis_cap)
    if o.mask_truncated:
        per_token = per_token * (~t["truncated"]).float()
    if o.kl_coef:
        per_token = per_token + o.kl_coef * compute_kl_penalty(log_probs, t["ref_log_probs"], o.kl_estimator)
    if o.length_normalization == "masked_mean":
        return masked_mean(per_token, mask, dim=-1).mean() / share
    return masked_normalize(per_token, mask, divisor, dim=-1).mean() / share


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
    ranges = {"grpo_clip": (0.05, 0.08), "gspo": (0.02, None)}.get(loss_type, (None, None))
    o = Objective(loss_type, *ranges, length_normalization=length_normalization, max_tokens=8, **options)
    log_probs, t = microbatch()
    divisor = normalizer(o, list(LENGTHS), [False, False, True, False])
    loss, meta = microbatch_loss(o, log_probs, t, divisor, share=2.0)
    loss.backward()
    direct = log_probs.detach().clone().requires_grad_()
    expected = by_hand(o, direct, t, divisor, share=2.0)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(log_probs.grad, direct.grad)
    assert log_probs.grad.abs().sum() > 0
    assert set(meta) == {"loss", *o.metrics}
    if "kl" in meta:
        kl = compute_kl_penalty(log_probs.detach(), t["ref_log_probs"], o.kl_estimator)
        torch.testing.assert_close(meta["kl"], masked_mean(kl, t["response_mask"]))


def test_clip_fraction_is_the_share_of_response_tokens_whose_clipped_term_was_chosen():
    o = Objective("grpo_clip", 0.05, None)
    log_probs, t = microbatch(1)
    _, meta = microbatch_loss(o, log_probs, t, None, share=1.0)
    ratio, mask = torch.exp(log_probs.detach() - t["old_log_probs"]), t["response_mask"]
    a = t["advantages"]
    chosen = (torch.clamp(ratio, 0.95, 1.05) * a < ratio * a) & mask
    assert 0 < chosen.sum() < mask.sum(), "the test needs some tokens clipped and some not"
    assert meta["clip_fraction"].item() == pytest.approx(chosen.sum().item() / mask.sum().item())


def test_an_empty_share_has_no_kl_term_so_its_gradient_is_zero():
    """A rank with no rollout left runs stand-ins at advantage 0 (FSDP2's collectives need the pass): not
    ``live``, the KL term is left out too, and nothing moves the weights."""
    o = Objective("reinforce_with_baseline", kl_coef=0.1)
    log_probs, t = microbatch(2)
    t["advantages"] = torch.zeros_like(t["advantages"])
    loss, meta = microbatch_loss(o, log_probs, t, None, share=1.0, live=False)
    loss.backward()
    assert (log_probs.grad == 0).all() and "kl" not in meta
    live, _ = microbatch_loss(o, log_probs, t, None, share=1.0)
    assert live.item() > 0  # live, the same stand-ins would carry a KL term


def test_the_length_normalisations_divisor():
    lengths, truncated = [6, 4, 2, 5], [False, True, False, False]
    assert normalizer(Objective(), lengths, truncated) is None  # masked_mean: each sequence's own length
    assert normalizer(Objective(length_normalization="masked_normalize", max_tokens=16), lengths, truncated) == 16.0
    token_mean = Objective(length_normalization="token_mean")
    assert normalizer(token_mean, lengths, truncated) == 17 / 4
    masked = Objective(length_normalization="token_mean", mask_truncated=True)
    assert normalizer(masked, lengths, truncated) == 13 / 4  # a masked rollout's tokens do not train
    assert normalizer(masked, [3, 3], [True, True]) == 1 / 2  # none trains: no division by 0


def test_a_config_gives_the_objective_its_loss_types_clip_range():
    grpo_clip = GRPOConfig(loss_type="grpo_clip", cliprange=0.1, cliprange_high=0.3, **OFF_POLICY).objective
    assert (grpo_clip.cliprange, grpo_clip.cliprange_high) == (0.1, 0.3)
    gspo = GRPOConfig(loss_type="gspo", gspo_cliprange=1e-3, gspo_cliprange_high=None, **OFF_POLICY).objective
    assert (gspo.cliprange, gspo.cliprange_high) == (1e-3, None)
    config = GRPOConfig(tis_cap=2.0, mask_truncated=True, kl_coef=0.1, kl_estimator="k2", max_tokens=64)
    assert config.objective == Objective(
        "reinforce_with_baseline", 0.2, None, 2.0, True, 0.1, "k2", "masked_mean", max_tokens=64
    )


@pytest.mark.parametrize("loss_type", get_args(LossType))
def test_what_each_loss_type_needs_and_reports(loss_type):
    o = GRPOConfig(loss_type=loss_type, **OFF_POLICY).objective
    assert o.needs_old_log_probs == (loss_type in ("grpo_clip", "grpo_no_clip", "gspo"))
    assert o.metrics == (("clip_fraction",) if loss_type in ("grpo_clip", "gspo") else ())
    assert o.uses_advantages == (loss_type != "no_baseline")
    assert Objective(loss_type, tis_cap=2.0).needs_old_log_probs  # the importance weight needs them too
    assert set(POLICY_GRADIENT_INPUTS) == set(get_args(LossType))


def test_cliprange_high_is_refused_where_the_loss_does_not_read_it():
    with pytest.raises(ValueError, match="cliprange_high must be None, or a number > 0 with loss_type grpo_clip"):
        GRPOConfig(loss_type="gspo", cliprange_high=0.3, **OFF_POLICY)
