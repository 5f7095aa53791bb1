"""Which process tracks. Under torchrun every rank runs a training flow's code (see :func:`flows.cli.run_flow`),
and one of them tracks (MLflow runs, output and metrics files, Prefect runs): rank 0. The other ranks train
alongside, untracked: they call a flow's or a task's plain function (:func:`tracked`), and where a run would be
opened they get :data:`UNTRACKED_RUN`, whose ``info.run_id`` is None."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from a5core.runtime import distributed

# What the ranks that do not track get for an MLflow run: a run id of None.
UNTRACKED_RUN = SimpleNamespace(info=SimpleNamespace(run_id=None))


def tracking_rank() -> bool:
    """Whether this process tracks (MLflow runs, output and metrics files, Prefect runs): a plain
    process does, and of a torchrun launch rank 0; the other ranks train alongside, untracked."""
    return distributed.rank_and_world()[0] == 0


def tracked(prefect_object: Any) -> Any:
    """A Prefect task or flow as this rank calls it: itself on the tracking rank (a task or flow run),
    its plain function (``.fn``) on the other ranks, which run the same code without Prefect."""
    return prefect_object if tracking_rank() else prefect_object.fn
