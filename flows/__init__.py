"""Prefect flows: one module per user-facing job, runnable from the CLI, the Prefect UI and DVC stages.

Prefect's offline defaults are set here, before any flow module imports prefect: its ephemeral API
server can take longer than the default 20 s to start on a small machine, analytics stay off, and the
project's loggers send their records to the flow run's logs.
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
# The project's log records (the loops' line per step, the flows' results) go to the Prefect run's logs too; a
# record made outside a flow run (a check before it starts, a torchrun rank without Prefect) stays on the console.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "a5core,flows,tasks")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
