"""A group's rewards: each rollout graded, shaped (DAPO's overlong penalty) and normalised within its group,
the advantages GRPO trains on (CS336 A5 §7), and the statistics a step logs of them.

Shapes: ``N`` rollouts, groups of ``group_size`` consecutive ones (``G`` = N / group_size groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from a5core.grading.grader import grade_batch


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, Any], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[Any],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
    *,
    reward_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Reward each rollout and normalise within its group of ``group_size`` consecutive rollouts.

    rollout_responses, repeated_ground_truths: length N = n_groups · group_size, grouped consecutively.
    Returns (advantages (N,), raw_rewards (N,), metadata) with advantage = r − mean(group), divided by
    (unbiased std(group) + advantage_eps) when ``normalize_by_std``. ``reward_offsets`` (N,), if given,
    are added to the graded rewards first (e.g. DAPO's :func:`overlong_penalty`): raw_rewards and the
    reward statistics are then of the shaped rewards. Metadata: :func:`reward_statistics`, and the mean
    format and answer rewards.
    """
    n = len(rollout_responses)
    if len(repeated_ground_truths) != n:
        raise ValueError(f"{n} responses but {len(repeated_ground_truths)} ground truths")
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {n} rollout responses")
    scores = grade_batch(reward_fn, rollout_responses, repeated_ground_truths)
    raw_rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)
    if reward_offsets is not None:
        raw_rewards = raw_rewards + reward_offsets.to(torch.float32)
    grouped = raw_rewards.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + advantage_eps)
    advantages = advantages.flatten()
    metadata = reward_statistics(raw_rewards, advantages, group_size)
    metadata["format_reward_mean"] = sum(s["format_reward"] for s in scores) / n
    metadata["answer_reward_mean"] = sum(s["answer_reward"] for s in scores) / n
    return advantages, raw_rewards, metadata


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards (N,) → (G,) bool: whether each group's rewards are all equal (every advantage 0: it teaches
    nothing)."""
    grouped = rewards.view(-1, group_size)
    return grouped.max(dim=1).values == grouped.min(dim=1).values


def reward_statistics(rewards: torch.Tensor, advantages: torch.Tensor, group_size: int) -> dict[str, float]:
    """rewards, advantages (N,) → their mean, standard deviation (0 for one rollout), extremes, and the share of
    groups whose rewards are all equal (``frac_groups_all_equal``)."""
    several = len(rewards) > 1
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if several else 0.0,
        "reward_max": rewards.max().item(),
        "reward_min": rewards.min().item(),
        "advantage_mean": advantages.mean().item(),
        "advantage_std": advantages.std().item() if several else 0.0,
        "frac_groups_all_equal": uniform_groups(rewards, group_size).float().mean().item(),
    }


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens − buffer`` response tokens, then falling
    linearly to −``factor`` at ``max_tokens`` (and −``factor`` beyond).

    lengths: (N,) response token counts → (N,) rewards to add.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer
