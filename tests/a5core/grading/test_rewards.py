"""The reward functions by name (a5core.grading.rewards): the arithmetic task's graders want the number itself, in
the answer format of the prompt they read."""

import pytest

from a5core.grading.grader import r1_zero_reward_fn


def test_arithmetic_reward_wants_the_number_itself():
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
