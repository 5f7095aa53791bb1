"""Which questions a GRPO step or an EI round samples: uniformly (the handout), or by difficulty.

A question's difficulty is its pass rate p under the policy: the share of correct samples, from a table
estimated before the run (``flows.difficulty``) and refreshed from the run's own rollouts (no extra
generation): every ``refresh_every`` steps each question sampled since the last refresh takes the pass
rate its latest group showed. Questions the table does not hold count as unknown. Modes:

- ``uniform``: every question alike (the handout; draws exactly as before this module existed);
- ``learnable``: only questions with 0 < p < 1 or unknown ones; a question every sample solves, or none
  does, gives all its rollouts the same reward and so no gradient (GRPO) and nothing (EI: all or none kept).
  When too few are left, the rest of the step is drawn at random from the others, so that their
  pass rates, perhaps stale (a table made under a weaker policy), are measured again;
- ``weighted``: every question, weighted by p(1 − p) + 0.01 (unknown: as p = ½), so questions near
  p = ½, whose groups vary most, come most often;
- ``curriculum``: by ``Problem.level`` (the digit count of the arithmetic task, MATH's 1–5): only questions
  up to the current level (the lowest at first); once a step's rollouts on the current level are correct
  at least ``threshold`` of the time, the next level joins. Too few questions: the next levels fill the step.

The sampler's state (the table, pending observations, the curriculum level) is saved with the run's
checkpoints, so a resumed run samples as the uninterrupted one would.
"""

from __future__ import annotations

import csv
import io
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from a5core.data.files import DataError, Problem
from a5core.runtime.reading import read_text_capped
from a5core.runtime.settings import Settings

MAX_TABLE_BYTES = 500_000_000  # a pass-rate table holds a row a training question (MATH's 12,000: under 1 MB)

QuestionSampling = Literal["uniform", "learnable", "weighted", "curriculum"]


class QuestionSamplingSettings(Settings):
    """How a loop picks its questions (see :mod:`a5core.loops.question_sampling`)."""

    question_sampling: QuestionSampling = Field(
        "uniform", description="uniform, learnable (0 < pass rate < 1), weighted (toward ½) or curriculum (by level)"
    )
    difficulty_refresh_every: int = Field(
        1, ge=0, description="steps between refreshes of the pass rates from the rollouts (0: the table as loaded)"
    )
    curriculum_threshold: float = Field(
        0.8, gt=0, le=1, description="curriculum: accuracy on the current level that lets the next one in"
    )


class QuestionSampler:
    """Draws each step's questions (see the module docstring). ``pass_rates``: question id → p, the
    table estimated before the run (None or {}: all unknown)."""

    def __init__(
        self, problems: Sequence[Problem], settings: QuestionSamplingSettings, pass_rates: dict[str, float] | None
    ):
        self.problems, self.settings = list(problems), settings
        self.rates: dict[str, float] = dict(pass_rates or {})
        self.pending: dict[str, float] = {}
        self.levels = sorted({p.level for p in self.problems if p.level is not None})
        if settings.question_sampling == "curriculum" and not self.levels:
            raise ValueError("question_sampling curriculum needs problems with a level (MATH, or arithmetic:N:D)")
        self.level = self.levels[0] if self.levels else None

    def sample(self, rng: random.Random, count: int) -> list[Problem]:
        """``count`` distinct questions, drawn with ``rng``."""
        mode = self.settings.question_sampling
        if mode == "uniform":
            return rng.sample(self.problems, count)
        if mode == "weighted":
            weights = [self._weight(p) for p in self.problems]
            keys = [rng.random() ** (1.0 / w) for w in weights]  # Efraimidis–Spirakis: weighted, no replacement
            order = sorted(range(len(self.problems)), key=lambda i: keys[i], reverse=True)
            return [self.problems[i] for i in order[:count]]
        if mode == "learnable":
            pool = [p for p in self.problems if self._learnable(p)]
        else:
            pool = [p for p in self.problems if p.level is None or p.level <= self.level]
        if len(pool) >= count:
            return rng.sample(pool, count)
        chosen = set(id(p) for p in pool)
        rest = [p for p in self.problems if id(p) not in chosen]
        if mode == "learnable":
            # at random: filled in problem order, the same few questions came every step, and the questions the
            # table calls unsolved were never measured again (a learnable run sampled that way ended below uniform
            # sampling: docs/results.md, Superseded runs)
            return rng.sample(pool, len(pool)) + rng.sample(rest, count - len(pool))
        rest.sort(key=lambda p: (p.level is None, p.level or 0))  # a curriculum: the next levels first
        return rng.sample(pool, len(pool)) + rest[: count - len(pool)]

    def observe(self, questions: Sequence[Problem], correct: Sequence[float], step: int) -> None:
        """After step ``step`` (1-based): each question's share of correct rollouts (``correct``: one value
        per rollout, ``len(correct) / len(questions)`` consecutive rollouts a question). Refreshes the
        table every ``difficulty_refresh_every`` steps; moves the curriculum on."""
        group = len(correct) // max(len(questions), 1)
        shares = [sum(correct[i * group : (i + 1) * group]) / group for i in range(len(questions))]
        self.pending.update({q.unique_id: share for q, share in zip(questions, shares, strict=True)})
        every = self.settings.difficulty_refresh_every
        if every and step % every == 0:
            self.rates.update(self.pending)
            self.pending.clear()
        if self.settings.question_sampling == "curriculum" and self.level != self.levels[-1]:
            at_level = [s for q, s in zip(questions, shares, strict=True) if q.level == self.level]
            if at_level and sum(at_level) / len(at_level) >= self.settings.curriculum_threshold:
                self.level = self.levels[self.levels.index(self.level) + 1]

    def metrics(self) -> dict[str, float]:
        """The pass-rate histogram over the training questions (shares unsolved p = 0, learnable 0 < p < 1,
        solved p = 1, unknown) and, in a curriculum, the current level."""
        n = len(self.problems)
        rates = [self.rates.get(p.unique_id) for p in self.problems]
        out = {
            "difficulty_unsolved": sum(r == 0 for r in rates) / n,
            "difficulty_learnable": sum(r is not None and 0 < r < 1 for r in rates) / n,
            "difficulty_solved": sum(r == 1 for r in rates) / n,
            "difficulty_unknown": sum(r is None for r in rates) / n,
        }
        if self.settings.question_sampling == "curriculum":
            out["curriculum_level"] = float(self.level)
        return out

    def state(self) -> dict[str, Any]:
        return {"rates": self.rates, "pending": self.pending, "level": self.level}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rates, self.pending, self.level = dict(state["rates"]), dict(state["pending"]), state["level"]

    def _learnable(self, problem: Problem) -> bool:
        rate = self.rates.get(problem.unique_id)
        return rate is None or 0 < rate < 1

    def _weight(self, problem: Problem) -> float:
        rate = self.rates.get(problem.unique_id, 0.5)
        return rate * (1 - rate) + 0.01


# The pass-rate table's columns (a csv, one question a row).
TABLE_COLUMNS = ("unique_id", "level", "samples", "correct", "pass_rate")


def pass_rate_table(problems: Sequence[Problem], correct: Sequence[Sequence[float]]) -> str:
    """The csv of each problem's pass rate: ``correct[i]``, whether each sample of problem i was right."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(TABLE_COLUMNS)
    for problem, samples in zip(problems, correct, strict=True):
        rate = sum(samples) / len(samples)
        writer.writerow([problem.unique_id, problem.level or "", len(samples), int(sum(samples)), f"{rate:.6g}"])
    return out.getvalue()


def load_pass_rates(path: str | os.PathLike) -> dict[str, float]:
    """Question id → pass rate from a table :func:`pass_rate_table` wrote; DataError naming the file and
    line for anything else."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such pass-rate table (make one with python -m flows.difficulty)")
    try:
        text = read_text_capped(path, "pass-rate table", MAX_TABLE_BYTES)
    except ValueError as error:
        raise DataError(str(error)) from None
    rows = list(csv.DictReader(text.splitlines()))
    if rows and not {"unique_id", "pass_rate"} <= set(rows[0]):
        raise DataError(f"{path}: a pass-rate table has the columns {', '.join(TABLE_COLUMNS)}")
    rates = {}
    for line, row in enumerate(rows, start=2):
        try:
            rate = float(row["pass_rate"])
        except (TypeError, ValueError):
            raise DataError(f"{path}:{line}: pass_rate {row['pass_rate']!r} is not a number") from None
        if not 0 <= rate <= 1:
            raise DataError(f"{path}:{line}: pass_rate {rate} is not between 0 and 1")
        rates[row["unique_id"]] = rate
    return rates
