"""The handout's GRPO micro-batch train step, as the CS336 A5 adapters call it: a thin front on the loop's own
objective (:func:`a5core.loops.grpo.objective.microbatch_loss`), so the adapters test the loop's code; nothing in
the loops imports this module. (The handout's other functions are the library's own, exported by
:mod:`a5core`: the policy-gradient dispatcher is :func:`a5core.policy.losses.compute_policy_gradient_loss`.)

Shapes: ``b`` sequences, ``T`` token positions; log-probs and masks (b, T), rewards and advantages (b, 1).
"""

from __future__ import annotations

import torch

from a5core.loops.grpo.batch import MicroBatch
from a5core.loops.grpo.config import GRPOConfig
from a5core.loops.grpo.objective import microbatch_loss
from a5core.policy.losses import LENGTH_NORMALIZATIONS, require_inputs


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: float,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    length_normalization: str = "masked_mean",
    normalize_constant: float | None = None,
    cliprange_high: float | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The handout's policy-gradient micro-batch step (its adapters' entry point): the loop's
    :func:`microbatch_loss` with these arguments, divided by ``gradient_accumulation_steps``, then ``backward``.

    policy_log_probs, response_mask, old_log_probs, ref_log_probs: (b, T); raw_rewards, advantages: (b, 1).
    ``cliprange`` and ``cliprange_high``: the clip range of ``loss_type`` (gspo's own, far smaller, for gspo).
    ``normalize_constant``: the divisor of ``masked_normalize`` and ``token_mean``. ``kl_coef`` > 0 adds that
    times the KL estimate to every response token's loss (needs ``ref_log_probs``). Returns the loss, scaled as
    it was back-propagated, and metadata (``loss``; ``clip_fraction`` where the loss clips; ``kl``). A missing
    or unknown argument raises ValueError naming it.
    """
    require_inputs(
        loss_type,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        response_mask=response_mask,
        cliprange=cliprange,
    )
    if length_normalization not in LENGTH_NORMALIZATIONS:
        expected = ", ".join(LENGTH_NORMALIZATIONS)
        raise ValueError(f"unknown length_normalization {length_normalization!r}; expected one of {expected}")
    if length_normalization != "masked_mean" and normalize_constant is None:
        need = "e.g. max_tokens" if length_normalization == "masked_normalize" else "tokens per sequence"
        raise ValueError(f"length_normalization {length_normalization!r} needs normalize_constant ({need})")
    if kl_coef and ref_log_probs is None:
        raise ValueError("kl_coef > 0 needs ref_log_probs (the frozen reference policy's log-probs)")
    # A run's settings, unvalidated: a run refuses what the handout's tests call for (a ratio loss on one batch,
    # on-policy, where every ratio is 1), and the rest (no importance weight, no truncation mask) are its defaults.
    config = GRPOConfig.model_construct(
        loss_type=loss_type,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        gspo_cliprange=cliprange,
        gspo_cliprange_high=cliprange_high,
        length_normalization=length_normalization,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )
    mb = MicroBatch(
        response_mask,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
    )
    loss, metadata = microbatch_loss(config, policy_log_probs, mb, normalize_constant, gradient_accumulation_steps)
    loss.backward()
    return loss.detach(), metadata
