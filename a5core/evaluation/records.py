"""Generate → grade → record: the evaluation path every stage shares.

``evaluate`` formats each problem with a prompt template, samples completions from an Engine, grades
them with a reward function and returns one record per completion plus a summary. The three
categories of the A5 handout are counted: format 1 & answer 1, format 1 & answer 0, format 0 & answer 0
(a sample of each, read: :mod:`a5core.evaluation.case_report`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from a5core.data.files import Problem
from a5core.data.prompts import PromptTemplate
from a5core.engines import Completion, Engine, SamplingSettings
from a5core.grading.grader import grade_batch
from a5core.grading.lenient import lenient_answer
from a5core.grading.sample_metrics import mean_and_se, problem_scores, sample_metrics

CATEGORIES = ("format1_answer1", "format1_answer0", "format0_answer0")


def category(record: dict[str, Any]) -> str:
    """The handout's category of a graded record (format 0 & answer 1 cannot happen)."""
    if not record["format_reward"]:
        return "format0_answer0"
    return "format1_answer1" if record["answer_reward"] else "format1_answer0"


def grade_completions(
    problems: Sequence[Problem],
    prompts: Sequence[str],
    completions: Sequence[Sequence[Completion]],
    reward_fn: Callable[[str, Any], dict[str, float]],
) -> list[dict[str, Any]]:
    """One record per completion: id, sample index, prompt, response, ground truth, rewards, length."""
    if not len(problems) == len(prompts) == len(completions):
        raise ValueError(f"{len(problems)} problems, {len(prompts)} prompts, {len(completions)} completion lists")
    flat = [
        (p, prompt, i, c)
        for p, prompt, cs in zip(problems, prompts, completions, strict=True)
        for i, c in enumerate(cs)
    ]
    rewards = grade_batch(reward_fn, [c.text for *_, c in flat], [p.answer for p, *_ in flat])
    return [
        {
            "unique_id": p.unique_id,
            "sample": i,
            "prompt": prompt,
            "response": c.text,
            "ground_truth": p.answer,
            **reward,
            "response_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason,
            "answer": lenient_answer(c.text),
        }
        for (p, prompt, i, c), reward in zip(flat, rewards, strict=True)
    ]


PER_PROBLEM_COLUMNS = ("unique_id", "sample", "reward", "format_reward", "answer_reward", "response_tokens")


def per_problem_table(records: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every record's outcome, compact (no prompt or response text): problem id, sample index, rewards and
    length, as columns: two evaluations of the same problems can be paired problem by problem."""
    columns = [c for c in PER_PROBLEM_COLUMNS if records and c in records[0]]
    return {c: [r[c] for r in records] for c in columns}


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy (and its standard error over problems), format rate, mean response length, category and
    finish-reason counts, and the several-sample metrics of :func:`a5core.grading.sample_metrics.sample_metrics`
    (avg@n, pass@k, maj@n, each with ``_se``)."""
    if not records:
        raise ValueError("no records to summarise")
    n = len(records)
    counts = Counter(category(r) for r in records)
    samples = sample_metrics(records)
    return {
        "n_records": n,
        "n_problems": len({r["unique_id"] for r in records}),
        "accuracy": sum(r["answer_reward"] for r in records) / n,
        "accuracy_se": mean_and_se(list(problem_scores(records).values()))[1],
        "format_rate": sum(r["format_reward"] for r in records) / n,
        "mean_response_tokens": sum(r["response_tokens"] for r in records) / n,
        **{f"count_{c}": counts.get(c, 0) for c in CATEGORIES},
        **{f"finish_{k}": v for k, v in sorted(Counter(r["finish_reason"] for r in records).items())},
        **samples,
    }


def evaluate(
    engine: Engine,
    problems: Sequence[Problem],
    prompt_template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
    sampling: SamplingSettings,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Generate ``sampling.n`` completions per problem, grade them, and summarise: (records, summary)."""
    prompts = [prompt_template.format(p.problem) for p in problems]
    records = grade_completions(problems, prompts, engine.generate(prompts, sampling), reward_fn)
    return records, summarize(records)
