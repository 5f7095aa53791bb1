"""Background servers for tests: a real Prefect API server and the MLflow UI on 127.0.0.1, free ports,
isolated homes, killed (their whole process group) when the test ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This environment with Prefect's home (database, profiles, UI build) in ``tmp`` and telemetry off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    home = tmp / "prefect_home"
    env.update(  # nested settings do not follow PREFECT_HOME (Prefect 3.7): results and memo store set too
        PREFECT_HOME=str(home),
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "storage"),
        PREFECT_SERVER_MEMO_STORE_PATH=str(home / "memo_store.toml"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PREFECT_UI_SHOW_PROMOTIONAL_CONTENT="false",
        MLFLOW_DISABLE_TELEMETRY="true",
        DVC_NO_ANALYTICS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        DO_NOT_TRACK="1",
    )
    env.update(extra)
    return env


# A shell script's background job (a CI run started with `&` among them) starts with SIGINT ignored, and so does
# every process it starts: Python keeps an inherited "ignore". A test that sends a Ctrl-C starts its child the
# way a terminal's foreground job starts, SIGINT at its default, whatever started the test run.
AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def from_a_terminal(cmd: list[str]) -> list[str]:
    """``cmd`` (its program an absolute path) started with SIGINT at its default disposition."""
    return [sys.executable, "-c", AS_FROM_A_TERMINAL, *cmd]


def log_tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@contextlib.contextmanager
def background(cmd: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` in its own process group (output to ``log``); on exit SIGTERM the group, SIGKILL after 5 s;
    and, should this process be killed before that (a test run stopped with SIGTERM), a watcher stops it."""
    from tasks.prefect_server import stop_with_this_process

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    watcher = stop_with_this_process(proc.pid)
    try:
        yield proc
    finally:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(proc):
                time.sleep(0.2)
            if not _group_alive(proc):
                break
        proc.wait(timeout=10)
        watcher.wait(timeout=10)  # it ends within half a second of the server; reaped, it leaves no zombie


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Poll ``url`` until it answers 200; fail with the server's log if it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s:\n{log_tail(log)}")


def prefect_server(env: dict[str, str]) -> tuple[list[str], int, dict[str, str]]:
    """The command line and env of a Prefect server on a free port. The UI finds its API through the
    server's settings, not ``--port``: a port other than 4200 goes into PREFECT_SERVER_API_PORT too."""
    port = free_port()
    env = {**env, "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
    return [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], port, env


@contextlib.contextmanager
def running_prefect_server(tmp: Path) -> Iterator[dict]:
    """``prefect server start --host 127.0.0.1 --port <free>`` with its home in ``tmp``, once /api/health answers:
    its ``url`` (…/api), ``ui`` address, ``port``, ``env`` for clients (PREFECT_API_URL set) and ``log``."""
    cmd, port, env = prefect_server(quiet_env(tmp))
    log = tmp / "prefect_server.log"
    with background(cmd, log, env) as proc:
        url = f"http://127.0.0.1:{port}/api"
        wait_http(f"{url}/health", proc, log)
        yield {
            "url": url,
            "ui": f"http://127.0.0.1:{port}",
            "port": port,
            "env": {**env, "PREFECT_API_URL": url},
            "log": log,
        }


def mlflow_ui(tracking_uri: str, artifact_root: Path) -> tuple[list[str], int]:
    port = free_port()
    return [
        str(BIN / "mlflow"),
        "ui",
        "--backend-store-uri",
        tracking_uri,
        "--default-artifact-root",
        str(artifact_root),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ], port


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if width == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found
