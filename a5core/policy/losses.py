"""Losses and their reductions, as pure functions with the CS336 A5 (2025) semantics.

Shapes: ``B`` sequences (rollouts) in a batch, ``T`` token positions, ``V`` vocabulary entries.
Nothing here holds state or calls ``backward``, nor imports the loops: the GRPO objective
(:func:`a5core.loops.grpo.objective.microbatch_loss`) and the SFT step (:mod:`a5core.policy.causal_lm`) build on these.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

# The policy-gradient losses, by the name GRPOConfig.loss_type takes (see POLICY_GRADIENT_INPUTS).
LossType = Literal["no_baseline", "reinforce_with_baseline", "grpo_clip", "grpo_no_clip", "gspo"]
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
