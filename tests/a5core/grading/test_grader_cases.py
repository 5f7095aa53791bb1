"""Data-driven grading corpus: real MATH validation answers and perturbations of them.

Each line of data/grading_cases.jsonl is one (response, ground_truth, expected) case; expectations are
the mathematically right verdicts, not whatever the grader happens to say.
"""

import json
from pathlib import Path

import pytest

from a5core.grading.rewards import REWARD_FNS

CASES = [
    json.loads(line)
    for line in (Path(__file__).resolve().parents[2] / "data" / "grading_cases.jsonl").open()
    if line.strip()
]

KINDS = {
    "integer",
    "thousands",
    "decimal",
    "fraction",
    "negative_fraction",
    "radical",
    "pi",
    "expression",
    "equation",
    "tuple",
    "interval",
    "set",
    "matrix",
    "solution_list",
    "degrees",
    "percent",
    "dollars",
    "text",
    "units",
    "multiple_choice",
    "base_n",
    "large_number",
    "infinity",
    "complex",
    "left_right",
    "spacing",
    "trailing_period",
    "format",
    "question_only",
    "gt_int",
    "gt_float",
    "gt_list",
    "gt_boxed",
    "adversarial",
}


def test_corpus_size_and_coverage():
    assert len(CASES) >= 150
    assert len({c["id"] for c in CASES}) == len(CASES), "case ids must be unique"
    assert {c["kind"] for c in CASES} == KINDS
    for case in CASES:
        assert case["fn"] in REWARD_FNS
        assert case["source"] == "handmade" or case["source"].startswith("validation:")


def _param(case):
    """A case with a ``known_weakness`` is a strict xfail: the day the grader gets it right, it fails."""
    marks = [pytest.mark.xfail(strict=True, reason=case["known_weakness"])] if "known_weakness" in case else []
    return pytest.param(case, id=case["id"], marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_grading_case(case):
    got = REWARD_FNS[case["fn"]](case["response"], case["ground_truth"])
    expected = case["expected"]
    assert got == {
        "format_reward": expected["format_reward"],
        "answer_reward": expected["answer_reward"],
        "reward": expected["answer_reward"],
    }
