"""SFT trace sets (a5core.data.sft_data): MATH solutions as traces, imported traces, dedup and the grader's filter."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from a5core.data.files import DataError, Problem, Trace, load_math, load_sft_traces
from a5core.data.prompts import load_prompt
from a5core.data.sft_data import dedup_traces, filter_correct, import_traces, math_solution_traces, r1_zero_response
from a5core.grading.grader import extract_r1_zero_answer, question_only_reward_fn, r1_zero_reward_fn

R1 = load_prompt("r1_zero")
QUESTION_ONLY = load_prompt("question_only")
EMPTY_BOX_IDS = ["train/number_theory/7115.json", "train/number_theory/7117.json"]


@pytest.fixture(scope="module")
def teacher_file(shared_data) -> Path:
    return shared_data / "sft" / "teacher_traces_sample.jsonl"


@pytest.fixture(scope="module")
def math_train(shared_data) -> list[Problem]:
    return load_math(shared_data / "math" / "train.jsonl")


# ------------------------------------------------------------------------------ MATH solutions


def test_every_math_train_solution_becomes_a_trace_that_grades_one(math_train):
    traces, skipped = math_solution_traces(math_train, R1)
    assert len(math_train) == 7500 and skipped == EMPTY_BOX_IDS and len(traces) == 7498
    kept = [p for p in math_train if p.unique_id not in skipped]
    for problem, trace in zip(kept, traces, strict=True):
        assert trace.prompt == R1.format(problem.problem) and trace.prompt.endswith("Assistant: <think>")
        assert trace.response.startswith(" " + problem.solution.strip() + " </think> <answer> ")
        assert (
            trace.response.endswith(f" <answer> {problem.answer.strip()} </answer>")
            and trace.ground_truth == problem.answer
        )
    rewards = r1_zero_reward_fn.batch([t.response for t in traces], [t.ground_truth for t in traces])
    assert all(r == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0} for r in rewards)
    # as question_only traces (the solution itself), each grades 1 by question_only's grader
    bare, _ = math_solution_traces(math_train, QUESTION_ONLY)
    rewards = question_only_reward_fn.batch([t.response for t in bare], [t.ground_truth for t in bare])
    assert len(bare) == 7498 and all(r["reward"] == 1.0 for r in rewards)


def test_the_response_convention_matches_the_teacher_traces(teacher_file):
    teacher = load_sft_traces(teacher_file)
    accepted = [
        t
        for t, r in zip(
            teacher,
            r1_zero_reward_fn.batch([t.response for t in teacher], [t.ground_truth for t in teacher]),
            strict=True,
        )
        if r["format_reward"]
    ]
    # The teacher's graded responses continue "<think>" with a space and end with "</answer>", as ours do.
    assert sum(t.response.startswith(" ") for t in accepted) / len(accepted) > 0.95
    assert all(t.response.endswith("</answer>") for t in accepted)
    assert r1_zero_response("  x = 2.\n", " 2 ") == " x = 2. </think> <answer> 2 </answer>"


def test_solutions_without_a_usable_box_are_skipped_and_named():
    problems = [
        Problem(str(i), f"q{i}", "", solution)
        for i, solution in enumerate(
            [
                "no box at all",
                "empty \\boxed{}",
                "blank \\boxed{ }",
                "unclosed \\boxed{3",
                "so \\boxed 5.",
                "\\fbox{7}",
                "\\boxed{1} then \\boxed{\\frac{1}{2}}",
            ]
        )
    ]
    traces, skipped = math_solution_traces(problems, R1)
    assert skipped == ["0", "1", "2", "3"]
    assert [t.response.split("<answer> ")[1] for t in traces] == [
        "5. </answer>",
        "7 </answer>",
        "\\frac{1}{2} </answer>",
    ]


def test_several_templates_take_turns_each_with_a_response_in_its_own_form():
    problems = [
        Problem(str(i), f"What is {i} + 1?", str(i + 1), solution)
        for i, solution in enumerate(
            [
                "So 0 + 1 = \\boxed{1}.",
                "Adding, we get \\boxed{2}.",
                "no box",  # skipped: it still takes its turn (r1_zero's)
                "Thus \\boxed{4}. ",
                "Adding one gives $\\boxed{5}$.\n",
            ]
        )
    ]
    traces, skipped = math_solution_traces(problems, R1, QUESTION_ONLY)
    assert skipped == ["2"]
    assert [t.prompt for t in traces] == [
        R1.format("What is 0 + 1?"),
        QUESTION_ONLY.format("What is 1 + 1?"),
        QUESTION_ONLY.format("What is 3 + 1?"),
        R1.format("What is 4 + 1?"),
    ]
    assert [t.response for t in traces] == [
        " So 0 + 1 = \\boxed{1}. </think> <answer> 1 </answer>",  # r1_zero asks for answer tags
        " Adding, we get \\boxed{2}.",  # question_only: the solution itself, its last box the answer
        " Thus \\boxed{4}.",
        " Adding one gives $\\boxed{5}$. </think> <answer> 5 </answer>",
    ]
    assert [t.ground_truth for t in traces] == ["1", "2", "4", "5"]
    graders = [r1_zero_reward_fn, question_only_reward_fn, question_only_reward_fn, r1_zero_reward_fn]
    assert all(grade(t.response, t.ground_truth)["reward"] == 1.0 for grade, t in zip(graders, traces, strict=True))
    assert math_solution_traces(problems, R1) == math_solution_traces(problems, R1, R1)  # one template: every problem
    with pytest.raises(ValueError, match="at least one template"):
        math_solution_traces(problems)


# ----------------------------------------------------------------------- imported traces, filter


def test_filter_keeps_exactly_the_teacher_traces_the_grader_accepts(teacher_file):
    traces = import_traces(teacher_file)
    kept, stats = filter_correct(traces)
    rewards = r1_zero_reward_fn.batch([t.response for t in traces], [t.ground_truth for t in traces])
    assert kept == [t for t, r in zip(traces, rewards, strict=True) if r["reward"] == 1.0]
    formatted = sum(r["format_reward"] for r in rewards)
    assert len(traces) == 1767 and formatted == 1439  # 328 write "\n</think>\n<answer>", which r1_zero rejects
    assert stats == {"raw": 1767, "filtered": len(kept), "kept_fraction": len(kept) / 1767, "format_rate": 1439 / 1767}
    assert 0.75 < stats["kept_fraction"] < 0.85
    # a wrong answer and a badly formatted right one are both dropped
    wrong = next(t for t in traces if t.ground_truth == "57" and extract_r1_zero_answer(t.response)[1] == "60")
    newline = next(t for t in traces if "\n</think>\n<answer>" in t.response)
    assert wrong not in kept and newline not in kept
    assert filter_correct([]) == ([], {"raw": 0, "filtered": 0, "kept_fraction": None, "format_rate": None})


def test_filter_grades_each_trace_by_the_grader_of_the_template_its_prompt_was_written_with():
    """A set written with both prompts keeps both halves' correct traces: r1_zero's tagged responses by r1_zero's
    grader, question_only's solutions by question_only's; without the templates, r1_zero grades every trace."""
    problems = [Problem(str(i), f"What is {i} + 1?", str(i + 1), f"It is \\boxed{{{i + 1}}}.") for i in range(4)]
    traces, _ = math_solution_traces(problems, R1, QUESTION_ONLY)
    wrong = [replace(t, ground_truth="99") for t in traces[:2]]  # one wrong answer in each form
    kept, stats = filter_correct([*traces, *wrong], R1, QUESTION_ONLY)
    assert kept == traces and stats["filtered"] == 4 and stats["format_rate"] == 1.0
    kept, stats = filter_correct([*traces, *wrong])
    assert kept == traces[0::2] and stats["format_rate"] == 3 / 6  # question_only's solutions lack r1_zero's tags


def test_import_can_rerender_prompts_with_the_project_template(teacher_file, math_train, tmp_path):
    raw, traces = import_traces(teacher_file), import_traces(teacher_file, R1)
    assert "</answer>.\n\nUser: " in raw[0].prompt  # the sample's own prompt differs from r1_zero.prompt
    questions = {p.problem for p in math_train}
    for before, after in zip(raw, traces, strict=True):
        assert after.response == before.response and after.ground_truth == before.ground_truth
        question = after.prompt[len(R1.text.split("{question}")[0]) : -len("\nAssistant: <think>")]
        assert after.prompt == R1.format(question) and question in questions
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": raw[0].prompt, "response": " a", "ground_truth": "1"})
        + "\n"
        + json.dumps({"prompt": "Q: 1+1?", "response": " a", "ground_truth": "2"})
        + "\n"
    )
    with pytest.raises(DataError, match=r"bad\.jsonl: record 2: prompt is not r1_zero-style"):
        import_traces(bad, R1)
    bad.write_text(json.dumps({"prompt": "p", "response": " a"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing key\(s\) 'ground_truth'"):
        import_traces(bad)


def test_dedup_drops_exact_repeats_in_order():
    a, b, c = Trace("p", " r1", "1"), Trace("p", " r2", "1"), Trace("q", " r1", "1")
    assert dedup_traces([a, b, a, c, b, Trace("p", " r1", "1")]) == ([a, b, c], 3)
    assert dedup_traces([Trace("p", " r1", "1"), Trace("p", " r1", "2")])[1] == 0  # a different truth is another trace


# ------------------------------------------------------------------------------------ distill


# --------------------------------------------------------------------------------------- CLI
