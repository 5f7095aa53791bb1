"""The reward functions by name, as settings give them: the MATH grader's (:mod:`a5core.grading.grader`) and the
arithmetic task's own (:mod:`a5core.data.arithmetic`), which wants the number itself; and which prompt's answer
format each reads.

Each takes ``(response, ground_truth)`` and returns ``{"format_reward", "answer_reward", "reward"}`` in {0, 1}.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Any, Literal

from a5core.grading.grader import (
    extract_question_only_answer,
    extract_r1_zero_answer,
    question_only_reward_fn,
    r1_zero_reward_fn,
)

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


def _integer_reward(formatted: bool, answer: str | None, ground_truth: str) -> dict[str, float]:
    """Reward 1 when the response is ``formatted`` and its extracted ``answer`` *is* the integer
    ``ground_truth``; ValueError if ``ground_truth`` is not an integer."""
    truth = _integer_digits(ground_truth)
    if truth is None:
        raise ValueError(f"arithmetic ground truth must be an integer, got {str(ground_truth)[:50]!r}")
    match = _INTEGER_ANSWER.match(answer or "")
    correct = formatted and match is not None and _integer_digits(match.group(1)) == truth
    return {"format_reward": float(formatted), "answer_reward": float(correct), "reward": float(correct)}


def arithmetic_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """The r1_zero format rule, then the answer must *be* the integer: a literal such as ``68``, ``$-12$``
    or ``\\boxed{68}``, not an expression equal to it: the MATH grader accepts ``$58 + 74$`` for 132, and GRPO
    graded by it learns to copy the question's expression (``docs/learning_runs.md``).

    Integers are compared as canonical digit strings, so an answer of any length grades (a 5,000-digit
    one is 0 or 1, never an error). Raises ValueError if ``ground_truth`` is not an integer.
    """
    return _integer_reward(*extract_r1_zero_answer(response), ground_truth)


def arithmetic_question_only_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """:func:`arithmetic_reward_fn` for the question_only prompt's format: the answer is the last
    ``\\boxed{}`` of the response (formatted iff there is one), and it must be the integer itself."""
    return _integer_reward(*extract_question_only_answer(response), ground_truth)


REWARD_FNS: dict[str, Callable[[str, Any], dict[str, float]]] = {
    "r1_zero": r1_zero_reward_fn,
    "question_only": question_only_reward_fn,
    "arithmetic": arithmetic_reward_fn,
    "arithmetic_question_only": arithmetic_question_only_reward_fn,
}
RewardName = Literal[tuple(REWARD_FNS)]  # a grader's name, as settings give it
# The arithmetic task's grader for each built-in prompt's answer format (the MATH graders accept a copied expression)
ARITHMETIC_GRADERS = {"r1_zero": "arithmetic", "question_only": "arithmetic_question_only"}
# The built-in prompt whose answer format each grader reads
GRADER_PROMPTS = {"r1_zero": "r1_zero", "question_only": "question_only"} | {
    grader: prompt for prompt, grader in ARITHMETIC_GRADERS.items()
}
