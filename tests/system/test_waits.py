"""What a run depends on outside itself (a tracking server, the Prefect API, the model hub, its model folder,
its MLflow database) failing: a deadline of seconds, not minutes of retries, and one line naming it.

Each case drives a flow's command line: in this process (``main(argv)``) where the setting is a flag, in a
child process where it is the environment (``PREFECT_API_URL``, the hub's address, read at import).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_bad_input import flags, inputs, user_error  # noqa: F401  (inputs: a fixture)
from test_flow_resume import flow_env  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port on 127.0.0.1 that takes connections and never answers (a hung server): its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


@contextlib.contextmanager
def web_page_server() -> Iterator[int]:
    """A port on 127.0.0.1 where an ordinary web server answers every GET with a page (not MLflow, not Prefect)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>Welcome</body></html>")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def command_line(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m flows.baseline_eval ARGV``; a guard of 600 s against a hang, not a timing assertion."""
    return subprocess.run(
        [sys.executable, "-m", "flows.baseline_eval", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    """The error line a command ended with (status 1, no traceback)."""
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-5000:]
    return result.stderr.strip().splitlines()[-1]


def test_a_tracking_server_that_does_not_answer_is_named(inputs, tmp_path):  # noqa: F811
    """Refused or hung: named within its deadline (10 s) before anything runs, instead of MLflow's retries."""
    port = closed_port()
    message = user_error(
        "baseline_eval", flags("baseline_eval", inputs, tmp_path, tracking_uri=f"http://127.0.0.1:{port}")
    )
    assert f"MLflow tracking server http://127.0.0.1:{port}: no answer within 10 s (" in message
    assert "start it, or pass another --tracking-uri" in message
    with silent_server() as hung:
        uri = f"http://127.0.0.1:{hung}"
        message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, tracking_uri=uri))
    assert f"MLflow tracking server {uri}: no answer within 10 s (timed out)" in message


def test_a_server_that_answers_but_is_not_mlflow_or_prefect_is_named(inputs, tmp_path):  # noqa: F811
    """An address where another web server answers (a typo'd port, a proxy's page): one line each, before anything
    runs, instead of the clients' tracebacks."""
    with web_page_server() as port:
        uri = f"http://127.0.0.1:{port}"
        message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, tracking_uri=uri))
        assert f"MLflow tracking server {uri}: a server answers there, but not as MLflow does (GET /health: " in message
        env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": f"{uri}/api"}
        line = one_line(command_line(flags("baseline_eval", inputs, tmp_path), tmp_path, env))
    assert line.startswith(
        f"flows.baseline_eval: error: Prefect API {uri}/api (PREFECT_API_URL): a server answers there, but not as a "
        "Prefect API does (GET /health: status 200, b'<html><body>Welcome</body></html>')"
    ), line


def test_a_store_whose_database_driver_is_missing_is_named(inputs, tmp_path):  # noqa: F811
    uri = "postgresql://alice:s3cret@127.0.0.1:5432/mlflow"
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, tracking_uri=uri))
    assert (
        "MLflow store postgresql://alice:***@127.0.0.1:5432/mlflow: the database driver it needs is not installed ("
        in message
    )
    assert "s3cret" not in message


def test_a_read_only_store_is_one_line_without_mlflows_tracebacks(inputs, flow_env, tmp_path):  # noqa: F811
    """MLflow logs each database error with three chained tracebacks before raising it: the command shows the
    one line that says what to do."""
    import mlflow

    mlflow.MlflowClient(f"sqlite:///{tmp_path / 'ro.db'}").search_experiments()  # a store with its tables
    uri = f"sqlite:///file:{tmp_path / 'ro.db'}?mode=ro&uri=true"
    line = one_line(command_line(flags("baseline_eval", inputs, tmp_path, tracking_uri=uri), tmp_path, flow_env))
    assert line.startswith(f"flows.baseline_eval: error: MLflow store {uri}: it is read-only"), line


def test_a_dead_prefect_api_is_named(inputs, tmp_path):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": f"http://127.0.0.1:{closed_port()}/api"}
    line = one_line(command_line(flags("baseline_eval", inputs, tmp_path), tmp_path, env))
    assert line.startswith(f"flows.baseline_eval: error: Prefect API {env['PREFECT_API_URL']} (PREFECT_API_URL): ")
    assert "no answer within 10 s" in line and "unset PREFECT_API_URL to run with a temporary one" in line


def test_a_model_hub_that_does_not_answer_is_named(inputs, flow_env, tmp_path):  # noqa: F811
    """A hub id, the hub on but not answering, the model not in the cache: one line naming the hub, within its
    deadline (10 s), instead of the hub client's retries of every file (minutes)."""
    with silent_server() as hung:
        hub = f"http://127.0.0.1:{hung}"
        env = {**flow_env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf")}
        line = one_line(command_line(flags("baseline_eval", inputs, tmp_path, model="someone/a-model"), tmp_path, env))
    assert f"model 'someone/a-model': the model hub {hub} does not answer within 10 s (timed out)" in line
    assert "hf download someone/a-model" in line


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_a_damaged_model_folder_is_named_before_an_engine_starts(damage, inputs, tmp_path, monkeypatch):  # noqa: F811
    """A config.json that is not JSON, a weights file cut short (a copy interrupted): the file named at once,
    not "Invalid control character" with no file, nor an engine started and retried six times."""
    monkeypatch.setattr("tasks.evaluation.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    model = tmp_path / "model"
    shutil.copytree(inputs["model"], model)
    if damage == "config":
        (model / "config.json").write_text('{"model_type": "qwen2", "hidden')
        expected = f"{model / 'config.json'}: not a model's config (not JSON: "
    else:
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:20_000])
        expected = f"{weights}: cut short (20,000 bytes of the "
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, model=str(model)))
    assert expected in message and message.endswith("; copy the model folder again"), message


@pytest.mark.parametrize(
    "flow, when, what",
    [
        ("sft_experiment", ("loss", "2"), "its database file is gone"),
        ("baseline_eval", ("provenance.json", "0"), "it holds no MLflow tables: its file was deleted, or emptied"),
    ],
)
def test_the_mlflow_database_deleted_mid_run_ends_in_one_line(flow, when, what, inputs, flow_env, tmp_path):  # noqa: F811
    """`rm mlflow.db` while a run logs into it (an SFT run between steps; an evaluation as it starts, which
    SQLite then finds as an empty file): the run ends with one line saying what happened and what to do,
    without MLflow's tracebacks, and a training run's checkpoint is intact."""
    database = tmp_path / "mlflow.db"
    argv = (
        flags(flow, inputs, tmp_path, checkpoint_every=1, eval_every=2, max_steps=6)
        if flow == "sft_experiment"
        else flags(flow, inputs, tmp_path)
    )
    target = [sys.executable, str(REPO / "tests/store_gone_target.py"), str(database), *when]
    result = subprocess.run(
        [*target, f"flows.{flow}", *argv],
        cwd=tmp_path,
        env=flow_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-5000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"flows.{flow}: error: MLflow store sqlite:///{database}: {what}"), line
    if flow == "sft_experiment":
        (state,) = (tmp_path / "out").glob("runs-*/full/checkpoint/latest/state.json")
        assert json.loads(state.read_text())["step"] >= 2
