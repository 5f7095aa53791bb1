"""evaluate / summarize / case_report over a scripted engine (the engines are tested in test_rollout.py)."""

import json
import subprocess
import sys
from pathlib import Path

from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.engines import Completion, SamplingSettings
from a5core.evaluation.case_report import case_report
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn
from a5core.grading.lenient import lenient_answer


class ScriptedEngine:
    """Answers each prompt with the next scripted responses; records what it was asked."""

    def __init__(self, responses):
        self.responses = list(responses)
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((list(prompts), sampling))
        out = []
        for _ in prompts:
            texts = [self.responses.pop(0) for _ in range(sampling.n)]
            out.append(
                [Completion(text=t, token_ids=tuple(range(len(t.split()))), finish_reason="stop") for t in texts]
            )
        return out

    def load_weights(self, policy_model):
        raise NotImplementedError


PROBLEMS = [
    Problem("p1", "What is 1+1?", "2"),
    Problem("p2", "What is half of 1?", "\\frac{1}{2}"),
    Problem("p3", "3*3?", "9"),
]
RESPONSES = [
    "1+1=2 </think> <answer> 2 </answer>",  # format 1, answer 1
    "half is 0.5 </think> <answer> 0.5 </answer>",  # format 1, answer 1 (equivalent form)
    "3*3 is 6 </think> <answer> 6 </answer>",  # format 1, answer 0
    "the answer is $\\boxed{2}$",  # format 0: correct answer the format rejected
    "I think it is 1/3",  # format 0: model failure
    "3*3=9 </think><answer> 9 </answer>",  # format 0 (no space): correct, format failure
]


def test_evaluate_records_and_summary():
    engine = ScriptedEngine(RESPONSES)
    sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=64)
    records, summary = evaluate(engine, PROBLEMS, load_prompt("r1_zero"), r1_zero_reward_fn, sampling)
    prompts, used = engine.calls[0]
    assert used is sampling and prompts[0].endswith("User: What is 1+1?\nAssistant: <think>")
    assert [(r["unique_id"], r["sample"]) for r in records] == [
        ("p1", 0),
        ("p1", 1),
        ("p2", 0),
        ("p2", 1),
        ("p3", 0),
        ("p3", 1),
    ]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    # records pair responses with their own problem: p1 got RESPONSES[0:2], p2 RESPONSES[2:4], p3 RESPONSES[4:6]
    assert records[2]["ground_truth"] == "\\frac{1}{2}" and records[2]["response"] == RESPONSES[2]
    assert set(records[0]) >= {
        "prompt",
        "response",
        "ground_truth",
        "format_reward",
        "answer_reward",
        "reward",
        "response_tokens",
        "finish_reason",
    }
    assert summary["n_records"] == 6 and summary["n_problems"] == 3
    assert summary["count_format1_answer1"] == 1 and summary["count_format1_answer0"] == 2
    assert summary["count_format0_answer0"] == 3 and summary["finish_stop"] == 6
    assert abs(summary["accuracy"] - 1 / 6) < 1e-9 and abs(summary["format_rate"] - 0.5) < 1e-9


def test_lenient_answer():
    assert lenient_answer("so \\boxed{7} done") == "7"
    assert lenient_answer("</think><answer> 9 </answer>") == "9"
    assert lenient_answer("The answer is 12.") == "12"
    assert lenient_answer("no idea") is None
    assert lenient_answer("So the final answer is: $\\frac{1}{2}$.\nDone") == "\\frac{1}{2}"
    assert lenient_answer("I think the answer is 4. No wait, the ANSWER IS 5") == "5"
    assert lenient_answer("The answer is x = 3 \n\n.") == "x = 3"
    assert lenient_answer("the answer is 5\nbecause") == "5"  # the rest of its line
    assert lenient_answer("The answer is 3.5. Next") == "3.5"
    assert lenient_answer("The answer is $7$ ") == "7"


# Hostile shapes (whitespace runs, repeats), each (text of size n, its lenient answer).
ADVERSARIAL = {
    "spaces after the phrase": (lambda n: "The answer is" + " " * n + "x\nfoo", lambda n: "x"),
    "spaces inside the answer": (lambda n: "The answer is x" + " " * n + "y\nz", lambda n: "x" + " " * n + "y"),
    "many phrases on one line": (lambda n: "answer is x " * (n // 12) + "\nfoo", lambda n: "x"),
    "spaces before the phrase": (lambda n: " " * n + "The answer is 5.", lambda n: "5"),
    "newlines after the phrase": (lambda n: "The answer is" + "\n" * n, lambda n: None),
    "spaces around dollars": (lambda n: "The answer is: " + " " * (n // 2) + "$7$" + " " * (n // 2), lambda n: "7"),
    "many lines with trailing spaces": (
        lambda n: ("the answer is 3 " + " " * 50 + "\n") * (n // 67) + "the answer is 4.",
        lambda n: "4",
    ),
    "blank lines before the answer": (lambda n: "The answer is " + "\t \n" * (n // 3) + "x", lambda n: "x"),
}


def test_adversarial_shapes_read_as_a_person_would():
    for name, (make, expected) in ADVERSARIAL.items():
        for n in (20, 67, 300):
            assert lenient_answer(make(n)) == expected(n), (name, n)


def test_lenient_answer_finishes_on_200k_character_adversarial_responses():
    """The old regex took 50 s on "the answer is", 2,000 spaces and a line break (cubic): 200,000
    characters would take days. Linear, they take well under a second; in a child process with a 240 s
    guard, so that a regression fails instead of hanging the suite."""
    n = 200_000
    texts = [make(n) for make, _ in ADVERSARIAL.values()]
    child = (
        "import json, sys, time\n"
        "from a5core.grading.lenient import lenient_answer\n"
        "out = []\n"
        "for text in json.load(sys.stdin):\n"
        "    start = time.perf_counter()\n"
        "    out.append([lenient_answer(text), time.perf_counter() - start])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).resolve().parents[3],
        check=True,
    )
    results = json.loads(done.stdout.splitlines()[-1])
    assert [answer for answer, _ in results] == [expected(n) for _, expected in ADVERSARIAL.values()]
    assert all(len(text) >= 0.99 * n for text in texts)


def test_case_report_separates_format_from_model_failures():
    engine = ScriptedEngine(
        [
            "</think> <answer> 2 </answer>",
            "the answer is $\\boxed{2}$",
            "nothing useful",
            "</think><answer> \\frac12 </answer>",
            "</think> <answer> 8 </answer>",
            "9?",
        ]
    )
    records, _ = evaluate(engine, PROBLEMS, load_prompt("r1_zero"), r1_zero_reward_fn, SamplingSettings(n=2))
    report = case_report(records, per_category=5)
    assert "| format0_answer0 | 4 |" in report and "| format1_answer1 | 1 |" in report
    assert "Of the 4 format-0 responses, 2 contain a correct answer" in report
    assert "(correct: format failure)" in report and "No answer found in the text: model failure." in report
    assert "**Ground truth:** `\\frac{1}{2}`" in report


def test_log_generations_rows_and_length_metrics(tiny_model):
    from a5core.evaluation.generations import log_generations

    class CharTokenizer:  # one id per character, within the tiny model's 64-entry vocabulary
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[1 + ord(c) % 60 for c in t] for t in texts]}

    records = [
        {
            "unique_id": f"p{i}",
            "prompt": "Q?",
            "response": "x" * (i + 1),
            "ground_truth": "1",
            "format_reward": 1.0,
            "answer_reward": float(i % 2),
            "reward": float(i % 2),
            "response_tokens": i + 1,
            "finish_reason": "stop",
        }
        for i in range(4)
    ]
    rows, metrics = log_generations(tiny_model, CharTokenizer(), records, sample_size=3, seed=0)
    assert len(rows) == 3 and all(0 < r["mean_token_entropy"] <= 4.2 for r in rows)  # ≤ log(64)
    assert metrics["mean_response_tokens"] == 2.5
    assert metrics["mean_response_tokens_correct"] == 3.0 and metrics["mean_response_tokens_incorrect"] == 2.0
    assert 0 < metrics["mean_token_entropy"] <= 4.2


HOSTILE = (
    "```\n<img src=x onerror=alert(1)>\n```\n`` ` ``\n<script>alert(2)</script>\n\n# a heading\n"
    "[a link](javascript:alert(3))"
)


def rendered_html(markdown: str) -> str:
    """The page a CommonMark viewer shows (raw HTML allowed, as GitHub-style viewers allow it)."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(markdown)


def test_the_case_report_shows_hostile_text_as_text_never_as_html():
    """A problem holding a fenced block and HTML, an answer holding backticks, a hostile id and ground truth:
    each stays inside its code block or span, so the viewer renders no tag, link or heading of theirs."""
    problems = [Problem("<img src=x onerror=alert(4)>", HOSTILE, "`<b>7</b>`\n\n# x")]
    engine = ScriptedEngine([HOSTILE + " </think> <answer> `<i>7</i>` </answer>", "``` <img src=y onerror=z> 7"])
    records, _ = evaluate(engine, problems, load_prompt("r1_zero"), r1_zero_reward_fn, SamplingSettings(n=2))
    page = rendered_html(case_report(records))
    assert "<img" not in page and "<script" not in page and "<a " not in page and "<b>" not in page
    assert page.count("<h1>") == 1 and page.count("<h3>") == 2  # the report's own headings alone
    assert "&lt;img src=x onerror=alert(1)&gt;" in page and "&lt;img src=x onerror=alert(4)&gt;" in page
    assert "<code>`&lt;b&gt;7&lt;/b&gt;`  # x</code>" in page  # the ground truth, whole, on one line
