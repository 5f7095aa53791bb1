"""The handout's case analysis of an evaluation: a markdown sample of each category, and for format-0 cases
whether the text holds a correct answer that the format parser rejected (a parser/format failure) or none (a
model failure)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from a5core.evaluation.records import CATEGORIES, category, summarize
from a5core.grading.grader import answers_equivalent_batch
from a5core.grading.lenient import lenient_answer


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
