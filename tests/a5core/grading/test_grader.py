"""The grader's mechanics: extraction rules, the real validation answers, deadlines, threads, batches.

The per-answer-type corpus lives in test_grader_cases.py.
"""

import json
import threading
import time

import pytest

from a5core.grading.grader import (
    SymbolicGrader,
    answers_equivalent_batch,
    extract_boxed,
    extract_r1_zero_answer,
    grade_batch,
    normalize_answer,
    question_only_reward_fn,
    r1_zero_reward_fn,
)

ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
FORMAT_ONLY = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
CORRECT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}


def test_all_validation_solutions_grade_correct(shared_data):
    rows = [json.loads(line) for line in (shared_data / "math/validation.jsonl").open()]
    responses = [f"{r['solution']} </think> <answer> {extract_boxed(r['solution'])} </answer>" for r in rows]
    rewards = r1_zero_reward_fn.batch(responses, [r["answer"] for r in rows])
    wrong = [r["unique_id"] for r, reward in zip(rows, rewards, strict=True) if reward != CORRECT]
    assert len(rows) == 5000 and wrong == []


def test_r1_zero_extraction_rules():
    assert extract_r1_zero_answer("a </think> <answer> 5 </answer>") == (True, "5")
    assert extract_r1_zero_answer("a </think><answer> 5 </answer>") == (False, None)  # needs the space
    assert extract_r1_zero_answer("a </think> <answer> 5") == (False, None)
    assert extract_r1_zero_answer("</answer> a </think> <answer> 5") == (False, None)  # close before open
    assert extract_r1_zero_answer("</think> <answer> 1 </answer> <answer> 2 </answer>") == (True, "2")
    assert extract_r1_zero_answer("</think> <answer> so \\boxed{7} </answer>") == (True, "7")
    assert extract_r1_zero_answer("</think> <answer> \\boxed{7 </answer>") == (True, None)


def test_reward_fns_on_formats():
    assert r1_zero_reward_fn("x </think> <answer> 4 </answer>", "4") == CORRECT
    assert r1_zero_reward_fn("x </think> <answer> 5 </answer>", "4") == FORMAT_ONLY
    assert r1_zero_reward_fn("the answer is 4", "4") == ZERO
    assert r1_zero_reward_fn("x </think> <answer> 4 </answer>", 4) == CORRECT
    assert r1_zero_reward_fn("x </think> <answer> 0.5 </answer>", 0.5) == CORRECT
    assert r1_zero_reward_fn("x </think> <answer> 3 </answer>", ["4", "3"]) == CORRECT
    assert question_only_reward_fn("so $\\boxed{\\frac{1}{2}}$.", "0.5") == CORRECT
    assert question_only_reward_fn("so 1/2", "0.5") == ZERO
    with pytest.raises(TypeError, match="ground truth must be"):
        r1_zero_reward_fn("x </think> <answer> 4 </answer>", None)


def test_normalize_answer_hendrycks_rules():
    cases = {
        "\\dfrac{1}{2}": "\\frac{1}{2}",
        "\\tfrac12": "\\frac{1}{2}",
        "1/2": "\\frac{1}{2}",
        "0.5": "\\frac{1}{2}",
        "5.0": "5",
        "2.50": "2.5",
        "1,000": "1000",
        "\\$5": "5",
        "10\\%": "10",
        "90^\\circ": "90",
        "5 \\text{ cm}": "5",
        "\\text{(B)}": "B",
        "(c)": "C",
        "x = 3": "x=3",
        "\\left( 1, 2 \\right)": "(1,2)",
        "\\sqrt3": "\\sqrt{3}",
        ".5": "\\frac{1}{2}",
        "7.": "7",
        "\\!1\\,000": "1000",
    }
    assert {raw: normalize_answer(raw) for raw in cases} == cases


def test_cheap_rules_units_bases_equations_numbers():
    assert answers_equivalent_batch(
        [
            ("25 \\text{ feet}", "25 \\text{ ft}"),
            ("25 \\text{ inches}", "25 \\text{ ft}"),
            ("9 \\text{ cm}^2", "9"),
            ("1011_2", "1011_{2}"),
            ("1011_3", "1011_2"),
        ]
    ) == [True, False, True, True, False]
    assert answers_equivalent_batch([("x = 3", "3"), ("3", "k=3"), ("x=-\\frac14", "y=-\\frac{1}{4}")]) == [
        True,
        True,
        False,
    ]
    assert answers_equivalent_batch(
        [("0.333333", "\\frac{1}{3}"), ("0.25", "\\frac{1}{4}"), ("\\frac{12}{5525}", "\\frac{12}{5,\\!525}")]
    ) == [False, True, True]
    assert answers_equivalent_batch(
        [("12", "(-6, 10)"), ("(1,2)", "1"), ("\\frac{2000}{6}", "\\frac{1{,}000}{3}")]
    ) == [False, False, True]


def test_pathological_answers_grade_zero_within_the_deadline():
    grader = SymbolicGrader(workers=1, deadline_s=1.0)
    try:
        start = time.monotonic()
        assert answers_equivalent_batch([("9^{9^{9^{9}}}", "3"), ("\\frac{1}{2}", "0.5")], grader) == [False, True]
        assert time.monotonic() - start < 15  # one deadline plus a worker restart, not a hang
        # The pool recovered: the killed worker was replaced and grades again.
        assert answers_equivalent_batch([("2\\sqrt{2}", "\\sqrt{8}")], grader) == [True]
    finally:
        grader.close()
    huge = "1+" * 50_000 + "1"
    assert r1_zero_reward_fn(f"</think> <answer> {huge} </answer>", "3") == FORMAT_ONLY


def test_grading_from_threads_off_the_main_thread():
    results, errors = [], []

    def work(i):
        try:
            results.append(r1_zero_reward_fn(f"</think> <answer> \\frac{{{i}}}{{{2 * i}}} </answer>", "1/2"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [CORRECT] * 8


def test_batch_equals_one_by_one():
    responses = [f"</think> <answer> {a} </answer>" for a in ["\\sqrt{8}", "3", "x=2", "(1,2)", "A"]]
    truths = ["2\\sqrt{2}", "4", "2", "(1, 2)", "\\text{(A)}"]
    batched = grade_batch(r1_zero_reward_fn, responses, truths)
    assert batched == [r1_zero_reward_fn(r, t) for r, t in zip(responses, truths, strict=True)]
    assert [b["reward"] for b in batched] == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert grade_batch(lambda r, t: {"reward": 1.0}, ["a"], ["b"]) == [{"reward": 1.0}]
