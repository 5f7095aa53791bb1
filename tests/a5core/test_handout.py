"""The handout's GRPO micro-batch train step (a5core.handout), a front on the loop's objective: hand values, how
each length normalisation weighs a token, and its refusals."""

import pytest
import torch

from a5core import grpo_microbatch_train_step

MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_length_normalization_per_token_weights():
    """docs/length_normalization.md: masked_mean weighs a token by −A/(B·|o|), masked_normalize by −A/(B·L)."""
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


def test_grpo_microbatch_train_step_masked_mean():
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -9.0, -9.0]], requires_grad=True)
    adv = torch.tensor([[2.0], [-1.0]])
    loss, meta = grpo_microbatch_train_step(logp, MASK, 4, "reinforce_with_baseline", advantages=adv)
    # seq0: mean(2·1, 2·2) = 3; seq1: mean(−1·3) = −3 → batch mean 0 → /4
    assert loss.item() == pytest.approx(0.0) and meta["loss"].item() == pytest.approx(0.0)
    expected_grad = torch.tensor([[-2.0 / 2, -2.0 / 2, 0.0], [1.0 / 1, 0.0, 0.0]]) / (2 * 4)
    assert torch.allclose(logp.grad, expected_grad)


def test_grpo_microbatch_train_step_masked_normalize_and_clip_fraction():
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]])).requires_grad_()
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0], [1.0]])
    loss, meta = grpo_microbatch_train_step(
        logp,
        MASK,
        1,
        "grpo_clip",
        advantages=adv,
        old_log_probs=old,
        cliprange=0.2,
        length_normalization="masked_normalize",
        normalize_constant=3.0,
    )
    # per-token losses: seq0 [−1.2 (clipped), −1.0], seq1 [−0.5] → sums −2.2/3, −0.5/3 → mean
    assert loss.item() == pytest.approx((-2.2 / 3 - 0.5 / 3) / 2, rel=1e-6)
    assert meta["clip_fraction"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="needs normalize_constant"):
        grpo_microbatch_train_step(
            logp, MASK, 1, "reinforce_with_baseline", advantages=adv, length_normalization="masked_normalize"
        )
    with pytest.raises(ValueError, match="unknown length_normalization 'sum'"):
        grpo_microbatch_train_step(logp, MASK, 1, "reinforce_with_baseline", advantages=adv, length_normalization="sum")
