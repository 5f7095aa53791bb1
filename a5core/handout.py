"""The handout's functional entry points that the loops do not call: the policy-gradient dispatcher and the GRPO
micro-batch train step, as the CS336 A5 adapters call them. Each is a thin front on what the loops use (the
formulas of :mod:`a5core.policy.losses`, the objective of :mod:`a5core.loops.grpo.objective`), so the adapters
test the loops' own code; nothing in the loops imports this module.

Shapes: ``B`` sequences, ``T`` token positions; log-probs and masks (B, T), rewards and advantages (B, 1).
"""

from __future__ import annotations

from typing import Any

import torch

from a5core.loops.grpo.objective import Objective, microbatch_loss
from a5core.policy.losses import (
    LENGTH_NORMALIZATIONS,
    compute_grpo_clip_loss,
    compute_grpo_no_clip_loss,
    compute_gspo_loss,
    compute_naive_policy_gradient_loss,
)

# What each policy-gradient loss reads (beside the policy's log-probs): the handout's dispatcher refuses a call
# without one, naming it.
POLICY_GRADIENT_INPUTS: dict[str, tuple[str, ...]] = {
    "no_baseline": ("raw_rewards",),
    "reinforce_with_baseline": ("advantages",),
    "grpo_clip": ("advantages", "old_log_probs", "cliprange"),
    "grpo_no_clip": ("advantages", "old_log_probs"),
    "gspo": ("advantages", "old_log_probs", "response_mask", "cliprange"),
}


def require_inputs(loss_type: str, **given: Any) -> None:
    """ValueError when ``loss_type`` is unknown, or when one of the inputs it reads is None in ``given``."""
    if loss_type not in POLICY_GRADIENT_INPUTS:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(POLICY_GRADIENT_INPUTS)}")
    missing = [name for name in POLICY_GRADIENT_INPUTS[loss_type] if given.get(name) is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}")


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    cliprange_high: float | None = None,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The handout's dispatcher: the per-token loss of ``loss_type``.

    policy_log_probs: (B, T); raw_rewards, advantages: (B, 1); old_log_probs, response_mask: (B, T) →
    loss (B, T). ``no_baseline`` needs raw_rewards; ``reinforce_with_baseline`` needs advantages;
    ``grpo_clip`` needs advantages, old_log_probs and cliprange (cliprange_high optional);
    ``grpo_no_clip`` needs advantages and old_log_probs; ``gspo`` needs advantages, old_log_probs,
    response_mask and cliprange (its own, far smaller than grpo_clip's; cliprange_high optional).
    A missing argument raises ValueError naming it.
    """
    given = dict(raw_rewards=raw_rewards, advantages=advantages, old_log_probs=old_log_probs)
    require_inputs(loss_type, **given, response_mask=response_mask, cliprange=cliprange)
    if loss_type == "no_baseline":
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if loss_type == "grpo_no_clip":
        return compute_grpo_no_clip_loss(advantages, policy_log_probs, old_log_probs)
    if loss_type == "grpo_clip":
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high)
    return compute_gspo_loss(advantages, policy_log_probs, old_log_probs, response_mask, cliprange, cliprange_high)


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
    objective = Objective(
        loss_type=loss_type,
        cliprange=cliprange,
        cliprange_high=cliprange_high,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        length_normalization=length_normalization,
    )
    given = dict(
        advantages=advantages, raw_rewards=raw_rewards, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs
    )
    t = {"response_mask": response_mask, **{k: v for k, v in given.items() if v is not None}}
    loss, metadata = microbatch_loss(objective, policy_log_probs, t, normalize_constant, gradient_accumulation_steps)
    loss.backward()
    return loss.detach(), metadata
