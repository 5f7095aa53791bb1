"""Prefect's temporary API server: out of reach of the terminal's Ctrl-C, stopped with the flow process that
started it, even after a kill -9 or a SIGTERM.

Without ``PREFECT_API_URL``, running a flow starts a temporary Prefect server as a child process
(uvicorn, ~300 MB, listening on 127.0.0.1) and stops it from an exit handler.
:func:`stop_temporary_server_with_this_process` changes two things about each such server:

- it starts in a session (and process group) of its own. In the flow's group, a Ctrl-C reached the server
  too, which died first, and the interrupted flow then retried its calls to the gone server for minutes
  with tracebacks; now the flow ends at once (its exit handler stops the server);
- a watcher (``_orphan_watch.py``) starts beside it and stops it once this process is gone: a killed flow
  process (kill -9, or a SIGTERM, whose default action runs no exit handler) left the server running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

WATCHER = Path(__file__).with_name("_orphan_watch.py")
API_DEADLINE_S = 10  # a Prefect API named by PREFECT_API_URL must answer within it before a flow starts


def check_prefect_api(otherwise: str = "unset PREFECT_API_URL to run with a temporary one") -> None:
    """With a Prefect API configured (``PREFECT_API_URL``, in the environment or the Prefect profile): ValueError
    naming it unless it answers within :data:`API_DEADLINE_S` seconds (Prefect's client would retry, with
    tracebacks) and answers as a Prefect API does (``/health``: ``true``; a server that asks for credentials is
    left to Prefect's client); the message ends with what to do ``otherwise`` than start the server. Without one
    (a temporary server starts): nothing."""
    from prefect.settings import PREFECT_API_URL

    from tasks.servers import CREDENTIALS_WANTED, http_get

    url = PREFECT_API_URL.value()
    if not url:
        return
    reply = http_get(url.rstrip("/") + "/health", API_DEADLINE_S)
    if isinstance(reply, str):
        raise ValueError(
            f"Prefect API {url} (PREFECT_API_URL): no answer within {API_DEADLINE_S} s ({reply}); start the "
            f"server (prefect server start --host 127.0.0.1), or {otherwise}"
        )
    status, body = reply
    if status not in CREDENTIALS_WANTED and (status, body.strip()) != (200, b"true"):
        raise ValueError(
            f"Prefect API {url} (PREFECT_API_URL): a server answers there, but not as a Prefect API does (GET "
            f"/health: status {status}, {body.strip()[:40]!r}); check the address (it ends in /api), or {otherwise}"
        )


def stop_with_this_process(pid: int) -> subprocess.Popen:
    """Start a watcher that stops process ``pid`` when this process is gone (see ``_orphan_watch.py``). It is
    reaped as soon as it ends (within half a second of ``pid``): it leaves no zombie in this process."""
    watcher = subprocess.Popen(
        [sys.executable, str(WATCHER), str(os.getpid()), str(pid)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    threading.Thread(target=watcher.wait, name=f"reap-watcher-of-{pid}", daemon=True).start()
    return watcher


def stop_temporary_server_with_this_process() -> None:
    """From now on, every temporary server Prefect starts in this process gets a watcher. Nothing to do
    when ``PREFECT_API_URL`` names a server: no temporary one starts (and Prefect's server module, 3 s to
    import, stays unimported)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    import prefect.server.api.server as server_module
    from prefect.server.api.server import SubprocessASGIServer

    start = SubprocessASGIServer._run_uvicorn_command
    if getattr(start, "watched", False):
        return
    server_module.subprocess = _InOwnSession()  # the module's Popen: the server's, alone

    def start_watched(server: SubprocessASGIServer) -> subprocess.Popen:
        process = start(server)
        stop_with_this_process(process.pid)
        return process

    start_watched.watched = True  # type: ignore[attr-defined]
    SubprocessASGIServer._run_uvicorn_command = start_watched  # type: ignore[method-assign]


class _PopenInOwnSession(subprocess.Popen):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "start_new_session": True})


class _InOwnSession:
    """``subprocess`` as Prefect's server module sees it: its ``Popen`` (the temporary server's) starts the
    process in a session of its own; everything else is the real module's."""

    Popen = _PopenInOwnSession

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)
