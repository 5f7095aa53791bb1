"""Prefect tasks: thin wrappers giving a5core calls a cache policy, retries, MLflow logging and artifacts.

MLflow's client defaults are set here, before any task module imports mlflow (it decides on telemetry as it is
imported).
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A tracking server that stops answering mid-run fails a call in seconds, not after MLflow's default 7 retries
# with growing waits (minutes): two retries, 1 and 2 s apart, each request given 30 s.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar for each small table read back
