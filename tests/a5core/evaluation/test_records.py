"""Evaluation records and their summary (a5core.evaluation.records) over a scripted engine."""

from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.engines import Completion, SamplingSettings
from a5core.evaluation.records import evaluate
from a5core.grading.grader import r1_zero_reward_fn


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
