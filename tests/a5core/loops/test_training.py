"""The setup and the optimizer step the SFT and GRPO loops share (a5core.loops.training): a step's gradient
accumulated from zero over its micro-batches, each mean divided so that they add up to the batch mean, and an
update refused before it moves the weights when the step diverged."""

from __future__ import annotations

import math

import pytest
import torch

from a5core.loops.sft import SFTConfig
from a5core.loops.training import prepare
from a5core.runtime.checkpoint import NonFiniteLossError
from a5core.runtime.guards import DivergenceError, DivergenceGuard


def trained(**settings):
    torch.manual_seed(0)
    return prepare(torch.nn.Linear(4, 1), SFTConfig(**settings), DivergenceGuard(fixed_scale=True))


def test_micro_batch_means_divided_by_their_divisors_add_up_to_the_batch_mean():
    policy = trained()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    for p in policy.params:
        p.grad = torch.ones_like(p)  # a last step's gradient: accumulation starts from zero
    divisors = []
    for index, divisor in policy.accumulating(6, [[0, 1], [2, 3, 4], [5], []]):
        divisors.append(divisor)
        rows = index or [0]  # an empty share's stand-in, at weight 0
        loss = ((policy.model(x[rows]) - y[rows]) ** 2).mean(dim=1).mean() / divisor
        (loss * bool(index)).backward()
    assert divisors == [3.0, 2.0, 6.0, 6.0]  # len(batch) / len(micro): an empty one counts as one
    accumulated = [p.grad.clone() for p in policy.params]
    policy.optimizer.zero_grad()
    ((policy.model(x) - y) ** 2).mean(dim=1).mean().backward()
    for got, want in zip(accumulated, (p.grad for p in policy.params), strict=True):
        torch.testing.assert_close(got, want)


def test_an_update_is_refused_when_the_step_is_not_finite_or_diverged(tmp_path):
    policy = trained(grad_clip=0.5)
    before = [p.detach().clone() for p in policy.params]
    for p in policy.params:
        p.grad = torch.full_like(p, 10.0)
    assert policy.clip_gradients().item() == pytest.approx(math.sqrt(5) * 10)  # the norm before clipping
    with pytest.raises(NonFiniteLossError, match=r"SFT step 2 of 3: loss nan, .* still holds the last good step"):
        policy.update("SFT step 2 of 3", math.nan, 1.0, tmp_path)
    policy.update("SFT step 1 of 3", 1.0, 1.0, tmp_path)
    with pytest.raises(DivergenceError, match="SFT step 3 of 3: the run diverged"):
        policy.update("SFT step 3 of 3", 100.0, 1.0, tmp_path)
    assert all(not torch.equal(a, p) for a, p in zip(before, policy.params, strict=True))  # the one good update
