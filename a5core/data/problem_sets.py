"""What a run trains and is scored on: problem sets and SFT trace sets from a source, split for selection and
scoring (the graders by name: :mod:`a5core.grading.rewards`).

A source is a MATH/GSM8K file or dataset id (:mod:`a5core.data.files`), or ``arithmetic:N:DIGITS``: N generated
problems of the arithmetic task (:mod:`a5core.data.arithmetic`), which small models can learn (``…:columns``:
their solutions worked column by column, for SFT traces).
"""

from __future__ import annotations

import random

from a5core.data.arithmetic import SOLUTIONS, arithmetic_problems
from a5core.data.files import PROBLEM_LOADERS, DataError, Problem, Trace, load_sft_traces
from a5core.data.prompts import PromptTemplate
from a5core.data.sft_data import math_solution_traces


def load_problem_set(source: str, data_format: str, seed: int, split: str) -> list[Problem]:
    """A MATH/GSM8K file or dataset id, or ``arithmetic:N:DIGITS`` (the ``split`` of the generated task;
    ``arithmetic:N:LOW-HIGH``: N problems at each digit count from LOW to HIGH, level = the digit count, for
    a curriculum); shuffled with ``seed`` (MATH files are ordered by subject: a prefix of the shuffled list
    is a fair subset)."""
    if source.startswith("arithmetic:"):
        problems = _arithmetic(source, seed, split)
    else:
        problems = PROBLEM_LOADERS[data_format](source)
    return random.Random(seed).sample(problems, len(problems))


# The validation set's draw and order, whatever a run's seed: runs of several seeds score the same problems
# (the seed changes sampling and training order, not which problems score), so their results pair problem by problem.
VALIDATION_SEED = 0


def load_validation_set(source: str, data_format: str) -> list[Problem]:
    """The validation problems of ``source`` (as :func:`load_problem_set`), drawn and ordered with
    :data:`VALIDATION_SEED`: the same problems, in the same order, for every run seed."""
    return load_problem_set(source, data_format, VALIDATION_SEED, "validation")


def hold_out(train: list[Problem], n: int, scored: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    """(the problems to train on, the selection split): the last ``n`` problems (at most half) of the (shuffled)
    train set are held out of training to choose a checkpoint or setting on, less any whose question is also in
    ``scored``, so the split that gives the reported score never takes part in the choice. ValueError when
    none is left to select on."""
    n = min(n, len(train) // 2)
    questions = {p.problem for p in scored}
    selection = [p for p in train[len(train) - n :] if p.problem not in questions]
    if not selection:
        raise ValueError(f"no train problem left to select on ({len(train)} problems, {n} held out, all scored)")
    return train[: len(train) - n], selection


def split_validation(problems: list[Problem], n: int, limit: int | None) -> tuple[list[Problem], list[Problem]]:
    """(the selection split, the score split) of the (shuffled) validation problems: the last ``n`` (at most half
    of them) choose a setting or checkpoint, the first ``limit`` of the rest (all if None) give the reported
    score; disjoint, so the problems that score a choice take no part in it. ValueError under two problems."""
    if len(problems) < 2:
        raise ValueError(f"{len(problems)} validation problem(s): a selection and a score split need two at least")
    n = min(n, len(problems) // 2)
    return problems[-n:], problems[:-n][:limit]


def load_trace_set(source: str, template: PromptTemplate, seed: int) -> list[Trace]:
    """SFT traces: a prompt/response/ground_truth file, or ``arithmetic:N:DIGITS``: N generated train
    problems of the arithmetic task as r1_zero traces (their one-line solution as the reasoning), the
    format a small model learns from a few dozen of; ``arithmetic:N:DIGITS:columns``: the reasoning works
    the sum or difference column by column, with its carries and borrows."""
    if not source.startswith("arithmetic:"):
        return load_sft_traces(source)
    return math_solution_traces(_arithmetic(source, seed, "train"), template)[0]


def arithmetic_spec(source: str) -> tuple[int, int, int, str]:
    """(N, LOW, HIGH, SOLUTION) of ``arithmetic:N:DIGITS`` (LOW = HIGH = DIGITS) or ``arithmetic:N:LOW-HIGH``,
    each with an optional ``:line`` (the default) or ``:columns``; DataError naming the source otherwise."""
    spec = source.split(":")
    solution = spec.pop() if len(spec) == 4 and spec[3] in SOLUTIONS else "line"
    digits = spec[2].split("-") if len(spec) == 3 else []
    parts = [spec[1], *digits] if len(spec) == 3 and len(digits) in (1, 2) else []
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts) or int(digits[0]) > int(digits[-1]):
        raise DataError(
            f"{source}: expected arithmetic:N:DIGITS (or arithmetic:N:LOW-HIGH) with N and DIGITS positive integers,"
            f" then optionally :{' or :'.join(SOLUTIONS)}"
        )
    return int(spec[1]), int(digits[0]), int(digits[-1]), solution


def _arithmetic(source: str, seed: int, split: str) -> list[Problem]:
    """The problems of an ``arithmetic:`` source: one block of N a digit count (one block: as
    :func:`a5core.data.arithmetic.arithmetic_problems` gives it; several: a problem drawn again at a higher digit
    count kept at the lower)."""
    n, low, high, solution = arithmetic_spec(source)
    if low == high:
        return arithmetic_problems(n, digits=low, seed=seed, split=split, solution=solution)
    problems, seen = [], set()
    for digits in range(low, high + 1):
        for problem in arithmetic_problems(n, digits=digits, seed=seed, split=split, solution=solution):
            if problem.unique_id not in seen:
                seen.add(problem.unique_id)
                problems.append(problem)
    return problems
