"""a5core.verdicts.statistics against references: scipy's t test and TOST, a textbook Holm and Benjamini–Hochberg
example, G*Power's sample sizes for the paired t test, and a Monte Carlo check of the equivalence test's power."""

import math
import random

import pytest
from scipy import stats

from a5core.verdicts.statistics import (
    PairedSample,
    adjust,
    half_width,
    p_difference,
    p_equivalence,
    pairs_to_decide,
    t_critical,
)


def test_the_difference_test_is_scipys_one_sample_t_test_and_its_interval():
    differences = [0.031, 0.052, -0.004, 0.047, 0.018]
    sample = PairedSample.of(differences)
    reference = stats.ttest_1samp(differences, 0.0)
    assert p_difference(sample) == pytest.approx(reference.pvalue, rel=1e-9)
    low, high = stats.t.interval(0.95, len(differences) - 1, loc=sample.mean, scale=stats.sem(differences))
    assert half_width(sample, 0.05) == pytest.approx((high - low) / 2, rel=1e-9)
    assert sample.sd == pytest.approx(stats.tstd(differences))


def test_differences_all_alike_are_decided_or_not_without_dividing_by_zero():
    assert p_difference(PairedSample.of([0.02, 0.02, 0.02])) == 0.0
    assert p_difference(PairedSample.of([0.0, 0.0, 0.0])) == 1.0
    assert p_equivalence(PairedSample.of([0.02, 0.02, 0.02]), 0.05) == 0.0
    assert p_equivalence(PairedSample.of([0.07, 0.07, 0.07]), 0.05) == 1.0
    assert math.isnan(PairedSample.of([0.1]).sd)


@pytest.mark.parametrize("margin", [0.03, 0.05, 0.08])
def test_equivalence_passes_exactly_when_the_90_percent_interval_lies_inside_the_margin(margin):
    rng = random.Random(7)
    for _ in range(200):
        k = rng.randint(2, 8)
        differences = [rng.gauss(rng.uniform(-0.06, 0.06), rng.uniform(0.005, 0.05)) for _ in range(k)]
        sample = PairedSample.of(differences)
        inside = abs(sample.mean) + half_width(sample, 0.10) < margin
        assert (p_equivalence(sample, margin) <= 0.05) == inside


def test_equivalence_p_is_the_textbook_tost_the_larger_one_sided_p():
    differences = [0.01, -0.012, 0.004, 0.0]
    sample = PairedSample.of(differences)
    lower = stats.ttest_1samp(differences, -0.05, alternative="greater").pvalue
    upper = stats.ttest_1samp(differences, 0.05, alternative="less").pvalue
    assert p_equivalence(sample, 0.05) == pytest.approx(max(lower, upper), rel=1e-9)


def test_holm_on_singletons_is_the_textbook_step_down():
    # sorted 0.01, 0.03, 0.04 → 3·0.01, max(.., 2·0.03), max(.., 1·0.04)
    assert adjust([0.01, 0.04, 0.03], [0, 1, 2], "holm") == pytest.approx([0.03, 0.06, 0.06])
    assert adjust([0.2, 0.9], [0, 1], "holm") == pytest.approx([0.4, 0.9])


def test_holm_counts_an_expectations_two_questions_once_until_one_is_passed():
    # Two expectations, two questions each: p 0.001 (e0), 0.004 (e1), 0.5 (e0), 0.9 (e1). Plain Holm would multiply
    # by 4, 3, 2, 1; since at most one of an expectation's two can be true, the multipliers are 2, 2, 2, 1.
    adjusted = adjust([0.001, 0.5, 0.004, 0.9], [0, 0, 1, 1], "holm")
    assert adjusted == pytest.approx([0.002, 1.0, 0.008, 1.0])
    plain = adjust([0.001, 0.5, 0.004, 0.9], [0, 1, 2, 3], "holm")
    assert plain == pytest.approx([0.004, 1.0, 0.012, 1.0])


def test_benjamini_hochberg_matches_its_definition():
    pvalues = [0.01, 0.04, 0.03, 0.005, 0.5]
    m = len(pvalues)
    expected = []
    for p in pvalues:  # min over the p-values at or above p of m·p_(j)/j
        ranked = sorted(pvalues)
        expected.append(min(min(1.0, m * q / (ranked.index(q) + 1)) for q in ranked if q >= p))
    assert adjust(pvalues, range(m), "bh") == pytest.approx(expected)
    assert adjust(pvalues, range(m), "none") == pvalues


def test_adjust_refuses_an_unknown_correction_and_mismatched_groups():
    with pytest.raises(ValueError, match="one of holm, bh, none"):
        adjust([0.1], [0], "bonferroni")
    with pytest.raises(ValueError, match="groups"):
        adjust([0.1, 0.2], [0], "holm")


@pytest.mark.parametrize(("effect_size", "gpower_n"), [(1.0, 10), (0.5, 34), (0.8, 15)])
def test_pairs_to_decide_a_difference_matches_gpower(effect_size, gpower_n):
    # G*Power 3.1, t test of a mean against 0 (matched pairs), two-tailed α 0.05, power 0.8
    assert pairs_to_decide(effect_size * 0.03, 0.03, 0.0, t_critical(0.05)) == gpower_n


def test_pairs_to_decide_parity_gives_enough_pairs_for_the_equivalence_test_by_simulation():
    rng = random.Random(3)
    effect, sd, margin = 0.01, 0.03, 0.05
    n = pairs_to_decide(effect, sd, margin, t_critical(0.05))
    assert n is not None and 3 <= n < 20
    passed = sum(
        p_equivalence(PairedSample.of([rng.gauss(effect, sd) for _ in range(n)]), margin) <= 0.05 for _ in range(2000)
    )
    assert passed / 2000 >= 0.75  # the power asked, 0.8, less Monte Carlo and the bound's slack
    assert pairs_to_decide(0.0, 0.5, margin, t_critical(0.05), most=30) is None  # too noisy to decide with 30
    assert pairs_to_decide(0.02, math.nan, margin, t_critical(0.05)) is None


def test_pairs_to_decide_reaches_past_where_the_noncentral_t_leaves_scipys_series():
    # at 10 pairs this effect's noncentrality puts -t_crit far in the left tail, where scipy's nctdtr gives NaN
    n = pairs_to_decide(0.0448, 0.0157, 0.05, t_critical(0.05 / 23))
    assert n == 7
    assert 0.9 < stats.nct.sf(stats.t.ppf(1 - 0.05 / 46, n - 1), n - 1, 0.0448 * math.sqrt(n) / 0.0157) < 0.95
