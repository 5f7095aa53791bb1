"""MLflow conventions of tasks.tracking: a new store safe for concurrent first runs, training experiments."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One process's first MLflow run on the store, started when the go-file appears (all at once).
FIRST_RUN = """
import sys, time
from pathlib import Path
import mlflow
from tasks.tracking import mlflow_run
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
    """The MLflow UI opens an experiment tagged mlflow.experimentKind=custom_model_development on its runs."""
    import mlflow

    from tasks.tracking import EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    new = ensure_experiment("new", uri, str(tmp_path / "mlruns"))
    assert client.get_experiment(new).tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT
    old = client.create_experiment("old")  # as an earlier version made them
    assert ensure_experiment("old", uri) == old
    assert client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == TRAINING_EXPERIMENT


def test_the_store_lock_of_a_sqlite_uri_lies_beside_its_database(tmp_path, monkeypatch):
    """SQLAlchemy's SQLite URI form (``file:PATH?mode=ro&uri=true``) names the same database as its path: the
    lock goes beside it, never into a folder called ``file:`` under the working directory."""
    from tasks.tracking import sqlite_database, store_lock

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
