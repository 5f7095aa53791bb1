"""The objective of one GRPO micro-batch, in one function: :func:`microbatch_loss`.

Every option of the loss is one branch there, read top to bottom: the per-token policy-gradient loss
(``loss_type``: the ratio and its clip), the token weights (``tis_cap``, ``mask_truncated``), the KL penalty
(``kl_coef``, ``kl_estimator``) and the length normalisation. The formulas are the handout's pure functions
(:mod:`a5core.policy.losses`); the settings are the run's :class:`~a5core.loops.grpo.config.GRPOConfig`, read
where they are declared.

Shapes: ``b`` rollouts of a micro-batch, ``T`` token positions; log-probs and masks (b, T), advantages and
raw rewards (b, 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from a5core.loops.grpo.batch import MicroBatch
from a5core.loops.grpo.config import GRPOConfig
from a5core.policy.losses import compute_kl_penalty, compute_policy_gradient_loss, masked_mean, masked_normalize


def microbatch_loss(
    config: GRPOConfig,
    log_probs: torch.Tensor,
    mb: MicroBatch,
    token_sum_divisor: float | None,
    microbatch_mean_divisor: float,
    live: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch, ready for ``backward``, and its metadata.

    log_probs: (b, T) the policy's, with gradient; ``mb``: the micro-batch's tensors (the per-token log-probs
    where the options need them). ``token_sum_divisor``: what each sequence's summed token losses are divided by
    under ``masked_normalize`` and ``token_mean`` (:func:`token_sum_divisor_for`). ``microbatch_mean_divisor``: what
    the micro-batch's mean loss is divided by, so that the micro-batches' losses add up to the train batch's
    mean. Not ``live`` (an empty share of a rank, run for FSDP2's collectives on stand-in rollouts at advantage
    0): no KL term, so that its gradient is 0. Metadata (:func:`loss_metrics`): ``loss``, ``clip_fraction``
    (the share of response tokens whose clipped term the min chose, where the loss clips) and ``kl`` (the mean
    per-token KL, with a penalty).
    """
    mask = mb.response_mask
    metadata: dict[str, torch.Tensor] = {}

    # 1. The per-token policy-gradient loss of loss_type (compute_policy_gradient_loss, a branch each): REINFORCE
    # on the raw reward or on the group-normalised advantage, or the importance ratio ρ = π/π_old, clipped or
    # not; gspo clips the sequence's ratio, with a clip range of its own.
    gspo = config.loss_type == "gspo"
    per_token, formula = compute_policy_gradient_loss(
        log_probs,
        config.loss_type,
        raw_rewards=mb.raw_rewards,
        advantages=mb.advantages,
        old_log_probs=mb.old_log_probs,
        cliprange=config.gspo_cliprange if gspo else config.cliprange,
        cliprange_high=config.gspo_cliprange_high if gspo else config.cliprange_high,
        response_mask=mask,
    )
    if "clipped" in formula:
        metadata["clip_fraction"] = masked_mean(formula["clipped"].float(), mask)

    # 2. Token weights (no gradient). The truncated importance weight min(π_old/π_engine, tis_cap) corrects for
    # the engine sampling from a slightly different distribution (or, one step off, older weights) than the
    # policy computes; DAPO's mask_truncated gives the rollouts cut at max_tokens no policy gradient.
    weights = None
    if config.tis_cap is not None:
        weights = torch.exp(mb.old_log_probs - mb.engine_log_probs).clamp(max=config.tis_cap)
    if config.mask_truncated:
        kept = (~mb.truncated).to(torch.float32).view(-1, 1)
        weights = kept if weights is None else weights * kept
    if weights is not None:
        per_token = per_token * weights.detach()

    # 3. A KL penalty to the frozen starting policy, on every response token (masked ones too).
    if config.kl_coef and live:
        kl = compute_kl_penalty(log_probs, mb.ref_log_probs, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        metadata["kl"] = masked_mean(kl.detach(), mask)

    # 4. Length normalisation: each sequence's summed token losses over its own length (masked_mean), or over one
    # divisor for all (masked_normalize: max_tokens; token_mean: the train batch's tokens per sequence, which
    # weighs every token of the train batch alike); then the micro-batch mean, over its divisor.
    if config.length_normalization == "masked_mean":
        per_sequence = masked_mean(per_token, mask, dim=-1)
    else:
        per_sequence = masked_normalize(per_token, mask, token_sum_divisor, dim=-1)
    loss = per_sequence.mean() / microbatch_mean_divisor
    metadata["loss"] = loss.detach()
    return loss, metadata


def loss_metrics(config: GRPOConfig) -> tuple[str, ...]:
    """The metadata of :func:`microbatch_loss` a step reports besides the loss: ``clip_fraction`` where the loss
    clips, ``kl`` with a KL penalty."""
    return (*(("clip_fraction",) if config.clips else ()), *(("kl",) if config.kl_coef else ()))


def token_sum_divisor_for(
    config: GRPOConfig, response_lengths: Sequence[int], truncated: Sequence[bool]
) -> float | None:
    """What each sequence's summed token losses are divided by, for a train batch whose rollouts have
    ``response_lengths`` tokens and were cut at max_tokens or not (``truncated``): max_tokens under
    ``masked_normalize``; under DAPO's ``token_mean`` the tokens per sequence that train (a masked rollout's do
    not); None under ``masked_mean``, which divides each sequence by its own length."""
    if config.length_normalization == "masked_mean":
        return None
    if config.length_normalization == "masked_normalize":
        return float(config.sampling.max_tokens)
    masked = [config.mask_truncated and cut for cut in truncated]
    trained = sum(n for n, skip in zip(response_lengths, masked, strict=True) if not skip)
    return max(trained, 1) / len(response_lengths)
