"""Metrics over several samples per problem, each with its standard error over problems.

Records are :func:`a5core.evaluation.records.grade_completions`'s: one per sample, with ``unique_id``, ``sample``,
``answer_reward`` and ``answer`` (the answer the response states). For P problems of n samples each:

- ``avg@n``: the mean reward, problem by problem, then over problems (the accuracy);
- ``pass@k`` (k ≤ n): the unbiased estimator of Chen et al. (2021), 1 − C(n − c, k) / C(n, k) for a
  problem with c correct samples, averaged over problems;
- ``maj@n``: whether the most frequent stated answer (ties: the first stated; none: wrong) is correct.

A metric's standard error is the standard deviation of its per-problem values over √P (the spread over
problems, the dominant one when P is in the hundreds): ``<metric>_se``. :func:`paired_difference` gives
the difference of two evaluations on the same problems with the standard error of the paired differences,
smaller than the two errors combined when the evaluations agree on which problems are hard. :func:`t_interval`
is Student's t interval on a mean of a few independent measurements (runs, or pairs of runs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples, drawn without replacement from n of which c are
    correct, is correct: 1 − C(n − c, k) / C(n, k), as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error, std (n − 1 in the denominator) / √n; 0 for one value."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """(mean, half-width, degrees of freedom) of Student's t interval on the mean of ``values`` (k ≥ 2 of them,
    each one independent measurement, such as one pair of runs' difference): mean ± t(1 − α/2, k − 1) · s.e."""
    from scipy.stats import t

    if len(values) < 2:
        raise ValueError(f"a t interval needs two values at least, got {len(values)}")
    mean, se = mean_and_se(values)
    df = len(values) - 1
    return mean, float(t.ppf(0.5 + confidence / 2, df)) * se, df


def by_problem(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The records of each problem, in sample order, problems in first-seen order."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        grouped.setdefault(record["unique_id"], []).append(record)
    return {uid: sorted(rows, key=lambda r: r.get("sample", 0)) for uid, rows in grouped.items()}


def majority_correct(samples: Sequence[dict[str, Any]]) -> float:
    """1.0 when the most frequent stated answer of ``samples`` is a correct one (ties: the first stated)."""
    stated = [s for s in samples if s.get("answer")]
    if not stated:
        return 0.0
    counts = Counter(s["answer"].strip() for s in stated)
    top = max(counts.values())
    winner = next(s for s in stated if counts[s["answer"].strip()] == top)
    return float(winner["answer_reward"])


def sample_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """avg@n, pass@k for k = 1, 2, 4, … up to n, and maj@n, each with ``_se``; n is the fewest samples any
    problem has (a problem's first n samples count). Also ``samples_per_problem``."""
    problems = by_problem(records)
    if not problems:
        raise ValueError("no records")
    n = min(len(samples) for samples in problems.values())
    firsts = [samples[:n] for samples in problems.values()]
    correct = [sum(float(s["answer_reward"]) for s in samples) for samples in firsts]
    out: dict[str, float] = {"samples_per_problem": float(n)}

    def put(name: str, values: list[float]) -> None:
        out[name], out[f"{name}_se"] = mean_and_se(values)

    put(f"avg_at_{n}", [c / n for c in correct])
    k = 1
    while k <= n:
        put(f"pass_at_{k}", [pass_at_k(n, int(c), k) for c in correct])
        k *= 2
    if k // 2 != n:
        put(f"pass_at_{n}", [pass_at_k(n, int(c), n) for c in correct])
    put(f"maj_at_{n}", [majority_correct(samples) for samples in firsts])
    return out


def problem_scores(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each problem's mean reward over its samples."""
    return {uid: sum(float(s["answer_reward"]) for s in rows) / len(rows) for uid, rows in by_problem(records).items()}


def paired_difference(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``a`` − ``b`` on the problems both scored (per-problem scores): the mean difference, its standard
    error over those problems, and how many there are. ValueError when they share none."""
    common = [uid for uid in a if uid in b]
    if not common:
        raise ValueError("the two evaluations share no problem")
    mean, se = mean_and_se([a[uid] - b[uid] for uid in common])
    return {"difference": mean, "difference_se": se, "n_problems": float(len(common))}
