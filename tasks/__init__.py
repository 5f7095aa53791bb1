"""Prefect tasks: thin wrappers giving a5core calls a cache policy, retries, MLflow logging and artifacts."""
