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

``children_in_processes(children, run_child, parent_run_id, sizing)`` is the local runner of children side by side
(:mod:`flows.seeds`): each child a process of its own on this machine, ``python -m flows.fanout SPEC``, which runs
the same ``run_child`` with an engine of its own in a Prefect flow run named after the child, as many at once as
``sizing`` says (:mod:`tasks.side_by_side`), each with its torch threads and its share of the GPU. A child's spec
(``child.json``: the task, the settings it was given, the parent run, the flow that started it) and its output
(``child.log``, appended to on each attempt) are in its run's folder. A child never outlives the process that
started it: stopped (Ctrl-C, SIGTERM, an error) it stops its children and waits for them; killed, a watcher stops
them (:func:`tasks.prefect_server.stop_with_this_process`). A child cut so resumes from its checkpoint when the
command is run again.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow

from a5core.runtime.writing import write_text_atomic
from tasks.engines import closing_engine, engine_for
from tasks.fanout import check_ray_address, loopback_only, run_child_task
from tasks.prefect_run import importable_module, prefect_flow_run
from tasks.prefect_server import stop_with_this_process
from tasks.runs import run_folder
from tasks.side_by_side import Sizing

logger = logging.getLogger(__name__)
SPEC, LOG = "child.json", "child.log"  # in a child's run folder: what it runs, and what it printed
POLL_S = 0.5  # how often the local runner looks at its children
STOP_S = 30  # a stopped child's time to end (its SIGTERM) before it is killed
SEED_MARK = "/seed"  # a child's label: its setting, then this and its seed (grpo/seed3)


def label(setting: str, seed: int) -> str:
    """The label of ``setting``'s child of seed ``seed`` (``grpo/seed3``): the parent run's name for it in its
    summary and curves (an MLflow metric's name takes ``/``); the child's own run keeps the setting's name."""
    return f"{setting}{SEED_MARK}{seed}"


def setting_of(name: str) -> str:
    """The setting of a child labelled ``name`` (:func:`label`), or ``name`` itself, a setting's own name."""
    setting, mark, seed = name.rpartition(SEED_MARK)
    return setting if mark and seed.isdigit() else name


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
        return run_child.fn(setting_of(name), params, engine, parent_run_id)


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


def children_in_processes(
    children: dict[str, Any], run_child: Any, parent_run_id: str | None, sizing: Sizing
) -> dict[str, int]:
    """Run every child, ``run_child(name, params, engine, parent_run_id)`` (the flow's Prefect task for one child),
    each in a process of its own, ``sizing.at_once`` at a time, in the children's order; each child's exit status,
    by name. See the module docstring."""
    made_by = prefect_flow_run()
    task = f"{importable_module(run_child.fn.__module__)}:{run_child.fn.__name__}"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(sizing.threads),
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),  # the children import what this process imports
        **prefect_api(),
    }
    pending, running, ended = list(children.items()), {}, {}
    try:
        while pending or running:
            while pending and len(running) < sizing.at_once:
                name, params = pending.pop(0)
                running[name] = _start_child(name, params, task, parent_run_id, made_by, env)
            for name, process in list(running.items()):
                if process.poll() is not None:
                    ended[name] = process.returncode
                    del running[name]
                    _ended(name, children[name], process.returncode)
            time.sleep(POLL_S)
    finally:
        stop_children(running)
    return ended


def prefect_api() -> dict[str, str]:
    """``PREFECT_API_URL`` of the API this flow run reports to (a temporary server's too), for its children."""
    if os.environ.get("PREFECT_API_URL"):
        return {}
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            return {"PREFECT_API_URL": str(client.api_url).rstrip("/")}
    except Exception:  # no API answers here: each child starts a temporary one of its own
        return {}


def _start_child(
    name: str, params: Any, task: str, parent_run_id: str | None, made_by: dict[str, str], env: dict[str, str]
) -> subprocess.Popen:
    folder = run_folder(params, setting_of(name))
    values = params.flat(mode="json")
    spec = {
        "name": name,
        "task": task,
        "params_model": f"{importable_module(type(params).__module__)}.{type(params).__qualname__}",
        "params": {key: values[key] for key in sorted(params.explicit())},
        "parent_run_id": parent_run_id,
        "made_by": made_by,
    }
    write_text_atomic(folder / SPEC, json.dumps(spec, indent=2) + "\n")
    command = child_command(folder / SPEC)
    with open(folder / LOG, "a") as log:
        log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    stop_with_this_process(process.pid)
    logger.info("child %s started (process %d; its output: %s)", name, process.pid, folder / LOG)
    return process


def child_command(spec: Path) -> list[str]:
    """The command of the child that ``spec`` describes: ``python -m flows.fanout SPEC``."""
    return [sys.executable, "-m", "flows.fanout", str(spec)]


def _ended(name: str, params: Any, status: int) -> None:
    log = run_folder(params, setting_of(name)) / LOG
    if status == 0:
        logger.info("child %s finished", name)
        return
    tail = log.read_text(errors="replace").splitlines()[-12:] if log.is_file() else []
    logger.warning("child %s ended, %s; the end of %s:\n  %s", name, ended_how(status), log, "\n  ".join(tail))


def ended_how(status: int | None) -> str:
    """How a child's process ended, in words: its exit status, or the signal that killed it."""
    if status is None:
        return "never ended: stopped"
    if status < 0:
        name = signal.Signals(-status).name
        return f"killed by {name}" + (" (out of memory?)" if -status == signal.SIGKILL else "")
    return f"exit status {status}"


def stop_children(running: dict[str, subprocess.Popen]) -> None:
    """Stop the children still running: SIGTERM to each one's process group (they keep their checkpoints), then,
    after :data:`STOP_S` seconds or another interrupt, SIGKILL."""
    if not running:
        return
    logger.warning("stopping %s (each resumes from its checkpoint when the command is run again)", ", ".join(running))
    for process in running.values():
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    try:
        while any(p.poll() is None for p in running.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for process in running.values():
            if process.poll() is None:
                _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def run_child_process(spec_path: Path) -> dict:
    """One child side by side (``python -m flows.fanout SPEC``): its task, with an engine of its own, in a Prefect
    flow run named after it; its run's record names the flow that started it."""
    from tasks.provenance import recorded_as_made_by

    spec = json.loads(spec_path.read_text())
    module, _, function = spec["task"].partition(":")
    model_module, _, model = spec["params_model"].rpartition(".")
    if not (module.startswith("flows.") and model_module.startswith("flows.")):
        raise ValueError(f"{spec_path}: names {spec['task']} and {spec['params_model']}, not this project's flows")
    run_child = getattr(importlib.import_module(module), function)
    params = getattr(importlib.import_module(model_module), model)(**spec["params"])

    @flow(name="side_by_side_child", flow_run_name=spec["name"].replace("/", "-"))
    def side_by_side_child() -> dict:
        with recorded_as_made_by(spec["made_by"]):
            return _with_own_engine(run_child, spec["name"], params, spec["parent_run_id"])

    return side_by_side_child()


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.fanout CHILD_SPEC``: one child of a command that runs its children side by side."""
    from flows.cli import command_line
    from tasks.prefect_server import stop_temporary_server_with_this_process

    argv = sys.argv[1:] if argv is None else argv
    with command_line("flows.fanout", lambda: getattr(sys.modules.get("__main__"), "main", None) is main):
        if len(argv) != 1:
            raise ValueError("usage: python -m flows.fanout CHILD_SPEC (a child's child.json, written by its parent)")
        stop_temporary_server_with_this_process()
        row = run_child_process(Path(argv[0]))
    print(f"child {row['setting']} finished: mlflow run {row['mlflow_run_id']}")


if __name__ == "__main__":
    main()
