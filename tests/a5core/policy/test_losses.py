"""Hand-computed values for each loss primitive (CS336 A5 semantics)."""

import math

import pytest
import torch

from a5core import (
    compute_entropy,
    compute_group_normalized_rewards,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    masked_mean,
    masked_normalize,
)

T = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[True, True, False], [False, False, False]])


def test_masked_mean():
    row = masked_mean(T, M, dim=-1)
    assert row[0].item() == 1.5 and math.isnan(row[1].item())  # a row without mask is NaN, like the reference
    assert masked_mean(T, M).item() == 1.5
    col = masked_mean(T, M, dim=0)
    assert col[:2].tolist() == [1.0, 2.0] and math.isnan(col[2].item())
    assert masked_mean(T, M.float(), dim=1)[0].item() == 1.5  # 0/1 float masks work too


def test_masked_ignores_non_finite_values_under_the_mask():
    t = torch.tensor([[1.0, float("-inf")]])
    m = torch.tensor([[True, False]])
    assert masked_mean(t, m).item() == 1.0 and masked_normalize(t, m, 2.0).item() == 0.5


def test_masked_normalize():
    assert masked_normalize(T, M, 2.0, dim=-1).tolist() == [1.5, 0.0]
    assert masked_normalize(T, M, 2.0).item() == 1.5
    assert masked_normalize(T, M).item() == 3.0
    assert masked_normalize(T, M, 4.0, dim=0).tolist() == [0.25, 0.5, 0.0]


def test_compute_entropy_hand_values_and_extreme_logits():
    uniform = torch.zeros(2, 3, 4)
    assert torch.allclose(compute_entropy(uniform), torch.full((2, 3), math.log(4)))
    p = torch.tensor([0.25, 0.75])
    assert compute_entropy(torch.log(p)).item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)
    huge = torch.tensor([[1e4, -1e4, 0.0], [1e4, 1e4, -1e4]])
    h = compute_entropy(huge)
    assert torch.isfinite(h).all()
    assert h[0].item() == pytest.approx(0.0, abs=1e-6) and h[1].item() == pytest.approx(math.log(2), abs=1e-6)
    masked = compute_entropy(torch.tensor([0.0, 0.0, float("-inf")]))
    assert masked.item() == pytest.approx(math.log(2), abs=1e-6)


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


def test_naive_policy_gradient_loss():
    a = torch.tensor([[2.0], [-1.0]])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    assert compute_naive_policy_gradient_loss(a, logp).tolist() == [[2.0, 4.0], [-0.5, -3.0]]


def test_grpo_clip_loss_hand_values():
    # ratios 1.5 and 0.5 against A = +1 and -1, clip 0.2.
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    adv = torch.tensor([[1.0], [-1.0]])
    loss, meta = compute_grpo_clip_loss(adv, logp, old, 0.2)
    # A=+1: min(1.5, 1.2)=1.2 (clipped), min(0.5, 0.8)=0.5;  A=-1: min(-1.5,-1.2)=-1.5, min(-0.5,-0.8)=-0.8 (clipped)
    assert loss.flatten().tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8], rel=1e-6)
    assert meta["clipped"].tolist() == [[True, False], [False, True]]


def test_policy_gradient_dispatch_and_errors():
    logp = torch.tensor([[-1.0, -2.0]])
    raw, adv = torch.tensor([[3.0]]), torch.tensor([[0.5]])
    assert compute_policy_gradient_loss(logp, "no_baseline", raw_rewards=raw)[0].tolist() == [[3.0, 6.0]]
    assert compute_policy_gradient_loss(logp, "reinforce_with_baseline", advantages=adv)[0].tolist() == [[0.5, 1.0]]
    loss, meta = compute_policy_gradient_loss(logp, "grpo_clip", advantages=adv, old_log_probs=logp, cliprange=0.2)
    assert loss.tolist() == [[-0.5, -0.5]] and not meta["clipped"].any()
    with pytest.raises(ValueError, match="'no_baseline' needs raw_rewards"):
        compute_policy_gradient_loss(logp, "no_baseline", advantages=adv)
    with pytest.raises(ValueError, match="'grpo_clip' needs old_log_probs, cliprange"):
        compute_policy_gradient_loss(logp, "grpo_clip", advantages=adv)
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        compute_policy_gradient_loss(logp, "ppo", advantages=adv)


def test_length_normalization_per_token_weights():
    """docs/length_normalization.md: masked_mean weighs a token by −A/(B·|o|), masked_normalize by −A/(B·L)."""
    from a5core.handout import grpo_microbatch_train_step

    lengths, width, max_tokens = (2, 8), 8, 16.0
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    advantages = torch.tensor([[1.0], [1.0]])
    weights = {}
    for reduction in ("masked_mean", "masked_normalize"):
        log_probs = torch.full((2, width), -1.0, requires_grad=True)
        grpo_microbatch_train_step(
            log_probs,
            mask,
            1,
            "reinforce_with_baseline",
            advantages=advantages,
            length_normalization=reduction,
            normalize_constant=max_tokens,
        )
        weights[reduction] = log_probs.grad
    short, long = weights["masked_mean"][0, 0].item(), weights["masked_mean"][1, 0].item()
    assert short == pytest.approx(-1 / (2 * 2)) and long == pytest.approx(-1 / (2 * 8))
    assert short / long == pytest.approx(
        4.0
    )  # a token of the 2-token answer moves 4× as much as one of the 8-token answer
    assert torch.allclose(weights["masked_normalize"][mask], torch.full((10,), -1 / (2 * max_tokens)))
    assert (weights["masked_mean"][~mask] == 0).all() and (weights["masked_normalize"][~mask] == 0).all()


def test_the_handouts_formulas_import_nothing_of_the_loops():
    """a5core.policy.losses is the handout's functional API, pure formulas on tensors: the loops build on it, and it
    imports no a5core module at all."""
    import ast
    from pathlib import Path

    import a5core.policy.losses

    tree = ast.parse(Path(a5core.policy.losses.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported if name.startswith("a5core")}
