"""The divergence guard (a5core.runtime.guards): a diverged run stops before its update, with the step named."""

from __future__ import annotations

import pytest

from a5core.runtime.guards import DivergenceError, DivergenceGuard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_vanishing_gradient_under_a_nonzero_loss_stops_the_run():
    guard = DivergenceGuard(fixed_scale=False)
    guard.check("GRPO step 1 of 3", 0.0, 0.0)  # nothing to learn from (uniform groups): fine
    guard.check("GRPO step 1 of 3", -0.4, 2.0)
    with pytest.raises(DivergenceError, match=r"^GRPO step 2 of 3: the run diverged \(gradient norm 0 under a loss"):
        guard.check("GRPO step 2 of 3", 267.0, 0.0)
    DivergenceGuard(fixed_scale=False, vanishing_gradient=False).check("a clipped loss", 0.3, 0.0)


def test_a_fixed_scale_loss_may_fall_and_wobble_but_not_explode():
    guard = DivergenceGuard(fixed_scale=True)
    for loss in (35.0, 20.0, 60.0, 3.0, 349.0):  # under 10 times the first
        guard.check("SFT", loss, 1.0)
    with pytest.raises(DivergenceError, match=r"loss 351, over 10 times the first step's 35"):
        guard.check("SFT step 6 of 8", 351.0, 1.0)
    DivergenceGuard(fixed_scale=False).check("GRPO", 351.0 * 1000, 1.0)  # a signed loss has no such scale
