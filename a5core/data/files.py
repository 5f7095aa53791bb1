"""Load and validate the project's datasets: MATH, GSM8K and SFT reasoning traces.

Every loader takes a *source*: a local ``.jsonl`` path, or a Hugging Face dataset id (read through
``datasets``; the hub must be reachable). Bad input fails with one :class:`DataError` that names the
file and line. Records come back as frozen dataclasses so later stages cannot mutate shared data.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from a5core.runtime.reading import not_a_file_to_read

# The longest line a jsonl file may hold: a record is a few kB (a MATH solution, an SFT trace); a file without line
# breaks (a binary file, an image) would otherwise be read whole into memory as one line.
MAX_LINE_BYTES = 64 * 2**20


class DataError(ValueError):
    """A data file or dataset is missing, malformed, empty, or lacks a required key."""


@dataclass(frozen=True)
class Problem:
    """One question with a verifiable answer (a MATH problem, or a GSM8K question in MATH's shape)."""

    unique_id: str
    problem: str
    answer: str
    solution: str = ""
    subject: str = ""
    level: int | None = None


@dataclass(frozen=True)
class Trace:
    """One SFT example: a formatted prompt, the response to learn, and the answer it should reach."""

    prompt: str
    response: str
    ground_truth: str


# --------------------------------------------------------------------------------------------- jsonl


def _is_hub_id(source: str) -> bool:
    """A hub id looks like ``name`` or ``owner/name``; anything path-like is treated as a local file."""
    return (
        not source.endswith((".jsonl", ".json"))
        and not source.startswith((".", "/", "~"))
        and source.count("/") <= 1
        and not Path(source).exists()
    )


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for each non-blank line of a jsonl file.

    Raises DataError for a missing file, one that is no file to read (a FIFO, a device, the system's
    ``/proc``: :func:`a5core.runtime.reading.not_a_file_to_read`), an empty file, a line longer than
    :data:`MAX_LINE_BYTES`, a line that is not UTF-8, malformed JSON, or a line that is not an object.
    """
    path = Path(path).expanduser()
    problem = not_a_file_to_read(path)
    if problem is not None or not path.is_file():
        raise DataError(f"{path}: " + (problem or ("not a regular file" if path.exists() else "no such data file")))
    seen = False
    with path.open("rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}:{lineno}: a line of more than {MAX_LINE_BYTES:,} bytes (not a data record)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line is "
                    f"{raw[e.start : e.start + 1]!r})"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:  # no data record nests a thousand levels deep
                raise DataError(f"{path}:{lineno}: JSON nested too deeply to read (not a data record)") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            seen = True
            yield lineno, record
    if not seen:
        raise DataError(f"{path}: empty data file (no records)")


def _records(source: str | os.PathLike, split: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` from a local jsonl file or a hub dataset; ``where`` names file:line."""
    source_str = str(source)
    if not _is_hub_id(source_str):
        for lineno, record in read_jsonl(source_str):
            yield f"{source_str}:{lineno}", record
        return
    try:
        import datasets

        dataset = datasets.load_dataset(source_str, split=split or "train")
    except Exception as e:  # the hub raises many types: connection, missing dataset, missing split
        raise DataError(
            f"{source_str}: could not load Hugging Face dataset (split {split or 'train'!r}): "
            f"{type(e).__name__}: {e}. Pass a local .jsonl path instead if the hub is unreachable."
        ) from e
    if len(dataset) == 0:
        raise DataError(f"{source_str}: empty dataset (split {split or 'train'!r})")
    for i, record in enumerate(dataset):
        yield f"{source_str}[{split or 'train'}]#{i}", record


def _require(record: dict[str, Any], where: str, *keys: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise DataError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")


def _text(record: dict[str, Any], key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: key {key!r} must be a string, got {type(value).__name__}")
    return value


def _level(value: Any, where: str) -> int | None:
    """MATH levels come as "Level 3" (jsonl), 3 (MATH500) or "Level ?" (two train items)."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"(?:Level\s*)?(\d+|\?)", value.strip())
        if match:
            return None if match.group(1) == "?" else int(match.group(1))
    raise DataError(f"{where}: unreadable level {value!r}")


# ------------------------------------------------------------------------------------------- loaders


def load_math(source: str | os.PathLike, split: str | None = None) -> list[Problem]:
    """Load MATH problems (unique_id, problem, solution, answer, level, type or subject). Two records with one
    ``unique_id`` raise DataError naming both: samples are grouped by it (accuracy, pass@k, maj@k and their
    standard errors would be computed over merged problems)."""
    problems: list[Problem] = []
    first: dict[str, str] = {}  # unique_id → where it was first read
    for where, record in _records(source, split):
        _require(record, where, "unique_id", "problem", "solution", "answer", "level")
        if "type" not in record and "subject" not in record:
            raise DataError(f"{where}: missing key 'type' (or 'subject')")
        unique_id = _text(record, "unique_id", where)
        if unique_id in first:
            raise DataError(
                f"{where}: unique_id {unique_id!r} is also the id of {first[unique_id]}; each problem needs its own "
                "(its samples are grouped by it for accuracy, pass@k and maj@k): give one of them another"
            )
        first[unique_id] = where
        problems.append(
            Problem(
                unique_id=unique_id,
                problem=_text(record, "problem", where),
                answer=_text(record, "answer", where),
                solution=_text(record, "solution", where),
                subject=str(record.get("subject") or record.get("type")),
                level=_level(record["level"], where),
            )
        )
    return problems


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_final_answer(answer_text: str) -> str:
    """The number after ``####`` in a GSM8K answer, without thousands separators: '1,000' → '1000'."""
    match = _GSM8K_FINAL.search(answer_text.strip())
    if match is None:
        raise ValueError("GSM8K answer does not end with '#### <number>'")
    return match.group(1).replace(",", "").replace("$", "").strip()


def load_gsm8k(source: str | os.PathLike, split: str | None = None) -> list[Problem]:
    """Load GSM8K (question, answer ending in ``#### N``) as Problems whose answer is N."""
    problems = []
    name = Path(str(source)).stem if not _is_hub_id(str(source)) else (split or "train")
    for index, (where, record) in enumerate(_records(source, split)):
        _require(record, where, "question", "answer")
        rationale = _text(record, "answer", where)
        try:
            final = gsm8k_final_answer(rationale)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        problems.append(
            Problem(
                unique_id=f"gsm8k/{name}/{index}",
                problem=_text(record, "question", where),
                answer=final,
                solution=rationale.rsplit("####", 1)[0].strip(),
                subject="gsm8k",
            )
        )
    return problems


def load_sft_traces(source: str | os.PathLike, split: str | None = None) -> list[Trace]:
    """Load SFT traces (prompt, response, ground_truth)."""
    traces = []
    for where, record in _records(source, split):
        _require(record, where, "prompt", "response", "ground_truth")
        traces.append(
            Trace(
                prompt=_text(record, "prompt", where),
                response=_text(record, "response", where),
                ground_truth=str(record["ground_truth"]),
            )
        )
    return traces


PROBLEM_LOADERS = {"math": load_math, "gsm8k": load_gsm8k}  # record format → loader of Problems
LOADERS = {**PROBLEM_LOADERS, "sft": load_sft_traces}  # every format params.yaml can name
