"""SFT trace sets for MATH: from MATH's worked solutions, from a trace file, or distilled from a teacher model;
then deduplicated and filtered to the traces the grader accepts.

Every set is a list of ``Trace(prompt, response, ground_truth)``: ``prompt`` is a template filled with the
problem; ``response`` is what the model should write after it. With r1_zero the prompt ends in ``Assistant:
<think>`` and the response has the shape the r1_zero grader accepts::

    " {reasoning} </think> <answer> {answer} </answer>"

The leading space follows the teacher traces (their responses start right after ``<think>``, with
a space); the grader needs exactly ``</think> <answer>`` (one space, no newline) and a later
``</answer>``. A template that asks for no answer tags (question_only) gets the worked solution itself, whose
last ``\\boxed{}`` its grader reads.

Sources:

- :func:`math_solution_traces` — MATH train solutions as reasoning, the last ``\\boxed{}`` of the
  solution as the answer; under several templates, alternately. All 7,500 train problems but the 2 with an
  empty box become traces that grade format 1 / answer 1 (by their prompt's grader).
- :func:`import_traces` — a prompt/response/ground_truth jsonl (the teacher sample is one); its
  prompts can be re-rendered with the project's template (the sample's use ``\\n\\nUser:`` where
  ``r1_zero.prompt`` has ``\\nUser:``).
- :func:`a5core.engines.teacher.distill` — ``n`` samples per problem from a teacher: a local
  :class:`~a5core.engines.Engine` or a served model (an OpenAI-compatible legacy ``/completions`` endpoint, as
  vLLM and sglang serve). All samples are kept: the raw set.

Then:

- :func:`dedup_traces` drops exact (prompt, response, ground_truth) repeats, keeping first
  occurrences in order. The pipeline dedups before filtering (``sft_data.dedup``): a teacher that
  samples the same short answer twice would otherwise weight that example double, and SFT runs
  that take "the first N examples" would get fewer distinct ones. (The teacher sample has 57.)
- :func:`filter_correct` keeps the traces whose response grades reward 1 by their prompt's grader
  (``r1_zero_reward_fn``, or ``question_only_reward_fn`` for a trace written with question_only; batch
  graders, all cores) and reports sizes, kept fraction and format rate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from a5core.data.files import DataError, Problem, Trace, load_sft_traces
from a5core.data.prompts import PromptTemplate, prompt_form_of_each
from a5core.grading.grader import extract_boxed, question_only_reward_fn, r1_zero_reward_fn

__all__ = ["dedup_traces", "filter_correct", "import_traces", "math_solution_traces", "r1_zero_response"]


def r1_zero_response(reasoning: str, answer: str) -> str:
    """``" {reasoning} </think> <answer> {answer} </answer>"``, both parts stripped."""
    return f" {reasoning.strip()} </think> <answer> {answer.strip()} </answer>"


# ------------------------------------------------------------------------------------------ sources


def math_solution_traces(problems: Sequence[Problem], *templates: PromptTemplate) -> tuple[list[Trace], list[str]]:
    """MATH worked solutions as traces: ``(traces, skipped unique_ids)``. Problem ``i`` is rendered with
    ``templates[i % len(templates)]`` (one template: every problem with it), its response in that template's form:

    - a template that asks for the answer in ``<answer>`` tags (its ``stop`` is ``</answer>``: r1_zero):
      ``" {solution} </think> <answer> {boxed} </answer>"`` (:func:`r1_zero_response`);
    - any other (question_only): ``" {solution}"``, the solution itself (stripped; a space after the question, as
      r1_zero's response has after ``<think>``), whose last ``\\boxed{}`` is the answer.

    boxed = the content of the solution's last ``\\boxed{}`` (see ``extract_boxed``), ground_truth = the
    problem's ``answer``. A problem whose solution has no closed box, or an empty one, is skipped (it still takes
    its template's turn) and its unique_id returned.
    """
    if not templates:
        raise ValueError("math_solution_traces needs at least one template")
    traces, skipped = [], []
    for index, problem in enumerate(problems):
        boxed = extract_boxed(problem.solution)
        if boxed is None or not boxed.strip():
            skipped.append(problem.unique_id)
            continue
        template = templates[index % len(templates)]
        response = r1_zero_response(problem.solution, boxed) if template.tagged else f" {problem.solution.strip()}"
        traces.append(Trace(template.format(problem.problem), response, problem.answer))
    return traces, skipped


# "<instruction>\nUser: <question>\nAssistant: <think>": any instruction text, any blank lines before "User:".
_R1_ZERO_PROMPT = re.compile(r"\A.*?\nUser: (?P<question>.*)\nAssistant: <think>\Z", re.DOTALL)


def import_traces(source: str | os.PathLike, template: PromptTemplate | None = None) -> list[Trace]:
    """Traces from a prompt/response/ground_truth jsonl (or hub dataset), validated by ``load_sft_traces``.

    With ``template``, each prompt is re-rendered with it: the question is read back out of an
    r1_zero-style prompt (``...\\nUser: {question}\\nAssistant: <think>``), so a trace file made with a
    slightly different prompt trains on exactly the prompt evaluation uses. A prompt not in that
    shape raises DataError naming the source and record.
    """
    traces = load_sft_traces(source)
    if template is None:
        return traces
    out = []
    for index, trace in enumerate(traces, start=1):
        match = _R1_ZERO_PROMPT.match(trace.prompt)
        if match is None:
            raise DataError(
                f"{source}: record {index}: prompt is not r1_zero-style "
                "('...\\nUser: <question>\\nAssistant: <think>'), "
                f"so it cannot be re-rendered with template {template.name!r}; import it without a template"
            )
        out.append(replace(trace, prompt=template.format(match.group("question"))))
    return out


# ------------------------------------------------------------------------------------ filtering


def dedup_traces(traces: Sequence[Trace]) -> tuple[list[Trace], int]:
    """``(unique traces in first-seen order, number of exact duplicates dropped)``."""
    unique = list(dict.fromkeys(traces))  # Trace is a frozen dataclass: hashable on all three fields
    return unique, len(traces) - len(unique)


def filter_correct(traces: Sequence[Trace], *templates: PromptTemplate) -> tuple[list[Trace], dict[str, Any]]:
    """Keep the traces whose response grades reward 1 against their ground truth by their prompt's grader; order
    kept. A trace's prompt is matched to the ``templates`` it may have been written with
    (:func:`a5core.data.prompts.prompt_form_of_each`): one that asks for answer tags (r1_zero) is graded by
    ``r1_zero_reward_fn``, any other (question_only) by ``question_only_reward_fn``; with no templates, or a prompt
    that fits none, by ``r1_zero_reward_fn``.

    Returns ``(kept, stats)`` with stats ``raw`` and ``filtered`` (sizes), ``kept_fraction``
    (filtered / raw) and ``format_rate`` (fraction with format reward 1, by each trace's grader); the two rates are
    None for an empty input.
    """
    untagged = {template.name for template in templates if not template.tagged}
    forms = prompt_form_of_each((t.prompt for t in traces), templates)  # no templates: each UNKNOWN_FORM
    graders = [question_only_reward_fn if form in untagged else r1_zero_reward_fn for form in forms]
    rewards: list[dict[str, float]] = [{}] * len(traces)
    for grader in dict.fromkeys(graders):  # each grader once, over its traces (a batch uses every core)
        indices = [i for i, g in enumerate(graders) if g is grader]
        graded = grader.batch([traces[i].response for i in indices], [traces[i].ground_truth for i in indices])
        for i, reward in zip(indices, graded, strict=True):
            rewards[i] = reward
    kept = [t for t, r in zip(traces, rewards, strict=True) if r["reward"] == 1.0]
    n = len(traces)
    return kept, {
        "raw": n,
        "filtered": len(kept),
        "kept_fraction": len(kept) / n if n else None,
        "format_rate": sum(r["format_reward"] for r in rewards) / n if n else None,
    }
