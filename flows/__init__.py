"""Prefect flows: one module per user-facing job, runnable from the CLI, the Prefect UI and DVC stages.

Prefect's offline defaults are set here, before any flow module imports prefect: its ephemeral API
server can take longer than the default 20 s to start on a small machine, and analytics stay off.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
