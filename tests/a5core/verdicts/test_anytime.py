"""a5core.verdicts.anytime against its definition: the closed-form e-value is the Bayes factor integrated numerically
(normal mixture over the standardised effect, right-Haar prior on the scale), the confidence sequence's edge is
where the e-value reaches 1/α, and by simulation the sequence covers the true mean at every look at once with
probability ≥ 1 − α, where Student's interval read after every added pair does not."""

import math
import random

import numpy as np
import pytest
from scipy import integrate, stats

from a5core.verdicts.anytime import critical, e_value, e_within, half_width, log_e_value
from a5core.verdicts.statistics import PairedSample


def bayes_factor(x, mu, g):
    """∫∫ Π N(x_i; μ + δσ, σ²) N(δ; 0, g) dδ dσ/σ  over  ∫ Π N(x_i; μ, σ²) dσ/σ, numerically."""

    def likelihood(shift, sigma):
        return np.prod(stats.norm.pdf(np.asarray(x), mu + shift, sigma))

    null = integrate.quad(lambda s: likelihood(0.0, s) / s, 1e-4, 3, limit=200)[0]
    mixture = integrate.dblquad(
        lambda d, s: likelihood(d * s, s) * stats.norm.pdf(d, 0, math.sqrt(g)) / s, 1e-4, 3, -25, 25
    )[0]
    return mixture / null


@pytest.mark.parametrize(("x", "mu", "g"), [([0.05, 0.11, -0.02, 0.08, 0.04], 0.0, 4.0), ([0.3, 0.1, 0.2], 0.05, 1.0)])
def test_the_closed_form_e_value_is_the_bayes_factor_of_its_definition(x, mu, g):
    assert e_value(PairedSample.of(x), mu, g) == pytest.approx(bayes_factor(x, mu, g), rel=1e-3)  # quadrature's error


def test_the_sequence_edge_is_where_the_e_value_reaches_one_over_alpha():
    sample = PairedSample.of([0.05, 0.11, -0.02, 0.08, 0.04, 0.07, 0.02])
    for alpha in (0.05, 0.01, 0.001):
        h = half_width(sample, alpha)
        assert e_value(sample, sample.mean + h) == pytest.approx(1 / alpha, rel=1e-9)
        assert e_value(sample, sample.mean - 0.999 * h) < 1 / alpha
    assert math.isinf(critical(3, 0.001)) and math.isinf(critical(1, 0.5))  # too few to ever reach 1/α
    assert log_e_value(PairedSample.of([0.1]), 0.0) == 0.0


def test_within_the_margin_reads_the_nearer_edge_and_nothing_outside_it():
    inside = PairedSample.of([0.01, -0.005, 0.0, 0.004, 0.002, -0.001])
    assert e_within(inside, 0.05) == pytest.approx(min(e_value(inside, -0.05), e_value(inside, 0.05)))
    assert e_within(PairedSample.of([0.08, 0.07, 0.09]), 0.05) <= 1.0


def test_the_sequence_covers_at_every_look_where_students_interval_read_after_each_pair_does_not():
    rng = np.random.default_rng(11)
    alpha, looks, runs = 0.1, 40, 3000
    data = rng.normal(0.3, 1.0, size=(runs, looks))
    missed_sequence = missed_student = 0
    for row in data:
        seq_miss = student_miss = False
        for k in range(2, looks + 1):
            sample = PairedSample.of(row[:k].tolist())
            if abs(sample.mean - 0.3) > half_width(sample, alpha):
                seq_miss = True
            if abs(sample.mean - 0.3) > stats.t.ppf(1 - alpha / 2, k - 1) * sample.se:
                student_miss = True
        missed_sequence += seq_miss
        missed_student += student_miss
    assert missed_sequence / runs <= alpha, f"the sequence missed at some look in {missed_sequence} of {runs}"
    assert missed_student / runs > 2 * alpha, f"Student's interval missed in only {missed_student} of {runs}"


def test_the_sequence_narrows_as_pairs_grow_and_is_wider_than_a_fixed_interval():
    ks = (10, 20, 50, 200, 1000)
    widths = [critical(k, 0.01) / math.sqrt(k) for k in ks]  # the half-width in units of the SD
    assert widths == sorted(widths, reverse=True)
    assert all(critical(k, 0.01) > stats.norm.ppf(1 - 0.01 / 2) for k in ks)  # the price of looking at every k
    rng = random.Random(0)
    sample = PairedSample.of([rng.gauss(0, 1) for _ in range(30)])
    assert half_width(sample, 0.05) > stats.t.ppf(0.975, 29) * sample.se
