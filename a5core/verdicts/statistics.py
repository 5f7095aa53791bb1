"""The tests behind a verdict, on k paired differences (each the difference of two runs from one start model
with one seed):

- a difference: Student's two-sided t test of "no difference", its (1 − α) interval mean ± h;
- equivalence within ±margin: the two one-sided t tests (TOST) against −margin and +margin, each at α, so that it
  passes exactly when the (1 − 2α) interval lies inside ±margin (:func:`p_equivalence`);
- a correction for the p-values of expectations asked together (:func:`adjust`): Holm's step-down, which bounds
  the chance of any false verdict at α under any dependence between the tests (comparisons that share a
  reference run are correlated), or Benjamini–Hochberg, which bounds the expected share of false verdicts;
- how many pairs would likely decide a question at the effect seen (:func:`pairs_to_decide`), from the power of
  a test that decides when |t| passes a critical value (the noncentral t): these tests', or the anytime-valid
  confidence sequence's (:mod:`a5core.verdicts.anytime`).

They hold for a number of pairs fixed before the runs are looked at; pairs added until a question is decided
need the anytime-valid rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Correction = Literal["holm", "bh", "none"]
MOST_PAIRS = 200  # pairs_to_decide looks no further


@dataclass(frozen=True)
class PairedSample:
    """k paired differences summarised: their mean, standard deviation (k − 1 in the denominator), the mean's
    standard error and degrees of freedom (k − 1)."""

    k: int
    mean: float
    sd: float

    @classmethod
    def of(cls, differences: Sequence[float]) -> PairedSample:
        k = len(differences)
        if k == 0:
            raise ValueError("no differences")
        mean = sum(differences) / k
        sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (k - 1)) if k > 1 else math.nan
        return cls(k, mean, sd)

    @property
    def df(self) -> int:
        return self.k - 1

    @property
    def se(self) -> float:
        return self.sd / math.sqrt(self.k)


# Student's t and the noncentral t through scipy.special's functions: the same numbers as scipy.stats', a
# hundred times faster (a page's "pairs that would decide it" evaluates thousands).


def _t_sf(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom."""
    from scipy.special import stdtr

    return float(stdtr(df, -x))


def t_quantile(probability: float, df: int) -> float:
    """x with P(T ≤ x) = ``probability``."""
    from scipy.special import stdtrit

    return float(stdtrit(df, probability))


def _nct_cdf(x: float, df: int, shift: float) -> float:
    """P(T ≤ x) for the noncentral t with ``df`` degrees of freedom and noncentrality ``shift``."""
    from scipy.special import nctdtr

    value = float(nctdtr(df, shift, x))
    if math.isnan(value):  # far in a tail scipy's series does not reach: from the other side, T(shift) = −T(−shift)
        value = 1 - float(nctdtr(df, -shift, -x))
    return value if not math.isnan(value) else float(x > shift)


def half_width(sample: PairedSample, alpha: float) -> float:
    """h of the two-sided (1 − α) t interval mean ± h (k ≥ 2)."""
    return t_quantile(1 - alpha / 2, sample.df) * sample.se


def p_difference(sample: PairedSample) -> float:
    """Two-sided p-value of "the mean difference is 0" (k ≥ 2). Differences all alike give 0 unless they are 0."""
    if sample.se == 0:
        return 1.0 if sample.mean == 0 else 0.0
    return min(1.0, 2 * _t_sf(abs(sample.mean) / sample.se, sample.df))


def p_equivalence(sample: PairedSample, margin: float) -> float:
    """p-value of "the mean difference lies outside ±margin": the larger of the two one-sided tests' p-values
    (against −margin and +margin), so that p ≤ α exactly when the (1 − 2α) interval of :func:`half_width` lies
    inside ±margin (k ≥ 2)."""
    if sample.se == 0:
        return 0.0 if abs(sample.mean) < margin else 1.0
    above_low = _t_sf((sample.mean + margin) / sample.se, sample.df)  # "d ≤ −margin"
    below_high = _t_sf((margin - sample.mean) / sample.se, sample.df)  # "d ≥ +margin"
    return max(above_low, below_high)


def adjust(pvalues: Sequence[float], groups: Sequence[int], correction: Correction) -> list[float]:
    """``pvalues`` adjusted for being asked together: an adjusted p ≤ α is a decision at family level α.

    - ``holm``: Holm's step-down with Shaffer's count of the hypotheses that can still be true: at each step the
      multiplier is the number of ``groups`` with a hypothesis not yet passed (one expectation's two questions,
      "no difference" and "a difference beyond the margin", cannot both be true, so they count once). With every
      group of its own this is plain Holm. It bounds the chance of one false decision or more at α, whatever the
      dependence between the tests.
    - ``bh``: Benjamini–Hochberg's step-up over all of them: the expected share of false decisions among those
      made is at most α (for tests that are independent or positively dependent, as shared references make them).
    - ``none``: the p-values as they are, each at α on its own.
    """
    m = len(pvalues)
    if len(groups) != m:
        raise ValueError(f"{m} p-values but {len(groups)} groups")
    if correction == "none" or m == 0:
        return list(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [1.0] * m
    if correction == "holm":
        still_open = Counter(groups)
        running = 0.0
        for i in order:
            possible = sum(1 for count in still_open.values() if count > 0)
            running = max(running, min(1.0, possible * pvalues[i]))
            adjusted[i] = running
            still_open[groups[i]] -= 1
        return adjusted
    if correction == "bh":
        running = 1.0
        for rank in range(m, 0, -1):
            i = order[rank - 1]
            running = min(running, m * pvalues[i] / rank)
            adjusted[i] = min(1.0, running)
        return adjusted
    raise ValueError(f"correction {correction!r}: one of holm, bh, none")


Critical = Callable[[int], float]  # k → the |t| beyond which a test decides at k pairs (inf: it cannot)


def t_critical(alpha: float) -> tuple[Critical, Critical]:
    """The critical values of the fixed-sample tests at level α: the two-sided t test's and the TOST's."""
    return (lambda k: t_quantile(1 - alpha / 2, k - 1)), (lambda k: t_quantile(1 - alpha, k - 1))


def power_difference(n: int, effect: float, sd: float, critical: float) -> float:
    """P(|T| > critical) at n pairs, T the t statistic when the true mean difference is ``effect`` and the
    differences' standard deviation ``sd`` (the noncentral t)."""
    if math.isinf(critical):
        return 0.0
    df, shift = n - 1, effect * math.sqrt(n) / sd
    return 1 - _nct_cdf(critical, df, shift) + _nct_cdf(-critical, df, shift)


def power_within(n: int, effect: float, sd: float, critical: float, margin: float) -> float:
    """P(mean ± critical · se lies inside ±margin) at n pairs: both one-sided statistics past ``critical`` (the
    sum-minus-one bound, exact as the standard error becomes known)."""
    if math.isinf(critical):
        return 0.0
    df, root = n - 1, math.sqrt(n)
    above_low = 1 - _nct_cdf(critical, df, (effect + margin) * root / sd)
    below_high = _nct_cdf(-critical, df, (effect - margin) * root / sd)
    return max(0.0, above_low + below_high - 1)


def pairs_to_decide(
    effect: float,
    sd: float,
    margin: float,
    critical: tuple[Critical, Critical],
    power: float = 0.8,
    most: int = MOST_PAIRS,
) -> int | None:
    """The fewest pairs (at least 3) with which a difference of ``effect`` (pairs' standard deviation ``sd``)
    would be decided with probability ``power`` by tests of ``critical`` values (a difference's, within ±margin's;
    :func:`t_critical`): as a difference, or as lying within ±margin where it does; None when more than ``most``
    would be needed or ``sd`` is not known. (Both powers grow with the pairs: found by doubling, then halving.)"""
    if not sd > 0 or math.isnan(sd) or math.isnan(effect):
        return None
    difference, within = critical

    def enough(n: int) -> bool:
        if power_difference(n, effect, sd, difference(n)) >= power:
            return True
        return abs(effect) < margin and power_within(n, effect, sd, within(n), margin) >= power

    low, high = 2, 3  # not enough at low (a verdict needs 3), try high
    while not enough(high):
        if high >= most:
            return None
        low, high = high, min(most, 2 * high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high
