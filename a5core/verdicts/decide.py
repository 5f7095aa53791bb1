"""Verdicts for expectations asked together (:func:`decide`).

Each expectation with at least ``min_pairs`` pairs (:mod:`a5core.verdicts.pairing`) asks two questions of its pairs'
differences: is there a difference (Student's two-sided t test; its sign then says whether the runs agree with the
expectation), and does the difference lie within ±margin (two one-sided tests, passing when the (1 − α) interval
lies inside ±margin)? The p-values of all of them are corrected together (:func:`a5core.verdicts.statistics.adjust`),
and the verdict is read from the corrected ones:

- **agrees** / **disagrees**: a difference, on the expected side or the other (for parity, any difference
  disagrees);
- **within noise**: no difference beyond ±margin;
- **inconclusive**: neither; differences beyond ±h (the interval's half-width at the correction's strictest level)
  would have been decided;
- **too few runs**: under ``min_pairs`` pairs, no verdict;
- **not judged**: no fair pair (the arms differ in more than the setting under test), or every run of both arms
  scored alike (:func:`a5core.verdicts.pairing.not_judged`); pairs whose start model favours an arm are set apart;
- **not measured**: no runs of one arm.

Each verdict is also read from the raw p-values (each test at α on its own), and for each one not decided the
number of pairs that would likely decide it at the effect seen (:func:`a5core.verdicts.statistics.pairs_to_decide`,
with the spread of its own pairs, or pooled over the expectations' pairs where it has under ``min_pairs``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from a5core.verdicts.expectations import Expectation
from a5core.verdicts.pairing import Arms, RunRecord, pair_arms
from a5core.verdicts.statistics import (
    Correction,
    PairedSample,
    adjust,
    half_width,
    p_difference,
    p_equivalence,
    pairs_to_decide,
)

DECIDED = ("agrees", "disagrees", "within noise")
WORDS = (*DECIDED, "inconclusive", "too few runs", "not judged", "not measured")
FAILED = ("FAILED", "KILLED")  # how MLflow says a run ended badly


@dataclass(frozen=True)
class Rule:
    """How verdicts are made: the family's level (``confidence`` = 1 − α), the margin of "within noise", the
    correction, the pairs a verdict needs, and the power at which more pairs "would likely decide"."""

    confidence: float = 0.95
    margin: float = 0.05
    correction: Correction = "holm"
    min_pairs: int = 3
    power: float = 0.8

    @property
    def alpha(self) -> float:
        return 1 - self.confidence


@dataclass
class Verdict:
    """One expectation's verdict; p-values and intervals are None where there are too few pairs."""

    expectation: Expectation
    arms: Arms
    sample: PairedSample | None = None
    half: float | None = None  # of the raw (1 − α) interval
    p_difference: float | None = None
    p_equivalence: float | None = None
    adjusted_difference: float | None = None
    adjusted_equivalence: float | None = None
    raw: str = ""
    word: str = ""
    decidable: float | None = None  # after the correction: differences beyond ±this would have been decided
    more_pairs: int | None = None  # pairs beyond these that would likely decide it (None: unknown or too many)
    shares_with: list[int] = field(default_factory=list)  # other expectations (indexes) that use a cell of its

    @property
    def k(self) -> int:
        return len(self.arms.pairs)

    @property
    def judged(self) -> bool:
        return self.p_difference is not None


@dataclass
class Decision:
    """The verdicts in the order asked, the runs left out (with why), the rule, and the pooled spread."""

    verdicts: list[Verdict]
    left_out: list[tuple[RunRecord, str]]
    rule: Rule
    pooled_sd: float | None

    @property
    def family(self) -> int:
        """The expectations judged together (each asks two questions)."""
        return sum(v.judged for v in self.verdicts)

    def counts(self, raw: bool = False) -> dict[str, int]:
        words = [v.raw if raw else v.word for v in self.verdicts]
        return {w: words.count(w) for w in WORDS if w in words}


def left_out(runs: Sequence[RunRecord], exclude: Mapping[str, str]) -> tuple[list[RunRecord], list[tuple]]:
    """The runs with a result (a final metric) that verdicts use, and those shown apart with why: excluded by id
    (or id prefix), not ended well, or run by a flow that failed (a sibling ran out of memory, say). A flow still
    RUNNING in its store (stopped with its machine) leaves its finished runs in."""
    kept, apart = [], []
    for run in runs:
        if not run.finals:  # a parent run, or a run stopped before its final evaluation: no result to show
            continue
        reason = next((why for prefix, why in exclude.items() if run.id.startswith(prefix)), None)
        if reason is None and run.status != "FINISHED":
            reason = f"it ended {run.status}"
        if reason is None and run.flow_status in FAILED:
            reason = f"the flow that ran it ended {run.flow_status}"
        (kept.append(run) if reason is None else apart.append((run, reason)))
    return kept, apart


def _word(expectation: Expectation, mean: float, difference: bool, equivalent: bool) -> str:
    if difference:
        return "agrees" if expectation.sign and mean * expectation.sign > 0 else "disagrees"
    return "within noise" if equivalent else "inconclusive"


def pooled_sd(samples: Sequence[PairedSample]) -> float | None:
    """The pairs' standard deviation pooled over samples of 2 pairs or more: sqrt(Σ (k − 1) sd² / Σ (k − 1))."""
    weighted = [(s.df, s.sd) for s in samples if s.k > 1 and not math.isnan(s.sd)]
    total = sum(df for df, _ in weighted)
    return math.sqrt(sum(df * sd**2 for df, sd in weighted) / total) if total else None


def decide(
    expectations: Sequence[Expectation],
    runs: Sequence[RunRecord],
    rule: Rule = Rule(),
    exclude: Mapping[str, str] | None = None,
) -> Decision:
    """The verdict on each expectation, from ``runs`` (see the module docstring)."""
    kept, apart = left_out(runs, exclude or {})
    verdicts = [Verdict(e, pair_arms(e, kept)) for e in expectations]
    for v in verdicts:
        if v.k:
            v.sample = PairedSample.of([p.difference for p in v.arms.pairs])
        if v.arms.missing:
            v.raw = v.word = "not measured"
        elif v.arms.not_judged:
            v.raw = v.word = "not judged"
        elif v.k < rule.min_pairs:
            v.raw = v.word = "too few runs"
        else:
            v.half = half_width(v.sample, rule.alpha)
            v.p_difference = p_difference(v.sample)
            v.p_equivalence = p_equivalence(v.sample, rule.margin)
    judged = [v for v in verdicts if v.judged]
    pvalues = [p for v in judged for p in (v.p_difference, v.p_equivalence)]
    adjusted = adjust(pvalues, [i for i in range(len(judged)) for _ in (0, 1)], rule.correction)
    for i, v in enumerate(judged):
        v.adjusted_difference, v.adjusted_equivalence = adjusted[2 * i], adjusted[2 * i + 1]
        mean = v.sample.mean
        v.raw = _word(v.expectation, mean, v.p_difference <= rule.alpha, v.p_equivalence <= rule.alpha)
        v.word = _word(v.expectation, mean, v.adjusted_difference <= rule.alpha, v.adjusted_equivalence <= rule.alpha)
    pooled = pooled_sd([v.sample for v in verdicts if v.sample is not None])
    # The strictest level a test meets under the correction: α over the expectations that are (or, given pairs,
    # would be) judged together.
    asked = sum(v.judged or v.word == "too few runs" for v in verdicts)
    strictest = rule.alpha if rule.correction == "none" else rule.alpha / max(1, asked)
    for v in verdicts:
        if v.judged:
            v.decidable = half_width(v.sample, strictest)
        if v.word in ("inconclusive", "too few runs") and v.sample is not None:
            sd = v.sample.sd if v.k >= rule.min_pairs else pooled
            needed = pairs_to_decide(v.sample.mean, sd or math.nan, strictest, rule.margin, rule.power)
            v.more_pairs = None if needed is None else max(1, needed - v.k)
    _mark_shared(verdicts)
    return Decision(verdicts, apart, rule, pooled)


def _mark_shared(verdicts: Sequence[Verdict]) -> None:
    """Each verdict's ``shares_with``: the other expectations whose pairs use one of its cells (their errors are
    correlated)."""
    users: dict[tuple[str, ...], set[int]] = defaultdict(set)
    for i, v in enumerate(verdicts):
        for pair in v.arms.pairs:
            for cell in (pair.a, pair.b):
                users[tuple(r.id for r in cell.runs)].add(i)
    for i, v in enumerate(verdicts):
        v.shares_with = sorted({j for group in users.values() if i in group for j in group} - {i})
