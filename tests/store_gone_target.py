"""A flow's command line whose MLflow database is deleted mid-run, for tests/system/test_waits.py:

    python tests/store_gone_target.py DATABASE KEY STEP MODULE [FLOW FLAGS...]

runs ``python -m MODULE FLOW FLAGS...`` unchanged, except that once an ``mlflow.log_metrics`` call has logged
metric KEY at step STEP (its metrics are in the store), or, KEY ``provenance.json``, once the run's record is
logged (STEP unused), the file DATABASE is deleted, as a user's ``rm mlflow.db`` would, and the run goes on.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(database: str, key: str, step: str, module: str, *argv: str) -> None:
    import mlflow

    real_log_metrics = mlflow.log_metrics

    def log_metrics(metrics, *args, **kwargs):
        result = real_log_metrics(metrics, *args, **kwargs)
        if key in metrics and kwargs.get("step", args[0] if args else None) == int(step):
            Path(database).unlink(missing_ok=True)
        return result

    real_log_dict = mlflow.log_dict

    def log_dict(dictionary, artifact_file, *args, **kwargs):
        result = real_log_dict(dictionary, artifact_file, *args, **kwargs)
        if artifact_file == key:
            Path(database).unlink(missing_ok=True)
        return result

    mlflow.log_metrics, mlflow.log_dict = log_metrics, log_dict
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
