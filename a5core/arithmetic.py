"""A verifiable toy task the project generates itself: arithmetic problems in MATH's record format.

Small models (SmolLM2-135M, tiny test models) cannot solve MATH, so their learning runs need a task in
their reach. Each problem is "What is 23 + 45?" with answer "68" and a one-line solution ending in a
``\\boxed{}`` answer, so every MATH tool (loaders, solution → r1 traces, the grader) applies unchanged.

Grade it with :func:`arithmetic_reward_fn`, not the MATH grader: the MATH grader accepts any expression
equal to the answer, so copying the question's "23 + 45" into ``<answer>`` scores, and RL finds that.
"""

from __future__ import annotations

import random
import re
import unicodedata
import zlib

from a5core.data import Problem
from a5core.grading import extract_r1_zero_answer

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


SPLITS = ("train", "validation")


def _split_of(a: int, op: str, b: int) -> str:
    """A fixed, disjoint assignment: one problem in five is validation, whatever the seed."""
    return "validation" if zlib.crc32(f"{a}{op}{b}".encode()) % 5 == 0 else "train"


def arithmetic_problems(
    n: int, digits: int = 2, operations: str = "+-", seed: int = 0, split: str = "train"
) -> list[Problem]:
    """``n`` distinct problems ``a op b`` with operands of up to ``digits`` digits, seeded.

    The train and validation splits never share a problem. ``unique_id`` is ``arithmetic/{split}/{i}``;
    level is the digit count; subject "arithmetic".
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = set(operations) - set(OPERATIONS)
    if unknown or not operations:
        raise ValueError(f"operations must be drawn from {''.join(OPERATIONS)}, got {operations!r}")
    if n < 1 or digits < 1:
        raise ValueError(f"n and digits must be ≥ 1, got n={n}, digits={digits}")
    rng = random.Random(f"{seed}/{split}")
    high = 10**digits - 1
    available = sum(_split_of(a, op, b) == split for a in range(high + 1) for op in operations for b in range(high + 1))
    if n > available:
        raise ValueError(
            f"only {available} distinct {split} problems exist for digits={digits}, operations={operations!r}"
        )
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
                unique_id=f"arithmetic/{split}/{len(problems)}",
                problem=f"What is ${a} {op} {b}$?",
                answer=str(result),
                solution=f"${a} {op} {b} = \\boxed{{{result}}}$.",
                subject="arithmetic",
                level=digits,
            )
        )
    return problems


_INTEGER_ANSWER = re.compile(r"^\$?\s*(-?\d+)\s*\$?$")
_INTEGER = re.compile(r"\s*([+-]?)(\d+(?:_\d+)*)\s*")  # what int() accepts in base 10


def _integer_digits(value: str | int) -> str | None:
    """The canonical decimal form of an integer (sign, then digits without leading zeros; ``-0`` is ``0``),
    or None if ``value`` is not one.

    Accepts what ``int()`` accepts (surrounding whitespace, a sign, underscores between digits, any
    script's decimal digits) but works on the text, with no length limit: ``int()`` refuses more than
    4,300 digits (``sys.get_int_max_str_digits``), and a model can write that many. An ``int`` goes
    through ``str``, so it is held to that limit (the project's ground truths are strings).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    match = _INTEGER.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        return None
    sign, digits = match.groups()
    digits = digits.replace("_", "")
    if not digits.isascii():
        digits = "".join(str(unicodedata.decimal(char)) for char in digits)
    digits = digits.lstrip("0") or "0"
    return "-" + digits if sign == "-" and digits != "0" else digits


def arithmetic_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """The r1_zero format rule, then the answer must *be* the integer: a literal such as ``68``, ``$-12$``
    or ``\\boxed{68}``, not an expression equal to it (GRPO on the H200 learned to copy the question's
    expression within 30 steps when graded by the MATH grader, which accepts ``$58 + 74$`` for 132).

    Integers are compared as canonical digit strings, so an answer of any length grades (a 5,000-digit
    one is 0 or 1, never an error). Raises ValueError if ``ground_truth`` is not an integer.
    """
    truth = _integer_digits(ground_truth)
    if truth is None:
        raise ValueError(f"arithmetic ground truth must be an integer, got {str(ground_truth)[:50]!r}")
    formatted, answer = extract_r1_zero_answer(response)
    match = _INTEGER_ANSWER.match(answer or "")
    correct = formatted and match is not None and _integer_digits(match.group(1)) == truth
    return {"format_reward": float(formatted), "answer_reward": float(correct), "reward": float(correct)}
