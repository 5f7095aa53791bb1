"""Caches key on what a path holds, not on the path: an edited data file is evaluated again, the same
relative path in another folder is that folder's file, a model folder counts by its weights' bytes, and a
training run's folder changes with its data file's contents."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from test_bad_input import math_record

import flows.baseline_eval
from a5core.runtime.writing import write_jsonl_atomic
from tasks import fingerprints


@pytest.fixture(autouse=True)
def digest_memo(tmp_path, monkeypatch) -> Path:
    memo = tmp_path / "digests"
    monkeypatch.setattr(fingerprints, "DIGEST_MEMO", memo)
    return memo


def evaluated_problems(folder: Path, model: Path, capsys) -> list[str]:
    """Run ``python -m flows.baseline_eval`` (its main) in ``folder`` on ``data/rel.jsonl``: the problems
    its records hold, and whether generation was served from the cache."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        flows.baseline_eval.main(
            ["--model", str(model), "--backend", "hf", "--data", "data/rel.jsonl", "--max-tokens", "4"]
            + ["--output-dir", "out", "--metrics-path", "null", "--tracking-uri", "sqlite:///mlflow.db"]
        )
    finally:
        os.chdir(cwd)
    capsys.readouterr()
    records = [json.loads(line) for line in (folder / "out/records.jsonl").read_text().splitlines()]
    return [re.search(r"What is \d+ \+ 1\?", r["prompt"]).group() for r in records]


def write_problems(folder: Path, first: int) -> None:
    write_jsonl_atomic(folder / "data/rel.jsonl", [math_record(i) for i in range(first, first + 2)])


def test_an_edited_data_file_and_another_folder_are_evaluated_on_their_contents(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys
):
    import tasks.evaluation

    starts = []
    real = tasks.evaluation.make_engine
    monkeypatch.setattr(tasks.evaluation, "make_engine", lambda *a, **k: starts.append(a) or real(*a, **k))
    here, there = tmp_path / "here", tmp_path / "there"
    write_problems(here, 0)
    assert evaluated_problems(here, tiny_lm_dir, capsys) == ["What is 0 + 1?", "What is 1 + 1?"]
    assert evaluated_problems(here, tiny_lm_dir, capsys) == ["What is 0 + 1?", "What is 1 + 1?"]
    assert len(starts) == 1, "the same contents are generated once"

    write_problems(here, 40)  # the same path, edited in place
    assert evaluated_problems(here, tiny_lm_dir, capsys) == ["What is 40 + 1?", "What is 41 + 1?"]
    write_problems(there, 70)  # the same relative path in another folder
    assert evaluated_problems(there, tiny_lm_dir, capsys) == ["What is 70 + 1?", "What is 71 + 1?"]
    assert len(starts) == 3
    assert list((here / ".a5-cache/prefect-results").iterdir()), "results stay in the folder the flow ran in"


def test_a_model_folder_counts_by_its_bytes_not_its_sizes_and_times(tiny_lm_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_lm_dir, model)
    before = fingerprints.model_fingerprint(str(model))
    weights = model / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size; the times put back below
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprints.model_fingerprint(str(model)) != before
    copy = tmp_path / "elsewhere"
    shutil.copytree(model, copy)
    assert fingerprints.model_fingerprint(str(copy)) == fingerprints.model_fingerprint(str(model))


def test_a_files_digest_is_remembered_until_the_file_changes(tmp_path, digest_memo, monkeypatch):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    hashed = []
    real = fingerprints.hashlib.file_digest
    monkeypatch.setattr(fingerprints.hashlib, "file_digest", lambda f, name: hashed.append(1) or real(f, name))
    first = fingerprints.file_digest(path)
    assert fingerprints.file_digest(path) == first and len(hashed) == 1
    path.write_bytes(b"b" * 1000)
    assert fingerprints.file_digest(path) != first and len(hashed) == 2


def test_a_training_runs_folder_follows_its_data_files_contents(tmp_path):
    from flows.params import GRPOParams
    from tasks.runs import run_key

    data = tmp_path / "train.jsonl"
    write_jsonl_atomic(data, [math_record(i) for i in range(4)])
    key = run_key(GRPOParams(train_data=str(data)))
    assert run_key(GRPOParams(train_data=str(data))) == key
    write_jsonl_atomic(data, [math_record(i) for i in range(1, 5)])
    assert run_key(GRPOParams(train_data=str(data))) != key
