"""Prompt templates: ``r1_zero`` and ``question_only`` ship here as ``*.prompt`` files.

A template is plain text with one ``{question}`` placeholder. It is filled by plain replacement, not
``str.format``, because questions and templates are full of LaTeX braces. A template carries the stop
strings of its responses (:attr:`PromptTemplate.stop`): a template that asks for the answer in
``<answer> </answer>`` tags (r1_zero) stops at ``</answer>``; one that does not (question_only) at EOS.
:func:`prompt_form_of_each` tells which template a finished prompt was written with (an SFT trace's, say).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from a5core.runtime.reading import read_text_capped

PROMPTS_DIR = Path(__file__).parent
MAX_TEMPLATE_BYTES = 1_000_000  # a template is a few hundred bytes
PLACEHOLDER = "{question}"
ANSWER_CLOSE = "</answer>"
UNKNOWN_FORM = "unknown"  # the form of a prompt no template fits (prompt_form_of_each)


class PromptTemplateError(ValueError):
    """A template is missing, unreadable, or lacks the ``{question}`` placeholder."""


@dataclass(frozen=True)
class PromptTemplate:
    """A named prompt template; ``format(question)`` returns the prompt string."""

    name: str
    text: str

    def __post_init__(self) -> None:
        if PLACEHOLDER not in self.text:
            raise PromptTemplateError(
                f"prompt template {self.name!r} has no {PLACEHOLDER} placeholder; "
                f"a template must contain {PLACEHOLDER} exactly where the question goes"
            )

    def format(self, question: str) -> str:
        return self.text.replace(PLACEHOLDER, question)

    @property
    def tagged(self) -> bool:
        """Whether it asks for the answer in ``<answer> </answer>`` tags (r1_zero; question_only does not)."""
        return ANSWER_CLOSE in self.text

    @property
    def stop(self) -> tuple[str, ...]:
        """Where a response to this template ends: ``("</answer>",)`` when it asks for the answer in
        ``<answer>`` tags, else none (generation ends at EOS or max_tokens)."""
        return (ANSWER_CLOSE,) if self.tagged else ()


def builtin_prompt_names() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.prompt"))


def load_prompt(name_or_path: str | os.PathLike) -> PromptTemplate:
    """Load a built-in template by name (``r1_zero``, ``question_only``) or any template file by path."""
    builtin = PROMPTS_DIR / f"{name_or_path}.prompt"
    path = builtin if builtin.is_file() else Path(name_or_path).expanduser()
    if not path.exists():
        raise PromptTemplateError(
            f"no prompt template {str(name_or_path)!r}: not a built-in "
            f"({', '.join(builtin_prompt_names())}) and no such file"
        )
    try:
        text = read_text_capped(path, "prompt template", MAX_TEMPLATE_BYTES)
    except ValueError as error:  # no regular file, larger than a template, or not UTF-8: one line naming it
        raise PromptTemplateError(str(error)) from None
    return PromptTemplate(name=path.stem if path == builtin else str(path), text=text)


def prompt_forms(prompts: Iterable[str], templates: Sequence[PromptTemplate] | None = None) -> list[str]:
    """The sorted names of the templates ``prompts`` were written with (:func:`prompt_form_of_each`)."""
    return sorted(set(prompt_form_of_each(prompts, templates)))


def prompt_form_of_each(prompts: Iterable[str], templates: Sequence[PromptTemplate] | None = None) -> list[str]:
    """For each prompt, the name of the template it was written with (among the built-ins unless ``templates``
    are given), :data:`UNKNOWN_FORM` for one that fits none.

    A prompt fits a template when it begins with the template's text before ``{question}`` and ends with its
    text after it (the two not overlapping), runs of whitespace compared as one space (the teacher sample writes
    a blank line where r1_zero has a line break). A prompt that fits several is counted as the most specific:
    the one with the most fixed text. question_only's template is the question alone, so it fits every prompt:
    a prompt counts as question_only when no template with fixed text fits it.
    """
    fixed = []
    for template in templates if templates is not None else map(load_prompt, builtin_prompt_names()):
        before, _, after = template.text.partition(PLACEHOLDER)
        fixed.append((_spaced(before), _spaced(after), template.name))
    fixed.sort(key=lambda f: len(f[0]) + len(f[1]), reverse=True)  # the most specific first (a stable sort)
    forms = []
    for prompt in map(_spaced, prompts):
        fits = (
            name
            for before, after, name in fixed
            if len(prompt) >= len(before) + len(after) and prompt.startswith(before) and prompt.endswith(after)
        )
        forms.append(next(fits, UNKNOWN_FORM))
    return forms


def _spaced(text: str) -> str:
    """``text`` with each run of whitespace one space, none at either end."""
    return " ".join(text.split())
