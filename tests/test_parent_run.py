"""The parent-run skeleton (tasks.parent_run) with scripted children: what runs inside the parent's MLflow run
and its lock, in which order the comparison is made, and what a child's failure leaves for the next attempt.
The flows' own tests (test_grpo_flows, test_training_flows, test_flow_resume) run it with real children."""

from __future__ import annotations

import json

import mlflow
import pytest

from flows.params import EIParams
from tasks.parent_run import Comparison, parent_run
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


def one_by_one(children, run_child, params, parent_run_id):
    """The children in turn, with no engine (the scripted children need none)."""
    return [run_child(name, child, None, parent_run_id) for name, child in children.items()]


class Script:
    """Scripted children (``child``: a setting's accuracy, or an error to raise), and a record of what the
    skeleton called when: each child, the registration, the flow's own marks."""

    def __init__(self, params: EIParams):
        self.params, self.calls = params, []

    def run_child(self, name: str, child: float | Exception, engine, parent_run_id: str) -> dict:
        folder = f"{self.params.output_dir}/runs-{run_key(self.params)}"
        with pytest.raises(RunInUseError):  # the parent's folder stays locked while its children run
            with run_lock(folder):
                pass
        assert mlflow.active_run().info.run_id == parent_run_id  # inside the parent's run
        self.calls.append(("child", name))
        if isinstance(child, Exception):
            raise child
        return row(name, child)

    def register(self, rows: list[dict]) -> list[dict]:
        self.calls.append(("register", [r["setting"] for r in rows]))
        return [{"name": "a5-test", "version": "1", "setting": rows[0]["setting"]}]

    def annotate(self, rows: list[dict]) -> None:
        self.calls.append(("annotate", [r["setting"] for r in rows]))
        mlflow.set_tag("annotated", "yes")

    def comparison(self) -> Comparison:
        return Comparison(
            published_as="scripted",
            headline="Scripted sweep",
            plot_title="Scripted: validation accuracy",
            columns=("setting", "final_accuracy"),
            register=self.register,
            annotate=self.annotate,
        )


def test_children_run_in_the_locked_parent_run_then_the_comparison_is_made_and_published(params, tmp_path):
    script = Script(params)
    result = parent_run(
        params, "scripted_sweep", {"a": 0.25, "b": 0.75}, script.run_child, script.comparison(), one_by_one
    )

    assert script.calls == [("child", "a"), ("child", "b"), ("register", ["a", "b"]), ("annotate", ["a", "b"])]
    summary = [{"setting": "a", "final_accuracy": 0.25}, {"setting": "b", "final_accuracy": 0.75}]
    assert result["summary"] == summary and result["models"] == script.register([row("a", 0)])
    out = tmp_path / "out"
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "curves.csv").read_text().splitlines()[0] == "setting,step,val_accuracy"
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"accuracy": 0.75, "format_rate": 1.0}  # b's
    published = json.loads((out / "run.json").read_text())
    assert published["flow"] == "scripted" and published["mlflow_run_id"] == result["mlflow_run_id"]

    client = mlflow.MlflowClient(params.tracking_uri)
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.info.run_name == "scripted_sweep" and parent.info.status == "FINISHED"
    assert parent.data.params["sweep_epochs"] == str(params.sweep_epochs)  # the flow's parameters
    assert parent.data.tags["annotated"] == "yes"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"summary.json", "accuracy_vs_step.png"}
    with run_lock(out / f"runs-{run_key(params)}"):  # released
        pass


def test_a_failed_child_leaves_a_failed_run_and_a_free_lock_and_the_next_attempt_continues_it(params, tmp_path):
    script = Script(params)
    with pytest.raises(RuntimeError, match="out of memory"):
        parent_run(
            params,
            "scripted_sweep",
            {"a": 0.25, "b": RuntimeError("out of memory")},
            script.run_child,
            script.comparison(),
            one_by_one,
        )
    assert script.calls == [("child", "a"), ("child", "b")]  # nothing compared, registered or published
    folder = tmp_path / "out" / f"runs-{run_key(params)}"
    first = (folder / "mlflow_run_id").read_text()
    client = mlflow.MlflowClient(params.tracking_uri)
    assert client.get_run(first).info.status == "FAILED"
    assert not (tmp_path / "out" / "summary.json").exists() and not (tmp_path / "out" / "run.json").exists()
    assert not (tmp_path / "metrics.json").exists()

    again = Script(params)
    result = parent_run(
        params, "scripted_sweep", {"a": 0.25, "b": 0.5}, again.run_child, again.comparison(), one_by_one
    )
    assert result["mlflow_run_id"] == first and client.get_run(first).info.status == "FINISHED"  # the same run
    assert [r["setting"] for r in result["summary"]] == ["a", "b"]
