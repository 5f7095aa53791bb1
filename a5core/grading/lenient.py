"""The answer a human would read off a response whose format the graders reject: a box, a loose ``<answer>`` tag,
or "the answer is X". Not a reward: records carry it, and case reports tell a format failure (a correct answer
the format rules rejected) from a model failure."""

from __future__ import annotations

import re

from a5core.grading.grader import extract_boxed

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
