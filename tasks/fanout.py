"""Fan a sweep's child runs out over Ray: Prefect's Ray task runner, one GPU (or what is asked) per child.

``run_children_on_ray(children, run_child, ...)`` runs ``run_child(name, params)`` for every child as a
Prefect task on a Ray worker, all at once as far as the cluster's resources allow, and returns their
results in the children's order. ``address`` None starts a local Ray instance (this machine's CPUs and
GPUs, no dashboard, every server of it listening on 127.0.0.1 only: see :func:`loopback_only`);
``"ray://host:10001"`` uses a user's cluster, whose workers must be able to import this project
(install it there, or pass ``runtime_env={"working_dir": "."}``). Each child builds its own engine: an
engine is a process-local object.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

# Ray's switch for a one-machine instance (its default on Windows and macOS): see loopback_only.
RAY_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """While open, a local Ray instance started in this process listens on 127.0.0.1 only.

    Ray (2.60) replaces a loopback ``_node_ip_address`` given to ``ray.init`` by this machine's outward
    address (``ray._private.services.resolve_ip_for_localhost``), and its C++ servers listen on all
    interfaces unless their node address is 127.0.0.1. So ``_node_ip_address="127.0.0.1"`` alone left
    the GCS, the raylet, every worker's and the driver's gRPC server and the dashboard agent on ``::``
    or ``0.0.0.0``, and the runtime-env and dashboard agents on the outward address. Ray keeps the
    loopback address only in its one-machine mode, which ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    selects: Ray reads it once, on import, into ``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, so
    the flag is set there too (this process may have imported Ray already), and in the environment
    the processes Ray starts inherit. Both are restored on exit (the instance is shut down by then),
    so a later connection to a real cluster from this process is not affected.
    """
    import ray

    # Through the attribute, not ``from ray._private import ...``: prefect_ray puts a lazily loaded ``ray``
    # into sys.modules, and importing a submodule of it first leaves a second ``ray._private`` behind.
    ray_constants = ray._private.ray_constants
    saved_env, saved_flag = os.environ.get(RAY_SINGLE_MACHINE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[RAY_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(RAY_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[RAY_SINGLE_MACHINE_ENV] = saved_env


@task(cache_policy=NO_CACHE)
def run_child_task(run_child: Callable[[str, Any], dict], name: str, params: Any) -> dict:
    return run_child(name, params)


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

    if runtime_env is None:  # a local instance: the workers import what this process imports
        runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    init_kwargs: dict[str, Any] = {"runtime_env": runtime_env}
    if address is None:
        init_kwargs |= {"include_dashboard": False, "log_to_driver": False, "_node_ip_address": "127.0.0.1"}
    runner = RayTaskRunner(address=address, init_kwargs=init_kwargs)

    @flow(name="children_on_ray", task_runner=runner)
    def fan_out() -> list[dict]:
        futures = []
        for name, params in children.items():
            with remote_options(num_gpus=gpus_per_child, num_cpus=cpus_per_child):
                futures.append(run_child_task.submit(run_child, name, params))
        return [future.result() for future in futures]

    with loopback_only() if address is None else contextlib.nullcontext():
        return fan_out()
