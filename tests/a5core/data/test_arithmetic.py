import pytest

from a5core.data.arithmetic import arithmetic_problems
from a5core.grading.grader import extract_boxed, r1_zero_reward_fn


def test_problems_are_distinct_seeded_and_correct():
    problems = arithmetic_problems(200, digits=2, operations="+-*", seed=3)
    assert len({p.problem for p in problems}) == 200
    assert problems == arithmetic_problems(200, digits=2, operations="+-*", seed=3)
    assert problems != arithmetic_problems(200, digits=2, operations="+-*", seed=4)
    for p in problems:
        a, op, b = p.problem.removeprefix("What is $").removesuffix("$?").split()
        assert int(p.answer) == eval(f"{a} {op} {b}")  # noqa: S307 - trusted, generated here
        assert extract_boxed(p.solution) == p.answer
        assert r1_zero_reward_fn(f" {p.solution} </think> <answer> {p.answer} </answer>", p.answer)["reward"] == 1.0


def test_splits_differ_and_bad_arguments_fail():
    validation = arithmetic_problems(50, split="validation")
    assert not {p.problem for p in arithmetic_problems(500, split="train")} & {
        p.problem for p in arithmetic_problems(500, split="validation")
    }
    first = validation[0]
    expression = first.problem.removeprefix("What is $").removesuffix("$?")
    assert first.unique_id == "arithmetic/validation/" + expression.replace(" ", "")
    with pytest.raises(ValueError, match="operations"):
        arithmetic_problems(5, operations="/")
    with pytest.raises(ValueError, match="only 84 distinct train problems"):
        arithmetic_problems(100, digits=1, operations="+")
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(5, split="test")


def test_arithmetic_reward_wants_the_number_itself():
    from a5core.grading.grader import r1_zero_reward_fn
    from a5core.grading.rewards import arithmetic_reward_fn

    def respond(answer):
        return f" 58 + 74 is 132 </think> <answer> {answer} </answer>"

    for answer in ("132", "$132$", "\\boxed{132}", " 132 "):
        assert arithmetic_reward_fn(respond(answer), "132")["reward"] == 1.0, answer
    for answer in ("$58 + 74$", "131", "132.0", "2*66", ""):
        assert arithmetic_reward_fn(respond(answer), "132")["reward"] == 0.0, answer
    assert arithmetic_reward_fn(respond("-5"), "-5")["reward"] == 1.0
    assert arithmetic_reward_fn("132", "132") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
    # The MATH grader accepts the copied expression: the hack this reward closes.
    assert r1_zero_reward_fn(respond("$58 + 74$"), "132")["reward"] == 1.0


def test_arithmetic_question_only_reward_reads_the_box_and_wants_the_number():
    from a5core.grading.grader import question_only_reward_fn
    from a5core.grading.rewards import arithmetic_question_only_reward_fn as reward

    assert reward("58 + 74 = 132, so $\\boxed{132}$.", "132")["reward"] == 1.0
    assert reward("first \\boxed{131}, no: \\boxed{132}", "132")["reward"] == 1.0  # the last box
    copied = "The answer is $\\boxed{58 + 74}$."
    assert reward(copied, "132") == {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    assert question_only_reward_fn(copied, "132")["reward"] == 1.0  # the MATH grader takes the copy
    assert reward("132", "132") == {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}  # no box
    with pytest.raises(ValueError, match="must be an integer"):
        reward("\\boxed{1}", "1/2")


def test_arithmetic_reward_grades_answers_of_any_length():
    """int() refuses more than 4,300 digits; a hostile 5,000-digit answer must grade, not raise."""
    from a5core.grading.rewards import arithmetic_reward_fn

    def respond(answer):
        return f"long </think> <answer> {answer} </answer>"

    huge = "9" * 5000
    format_only = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}
    correct = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    assert arithmetic_reward_fn(respond(huge), "132") == format_only
    assert arithmetic_reward_fn(respond(f"$-{huge}$"), "-5") == format_only
    # A ground truth that long grades too: equal only to the same integer.
    assert arithmetic_reward_fn(respond(huge), huge) == correct
    assert arithmetic_reward_fn(respond("00" + huge), huge) == correct  # leading zeros, as int() reads them
    assert arithmetic_reward_fn(respond(huge[:-1] + "8"), huge) == format_only
    assert arithmetic_reward_fn(respond("-" + huge), huge) == format_only
    assert arithmetic_reward_fn(respond("132"), "-" + huge) == format_only
    # The short cases keep int()'s reading: signs, leading zeros, -0.
    assert arithmetic_reward_fn(respond("007"), "7") == correct
    assert arithmetic_reward_fn(respond("-0"), "0") == correct
    assert arithmetic_reward_fn(respond("132"), " +132 ") == correct
    assert arithmetic_reward_fn(respond("-7"), "7") == format_only
    with pytest.raises(ValueError, match="ground truth must be an integer"):
        arithmetic_reward_fn(respond("1"), "1/2")


def test_column_solutions_box_the_result_and_every_equation_and_written_digit_holds():
    import re

    from a5core.data.arithmetic import column_solution

    assert column_solution(57, "+", 68) == (
        "Column by column, ones first. ones: 7 + 8 = 15, write 5, carry 1; tens: 5 + 6 + 1 = 12, write 2, carry 1;"
        " hundreds: write the carried 1. So $57 + 68 = \\boxed{125}$."
    )
    for a in range(100):
        for b in range(100):
            for op, result in (("+", a + b), ("-", a - b)):
                text = column_solution(a, op, b)
                assert extract_boxed(text) == str(result), text
                equations = re.findall(r"(-?\d+(?: [+-] \d+)+) = (-?\d+)", text)
                assert equations and all(eval(lhs) == int(rhs) for lhs, rhs in equations), text  # noqa: S307
                if op == "+":  # the written digits, ones first, and a final carry spell the sum
                    written = re.findall(r"write (\d)\b|write the carried (1)", text)
                    assert int("".join(d or c for d, c in reversed(written))) == result, text
    with pytest.raises(ValueError, match="for \\+ and -"):
        column_solution(3, "*", 4)
    with pytest.raises(ValueError, match="columns: for \\+ and - only"):
        arithmetic_problems(5, operations="+*", solution="columns")


def test_arithmetic_sources_with_column_solutions():
    from a5core.data.problem_sets import load_problem_set, load_trace_set
    from a5core.data.prompts import load_prompt
    from a5core.grading.rewards import arithmetic_reward_fn

    line = load_problem_set("arithmetic:20:2", "math", seed=1, split="train")
    columns = load_problem_set("arithmetic:20:2:columns", "math", seed=1, split="train")
    assert [(p.unique_id, p.problem, p.answer) for p in columns] == [(p.unique_id, p.problem, p.answer) for p in line]
    assert all(p.solution.startswith(("Column by column", f"{p.problem[9:].split()[0]} <")) for p in columns)
    traces = load_trace_set("arithmetic:20:1-2:columns", load_prompt("r1_zero"), seed=0)
    assert len(traces) > 20 and all("ones: " in t.response for t in traces)
    assert all(arithmetic_reward_fn(t.response, t.ground_truth)["reward"] == 1.0 for t in traces)


def test_a_problem_has_one_id_in_every_seeds_draw():
    """Ids name the problem, not its place in a draw: a difficulty table or per-problem result made under one
    seed matches the same problems under another."""
    draws = [{p.unique_id: p.problem for p in arithmetic_problems(60, digits=1, seed=seed)} for seed in (0, 1)]
    shared = draws[0].keys() & draws[1].keys()
    assert shared and all(draws[0][uid] == draws[1][uid] for uid in shared)
    assert len({p.problem for p in arithmetic_problems(60, digits=1, seed=0)}) == len(draws[0]) == 60
