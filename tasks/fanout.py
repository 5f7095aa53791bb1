"""The task a sweep's child runs as on a Ray worker, the switch that keeps a local Ray instance on 127.0.0.1
(:func:`loopback_only`) and the check that a cluster's address answers (:func:`check_ray_address`). The sub-flow
that fans children out is :mod:`flows.fanout`."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from prefect import task
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


RAY_DEADLINE_S = 10  # a Ray cluster named by ray_address must take a connection within it


def check_ray_address(address: str | None) -> None:
    """ValueError naming ``address`` (``ray://host:port``, or a cluster's ``host:port``) unless it takes a connection
    within :data:`RAY_DEADLINE_S` seconds: Ray's own client tried for 46 s and ended in a traceback. None (a local
    instance) and Ray's ``auto`` (the cluster this machine is part of): nothing to check."""
    if address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_DEADLINE_S):
            return
    except ValueError:
        reason = "no port: give ray://HOST:PORT"
    except OSError as error:
        reason = str(error) or type(error).__name__
    raise ValueError(
        f"ray_address {address}: no Ray cluster answers there within {RAY_DEADLINE_S} s ({reason}); start the "
        "cluster, or leave ray_address unset to start a local Ray"
    )


@task(cache_policy=NO_CACHE)
def run_child_task(run_child: Callable[[str, Any], dict], name: str, params: Any, made_by: dict[str, str]) -> dict:
    """One child of a sweep: ``run_child(name, params)``, on whichever worker Ray placed it; its run's record names
    ``made_by`` (the flow that fanned it out) as the flow that made it."""
    from tasks.provenance import recorded_as_made_by

    with recorded_as_made_by(made_by):
        return run_child(name, params)
