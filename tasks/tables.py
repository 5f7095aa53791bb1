"""Tables as text: markdown (summaries, reports, comparisons) and csv (curves for DVC plots)."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from typing import Any


def markdown_table(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str] | None = None,
    number: Callable[[float], str] = lambda value: f"{value:.4g}",
    width: int | None = None,
) -> str:
    """A markdown table of ``rows``: ``columns`` (default: every key, in first-seen order) as its header;
    floats through ``number``, None empty, ``|`` escaped, line breaks flattened, cells cut at ``width``."""
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> str:
        if value is None:
            return ""
        text = number(value) if isinstance(value, float) else str(value)
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if width is None or len(text) <= width else text[: width - 1] + "…"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
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
