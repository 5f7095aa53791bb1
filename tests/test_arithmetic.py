import pytest

from a5core.arithmetic import arithmetic_problems
from a5core.grading import extract_boxed, r1_zero_reward_fn


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
    assert not {p.problem for p in arithmetic_problems(500, split="train")} & {p.problem for p in arithmetic_problems(500, split="validation")}
    assert validation[0].unique_id == "arithmetic/validation/0"
    with pytest.raises(ValueError, match="operations"):
        arithmetic_problems(5, operations="/")
    with pytest.raises(ValueError, match="only 84 distinct train problems"):
        arithmetic_problems(100, digits=1, operations="+")
    with pytest.raises(ValueError, match="split"):
        arithmetic_problems(5, split="test")
