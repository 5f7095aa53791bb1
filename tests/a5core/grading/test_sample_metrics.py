"""avg@n, pass@k, maj@n and paired differences with their standard errors, against direct computations."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from a5core.grading.sample_metrics import mean_and_se, paired_difference, pass_at_k, problem_scores, sample_metrics


@pytest.mark.parametrize("n, c, k", [(5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 2, 4), (10, 3, 5), (8, 0, 4), (8, 8, 1)])
def test_pass_at_k_is_the_closed_form_and_the_subset_average(n, c, k):
    """1 − C(n−c, k)/C(n, k), and the same by brute force: the share of k-subsets holding a correct sample."""
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_1_is_the_mean_and_bad_arguments_are_refused():
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 2, 5)


def records(per_problem: dict[str, list[tuple[str | None, int]]]) -> list[dict]:
    """Records of (stated answer, correct) samples per problem, shuffled (the metrics must not care)."""
    rows = [
        {"unique_id": uid, "sample": i, "answer": answer, "answer_reward": float(ok)}
        for uid, samples in per_problem.items()
        for i, (answer, ok) in enumerate(samples)
    ]
    random.Random(0).shuffle(rows)
    return rows


PROBLEMS = {
    "a": [("3", 1), ("4", 0), ("3", 1), ("5", 0)],  # majority 3: correct
    "b": [("7", 0), ("7", 0), ("2", 1), ("9", 0)],  # majority 7: wrong, one correct sample
    "c": [(None, 0), ("1", 1), ("8", 0), (None, 0)],  # tie between 1 and 8: the first stated, 1, correct
    "d": [("0", 0), ("0", 0), ("0", 0), ("0", 0)],  # never correct
}


def test_sample_metrics_against_a_direct_computation():
    metrics = sample_metrics(records(PROBLEMS))
    correct = {"a": 2, "b": 1, "c": 1, "d": 0}
    per_problem_avg = [correct[u] / 4 for u in PROBLEMS]
    assert metrics["samples_per_problem"] == 4
    assert metrics["avg_at_4"] == pytest.approx(statistics.mean(per_problem_avg))
    assert metrics["avg_at_4_se"] == pytest.approx(statistics.stdev(per_problem_avg) / 2)
    for k in (1, 2, 4):
        values = [1 - math.comb(4 - correct[u], k) / math.comb(4, k) for u in PROBLEMS]
        assert metrics[f"pass_at_{k}"] == pytest.approx(statistics.mean(values))
        assert metrics[f"pass_at_{k}_se"] == pytest.approx(statistics.stdev(values) / 2)
    assert metrics["pass_at_4"] == 0.75 and metrics["pass_at_1"] == metrics["avg_at_4"]
    assert metrics["maj_at_4"] == pytest.approx(2 / 4)  # a and c
    assert "pass_at_3" not in metrics


def test_sample_metrics_use_each_problems_first_n_samples_and_add_pass_at_n():
    uneven = {**PROBLEMS, "e": [("5", 1), ("5", 1), ("6", 0)]}  # three samples: n = 3 for all
    metrics = sample_metrics(records(uneven))
    assert metrics["samples_per_problem"] == 3 and "pass_at_3" in metrics and "pass_at_4" not in metrics
    assert metrics["avg_at_3"] == pytest.approx(statistics.mean([2 / 3, 1 / 3, 1 / 3, 0, 2 / 3]))  # first three


def test_one_sample_per_problem_is_the_accuracy_with_its_binomial_error():
    rows = records({f"p{i}": [("x", int(i % 4 == 0))] for i in range(40)})
    metrics = sample_metrics(rows)
    p = 10 / 40
    assert metrics["avg_at_1"] == metrics["pass_at_1"] == pytest.approx(p)
    assert metrics["avg_at_1_se"] == pytest.approx(math.sqrt(p * (1 - p) / 39))  # sample std, n − 1


def test_paired_difference_on_shared_problems():
    a = problem_scores(records(PROBLEMS))
    b = {"a": 0.25, "b": 0.25, "c": 0.5, "zz": 1.0}  # d missing in b, zz missing in a
    result = paired_difference(a, b)
    diffs = [a["a"] - 0.25, a["b"] - 0.25, a["c"] - 0.5]
    assert result["n_problems"] == 3
    assert result["difference"] == pytest.approx(statistics.mean(diffs))
    assert result["difference_se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    with pytest.raises(ValueError, match="share no problem"):
        paired_difference({"x": 1.0}, {"y": 1.0})
    assert mean_and_se([0.5]) == (0.5, 0.0)


def test_t_interval_is_students_on_k_minus_one_degrees_of_freedom():
    """Textbook critical values (t at 0.975: 12.706 for 1 degree of freedom, 4.303 for 2, 2.776 for 4): three
    pairs' mean difference ± 2 s.e. would be a 82% interval, not 95%."""
    from a5core.grading.sample_metrics import t_interval

    mean, half, df = t_interval([1.0, 2.0, 3.0])
    assert (mean, df) == (2.0, 2) and half == pytest.approx(4.3027 / math.sqrt(3), abs=1e-3)
    assert t_interval([0.0, 1.0])[1] == pytest.approx(12.706 * 0.5, abs=1e-3)
    values = [0.1, 0.3, 0.2, 0.4, 0.5]
    assert t_interval(values)[1] == pytest.approx(2.776 * statistics.stdev(values) / math.sqrt(5), abs=1e-3)
    with pytest.raises(ValueError, match="two values"):
        t_interval([1.0])
