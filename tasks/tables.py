"""Tables as text: markdown (summaries, reports, comparisons) and csv (curves for DVC plots); text from a store made
safe as Markdown (:func:`markdown_text`), and strict JSON (:func:`json_text`)."""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

# Outside a code span: what would start raw HTML, an entity, a link or an image, and a table's cell separator.
_ESCAPED = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "[": "\\[", "]": "\\]", "|": "\\|"}
_PUNCTUATION = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
_LINE_BREAKS = re.compile(r"[\r\n\u2028\u2029\x85]+")
_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # in a code span: shown as text, but kept from every renderer's HTML


def markdown_text(value: Any, in_table: bool = False) -> str:
    """``value`` (a name a store or a user gave: a run's ablation, a title) as inline Markdown that shows as
    written and can inject nothing: line breaks flattened (no heading, list or block of its own), and outside code
    spans HTML's ``<``, ``>`` and ``&`` as entities, the brackets of links and images and ``|`` escaped. A code span
    (text in backticks, as the pages quote names) shows its text as it is: only what would start an HTML tag is
    escaped there, and ``|`` in a table's cell (``in_table``)."""
    text = _LINE_BREAKS.sub(" ", str(value))
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text) and text[i + 1] in _PUNCTUATION:
            following = text[i + 1]
            out.append("\\\\" + _ESCAPED[following] if following in _ESCAPED else text[i : i + 2])
            i += 2
        elif char == "`":
            opening = len(text[i:]) - len(text[i:].lstrip("`"))
            close = _closing_backticks(text, i + opening, opening)
            if close is None:  # no closing run: the backticks are text
                out.append(text[i : i + opening])
                i += opening
                continue
            code = _TAG_START.sub("&lt;", text[i + opening : close])
            out.append("`" * opening + (code.replace("|", "\\|") if in_table else code) + "`" * opening)
            i = close + opening
        else:
            out.append(_ESCAPED.get(char, char))
            i += 1
    return "".join(out)


def _closing_backticks(text: str, start: int, length: int) -> int | None:
    """Where the first run of exactly ``length`` backticks at or after ``start`` begins (a code span's end), or
    None."""
    for run in re.finditer(r"`+", text[start:]):
        if len(run.group()) == length:
            return start + run.start()
    return None


def is_finite(value: Any) -> bool:
    """Whether ``value`` is a finite number, as MLflow keeps them: it stores an infinity as the largest float
    (±1.8e308), which is no measurement either."""
    return isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) < sys.float_info.max


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN and infinity (at any depth of lists and mappings) as None: what strict JSON holds."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """``value`` as strict JSON (a NaN or an infinity, which JSON has no word for, as null), indented, with a
    final line break."""
    return json.dumps(finite_or_none(value), indent=2, allow_nan=False) + "\n"


def markdown_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    number: Callable[[float], str] = lambda value: f"{value:.4g}",
    width: int | None = None,
    escape: bool = True,
) -> str:
    """A markdown table of ``rows``: ``columns`` (default: every key, in first-seen order) as its header;
    floats through ``number``, None empty, cells cut at ``width``, and every cell and header made safe
    (:func:`markdown_text`: line breaks flattened, ``|``, HTML and links escaped). ``escape=False``: a table for a
    terminal, which renders no Markdown (line breaks flattened and ``|`` escaped only)."""
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))

    def safe(text: str) -> str:
        return markdown_text(text, in_table=True) if escape else _LINE_BREAKS.sub(" ", text).replace("|", "\\|")

    def cell(value: Any) -> str:
        if value is None:
            return ""
        text = _LINE_BREAKS.sub(" ", number(value) if isinstance(value, float) else str(value))
        return safe(text if width is None or len(text) <= width else text[: width - 1] + "…")

    lines = ["| " + " | ".join(safe(str(c)) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """``rows`` as csv, the first row's keys as the header."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


# A training stage's DVC metrics (its best row's): the same few keys in every stage's file, so that `dvc metrics
# show` is one row a stage and one column a number.
HEADLINE_METRICS = {
    "accuracy": "final_accuracy",
    "accuracy_se": "final_accuracy_se",
    "change": "accuracy_change",
    "change_se": "accuracy_change_se",
    "format_rate": "final_format_rate",
}


def headline_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A flat mapping of a stage's headline numbers from its best row: final accuracy and its standard error,
    the change from the starting model on the same problems and its standard error, format rate (those the
    row holds)."""
    return {key: row[field] for key, field in HEADLINE_METRICS.items() if isinstance(row.get(field), (int, float))}
