"""A verifiable toy task the project generates itself: arithmetic problems in MATH's record format.

Small models (SmolLM2-135M, tiny test models) cannot solve MATH, so their learning runs need a task in
their reach. Each problem is "What is 23 + 45?" with answer "68" and a one-line solution ending in a
``\\boxed{}`` answer, so every MATH tool (loaders, solution → r1 traces, the grader) applies unchanged.

With ``solution="columns"`` the solution works the sum or difference column by column, ones first, with
its carries and borrows (:func:`column_solution`): SFT traces that show a small model the algorithm, not
only the answer.

Grade it with the task's own graders (:func:`a5core.grading.rewards.arithmetic_reward_fn`, and for the
question_only prompt's format :func:`a5core.grading.rewards.arithmetic_question_only_reward_fn`), not the MATH
grader: the MATH grader accepts any expression equal to the answer, so copying the question's "23 + 45" into
``<answer>`` scores, and RL finds that.
"""

from __future__ import annotations

import random
import zlib

from a5core.data.files import Problem

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


SPLITS = ("train", "validation")
SOLUTIONS = ("line", "columns")  # a problem's solution: one line, or worked column by column (+ and − only)
_PLACES = ("ones", "tens", "hundreds", "thousands")


def _place(i: int) -> str:
    return _PLACES[i] if i < len(_PLACES) else f"10^{i}s"


def _digit(n: int, i: int) -> int:
    return n // 10**i % 10


def _add_columns(a: int, b: int) -> list[str]:
    steps, carry = [], 0
    for i in range(max(len(str(a)), len(str(b)))):
        total = _digit(a, i) + _digit(b, i) + carry
        terms = f"{_digit(a, i)} + {_digit(b, i)}" + (" + 1" if carry else "")
        steps.append(f"{_place(i)}: {terms} = {total}, write {total % 10}" + (", carry 1" if total > 9 else ""))
        carry = total // 10
    if carry:
        steps.append(f"{_place(len(str(max(a, b))))}: write the carried 1")
    return steps


def _subtract_columns(a: int, b: int) -> list[str]:
    """a ≥ b ≥ 0."""
    steps, borrow = [], 0
    for i in range(len(str(a))):
        top, bottom = _digit(a, i), _digit(b, i)
        lent = f"{top} - 1 = {top - 1}, " if borrow else ""
        top -= borrow
        borrow = int(top < bottom)
        if borrow:
            steps.append(f"{_place(i)}: {lent}borrow: {top + 10} - {bottom} = {top + 10 - bottom}")
        else:
            steps.append(f"{_place(i)}: {lent}{top} - {bottom} = {top - bottom}")
    return steps


def column_solution(a: int, op: str, b: int) -> str:
    """The worked solution of ``a op b`` (a, b ≥ 0; op + or −), ones column first, ending in ``\\boxed{}``:

    ``57 + 68``: "Column by column, ones first. ones: 7 + 8 = 15, write 5, carry 1; tens: 5 + 6 + 1 = 12,
    write 2, carry 1; hundreds: write the carried 1. So $57 + 68 = \\boxed{125}$." A difference whose
    first term is the smaller is worked as the negated reverse difference. Every equation in it holds."""
    if op == "+":
        steps, result = _add_columns(a, b), a + b
    elif op == "-":
        steps, result = _subtract_columns(max(a, b), min(a, b)), a - b
    else:
        raise ValueError(f"column solutions are for + and -, not {op!r}")
    work = "Column by column, ones first. " + "; ".join(steps) + "."
    if result < 0:
        work = f"{a} < {b}, so subtract {a} from {b} and negate. " + work + f" So {b} - {a} = {-result}, and"
    else:
        work += " So"
    return f"{work} ${a} {op} {b} = \\boxed{{{result}}}$."


def _split_of(a: int, op: str, b: int) -> str:
    """A fixed, disjoint assignment: one problem in five is validation, whatever the seed."""
    return "validation" if zlib.crc32(f"{a}{op}{b}".encode()) % 5 == 0 else "train"


def arithmetic_problems(
    n: int, digits: int = 2, operations: str = "+-", seed: int = 0, split: str = "train", solution: str = "line"
) -> list[Problem]:
    """``n`` distinct problems ``a op b`` with operands of up to ``digits`` digits, seeded; ``solution``
    "line" (``$a op b = \\boxed{r}$.``) or "columns" (:func:`column_solution`; needs operations + and −).

    The train and validation splits never share a problem. ``unique_id`` names the problem itself,
    ``arithmetic/{split}/{a}{op}{b}`` (the same problem has the same id in any seed's draw: difficulty tables and
    per-problem results of runs of other seeds match it); level is the digit count; subject "arithmetic".
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = set(operations) - set(OPERATIONS)
    if unknown or not operations:
        raise ValueError(f"operations must be drawn from {''.join(OPERATIONS)}, got {operations!r}")
    if solution not in SOLUTIONS or (solution == "columns" and "*" in operations):
        raise ValueError(f"solution must be one of {SOLUTIONS} (columns: for + and - only), got {solution!r}")
    if n < 1 or digits < 1:
        raise ValueError(f"n and digits must be ≥ 1, got n={n}, digits={digits}")
    rng = random.Random(f"{seed}/{split}")
    high = 10**digits - 1
    _check_drawable(n, digits, operations, split)
    seen: set[tuple[int, str, int]] = set()
    problems = []
    while len(problems) < n:
        a, op, b = rng.randint(0, high), rng.choice(operations), rng.randint(0, high)
        if (a, op, b) in seen or _split_of(a, op, b) != split:
            continue
        seen.add((a, op, b))
        result = OPERATIONS[op](a, b)
        problems.append(
            Problem(
                unique_id=f"arithmetic/{split}/{a}{op}{b}",
                problem=f"What is ${a} {op} {b}$?",
                answer=str(result),
                solution=column_solution(a, op, b)
                if solution == "columns"
                else f"${a} {op} {b} = \\boxed{{{result}}}$.",
                subject="arithmetic",
                level=digits,
            )
        )
    return problems


# Sizes the generator draws in seconds: at most MAX_PROBLEMS problems; the problems of a split counted one by one
# where there are at most EXACT_COUNT of them in all (a second), else taken as the split's share of them (crc32
# spreads a large space evenly); and at most half of them, so that drawing at random rarely draws one again.
MAX_PROBLEMS = 1_000_000
EXACT_COUNT = 1_000_000


def _check_drawable(n: int, digits: int, operations: str, split: str) -> None:
    """ValueError, before any is drawn, for ``n`` problems the generator cannot draw in reasonable time: more
    than :data:`MAX_PROBLEMS`, more than the split holds, or more than half of a split too large to count."""
    if n > MAX_PROBLEMS:
        raise ValueError(f"{n:,} problems: the arithmetic task generates at most {MAX_PROBLEMS:,} at a time")
    space = 10 ** (2 * digits) * len(operations)
    if space <= EXACT_COUNT:
        high = 10**digits - 1
        pairs = ((a, op, b) for a in range(high + 1) for op in operations for b in range(high + 1))
        available = sum(_split_of(*pair) == split for pair in pairs)
        if n > available:
            raise ValueError(
                f"only {available} distinct {split} problems exist for digits={digits}, operations={operations!r}"
            )
        return
    about = space // 5 if split == "validation" else space * 4 // 5
    if n > about // 2:
        raise ValueError(
            f"{n:,} problems: more than half of the about {about:,} distinct {split} problems of digits={digits}, "
            f"operations={operations!r}, which drawing at random does not find in reasonable time; ask for fewer"
        )
