"""The policy-gradient losses as small configured objects, one per ``loss_type``.

A GRPO run builds its loss once from its settings (:func:`policy_gradient_loss`); the loss carries its clip
ranges, says whether the rollouts' old log-probs must be computed before training
(``needs_old_log_probs``) and which of its own metrics a step reports (``metrics``). The formulas are
the pure functions of :mod:`a5core.losses`; :data:`POLICY_GRADIENT_LOSSES` is the one place where a
``loss_type`` name is read.

Shapes: ``B`` sequences, ``T`` token positions; log-probs and the response mask (B, T), advantages and
raw rewards (B, 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from a5core.losses import (
    compute_grpo_clip_loss,
    compute_grpo_no_clip_loss,
    compute_gspo_loss,
    compute_naive_policy_gradient_loss,
)

Metadata = dict[str, torch.Tensor]
Inputs = Mapping[str, Any]  # advantages, raw_rewards, old_log_probs, response_mask (a micro-batch's tensors)


@dataclass(frozen=True)
class PolicyGradientLoss:
    """A per-token policy-gradient loss. ``inputs``: the keys :meth:`per_token` reads (and "cliprange" where
    it clips), for the handout interface's error when one is missing; ``settings``: the GRPOConfig fields it is
    built from."""

    needs_old_log_probs: ClassVar[bool] = False
    clips: ClassVar[bool] = False  # a clipped loss's gradient is 0 where every token is clipped, legitimately
    metrics: ClassVar[tuple[str, ...]] = ()
    inputs: ClassVar[tuple[str, ...]] = ("advantages",)
    settings: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_settings(cls, settings: Any) -> PolicyGradientLoss:
        return cls(*(getattr(settings, name) for name in cls.settings))

    @classmethod
    def with_clip_range(cls, cliprange: float | None, cliprange_high: float | None) -> PolicyGradientLoss:
        """The loss with these clip ranges, if it clips (the handout's interface passes them to every loss)."""
        return cls()

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        """The (B, T) loss and the formula's metadata ("clipped" (B, T) bool where it clips, "ratio"), from
        ``inputs``: what the loss reads of advantages, raw_rewards, old_log_probs and response_mask."""
        raise NotImplementedError


@dataclass(frozen=True)
class NoBaseline(PolicyGradientLoss):
    """REINFORCE on the raw reward: −r·log π(o_t)."""

    inputs: ClassVar[tuple[str, ...]] = ("raw_rewards",)

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        return compute_naive_policy_gradient_loss(inputs["raw_rewards"], log_probs), {}


@dataclass(frozen=True)
class ReinforceWithBaseline(PolicyGradientLoss):
    """REINFORCE on the group-normalised advantage: −A·log π(o_t)."""

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        return compute_naive_policy_gradient_loss(inputs["advantages"], log_probs), {}


@dataclass(frozen=True)
class GRPONoClip(PolicyGradientLoss):
    """The importance-weighted loss −(π/π_old)·A, unclipped."""

    needs_old_log_probs: ClassVar[bool] = True
    inputs: ClassVar[tuple[str, ...]] = ("advantages", "old_log_probs")

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        return compute_grpo_no_clip_loss(inputs["advantages"], log_probs, inputs["old_log_probs"])


@dataclass(frozen=True)
class _Clipped(PolicyGradientLoss):
    """A loss whose ratio is clipped to [1 − cliprange, 1 + cliprange_high] (None: symmetric)."""

    cliprange: float
    cliprange_high: float | None = None
    needs_old_log_probs: ClassVar[bool] = True
    clips: ClassVar[bool] = True
    metrics: ClassVar[tuple[str, ...]] = ("clip_fraction",)

    @classmethod
    def with_clip_range(cls, cliprange: float | None, cliprange_high: float | None) -> PolicyGradientLoss:
        return cls(cliprange, cliprange_high)


@dataclass(frozen=True)
class GRPOClip(_Clipped):
    """GRPO-Clip: −min(ρ·A, clip(ρ)·A) per token, ρ = π/π_old; ``cliprange_high`` is DAPO's clip-higher."""

    inputs: ClassVar[tuple[str, ...]] = ("advantages", "old_log_probs", "cliprange")
    settings: ClassVar[tuple[str, ...]] = ("cliprange", "cliprange_high")

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        advantages, old_log_probs = inputs["advantages"], inputs["old_log_probs"]
        return compute_grpo_clip_loss(advantages, log_probs, old_log_probs, self.cliprange, self.cliprange_high)


@dataclass(frozen=True)
class GSPO(_Clipped):
    """GSPO: the clipped objective on the sequence's ratio, with its own (far smaller) clip ranges."""

    inputs: ClassVar[tuple[str, ...]] = ("advantages", "old_log_probs", "response_mask", "cliprange")
    settings: ClassVar[tuple[str, ...]] = ("gspo_cliprange", "gspo_cliprange_high")

    def per_token(self, log_probs: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, Metadata]:
        advantages, old_log_probs, mask = inputs["advantages"], inputs["old_log_probs"], inputs["response_mask"]
        return compute_gspo_loss(advantages, log_probs, old_log_probs, mask, self.cliprange, self.cliprange_high)


POLICY_GRADIENT_LOSSES: dict[str, type[PolicyGradientLoss]] = {
    "no_baseline": NoBaseline,
    "reinforce_with_baseline": ReinforceWithBaseline,
    "grpo_clip": GRPOClip,
    "grpo_no_clip": GRPONoClip,
    "gspo": GSPO,
}


LossType = Literal[tuple(POLICY_GRADIENT_LOSSES)]  # GRPOConfig.loss_type: the names above


def loss_class(loss_type: str) -> type[PolicyGradientLoss]:
    """The loss named ``loss_type``; ValueError naming the known ones."""
    if loss_type not in POLICY_GRADIENT_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(POLICY_GRADIENT_LOSSES)}")
    return POLICY_GRADIENT_LOSSES[loss_type]


def policy_gradient_loss(settings: Any) -> PolicyGradientLoss:
    """The loss of a GRPO config (its ``loss_type`` and the clip ranges that loss reads)."""
    return loss_class(settings.loss_type).from_settings(settings)


def users_of(setting: str) -> list[str]:
    """The loss types built from the GRPOConfig field ``setting``."""
    return [name for name, loss in POLICY_GRADIENT_LOSSES.items() if setting in loss.settings]
