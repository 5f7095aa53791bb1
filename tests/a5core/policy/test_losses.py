"""Hand-computed values for each loss primitive (CS336 A5 semantics)."""

import math

import pytest
import torch

from a5core import (
    compute_entropy,
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
