"""Losses and their reductions, as pure functions with the CS336 A5 (2025) semantics.

Shapes: ``B`` sequences (rollouts) in a batch, ``T`` token positions, ``V`` vocabulary entries.
Nothing here holds state or calls ``backward``: the GRPO objective
(:func:`a5core.loops.grpo.objective.microbatch_loss`) and the SFT step (:mod:`a5core.policy.causal_lm`) build on
these. :func:`compute_policy_gradient_loss` is the one dispatch on the loss type, the handout's and the loop's.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

# The policy-gradient losses, by the name GRPOConfig.loss_type takes, and what each reads beside the policy's
# log-probs: the one table of their facts. A loss that reads old_log_probs weighs each token by the ratio
# π/π_old (it needs the log-probs of the policy that sampled); one that reads a cliprange clips that ratio (its
# gradient is 0, legitimately, where every token is clipped); one that reads raw_rewards has no baseline.
POLICY_GRADIENT_INPUTS: dict[str, tuple[str, ...]] = {
    "no_baseline": ("raw_rewards",),
    "reinforce_with_baseline": ("advantages",),
    "grpo_clip": ("advantages", "old_log_probs", "cliprange"),
    "grpo_no_clip": ("advantages", "old_log_probs"),
    "gspo": ("advantages", "old_log_probs", "response_mask", "cliprange"),
}
LossType = Literal[tuple(POLICY_GRADIENT_INPUTS)]
# Per-sequence mean over response tokens, their sum over a constant, or (DAPO) every response token of the
# train batch weighted alike (see docs/length_normalization.md).
LengthNormalization = Literal["masked_mean", "masked_normalize", "token_mean"]
LENGTH_NORMALIZATIONS: tuple[str, ...] = get_args(LengthNormalization)
# Estimators of KL(π ‖ π_ref) per sampled token (Schulman 2020, "Approximating KL divergence").
KLEstimator = Literal["k1", "k2", "k3"]


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``tensor`` over the positions where ``mask`` is true: sum(t·m) / sum(m).

    tensor, mask: same shape (mask bool or 0/1). Reduces over ``dim`` (all elements if None).
    A row with no true mask entry gives NaN (0/0), as the reference does.
    """
    mask = mask.to(tensor.dtype)
    masked = torch.where(mask.bool(), tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    if dim is None:
        return masked.sum() / mask.sum()
    return masked.sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float = 1.0, dim: int | None = None
) -> torch.Tensor:
    """Sum of ``tensor`` over the positions where ``mask`` is true, divided by a constant.

    tensor, mask: same shape. Reduces over ``dim`` (all elements if None).
    """
    masked = torch.where(mask.bool(), tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    total = masked.sum() if dim is None else masked.sum(dim=dim)
    return total / normalize_constant


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position.

    logits: (..., V) → entropy (...,). H = logsumexp(z) − Σ softmax(z)·z with z shifted by its max,
    so logits of ±1e4 lose no precision; entries of probability 0 (even at −inf) contribute 0.
    """
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted, dim=-1)
    weighted = torch.where(probs > 0, probs * shifted, torch.zeros((), dtype=probs.dtype, device=probs.device))
    return torch.logsumexp(shifted, dim=-1) - weighted.sum(dim=-1)


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """Per-token REINFORCE loss −A·log π(o_t).

    raw_rewards_or_advantages: (B, 1); policy_log_probs: (B, T) → loss (B, T).
    """
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO-Clip loss −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) with ρ = π/π_old.

    advantages: (B, 1); policy_log_probs, old_log_probs: (B, T) → loss (B, T), and metadata with
    "clipped" (B, T) bool: where the clipped term is the smaller one (the min chose it), and "ratio".
    ``cliprange_high`` None means ε_high = ε (the handout's symmetric clip); a larger ε_high is
    DAPO's "clip-higher", which lets low-probability tokens with positive advantage grow further.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(policy_log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def compute_grpo_no_clip_loss(
    advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance-weighted policy-gradient loss −ρ·A with ρ = π/π_old, unclipped.

    advantages: (B, 1); policy_log_probs, old_log_probs: (B, T) → loss (B, T), metadata "ratio".
    """
    ratio = torch.exp(policy_log_probs - old_log_probs)
    return -ratio * advantages, {"ratio": ratio.detach()}


def compute_gspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the clipped objective on the sequence-level importance ratio
    s = exp(mean_t(log π(o_t) − log π_old(o_t))), the length-normalised sum of token log-ratios.

    advantages: (B, 1); policy_log_probs, old_log_probs, response_mask: (B, T) → loss (B, T), in the
    paper's GSPO-token form: token t of sequence i carries −min(s_{i,t}·A, clip(s_{i,t}, 1−ε, 1+ε_high)·A)
    with s_{i,t} = sg[s_i] · π(o_t)/sg[π(o_t)], whose value is s_i and whose gradient is s_i·∇log π(o_t);
    reduced by the per-sequence mean (``masked_mean``) it is exactly the sequence-level objective and its
    gradient. Metadata: "clipped" (B, T) bool (a whole sequence is clipped or not), "ratio" (B, T): s_i.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    sequence_log_ratio = masked_mean(policy_log_probs - old_log_probs, response_mask, dim=-1).unsqueeze(-1)
    ratio = torch.exp(policy_log_probs - policy_log_probs.detach() + sequence_log_ratio.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def compute_kl_penalty(
    policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) at the sampled tokens, differentiable through π.

    policy_log_probs, ref_log_probs: (B, T) → (B, T). With r = log π_ref − log π: ``k1`` = −r (unbiased,
    can be negative), ``k2`` = r²/2, ``k3`` = exp(r) − r − 1 (unbiased, never negative: GRPO's and
    DeepSeekMath's choice).
    """
    r = ref_log_probs - policy_log_probs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    if estimator == "k3":
        return torch.exp(r) - r - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(get_args(KLEstimator))}")


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
    """The per-token loss of ``loss_type``: the handout's dispatcher, and the GRPO loop's.

    policy_log_probs: (B, T); raw_rewards, advantages: (B, 1); old_log_probs, response_mask: (B, T) →
    loss (B, T), and the formula's metadata ("clipped" (B, T) bool where the loss clips). ``no_baseline``
    needs raw_rewards; ``reinforce_with_baseline`` needs advantages; ``grpo_clip`` needs advantages,
    old_log_probs and cliprange (cliprange_high optional); ``grpo_no_clip`` needs advantages and old_log_probs;
    ``gspo`` needs advantages, old_log_probs, response_mask and cliprange (its own, far smaller than
    grpo_clip's; cliprange_high optional). A missing argument raises ValueError naming it.
    """
    given = dict(raw_rewards=raw_rewards, advantages=advantages, old_log_probs=old_log_probs)
    require_inputs(loss_type, **given, response_mask=response_mask, cliprange=cliprange)
    if loss_type == "no_baseline":  # −r·log π(o_t), on the raw reward
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":  # −A·log π(o_t), A the group-normalised advantage
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if loss_type == "grpo_no_clip":  # −ρ·A, ρ = π/π_old
        return compute_grpo_no_clip_loss(advantages, policy_log_probs, old_log_probs)
    if loss_type == "grpo_clip":  # −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A); ε_high: DAPO's clip-higher
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange, cliprange_high)
    # gspo: the same clip on the sequence's ratio s = exp(mean_t log ρ_t), each token carrying s
    return compute_gspo_loss(advantages, policy_log_probs, old_log_probs, response_mask, cliprange, cliprange_high)
