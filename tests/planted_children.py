"""Children side by side whose final accuracy is planted, for the test of ``until_decided``: put in place of the
local runner (:func:`flows.fanout.children_in_processes`), :func:`run_planted` makes each child's GRPO run as the
flow makes it (its folder, its MLflow run under the parent, its parameters, provenance and row), in this process, but
instead of training ends it with a final evaluation planted by its seed and setting: an accuracy of 0.3 plus the
seed's noise (sd 0.05), plus :data:`EFFECT` for the setting ``dapo`` (with noise of sd 0.01): a large effect, which
the verdicts decide after a few pairs.
"""

from __future__ import annotations

import random
from typing import Any

EFFECT = 0.4


def planted_accuracy(setting: str, seed: int) -> float:
    rng = random.Random(seed)
    base = 0.3 + rng.gauss(0, 0.05)
    return base + (EFFECT + rng.gauss(0, 0.01) if setting == "dapo" else 0.0)


def run_planted(children: dict[str, Any], run_child: Any, parent_run_id: str | None, sizing: Any) -> dict[str, int]:
    """Each child's run made with its planted final evaluation; every exit status 0."""
    from flows.fanout import setting_of
    from tasks.runs import training_run

    for name, params in children.items():
        setting = setting_of(name)
        accuracy = planted_accuracy(setting, params.seed)
        with training_run(setting, f"grpo-{setting}", params, None, parent_run_id) as run:
            if not run.finished:
                row = {"wall_seconds": 0.0, "curve": [{"step": 1, "val_accuracy": accuracy}], "trends": []}
                run.trained(1, row, final={"val_accuracy": accuracy, "val_format_rate": 1.0})
    return dict.fromkeys(children, 0)
