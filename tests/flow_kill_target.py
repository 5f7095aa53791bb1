"""A flow's command line, frozen at a known point for tests/system/test_flow_resume.py to SIGKILL.

    python tests/flow_kill_target.py MODULE MARKER KEY STEP [FLOW FLAGS...]

runs ``python -m MODULE FLOW FLAGS...`` unchanged, except that the first ``mlflow.log_metrics`` call
that logs metric KEY at step STEP completes (its metrics are in the store), then writes MARKER and
sleeps until killed. The test waits for MARKER, checks the flow's checkpoint files and kills the
process there: a deterministic kill point instead of a race against a fast tiny run.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path


def main(module: str, marker: str, key: str, step: str, *argv: str) -> None:
    import mlflow

    real_log_metrics = mlflow.log_metrics

    def log_metrics(metrics, *args, **kwargs):
        result = real_log_metrics(metrics, *args, **kwargs)
        logged_step = kwargs.get("step", args[0] if args else None)
        if key in metrics and logged_step == int(step):
            Path(marker).write_text(f"{key} logged at step {step}\n")
            while True:
                time.sleep(60)
        return result

    mlflow.log_metrics = log_metrics
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(f"{module} finished without logging {key} at step {step}")  # the test expects to kill it first


if __name__ == "__main__":
    main(*sys.argv[1:])
