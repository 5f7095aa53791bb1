"""Verdicts for expectations asked together (:func:`decide`).

Each expectation with at least ``min_pairs`` pairs (:mod:`a5core.verdicts.pairing`) asks two questions of its
differences: is there a difference (its sign then says whether the runs agree with the expectation), and does
the difference lie within ±margin? The rule (:class:`Rule`) answers them one of two ways:

- ``anytime`` (the default): each question reads a confidence sequence (:mod:`a5core.verdicts.anytime`), valid
  however many pairs were made and whenever the page was looked at: pairs may be added until a row is decided.
  Two tests an expectation, each with units of its own: its **pairs** (a verdict for the start models they come
  from) and its **start models** (the mean of each one's pairs, a unit: a general verdict, since a start model is
  a random draw too, whose effect on a comparison can differ from another's). The family's level is Bonferroni's
  over every test the page asks (two an expectation), fixed before any run: an e-value reaching (tests)/α.
- ``fixed``: Student's t test and the two one-sided tests on the pairs, with Holm's or Benjamini–Hochberg's
  correction (:mod:`a5core.verdicts.statistics`): valid only for a number of pairs fixed before the runs were
  looked at.

Verdicts: **agrees** / **disagrees** (a difference on the expected side or the other; for parity any difference
disagrees), **within noise** (no difference beyond ±margin), **inconclusive** (neither; differences beyond ±h
would have been decided), **too few runs** (under ``min_pairs`` pairs), **not judged** (no fair pair, or every run
of both arms scored alike), **not measured** (no runs of an arm). A decided verdict says its scope: general, or
for its start models. For each one not decided: the pairs (and start models) that would likely decide it at the
effect seen.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from a5core.verdicts import anytime
from a5core.verdicts.expectations import Expectation
from a5core.verdicts.pairing import Arms, Pair, Resolve, RunRecord, pair_arms
from a5core.verdicts.statistics import (
    PairedSample,
    adjust,
    half_width,
    p_difference,
    p_equivalence,
    pairs_to_decide,
    t_critical,
)

DECIDED = ("agrees", "disagrees", "within noise")
WORDS = (*DECIDED, "inconclusive", "too few runs", "not judged", "not measured")
FAILED = ("FAILED", "KILLED")  # how MLflow says a run ended badly
CORRECTIONS = {"anytime": ("bonferroni", "bh", "none"), "fixed": ("holm", "bh", "none")}
PAIRS, START_MODELS = "pairs", "start models"  # a test's units
GENERAL = "general"


@dataclass(frozen=True)
class Rule:
    """How verdicts are made: the family's level (``confidence`` = 1 − α), the margin of "within noise", the
    method and its correction (None: bonferroni for anytime, holm for fixed), the pairs a verdict needs, the power
    at which more pairs "would likely decide", the confidence sequence's mixture ``g``, and the rules that can be
    switched off: start models as a level, pairs whose start model favours an arm or sits at a bound set apart."""

    confidence: float = 0.95
    margin: float = 0.05
    method: Literal["anytime", "fixed"] = "anytime"
    correction: str | None = None
    min_pairs: int = 3
    power: float = 0.8
    mixture_g: float = anytime.MIXTURE_G
    start_model_level: bool = True
    favoured_apart: bool = True
    bound_apart: bool = True

    def __post_init__(self) -> None:
        if self.method not in CORRECTIONS:
            raise ValueError(f"method {self.method!r}: anytime or fixed")
        if self.correction is not None and self.correction not in CORRECTIONS[self.method]:
            raise ValueError(
                f"correction {self.correction!r} with the {self.method} method: one of "
                + ", ".join(CORRECTIONS[self.method])
            )

    @property
    def alpha(self) -> float:
        return 1 - self.confidence

    @property
    def corrected_by(self) -> str:
        return self.correction or CORRECTIONS[self.method][0]

    @property
    def levels(self) -> tuple[str, ...]:
        """The tests each expectation asks: its pairs, and (anytime, start models as a level) its start models."""
        return (PAIRS, START_MODELS) if self.method == "anytime" and self.start_model_level else (PAIRS,)


@dataclass
class Test:
    """One test of an expectation: its units' sample (pair differences, or start models' mean differences), the
    raw (1 − α) interval's half-width, the half-width at the level verdicts are read (``decidable``), the
    p-values (anytime: 1/e, the e-value's) before and after the correction, the words they earn, and how many
    more units would likely decide it (None: unknown or too many)."""

    units: str
    sample: PairedSample
    half: float
    decidable: float
    p_difference: float
    p_within: float
    adjusted_difference: float = 1.0
    adjusted_within: float = 1.0
    raw: str = ""
    word: str = ""
    more: int | None = None


@dataclass
class Verdict:
    """One expectation's verdict: its pairs, its tests by units, the words, the scope of a decided verdict, its
    start models' spread (within and between) and each arm's compute."""

    expectation: Expectation
    arms: Arms
    tests: dict[str, Test] = field(default_factory=dict)
    raw: str = ""
    word: str = ""
    scope: str = ""  # of a decided verdict: "general", or "for this start model" / "for these N start models"
    more_pairs: int | None = None  # pairs beyond these that would likely decide it (None: unknown or too many)
    shares_with: list[int] = field(default_factory=list)  # other expectations (indexes) that use a cell of its

    @property
    def k(self) -> int:
        return len(self.arms.pairs)

    @property
    def sample(self) -> PairedSample | None:
        return PairedSample.of([p.difference for p in self.arms.pairs]) if self.arms.pairs else None

    @property
    def judged(self) -> bool:
        return bool(self.tests)

    @property
    def start_models(self) -> dict[str, list[Pair]]:
        """The pairs by start model, in the order the start models came in."""
        grouped: dict[str, list[Pair]] = defaultdict(list)
        for pair in sorted(self.arms.pairs, key=lambda p: p.made):
            grouped[pair.a.origin].append(pair)
        return dict(grouped)

    def spread(self) -> tuple[float | None, float | None]:
        """(within, between): the pairs' SD around their start model's mean (pooled), and the SD of the start
        models' mean differences; None where too few to say."""
        groups = [[p.difference for p in pairs] for pairs in self.start_models.values()]
        within = pooled_sd([PairedSample.of(g) for g in groups])
        means = [sum(g) / len(g) for g in groups]
        between = PairedSample.of(means).sd if len(means) > 1 else None
        return within, between

    def compute(self) -> dict[str, dict[str, float]]:
        """Each arm's mean rollouts, response tokens and seconds a run, over its runs in the pairs that logged them."""
        found = {}
        for arm, side in ((self.expectation.a, "a"), (self.expectation.b, "b")):
            runs = [r for p in self.arms.pairs for r in getattr(p, side).runs if r.compute is not None]
            if runs:
                found[arm] = {
                    what: sum(getattr(r.compute, what) for r in runs) / len(runs)
                    for what in ("rollouts", "tokens", "seconds")
                }
        return found


@dataclass
class Decision:
    """The verdicts in the order asked, the runs left out (with why), the rule, the pooled spread of the pairs,
    and the tests the family counts."""

    verdicts: list[Verdict]
    left_out: list[tuple[RunRecord, str]]
    rule: Rule
    pooled_sd: float | None
    family: int = 0

    def counts(self, raw: bool = False) -> dict[str, int]:
        words = [v.raw if raw else v.word for v in self.verdicts]
        return {w: words.count(w) for w in WORDS if w in words}

    def general_counts(self) -> tuple[int, int]:
        """(general, for their start models): the decided verdicts of each scope."""
        decided = [v for v in self.verdicts if v.word in DECIDED]
        general = sum(v.scope == GENERAL for v in decided)
        return general, len(decided) - general


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
    """The standard deviation pooled over samples of 2 or more: sqrt(Σ (k − 1) sd² / Σ (k − 1))."""
    weighted = [(s.df, s.sd) for s in samples if s.k > 1 and not math.isnan(s.sd)]
    total = sum(df for df, _ in weighted)
    return math.sqrt(sum(df * sd**2 for df, sd in weighted) / total) if total else None


def decide(
    expectations: Sequence[Expectation],
    runs: Sequence[RunRecord],
    rule: Rule = Rule(),
    exclude: Mapping[str, str] | None = None,
    resolve: Resolve | None = None,
) -> Decision:
    """The verdict on each expectation, from ``runs`` (see the module docstring). ``resolve``: the settings that
    define an arm label no run carries (:func:`a5core.verdicts.pairing.pair_arms`)."""
    kept, apart = left_out(runs, exclude or {})
    verdicts = [Verdict(e, pair_arms(e, kept, resolve, rule.favoured_apart, rule.bound_apart)) for e in expectations]
    for v in verdicts:
        if v.arms.missing:
            v.raw = v.word = "not measured"
        elif v.arms.not_judged:
            v.raw = v.word = "not judged"
        elif v.k < rule.min_pairs:
            v.raw = v.word = "too few runs"
    pooled = pooled_sd([v.sample for v in verdicts if v.sample is not None])
    family = (_anytime if rule.method == "anytime" else _fixed)(verdicts, rule, pooled)
    _mark_shared(verdicts)
    return Decision(verdicts, apart, rule, pooled, family)


def _open(v: Verdict) -> bool:
    return not v.word


def _fixed(verdicts: list[Verdict], rule: Rule, pooled: float | None) -> int:
    """Student's t and the TOST on each expectation's pairs, corrected together; the family: those judged."""
    judged = [v for v in verdicts if _open(v)]
    for v in judged:
        sample = v.sample
        v.tests[PAIRS] = Test(
            PAIRS, sample, half_width(sample, rule.alpha), 0.0, p_difference(sample), p_equivalence(sample, rule.margin)
        )
    tests = [v.tests[PAIRS] for v in judged]
    pvalues = [p for t in tests for p in (t.p_difference, t.p_within)]
    adjusted = adjust(pvalues, [i for i in range(len(tests)) for _ in (0, 1)], rule.corrected_by)
    strictest = rule.alpha if rule.corrected_by == "none" else rule.alpha / max(1, len(judged))
    critical = t_critical(strictest)
    for i, (v, test) in enumerate(zip(judged, tests, strict=True)):
        test.adjusted_difference, test.adjusted_within = adjusted[2 * i], adjusted[2 * i + 1]
        _read(v, test, rule)
        test.decidable = half_width(test.sample, strictest)
        if test.word == "inconclusive":
            test.more = _more(test.sample, test.sample.sd, rule, critical)
        v.raw, v.word = test.raw, test.word
        v.scope = GENERAL if v.word in DECIDED else ""
        v.more_pairs = test.more
    for v in verdicts:
        if v.word == "too few runs" and v.sample is not None:
            v.more_pairs = _more(v.sample, pooled, rule, critical)
    return len(judged)


def _anytime(verdicts: list[Verdict], rule: Rule, pooled: float | None) -> int:
    """Confidence sequences on each expectation's pairs and start models, Bonferroni's (or e-BH's) level over
    every test the page asks; the family: that number of tests."""
    family = len(verdicts) * len(rule.levels)  # fixed before any run: every expectation asked, each level
    level = rule.alpha / family if rule.corrected_by == "bonferroni" else rule.alpha
    critical = (lambda k: anytime.critical(k, level, rule.mixture_g),) * 2
    tests = [test for v in verdicts if _open(v) for test in _sequences(v, rule, level)]
    pvalues = [p for t in tests for p in (t.p_difference, t.p_within)]
    adjusted = _corrected(pvalues, family, rule.corrected_by)
    for i, test in enumerate(tests):
        test.adjusted_difference, test.adjusted_within = adjusted[2 * i], adjusted[2 * i + 1]
    for v in verdicts:
        for test in v.tests.values():
            _read(v, test, rule)
            if test.word == "inconclusive":
                test.more = _more(test.sample, test.sample.sd, rule, critical)
        if v.tests:
            _verdict_of_tests(v, rule)
        elif v.word == "too few runs" and v.sample is not None:
            v.more_pairs = _more(v.sample, pooled, rule, critical)
    return family


def _sequences(v: Verdict, rule: Rule, level: float) -> list[Test]:
    """``v``'s tests (kept in ``v.tests``): its pairs' differences in the order made, and (a level) its start
    models' mean differences in the order the start models came, where there are two or more."""
    units = {PAIRS: [p.difference for p in sorted(v.arms.pairs, key=lambda p: p.made)]}
    if START_MODELS in rule.levels:
        means = [sum(p.difference for p in ps) / len(ps) for ps in v.start_models.values()]
        if len(means) > 1:
            units[START_MODELS] = means
    g = rule.mixture_g
    for name, values in units.items():
        sample = PairedSample.of(values)
        p_diff = min(1.0, 1 / anytime.e_value(sample, 0.0, g))
        p_within = min(1.0, 1 / anytime.e_within(sample, rule.margin, g))
        half = anytime.half_width(sample, rule.alpha, g)
        v.tests[name] = Test(name, sample, half, anytime.half_width(sample, level, g), p_diff, p_within)
    return list(v.tests.values())


def _corrected(pvalues: list[float], family: int, correction: str) -> list[float]:
    """Anytime p-values (1/e) corrected for the ``family`` tests asked (two questions each)."""
    if correction == "bonferroni":  # an expectation's two questions cannot both be true: counted once
        return [min(1.0, family * p) for p in pvalues]
    if correction == "bh":  # e-BH: BH on 1/e, valid whatever the dependence; questions not yet tested at 1
        padding = 2 * family - len(pvalues)
        return adjust(pvalues + [1.0] * padding, range(2 * family), "bh")[: len(pvalues)]
    return list(pvalues)


def _read(v: Verdict, test: Test, rule: Rule) -> None:
    """A test's words, before and after the correction."""
    mean, alpha = test.sample.mean, rule.alpha
    test.raw = _word(v.expectation, mean, test.p_difference <= alpha, test.p_within <= alpha)
    test.word = _word(v.expectation, mean, test.adjusted_difference <= alpha, test.adjusted_within <= alpha)


def _verdict_of_tests(v: Verdict, rule: Rule) -> None:
    """The verdict from its tests: the start models' where decided (general), else the pairs' (for their start
    models, where start models are a level; else general)."""
    pairs, models = v.tests[PAIRS], v.tests.get(START_MODELS)
    count = len(v.start_models)
    if models is not None and models.word in DECIDED:
        v.word, v.scope = models.word, GENERAL
    elif pairs.word in DECIDED:
        own = "for this start model" if count == 1 else f"for these {count} start models"
        v.word, v.scope = pairs.word, own if START_MODELS in rule.levels else GENERAL
    else:
        v.word = "inconclusive"
    v.raw = models.raw if models is not None and models.raw in DECIDED else pairs.raw
    v.more_pairs = pairs.more


def _more(sample: PairedSample, sd: float | None, rule: Rule, critical: tuple) -> int | None:
    """Units beyond the sample's that would likely decide it at the mean seen, with spread ``sd``."""
    needed = pairs_to_decide(sample.mean, sd or math.nan, rule.margin, critical, rule.power)
    return None if needed is None else max(1, needed - sample.k)


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


# The page's rules, each with the day it was adopted and the switch that turns it off (to show what it changed).
RULES = (
    ("Pairs whose start model was trained with one arm's prompt are set apart", "2026-12-06", "favoured_apart"),
    ("Pairs of a start model whose every run scored 0 or 1 are set apart", "2026-12-06", "bound_apart"),
    ("Anytime-valid confidence sequences (pairs may be added until decided)", "2026-12-07", "method"),
    ("Start models as a level: a general verdict needs its start models' means to decide", "2026-12-07", None),
)


def rule_changes(
    expectations: Sequence[Expectation],
    runs: Sequence[RunRecord],
    rule: Rule,
    exclude: Mapping[str, str] | None = None,
    resolve: Resolve | None = None,
    decision: Decision | None = None,
) -> list[tuple[str, str, list[str]]]:
    """Each of :data:`RULES` with its date and the verdicts it changes on these runs: the expectations whose verdict
    (or scope) differs when the rule alone is switched off, as ``text: without → with``."""
    decision = decision or decide(expectations, runs, rule, exclude, resolve)
    found = []
    for text, adopted, switch in RULES:
        if switch == "method":
            other = replace(rule, method="fixed", correction=None)
        elif switch is None:
            other = replace(rule, start_model_level=False)
        else:
            other = replace(rule, **{switch: False})
        if other == rule:
            found.append((text, adopted, []))
            continue
        without = decide(expectations, runs, other, exclude, resolve)
        changed = [
            f"{v.expectation.text}: {_said(w)} → {_said(v)}"
            for v, w in zip(decision.verdicts, without.verdicts, strict=True)
            if (v.word, v.scope) != (w.word, w.scope)
        ]
        found.append((text, adopted, changed))
    return found


def _said(v: Verdict) -> str:
    return f"{v.word} ({v.scope})" if v.scope and v.scope != GENERAL else v.word
