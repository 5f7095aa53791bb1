"""A damaged file of a stopped run (its checkpoint's state.json or tensors, done.json, the MLflow run id, the
MLflow store) ends the command with one message naming the file, what is wrong and what to delete, and the
damaged command deletes nothing itself."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_bad_input import math_record, trace_record, user_error
from test_flow_resume import cli_flags

from a5core.runtime.writing import write_jsonl_atomic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def argv(model: Path, project: Path) -> list[str]:
    """A tiny SFT sweep (one setting) whose learning rate turns the loss NaN at step 2: it stops there, its
    step-1 checkpoint written and not finished; run again, it resumes from that checkpoint first. (The store's
    address is absolute: MLflow keeps one store per address in a process.)"""
    return cli_flags(
        model=str(model),
        backend="hf",
        train_data="traces.jsonl",
        filtered_data=None,
        sizes=["full"],
        validation_data="math.jsonl",
        batch_size=2,
        microbatch_size=2,
        max_tokens=12,
        learning_rate=1e30,
        lr_schedule="constant",
        eval_every=0,
        checkpoint_every=1,
        output_dir="out",
        metrics_path=None,
        tracking_uri=f"sqlite:///{project / 'mlflow.db'}",
    )


@pytest.fixture(scope="module")
def stopped_run(prefect_harness, tiny_lm_dir, tmp_path_factory) -> Path:
    """A project folder holding the stopped run (see :func:`argv`)."""
    project = tmp_path_factory.mktemp("stopped")
    write_jsonl_atomic(project / "traces.jsonl", [trace_record(i) for i in range(8)])
    write_jsonl_atomic(project / "math.jsonl", [math_record(i) for i in range(4)])
    cwd = os.getcwd()
    os.chdir(project)
    try:
        assert "loss nan" in user_error("sft_experiment", argv(tiny_lm_dir, Path.cwd()))
    finally:
        os.chdir(cwd)
    (checkpoint,) = project.glob("out/runs-*/full/checkpoint")
    assert json.loads((checkpoint / "latest/state.json").read_text())["step"] == 1
    return project


@pytest.fixture
def project(stopped_run, tmp_path, monkeypatch) -> Path:
    """A copy of the stopped run's folder, as the working directory."""
    copy = tmp_path / "project"
    shutil.copytree(stopped_run, copy)
    monkeypatch.chdir(copy)
    return copy


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "damage, name, problem",
    [
        ("truncate", "latest/state.json", "unreadable ("),  # the JSON error depends on where the cut falls
        ("replace", "latest/state.json", "not a run's state (no 'finished', 'fingerprint')"),
        ("nest", "latest/state.json", "unreadable (JSON nested too deeply)"),
        ("truncate", "latest/model.pt", "unreadable (PytorchStreamReader failed"),
        ("truncate", "latest/optimizer.pt", "unreadable ("),
        ("delete", "latest/rng.pt", "missing"),
        ("tamper", "latest/rng.pt", "does not hold random generators' states (state with version tensor"),
        ("tamper", "latest/model.pt", "does not hold this model's weights (Error(s) in loading state_dict"),
        ("tamper", "latest/optimizer.pt", "does not hold this run's optimizer state ("),
    ],
)
def test_a_damaged_checkpoint_names_its_file_and_the_folder_to_delete(project, tiny_lm_dir, damage, name, problem):
    """Cut short, replaced, deleted, or replaced by a whole tensor file that is not this run's (another model's
    weights, other RNG states): one message naming the file."""
    import torch

    (checkpoint,) = project.glob("out/runs-*/full/checkpoint")
    path = checkpoint / name
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "replace":
        path.write_text('{"step": 2}')
    elif damage == "nest":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "tamper":
        torch.save({"python": torch.zeros(3), "lm_head.weight": torch.zeros(2, 2), "optimizer": {}}, path)
    else:
        path.unlink()
    before = files(project)
    message = user_error("sft_experiment", argv(tiny_lm_dir, Path.cwd()))
    shown = checkpoint.relative_to(project)
    assert f"{shown / name}: {problem}" in message, message
    assert message.endswith(f"delete {shown} to train this run again from its start (its MLflow run and outputs stay)")
    assert files(project) == before


@pytest.mark.parametrize(
    "key, value, problem",
    [
        ("step", -5, "step -5 is not a whole number from 0 to 8"),
        ("step", "abc", "step 'abc' is not a whole number from 0 to 8"),
        ("step", 99, "step 99 is not a whole number from 0 to 8"),
        ("step", True, "step True is not a whole number from 0 to 8"),
        ("batch_in_epoch", 7, "batch_in_epoch 7 is not a whole number from 0 to 3"),
        ("finished", "no", "finished 'no' is not true or false"),
        ("finished", True, "finished at step 1, but the run's last step is 8"),
    ],
)
def test_a_checkpoint_position_that_is_not_the_runs_is_named(project, tiny_lm_dir, key, value, problem):
    """A state.json that reads as JSON but holds a position no run of these settings reaches (a step below 0 or
    past the run's 8, a string): one message naming the file, not a run resumed at step -5 or five tracebacks."""
    (checkpoint,) = project.glob("out/runs-*/full/checkpoint")
    state = json.loads((checkpoint / "latest/state.json").read_text())
    (checkpoint / "latest/state.json").write_text(json.dumps({**state, key: value}))
    before = files(project)
    message = user_error("sft_experiment", argv(tiny_lm_dir, Path.cwd()))
    shown = checkpoint.relative_to(project) / "latest/state.json"
    assert f"{shown}: {problem} (damaged?); delete {shown.parent.parent} to train this run again" in message, message
    assert files(project) == before


@pytest.mark.parametrize("name, content", [("done.json", '{"setting": "fu'), ("mlflow_run_id", "0f3a")])
def test_a_damaged_run_record_names_its_file(project, tiny_lm_dir, name, content):
    (run,) = project.glob("out/runs-*/full")
    (run / name).write_text(content)
    before = files(project)
    message = user_error("sft_experiment", argv(tiny_lm_dir, Path.cwd()))
    shown = run.relative_to(project) / name
    if name == "done.json":
        assert f"{shown}: unreadable (" in message and message.endswith(f"delete {shown.parent} to train it again")
    else:
        assert f"{shown}: names MLflow run '0f3a', which sqlite:///{project / 'mlflow.db'} does not hold" in message
        assert message.endswith("delete the file to log the run as a new MLflow run (its checkpoint still resumes)")
    assert files(project) == before


@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_a_damaged_mlflow_store_is_named_before_an_engine_starts(project, tiny_lm_dir, damage, monkeypatch):
    monkeypatch.setattr("tasks.engines.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    store = project / "mlflow.db"
    data = store.read_bytes()
    store.write_bytes(data[: len(data) // 2] if damage == "truncate" else os.urandom(len(data)))
    message = user_error("sft_experiment", argv(tiny_lm_dir, Path.cwd()))
    what = "the database is damaged" if damage == "truncate" else "the file is not an SQLite database"
    assert message.startswith(f"flows.sft_experiment: error: MLflow store sqlite:///{store}: {what}"), message
    assert "move the file aside" in message


def test_a_finished_run_says_which_deleted_artifacts_it_does_not_make_again(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, caplog
):
    """A finished run's MLflow artifacts deleted from mlruns/: run again, it is not trained again, and it says
    which of the artifacts it logged while training are gone for good (the comparison is logged anew)."""
    import flows.sft_experiment

    monkeypatch.chdir(tmp_path)  # artifacts under ./mlruns
    write_jsonl_atomic(tmp_path / "traces.jsonl", [trace_record(i) for i in range(4)])
    write_jsonl_atomic(tmp_path / "math.jsonl", [math_record(i) for i in range(2)])
    run_argv = [*argv(tiny_lm_dir, tmp_path), "--learning-rate", "1e-3", "--eval-every", "1", "--val-subset", "2"]
    flows.sft_experiment.main(run_argv)
    (run,) = tmp_path.glob("out/runs-*/full")
    run_id = (run / "mlflow_run_id").read_text().strip()
    (tables,) = tmp_path.glob(f"mlruns/sft_experiment/{run_id}/artifacts/generations")
    lost = sorted(f"generations/{p.name}" for p in tables.iterdir())
    assert lost and set(lost) <= set(json.loads((run / "artifacts.json").read_text()))
    shutil.rmtree(tables)
    with caplog.at_level("WARNING", logger="tasks.runs"):
        flows.sft_experiment.main(run_argv)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "tasks.runs"]
    assert (
        f"its MLflow run {run_id} has lost {len(lost)} of the artifacts it logged while training ({lost[0]}" in warning
    )
    assert warning.endswith(f"delete {run.relative_to(tmp_path)} to train it again")
