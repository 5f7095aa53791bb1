"""Guards of the training loops: a run that has diverged stops, a run that cannot learn says so.

- :class:`DivergenceGuard`, asked at every optimizer step before the update (and so before a checkpoint
  keeps it): a finite loss can still be a diverged run. It stops the run with :class:`DivergenceError`
  when the gradient vanishes under a nonzero loss (weights driven into saturation: a learning rate of 1e6
  gave loss 35 → 267 with a gradient norm of exactly 0), or, for a loss on a fixed scale (cross-entropy,
  never negative), when the loss exceeds ``factor`` times the first loss the guard saw (a healthy run's loss
  falls from its starting model's).
- :func:`warn_if_groups_are_uniform`: GRPO sampling greedily (temperature 0) draws every rollout of a
  question alike, so every group's rewards are equal, every advantage is 0, and the run trains on nothing.
- :class:`LearningSignal`: a GRPO step whose groups all have equal rewards has no learning signal (every
  advantage is 0: it trains nothing); a run with several such steps in a row is warned of.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)


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


def warn_if_groups_are_uniform(temperature: float, group_size: int) -> None:
    """Warn that greedy GRPO sampling (``temperature`` 0) makes every group of ``group_size`` uniform."""
    if temperature == 0 and group_size > 1:
        logger.warning(
            "GRPO at temperature 0 samples the %d rollouts of a question alike: every group's rewards are equal, "
            "every advantage is 0, and the run trains on nothing; sample with a temperature > 0 (the handout's "
            "1.0)",
            group_size,
        )


class LearningSignal:
    """Which GRPO steps had no learning signal: every group's rewards equal (``frac_groups_all_equal`` 1), so
    every advantage is 0 and the step trained nothing. ``uses_advantages`` False (a loss on the raw rewards,
    no_baseline): a uniform group still has a gradient unless its rewards are 0. A warning after ``patience``
    such steps in a row (and after each ``patience`` more)."""

    def __init__(self, uses_advantages: bool, patience: int = 3) -> None:
        self.uses_advantages, self.patience, self.streak = uses_advantages, patience, 0

    def none(self, metrics: dict[str, float]) -> bool:
        """Whether the step of ``metrics`` had no learning signal."""
        uniform = metrics.get("frac_groups_all_equal") == 1.0
        return uniform and (self.uses_advantages or metrics.get("reward_max") == 0.0)

    def observe(self, step: int, total: int, metrics: dict[str, float]) -> str:
        """Note step ``step``'s signal; returns what its status line says of it ("" when it had one)."""
        if not self.none(metrics):
            self.streak = 0
            return ""
        self.streak += 1
        if self.streak % self.patience == 0:
            logger.warning(
                "GRPO steps %d-%d of %d: no learning signal in %d steps in a row: in each, every group's rewards were "
                "equal (all its questions solved by every rollout, or by none), so every advantage was 0 and nothing "
                "was trained. More rollouts per question (group_size), problems nearer the model's level, or "
                "question_sampling: learnable give groups whose rewards differ",
                step - self.streak + 1,
                step,
                total,
                self.streak,
            )
        return "no learning signal (every group's rewards equal)"
