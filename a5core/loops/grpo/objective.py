"""The objective of one GRPO micro-batch, in one function: :func:`microbatch_loss`.

Every option of the loss is one branch there, read top to bottom: the per-token policy-gradient loss
(``loss_type``: the ratio and its clip), the token weights (``tis_cap``, ``mask_truncated``), the KL penalty
(``kl_coef``, ``kl_estimator``) and the length normalisation. The formulas are the handout's pure functions
(:mod:`a5core.policy.losses`); :class:`Objective` is the handful of settings they read, taken from a GRPOConfig.

Shapes: ``b`` rollouts of a micro-batch, ``T`` token positions; log-probs and masks (b, T), advantages and
raw rewards (b, 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from a5core.policy.losses import (
    KLEstimator,
    LengthNormalization,
    LossType,
    compute_grpo_clip_loss,
    compute_grpo_no_clip_loss,
    compute_gspo_loss,
    compute_kl_penalty,
    compute_naive_policy_gradient_loss,
    masked_mean,
    masked_normalize,
)

RATIO_LOSSES = ("grpo_clip", "grpo_no_clip", "gspo")  # weigh each token by π/π_old: they need the old log-probs
CLIPPED_LOSSES = ("grpo_clip", "gspo")  # a clipped loss's gradient is 0 where every token is clipped, legitimately


@dataclass(frozen=True)
class Objective:
    """The settings of a micro-batch's loss (GRPOConfig.objective builds it). ``cliprange`` and
    ``cliprange_high`` are the clip range of ``loss_type``: grpo_clip's, or gspo's own (far smaller, on the
    sequence's ratio); ``max_tokens``: the divisor of ``masked_normalize``."""

    loss_type: LossType = "reinforce_with_baseline"
    cliprange: float | None = None
    cliprange_high: float | None = None
    tis_cap: float | None = None
    mask_truncated: bool = False
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    length_normalization: LengthNormalization = "masked_mean"
    max_tokens: int | None = None

    @property
    def needs_old_log_probs(self) -> bool:
        """Whether a step computes the rollouts' log-probs under the policy that sampled them (π_old): for the
        ratio losses, and for the importance weight."""
        return self.loss_type in RATIO_LOSSES or self.tis_cap is not None

    @property
    def clips(self) -> bool:
        return self.loss_type in CLIPPED_LOSSES

    @property
    def uses_advantages(self) -> bool:
        """False for ``no_baseline``, the loss on the raw rewards."""
        return self.loss_type != "no_baseline"

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metadata of :func:`microbatch_loss` a step reports (besides the loss)."""
        return (*(("clip_fraction",) if self.clips else ()), *(("kl",) if self.kl_coef else ()))


def microbatch_loss(
    objective: Objective,
    log_probs: torch.Tensor,
    t: Mapping[str, torch.Tensor],
    normalizer: float | None,
    share: float,
    live: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, ready for ``backward``, and its metadata.

    log_probs: (b, T) the policy's, with gradient. ``t``: the micro-batch's tensors: response_mask (b, T);
    advantages, raw_rewards (b, 1); old_log_probs, engine_log_probs, ref_log_probs (b, T) where the options
    need them; truncated (b, 1) bool. ``normalizer``: the length normalisation's divisor (:func:`normalizer`).
    ``share``: the micro-batch mean is divided by it, so that the micro-batches' losses add up to the train
    batch's mean. Not ``live`` (an empty share of a rank, run for FSDP2's collectives on stand-in rollouts at
    advantage 0): no KL term, so that its gradient is 0. Metadata: ``loss``, ``clip_fraction`` (the share of
    response tokens whose clipped term the min chose, where the loss clips) and ``kl`` (the mean per-token KL,
    with a penalty).
    """
    o, mask = objective, t["response_mask"]
    metadata: dict[str, torch.Tensor] = {}

    # 1. The per-token policy-gradient loss: REINFORCE, or the importance ratio ρ = π/π_old (clipped or not).
    if o.loss_type == "no_baseline":  # −r·log π(o_t), on the raw reward
        per_token = compute_naive_policy_gradient_loss(t["raw_rewards"], log_probs)
    elif o.loss_type == "reinforce_with_baseline":  # −A·log π(o_t), A the group-normalised advantage
        per_token = compute_naive_policy_gradient_loss(t["advantages"], log_probs)
    elif o.loss_type == "grpo_no_clip":  # −ρ·A
        per_token, _ = compute_grpo_no_clip_loss(t["advantages"], log_probs, t["old_log_probs"])
    elif o.loss_type == "grpo_clip":  # −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A); ε_high: DAPO's clip-higher
        per_token, formula = compute_grpo_clip_loss(
            t["advantages"], log_probs, t["old_log_probs"], o.cliprange, o.cliprange_high
        )
        metadata["clip_fraction"] = masked_mean(formula["clipped"].float(), mask)
    else:  # gspo: the same clip on the sequence's ratio s = exp(mean_t log ρ_t), each token carrying s
        per_token, formula = compute_gspo_loss(
            t["advantages"], log_probs, t["old_log_probs"], mask, o.cliprange, o.cliprange_high
        )
        metadata["clip_fraction"] = masked_mean(formula["clipped"].float(), mask)

    # 2. Token weights (no gradient). The truncated importance weight min(π_old/π_engine, tis_cap) corrects for
    # the engine sampling from a slightly different distribution (or, one step off, older weights) than the
    # policy computes; DAPO's mask_truncated gives the rollouts cut at max_tokens no policy gradient.
    weights = None
    if o.tis_cap is not None:
        weights = torch.exp(t["old_log_probs"] - t["engine_log_probs"]).clamp(max=o.tis_cap)
    if o.mask_truncated:
        kept = (~t["truncated"]).to(torch.float32).view(-1, 1)
        weights = kept if weights is None else weights * kept
    if weights is not None:
        per_token = per_token * weights.detach()

    # 3. A KL penalty to the frozen starting policy, on every response token (masked ones too).
    if o.kl_coef and live:
        kl = compute_kl_penalty(log_probs, t["ref_log_probs"], o.kl_estimator)
        per_token = per_token + o.kl_coef * kl
        metadata["kl"] = masked_mean(kl.detach(), mask)

    # 4. Length normalisation: each sequence's summed token losses over its own length (masked_mean), or over one
    # divisor for all (masked_normalize: max_tokens; token_mean: the train batch's tokens per sequence, which
    # weighs every token of the train batch alike); then the micro-batch mean, divided by its share.
    if o.length_normalization == "masked_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
    else:
        per_sequence = masked_normalize(per_token, mask, normalizer, dim=-1)
    loss = per_sequence.mean() / share
    metadata["loss"] = loss.detach()
    return loss, metadata


def normalizer(objective: Objective, response_lengths: Sequence[int], truncated: Sequence[bool]) -> float | None:
    """The length normalisation's divisor for a train batch whose rollouts have ``response_lengths`` tokens and
    were cut at max_tokens or not (``truncated``): max_tokens under ``masked_normalize``; under DAPO's
    ``token_mean`` the tokens per sequence that train (a masked rollout's do not); None under ``masked_mean``,
    which divides each sequence by its own length."""
    if objective.length_normalization == "masked_mean":
        return None
    if objective.length_normalization == "masked_normalize":
        return float(objective.max_tokens)
    masked = [objective.mask_truncated and cut for cut in truncated]
    trained = sum(n for n, skip in zip(response_lengths, masked, strict=True) if not skip)
    return max(trained, 1) / len(response_lengths)
