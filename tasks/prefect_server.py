"""Prefect's temporary API server, stopped with the flow process that started it, even after a kill -9.

Without ``PREFECT_API_URL``, running a flow starts a temporary Prefect server as a child process
(uvicorn, ~300 MB, listening on 127.0.0.1) and stops it from an exit handler. A killed flow process runs
no exit handler, and the server kept running. :func:`stop_temporary_server_with_this_process` makes
Prefect start, beside each such server, a watcher (``_orphan_watch.py``) that stops the server once this
process is gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WATCHER = Path(__file__).with_name("_orphan_watch.py")


def stop_with_this_process(pid: int) -> subprocess.Popen:
    """Start a watcher that stops process ``pid`` when this process is gone (see ``_orphan_watch.py``)."""
    return subprocess.Popen(
        [sys.executable, str(WATCHER), str(os.getpid()), str(pid)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_temporary_server_with_this_process() -> None:
    """From now on, every temporary server Prefect starts in this process gets a watcher. Nothing to do
    when ``PREFECT_API_URL`` names a server: no temporary one starts (and Prefect's server module, 3 s to
    import, stays unimported)."""
    if os.environ.get("PREFECT_API_URL"):
        return
    from prefect.server.api.server import SubprocessASGIServer

    start = SubprocessASGIServer._run_uvicorn_command
    if getattr(start, "watched", False):
        return

    def start_watched(server: SubprocessASGIServer) -> subprocess.Popen:
        process = start(server)
        stop_with_this_process(process.pid)
        return process

    start_watched.watched = True  # type: ignore[attr-defined]
    SubprocessASGIServer._run_uvicorn_command = start_watched  # type: ignore[method-assign]
