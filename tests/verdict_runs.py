"""Runs for the verdict tests, as a5core.verdicts sees them: a small helper that fills a RunRecord's defaults."""

from __future__ import annotations

import itertools

from a5core.verdicts.pairing import RunRecord

BASE = {
    "loss_type": "reinforce_with_baseline",
    "learning_rate": "2e-05",
    "prompt": "r1_zero",
    "reward_fn": "arithmetic",
}
_ids = itertools.count()


def run(
    setting: str,
    accuracy: float,
    *,
    seed: int = 0,
    origin: str = "folder:aaaa",
    group: str = "ablation",
    start: float | None = None,
    made: str | None = None,
    status: str = "FINISHED",
    flow_status: str = "FINISHED",
    **settings: str,
) -> RunRecord:
    number = next(_ids)
    return RunRecord(
        id=f"{number:08x}" + "0" * 24,
        name=f"run-{setting}",
        group=group,
        setting=setting,
        settings={**BASE, **settings},
        seed=str(seed),
        origin=origin,
        finals={"final_val_accuracy": accuracy},
        starts={} if start is None else {"final_val_accuracy": start},
        status=status,
        flow_status=flow_status,
        made=made,
        start_time=number,
    )
