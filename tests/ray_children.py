"""What the tests hand to :func:`flows.fanout.run_children_on_ray` as children.

A child runs in a Ray worker process, where a test's monkeypatch does not reach; these are plain objects
the workers unpickle by importing this module (a local instance's workers get the driver's ``sys.path``,
which under pytest holds ``tests/``).

- :class:`Rendezvous` wraps a child runner so that each child, once started, waits until every child
  has started: children run one after another can never all meet, so a test that passes has shown that
  they ran at the same time (no clock is compared), and one that does not fails after ``timeout``
  seconds naming the children that never started.
- :func:`meeting_fan_out` puts the rendezvous between a flow and its fan-out.
- :func:`ray_listeners` is a child that lists the listening TCP sockets of a Ray session's processes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil


class Rendezvous:
    """``run_child(name, params)``, run once every child of ``names`` has written ``started-<child>`` (its
    pid) into ``directory``; waits at most ``timeout`` seconds for them."""

    def __init__(self, run_child: Callable[[str, Any], Any], directory: Path, names: list[str], timeout: float = 120.0):
        self.run_child, self.directory, self.names, self.timeout = run_child, Path(directory), list(names), timeout

    def __call__(self, name: str, params: Any) -> Any:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self.directory / f".started-{name}.{os.getpid()}"
        partial.write_text(json.dumps({"pid": os.getpid()}))
        partial.replace(self.directory / f"started-{name}")  # whole or absent
        deadline = time.monotonic() + self.timeout
        while missing := [n for n in self.names if not (self.directory / f"started-{n}").is_file()]:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"child {name!r} waited {self.timeout:.0f} s for {missing} to start: "
                    "the children did not run at the same time"
                )
            time.sleep(0.05)
        return self.run_child(name, params)

    @staticmethod
    def check_met(directory: Path, names: list[str]) -> None:
        """Each of ``names`` started, each in a worker process of its own, none in this one."""
        workers = Rendezvous.started(directory)
        assert sorted(workers) == sorted(names), workers
        assert len(set(workers.values())) == len(names) and os.getpid() not in workers.values(), workers

    @staticmethod
    def started(directory: Path) -> dict[str, int]:
        """Each child that started: the pid of the process it ran in."""
        return {
            p.name.removeprefix("started-"): json.loads(p.read_text())["pid"]
            for p in sorted(Path(directory).glob("started-*"))
        }


def meeting_fan_out(directory: Path, handed: list[list[str]]) -> Callable[..., list]:
    """A stand-in for :func:`flows.fanout.run_children_on_ray` (patched over it in :mod:`flows.fanout`):
    records each fan-out's children in ``handed``, then runs them through the real one (taken now, before the
    patch), each in a :class:`Rendezvous` in ``directory``."""
    from flows import fanout

    real = fanout.run_children_on_ray

    def fan_out(children: dict[str, Any], run_child: Callable[[str, Any], Any], **options: Any) -> list:
        handed.append(list(children))
        return real(children, Rendezvous(run_child, directory, list(children)), **options)

    return fan_out


def ray_listeners(name: str, params: dict) -> list[dict]:
    """The TCP sockets listening while this child runs, of the Ray session's processes: those that
    ``params["driver"]`` (the process that started the local instance) started after
    ``params["before"]`` (its descendants then, excluded with theirs), and the driver itself, less the
    sockets it listened on before (``params["driver_listening"]``, ``[ip, port]`` pairs)."""
    driver = psutil.Process(params["driver"])
    excluded = set(params["before"])
    session = {driver.pid: driver}
    for process in driver.children(recursive=True):
        try:
            ancestry = {p.pid for p in process.parents()}
        except psutil.Error:
            continue
        if process.pid not in excluded and not ancestry & excluded:
            session[process.pid] = process
    known = {tuple(pair) for pair in params["driver_listening"]}
    found = []
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status != psutil.CONN_LISTEN or connection.pid not in session:
            continue
        address = [connection.laddr.ip, connection.laddr.port]
        if connection.pid == driver.pid and tuple(address) in known:
            continue
        try:
            command = " ".join(session[connection.pid].cmdline())[:160]
        except psutil.Error:
            command = "?"
        found.append({"ip": address[0], "port": address[1], "pid": connection.pid, "command": command})
    return found
