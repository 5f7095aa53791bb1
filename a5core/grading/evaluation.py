"""Generate → grade → record: the evaluation path every stage shares.

``evaluate`` formats each problem with a prompt template, samples completions from an Engine, grades
them with a reward function and returns one record per completion plus a summary. The three
categories of the A5 handout are counted: format 1 & answer 1, format 1 & answer 0, format 0 & answer 0.
``case_report`` renders a markdown sample of each category, and for format-0 cases says whether the
text holds a correct answer that the format parser rejected (a parser/format failure) or none
(a model failure).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from a5core.data.files import Problem
from a5core.data.prompts import PromptTemplate
from a5core.engines import Completion, Engine, SamplingSettings
from a5core.grading.grader import answers_equivalent_batch, extract_boxed, grade_batch
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


# ------------------------------------------------------------------------------- case analysis

_LOOSE_TAG = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)
_ANSWER_IS = re.compile("answer is", re.IGNORECASE)
# After "answer is": colons and blanks, an optional "$", then X, the rest of the line up to a "$".
_STATED = re.compile(r"[:\s]*\$?([^\n$]*)")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


def stated_answer(text: str) -> str | None:
    """The last "answer is X" of ``text`` with a non-empty X: X runs to the end of its line, a ``$`` or
    the next "answer is", cut at a full stop that ends a sentence (``3.5.`` → ``3.5``). Linear in the
    text's length: each stretch between two "answer is" is read once (a regex that searched for the stop
    backtracked over whitespace runs: 50 s on "the answer is", 2,000 spaces and a line break)."""
    for after in reversed(_ANSWER_IS.split(text)[1:]):
        stated = _SENTENCE_END.split(_STATED.match(after)[1], maxsplit=1)[0].strip()
        if stated:
            return stated
    return None


def lenient_answer(response: str) -> str | None:
    """An answer a human would read off an unformatted response: a box, a loose tag, or "answer is X"."""
    boxed = extract_boxed(response)
    if boxed:
        return boxed
    tags = _LOOSE_TAG.findall(response)
    if tags and tags[-1].strip():
        return tags[-1].strip()
    return stated_answer(response)


def case_report(records: Sequence[dict[str, Any]], per_category: int = 3, seed: int = 0) -> str:
    """Markdown: the summary counts, then a random sample of each category with prompt, response, truth.

    Format-0 cases are checked with ``lenient_answer``: a correct answer found there means the model
    solved the problem but broke the format (or the parser is too strict); none means a model failure.
    """
    rng = random.Random(seed)
    unformatted = [r for r in records if not r["format_reward"]]
    leniently_correct = answers_equivalent_batch(
        [(lenient_answer(r["response"]), r["ground_truth"]) for r in unformatted]
    )
    missed = {id(r) for r, ok in zip(unformatted, leniently_correct, strict=True) if ok}
    summary = summarize(records)
    lines = [
        "# Evaluation case analysis",
        "",
        f"{summary['n_records']} responses to {summary['n_problems']} problems: accuracy {summary['accuracy']:.3f}, "
        f"format rate {summary['format_rate']:.3f}, mean length {summary['mean_response_tokens']:.1f} tokens.",
        "",
        "| category | count |",
        "|---|---|",
        *(f"| {c} | {summary[f'count_{c}']} |" for c in CATEGORIES),
        "",
        f"Of the {len(unformatted)} format-0 responses, {len(missed)} contain a correct answer that the "
        "r1_zero format rules rejected (format/parser failures); the rest hold no correct answer (model failures).",
    ]
    for name in CATEGORIES:
        members = [r for r in records if category(r) == name]
        lines += ["", f"## {name} ({len(members)})"]
        for r in rng.sample(members, min(per_category, len(members))):
            lines += [
                "",
                f"### {code_span(r['unique_id'])} (sample {r['sample']}, {r['response_tokens']} tokens, "
                f"{code_span(r['finish_reason'])})",
            ]
            if name == "format0_answer0":
                found = lenient_answer(r["response"])
                verdict = "correct: format failure" if id(r) in missed else "not correct: model failure"
                lines.append(
                    f"Lenient read of the answer: {code_span(found)} ({verdict})."
                    if found
                    else "No answer found in the text: model failure."
                )
            lines += [
                "",
                "**Prompt**",
                "",
                code_block(r["prompt"]),
                "",
                "**Response**",
                "",
                code_block(r["response"]),
                "",
                f"**Ground truth:** {code_span(r['ground_truth'])}",
            ]
    return "\n".join(lines) + "\n"


# Data and model output go into the case report as code, which a Markdown viewer shows as text: never as
# HTML (an <img onerror=…> in a problem), a link or a heading. CommonMark ends a code block or span only at
# a backtick run of its delimiter's length, so the delimiter is longer than any run in the text.


def _delimiter(text: str, shortest: int) -> str:
    return "`" * max(shortest, max(map(len, re.findall(r"`+", text)), default=0) + 1)


def code_block(text: str) -> str:
    """``text`` as a fenced code block whose fence no line of it can close."""
    fence = _delimiter(text, 3)
    return f"{fence}\n{text}\n{fence}"


def code_span(value: Any) -> str:
    """``str(value)`` as an inline code span, on one line (a line break inside could start a new block)."""
    text = " ".join(str(value).splitlines()) or " "
    tick = _delimiter(text, 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{tick}{pad}{text}{pad}{tick}"


# ----------------------------------------------------------------------------- log_generations


def response_entropies(
    model: Any, tokenizer: Any, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 8
) -> list[float]:
    """Mean next-token entropy over each response's tokens under ``model`` (no gradient).

    prompts, responses: N strings → N floats (NaN for an empty response). Responses are re-tokenised
    from text, so the ids can differ slightly from those the engine sampled; fine for a logged statistic.
    """
    import torch

    from a5core.policy.causal_lm import get_response_log_probs, tokenize_prompt_and_output

    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = tokenize_prompt_and_output(
                list(prompts[start : start + batch_size]), list(responses[start : start + batch_size]), tokenizer
            )
            entropy = get_response_log_probs(
                model, batch["input_ids"].to(device), batch["labels"].to(device), return_token_entropy=True
            )["token_entropy"]
            mask = batch["response_mask"].to(device)
            per_row = (entropy * mask).sum(-1) / mask.sum(-1)
            out.extend(per_row.tolist())
    return out


def log_generations(
    model: Any, tokenizer: Any, records: Sequence[dict[str, Any]], sample_size: int = 16, seed: int = 0
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """What the handout's log_generations reports at each evaluation.

    Returns (rows, metrics): ``rows`` is a random sample of ``sample_size`` records with prompt,
    response, ground truth, format/answer reward, mean token entropy of the response and its length;
    ``metrics`` has the mean response length overall, of correct and of incorrect responses, and the
    sample's mean token entropy.
    """
    sample = random.Random(seed).sample(list(records), min(sample_size, len(records)))
    entropies = response_entropies(model, tokenizer, [r["prompt"] for r in sample], [r["response"] for r in sample])
    rows = [
        {
            k: r[k]
            for k in (
                "unique_id",
                "prompt",
                "response",
                "ground_truth",
                "format_reward",
                "answer_reward",
                "response_tokens",
            )
        }
        | {"mean_token_entropy": e}
        for r, e in zip(sample, entropies, strict=True)
    ]

    def mean_length(rs: list[dict[str, Any]]) -> float:
        return sum(r["response_tokens"] for r in rs) / len(rs) if rs else float("nan")

    correct = [r for r in records if r["answer_reward"]]
    incorrect = [r for r in records if not r["answer_reward"]]
    finite = [e for e in entropies if e == e]
    metrics = {
        "mean_response_tokens": mean_length(list(records)),
        "mean_response_tokens_correct": mean_length(correct),
        "mean_response_tokens_incorrect": mean_length(incorrect),
        "mean_token_entropy": sum(finite) / len(finite) if finite else float("nan"),
    }
    return rows, metrics
