"""A GRPO run that cannot learn says so: a step whose groups all have equal rewards has no learning signal (every
advantage is 0: it trains nothing).

- :func:`warn_if_groups_are_uniform`: sampling greedily (temperature 0) draws every rollout of a question alike,
  so every group's rewards are equal, every advantage is 0, and the run trains on nothing.
- :class:`LearningSignal`: a run with several steps in a row without a learning signal is warned of.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__package__)  # the package's: every GRPO line is "a5core.loops.grpo"'s


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
