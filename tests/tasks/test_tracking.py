"""MLflow as the project uses it: a new store safe for concurrent first runs, training experiments, the store lock,
run tags and settings."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One process's first MLflow run on the store, started when the go-file appears (all at once).
FIRST_RUN = """
import sys, time
from pathlib import Path
import mlflow
from tasks.mlflow_runs import mlflow_run
uri, go, index = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
while not go.exists():
    time.sleep(0.01)
with mlflow_run("concurrent", f"run-{index}", uri):
    mlflow.log_metric("index", float(index))
"""


def test_runs_started_together_on_a_new_store_all_land(tmp_path):
    """Eight processes make their first run on a new mlflow.db at once: each creates the store's tables
    and the experiment unless the store lock orders them (before it, 7 of 8 failed)."""
    import mlflow

    uri, go = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", FIRST_RUN, uri, str(go), str(i)],
            cwd=tmp_path,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MLFLOW_DISABLE_TELEMETRY": "true"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(8)
    ]
    time.sleep(5)  # let them import; the go-file releases them together (the lock, not this wait, makes it pass)
    go.touch()
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0] * 8, "\n".join(o[-1500:] for o in outputs if o)
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("concurrent").experiment_id])
    assert sorted(r.data.metrics["index"] for r in runs) == [float(i) for i in range(8)]
    assert (tmp_path / "mlflow.db.lock").is_file()  # the lock stays with its store, not in the temp folder


def test_experiments_are_training_experiments_and_old_ones_are_tagged(tmp_path):
    """Every experiment is a model-training one, says on MLflow's home page how to reach its runs, and holds the
    runs table's view that the printed address opens (its headline metric a column); older ones get the tags,
    a user's own description is kept."""
    import json

    import mlflow

    from tasks.experiments import (
        DESCRIPTION_TAG,
        EXPERIMENT_KIND_TAG,
        TRAINING_EXPERIMENT,
        VIEW_TAG,
        ensure_experiment,
        ui_address,
    )

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    new = ensure_experiment("grpo", uri, str(tmp_path / "mlruns"))
    tags = client.get_experiment(new).tags
    assert tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT and "pick Model training" in tags[DESCRIPTION_TAG]
    view = json.loads(tags[VIEW_TAG])
    assert (
        view["orderByKey"] == "metrics.`final_val_accuracy`"
        and "metrics.`final_val_accuracy`" in view["selectedColumns"]
    )
    assert ui_address("grpo", uri).endswith(
        f"/#/experiments/{new}/runs?viewStateShareKey=a5&workflowType=machine_learning"
    )
    old = client.create_experiment("baseline_eval", tags={DESCRIPTION_TAG: "mine"})  # as an earlier version made them
    assert ensure_experiment("baseline_eval", uri) == old
    tags = client.get_experiment(old).tags
    assert tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT and tags[DESCRIPTION_TAG] == "mine"
    assert json.loads(tags[VIEW_TAG])["orderByKey"] == "metrics.`accuracy`"


def test_the_store_lock_of_a_sqlite_uri_lies_beside_its_database(tmp_path, monkeypatch):
    """SQLAlchemy's SQLite URI form (``file:PATH?mode=ro&uri=true``) names the same database as its path: the
    lock goes beside it, never into a folder called ``file:`` under the working directory."""
    from tasks.mlflow_store import sqlite_database, store_lock

    monkeypatch.chdir(tmp_path)
    database = tmp_path / "store" / "mlflow.db"
    assert sqlite_database(f"sqlite:///{database}") == database
    assert sqlite_database(f"sqlite:///file:{database}?mode=ro&uri=true") == database
    assert sqlite_database("sqlite:///mlflow.db") == Path("mlflow.db")
    assert sqlite_database("sqlite:///:memory:") is None and sqlite_database("http://127.0.0.1:5000") is None
    with store_lock(f"sqlite:///file:{database}?mode=ro&uri=true"):
        pass
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "store",
        "store/mlflow.db.lock",
    ]


def test_every_run_records_where_it_came_from_and_a_resumed_run_keeps_its_first_settings(tmp_path):
    """run_tags: the commit and whether the tree was dirty, the versions, the device; no Prefect tags outside a
    flow run. log_settings: parameters once; a resumed run's changed setting goes to a tag, not an error."""
    import subprocess

    import mlflow

    from tasks.mlflow_runs import log_settings, mlflow_run
    from tasks.resumable_runs import reopen_run
    from tasks.run_tags import run_tags

    tags = run_tags()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags["git.dirty"] in ("true", "false")
    assert tags["versions.torch"] == __import__("torch").__version__ and tags["versions.mlflow"] == mlflow.__version__
    assert tags["device"] == "cpu" and not any(key.startswith("prefect.") for key in tags)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with mlflow_run("settings", "first", uri) as run:
        log_settings({"learning_rate": 1e-5, "output_dir": "out", "limit": None})
    with reopen_run(run.info.run_id, run.info.experiment_id):  # a later attempt, elsewhere
        log_settings({"learning_rate": 1e-5, "output_dir": "elsewhere", "seed": 1})
    logged = mlflow.MlflowClient(uri).get_run(run.info.run_id)
    assert logged.data.params == {"learning_rate": "1e-05", "output_dir": "out", "limit": "None", "seed": "1"}
    assert logged.data.tags["changed_on_resume.output_dir"] == "elsewhere"
    assert logged.data.tags["mlflow.source.git.commit"] == head
