"""The training loops' guard against divergence: :class:`DivergenceGuard`, asked at every optimizer step before
the update (and so before a checkpoint keeps it), because a finite loss can still be a diverged run. It stops the
run with :class:`DivergenceError` when the gradient vanishes under a nonzero loss (weights driven into
saturation: a learning rate of 1e6 gave loss 35 → 267 with a gradient norm of exactly 0), or, for a loss on a
fixed scale (cross-entropy, never negative), when the loss exceeds ``factor`` times the first loss the guard saw
(a healthy run's loss falls from its starting model's). A GRPO run that cannot learn says so on its own
(:mod:`a5core.loops.grpo.learning_signal`).
"""

from __future__ import annotations

import math


class DivergenceError(FloatingPointError):
    """A training step's loss or gradient says the run diverged; the step's update was not applied."""


class DivergenceGuard:
    """Stops a diverged run before its update (see the module docstring).

    ``fixed_scale``: the loss is never negative and its scale is set by the data (cross-entropy), so a loss
    ``factor`` times the first one is an explosion; a signed loss (GRPO's) is checked for a vanishing gradient
    alone. ``vanishing_gradient``: False where a zero gradient under a nonzero loss is legitimate (every token
    of a clipped loss clipped).
    """

    def __init__(self, fixed_scale: bool, vanishing_gradient: bool = True, factor: float = 10.0) -> None:
        self.fixed_scale, self.vanishing_gradient, self.factor = fixed_scale, vanishing_gradient, factor
        self.first_loss: float | None = None

    def check(self, where: str, loss: float, grad_norm: float) -> None:
        """DivergenceError naming ``where`` (e.g. "SFT step 3 of 8") when ``loss`` and ``grad_norm`` (finite:
        the loops refuse non-finite values first) say the run diverged."""
        if self.vanishing_gradient and grad_norm == 0 and loss != 0:
            reason = f"gradient norm 0 under a loss of {loss:.4g}: the weights are saturated"
        elif self.fixed_scale and self.first_loss is not None and loss > self.factor * max(self.first_loss, 1e-3):
            reason = f"loss {loss:.4g}, over {self.factor:g} times the first step's {self.first_loss:.4g}"
        else:
            if self.first_loss is None and math.isfinite(loss):
                self.first_loss = loss
            return
        raise DivergenceError(
            f"{where}: the run diverged ({reason}); training stopped before the update. Its last checkpoint may "
            "already hold diverging weights: lower learning_rate (a new run) rather than resume it"
        )
