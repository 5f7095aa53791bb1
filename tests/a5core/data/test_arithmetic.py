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


def test_a_problem_has_one_id_in_every_seeds_draw():
    """Ids name the problem, not its place in a draw: a difficulty table or per-problem result made under one
    seed matches the same problems under another."""
    draws = [{p.unique_id: p.problem for p in arithmetic_problems(60, digits=1, seed=seed)} for seed in (0, 1)]
    shared = draws[0].keys() & draws[1].keys()
    assert shared and all(draws[0][uid] == draws[1][uid] for uid in shared)
    assert len({p.problem for p in arithmetic_problems(60, digits=1, seed=0)}) == len(draws[0]) == 60
