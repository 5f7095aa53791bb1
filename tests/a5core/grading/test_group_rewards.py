"""A group's rewards (a5core.grading.group_rewards): graded, normalised within each group, and their statistics."""

import math

import pytest
import torch

from a5core import compute_group_normalized_rewards
from a5core.grading.group_rewards import overlong_penalty, reward_statistics, uniform_groups


def reward_exact(response, ground_truth):
    ok = float(response == ground_truth)
    return {"format_reward": 1.0, "answer_reward": ok, "reward": ok}


def test_group_normalized_rewards_with_and_without_std():
    responses, truths = ["1", "0", "1", "1"], ["1", "1", "1", "1"]
    adv, raw, meta = compute_group_normalized_rewards(reward_exact, responses, truths, 2, 1e-6, False)
    assert raw.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert meta["reward_mean"] == 0.75 and meta["frac_groups_all_equal"] == 0.5
    adv, _, _ = compute_group_normalized_rewards(reward_exact, responses, truths, 2, 1e-6, True)
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_normalized_rewards_uses_the_real_grader():
    responses = [
        "</think> <answer> \\frac{1}{2} </answer>",
        "</think> <answer> 0.5 </answer>",
        "no tags",
        "</think> <answer> 3 </answer>",
    ]
    from a5core import r1_zero_reward_fn

    adv, raw, meta = compute_group_normalized_rewards(r1_zero_reward_fn, responses, ["1/2"] * 4, 4, 1e-6, False)
    assert raw.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert adv.tolist() == [0.5, 0.5, -0.5, -0.5]
    assert meta["format_reward_mean"] == 0.75


def test_group_normalized_rewards_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size 3 does not divide the 4"):
        compute_group_normalized_rewards(reward_exact, ["a"] * 4, ["a"] * 4, 3, 1e-6, True)


def test_uniform_groups_and_the_statistics_of_rewards_and_advantages():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    advantages = torch.tensor([0.0, 0.0, -0.5, 0.5, 0.0, 0.0])
    assert uniform_groups(rewards, 2).tolist() == [True, False, True]
    stats = reward_statistics(rewards, advantages, 2)
    assert stats["frac_groups_all_equal"] == pytest.approx(2 / 3)
    assert (stats["reward_mean"], stats["reward_max"], stats["reward_min"]) == (0.5, 1.0, 0.0)
    assert stats["reward_std"] == pytest.approx(rewards.std().item())
    assert (stats["advantage_mean"], stats["advantage_std"]) == (0.0, pytest.approx(advantages.std().item()))
    one = reward_statistics(torch.tensor([1.0]), torch.tensor([0.0]), 1)
    assert (one["reward_std"], one["advantage_std"], one["frac_groups_all_equal"]) == (0.0, 0.0, 1.0)


def test_overlong_penalty_is_dapos_soft_punishment():
    """0 up to max_tokens − buffer, then linear to −factor at max_tokens."""
    lengths = torch.tensor([10, 16, 17, 18, 20, 24])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0] * 6
