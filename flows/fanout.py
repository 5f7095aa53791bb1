"""A sweep's or an ablation's child runs fanned out over Ray (a sub-flow on Prefect's Ray task runner, one GPU,
or what is asked, per child), for a flow whose ``runner`` is ``ray``; with ``runner`` local a flow runs its
children itself, one after another on one engine.

``children_on_ray(children, run_child, params, parent_run_id)`` is what the EI sweep and the GRPO ablations call:
each child runs the flow's own Prefect task for one child (``run_child``: :func:`flows.grpo.run_grpo`,
:func:`flows.expert_iteration.run_ei`) on a Ray worker, with ``params``' Ray address and per-child GPUs and CPUs.
``run_children_on_ray(children, run_child, ...)`` runs ``run_child(name, params)`` for every child as a
Prefect task on a Ray worker, all at once as far as the cluster's resources allow, and returns their
results in the children's order. ``address`` None starts a local Ray instance (this machine's CPUs and
GPUs, no dashboard, every server of it listening on 127.0.0.1 only: see :func:`tasks.fanout.loopback_only`);
``"ray://host:10001"`` uses a user's cluster, whose workers must be able to import this project
(install it there, or pass ``runtime_env={"working_dir": "."}``). Each child builds its own engine: an
engine is a process-local object.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from prefect import flow

from tasks.engines import closing_engine, engine_for
from tasks.fanout import check_ray_address, loopback_only, run_child_task
from tasks.prefect_run import prefect_flow_run


def children_on_ray(children: dict[str, Any], run_child: Any, params: Any, parent_run_id: str) -> list[dict]:
    """Every child's row, in the children's order, run at once on Ray: ``run_child(name, child_params, engine,
    parent_run_id)``, the flow's Prefect task for one child, whose plain function each worker runs with an engine
    of its own."""
    if 0 < params.ray_gpus_per_child < 1:  # Ray counts GPU shares but bounds no memory: each child bounds its own
        children = {
            name: child if child.gpu_memory_fraction else child.replace(gpu_memory_fraction=params.ray_gpus_per_child)
            for name, child in children.items()
        }
    return run_children_on_ray(
        children,
        functools.partial(_with_own_engine, run_child, parent_run_id=parent_run_id),
        address=params.ray_address,
        gpus_per_child=params.ray_gpus_per_child,
        cpus_per_child=params.ray_cpus_per_child,
    )


def _with_own_engine(run_child: Any, name: str, params: Any, parent_run_id: str) -> dict:
    """One child on a Ray worker, with an engine of its own (a task there already: the task's plain function)."""
    with closing_engine(engine_for(params)) as engine:
        return run_child.fn(name, params, engine, parent_run_id)


def run_children_on_ray(
    children: dict[str, Any],
    run_child: Callable[[str, Any], dict],
    *,
    address: str | None = None,
    gpus_per_child: float = 1.0,
    cpus_per_child: float = 1.0,
    runtime_env: dict[str, Any] | None = None,
) -> list[dict]:
    """Run every child on Ray in parallel; results in the order of ``children``."""
    from prefect_ray import RayTaskRunner
    from prefect_ray.context import remote_options

    check_ray_address(address)
    if runtime_env is None:  # a local instance: the workers import what this process imports
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    init_kwargs: dict[str, Any] = {"runtime_env": runtime_env}
    if address is None:
        init_kwargs |= {"include_dashboard": False, "log_to_driver": False, "_node_ip_address": "127.0.0.1"}
    runner = RayTaskRunner(address=address, init_kwargs=init_kwargs)
    made_by = prefect_flow_run()  # the flow that fans out: what a child's record names (the sub-flow cannot re-run)

    @flow(name="children_on_ray", task_runner=runner)
    def fan_out() -> list[dict]:
        futures = []
        for name, params in children.items():
            with remote_options(num_gpus=gpus_per_child, num_cpus=cpus_per_child):
                futures.append(run_child_task.submit(run_child, name, params, made_by))
        return [future.result() for future in futures]

    with loopback_only() if address is None else contextlib.nullcontext():
        return fan_out()
