"""The parent run (tasks.parent_run) with scripted children: what runs inside the parent's MLflow run and its
lock, what the summary is made of (the flow's own choices where it makes them), and what a child's failure leaves
for the next attempt.
The flows' own tests (test_grpo_flows, test_training_flows, test_flow_resume) run it with real children."""

from __future__ import annotations

import json

import mlflow
import pytest

from flows.params import EIParams
from tasks.parent_run import Summary, parent_run
from tasks.run_lock import RunInUseError, run_lock
from tasks.runs import run_key


@pytest.fixture
def params(tmp_path, monkeypatch) -> EIParams:
    monkeypatch.chdir(tmp_path)
    return EIParams(
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        experiment="parent_run_test",
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )


def row(name: str, accuracy: float) -> dict:
    """A finished child's row, as tasks.runs.training_run returns it (the fields the comparison reads)."""
    return {
        "setting": name,
        "final_accuracy": accuracy,
        "final_format_rate": 1.0,
        "curve": [{"step": 0, "val_accuracy": 0.0}, {"step": 2, "val_accuracy": accuracy}],
        "mlflow_run_id": f"run-of-{name}",
    }


SUMMARY = Summary(
    "scripted", "Scripted sweep", "Scripted: validation accuracy", ("setting", "final_accuracy"), "a5-test"
)


def test_children_run_in_the_locked_parent_run_then_the_summary_is_made_and_published(params, tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(
        "tasks.parent_run.register_model",
        lambda model_dir, name, run_id, setting: registered.append((name, setting)) or {"name": name, "version": "1"},
    )
    (tmp_path / "model_b").mkdir()
    folder = tmp_path / "out" / f"runs-{run_key(params)}"
    with parent_run(params, "scripted_sweep", SUMMARY) as parent:
        with pytest.raises(RunInUseError):  # the parent's folder stays locked while its children run
            with run_lock(folder):
                pass
        assert mlflow.active_run().info.run_id == parent.run_id  # the children run inside the parent's run
        parent.rows = [row("a", 0.25), {**row("b", 0.75), "model_dir": str(tmp_path / "model_b")}]
        parent.tags = {"annotated": "yes"}
        parent.metrics = {"final_accuracy_b": 0.75}
    result = parent.result

    assert registered == [("a5-test", "b")]  # the one child that saved a policy
    summary = [{"setting": "a", "final_accuracy": 0.25}, {"setting": "b", "final_accuracy": 0.75}]
    assert result["summary"] == summary and result["models"] == [{"name": "a5-test", "version": "1"}]
    out = tmp_path / "out"
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "curves.csv").read_text().splitlines()[0] == "setting,step,val_accuracy"
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"accuracy": 0.75, "format_rate": 1.0}  # b's
    published = json.loads((out / "run.json").read_text())
    assert published["flow"] == "scripted" and published["mlflow_run_id"] == result["mlflow_run_id"]

    client = mlflow.MlflowClient(params.tracking_uri)
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.run_name == "scripted_sweep" and run.info.status == "FINISHED"
    assert run.data.params["sweep_epochs"] == str(params.sweep_epochs)  # the flow's parameters
    assert run.data.tags["annotated"] == "yes" and run.data.metrics["final_accuracy_b"] == 0.75
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"summary.json", "accuracy_vs_step.png"}
    with run_lock(folder):  # released
        pass


def test_what_the_flow_chose_is_what_is_plotted_measured_and_registered(params, tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(
        "tasks.parent_run.register_model", lambda model_dir, name, run_id, setting: registered.append(setting) or {}
    )
    for name in ("a", "b"):
        (tmp_path / f"model_{name}").mkdir()
    rows = [{**row(n, acc), "model_dir": str(tmp_path / f"model_{n}")} for n, acc in (("a", 0.25), ("b", 0.75))]
    with parent_run(params, "scripted_sweep", SUMMARY) as parent:
        parent.rows = rows
        parent.best, parent.registered = rows[0], [rows[0]]  # chosen on other problems than the final score's
        parent.curves = [{"setting": "a", "step": 0, "val_accuracy": 0.5}]
    assert registered == ["a"]
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"accuracy": 0.25, "format_rate": 1.0}
    assert (tmp_path / "out" / "curves.csv").read_text().splitlines() == ["setting,step,val_accuracy", "a,0,0.5"]


def test_a_failed_child_leaves_a_failed_run_and_a_free_lock_and_the_next_attempt_continues_it(params, tmp_path):
    with pytest.raises(RuntimeError, match="out of memory"):
        with parent_run(params, "scripted_sweep", SUMMARY) as parent:
            parent.rows = [row("a", 0.25)]
            raise RuntimeError("out of memory")  # the second child
    folder = tmp_path / "out" / f"runs-{run_key(params)}"
    first = (folder / "mlflow_run_id").read_text()
    client = mlflow.MlflowClient(params.tracking_uri)
    assert client.get_run(first).info.status == "FAILED"
    assert not (tmp_path / "out" / "summary.json").exists() and not (tmp_path / "out" / "run.json").exists()
    assert not (tmp_path / "metrics.json").exists() and parent.result == {}  # nothing compared or published

    with parent_run(params, "scripted_sweep", SUMMARY) as parent:
        parent.rows = [row("a", 0.25), row("b", 0.5)]
    assert parent.result["mlflow_run_id"] == first and client.get_run(first).info.status == "FINISHED"  # the same
    assert [r["setting"] for r in parent.result["summary"]] == ["a", "b"]
