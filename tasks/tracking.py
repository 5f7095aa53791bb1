"""MLflow conventions: one store (``sqlite:///mlflow.db``) with artifacts under ``mlruns/``.

MLflow 3.17 refuses a plain ``./mlruns`` file store, so runs live in SQLite and artifacts in files.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import mlflow  # noqa: E402

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_ARTIFACT_ROOT = "mlruns"


def system_metrics_logging() -> bool | None:
    """Whether training runs log MLflow system metrics (``system/*``: CPU, memory, disk, network, and GPU
    utilisation/memory where ``nvidia-ml-py`` is installed; sampled every 10 s,
    ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` changes that).

    On wherever psutil is installed; ``A5_SYSTEM_METRICS=0`` turns it off. None (no psutil) leaves it to
    MLflow's own switch, ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``.
    """
    import importlib.util

    if os.environ.get("A5_SYSTEM_METRICS", "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return True if importlib.util.find_spec("psutil") is not None else None


def ensure_experiment(name: str, tracking_uri: str = DEFAULT_TRACKING_URI, artifact_root: str = DEFAULT_ARTIFACT_ROOT) -> str:
    """Point MLflow at the store and return the experiment's id, creating it with artifacts under mlruns/."""
    mlflow.set_tracking_uri(tracking_uri)
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = (Path(artifact_root).resolve() / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


@contextmanager
def mlflow_run(experiment: str, run_name: str, tracking_uri: str = DEFAULT_TRACKING_URI, **tags: Any) -> Iterator[Any]:
    """Start (and end) one MLflow run in ``experiment``."""
    experiment_id = ensure_experiment(experiment, tracking_uri)
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()}) as run:
        yield run


def log_params_flat(params: dict[str, Any]) -> None:
    """Log a (possibly nested) parameter dict; values are stringified and cut to MLflow's limit."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = str(value)[:6000]

    walk("", params)
    mlflow.log_params(flat)
