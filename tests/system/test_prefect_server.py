"""Flows as users drive them from the Prefect UI: a real ``prefect server start --host 127.0.0.1``, the
deployments ``python -m flows.serve`` registers, a run triggered through the API, engine-start retries.

(That re-running a flow with unchanged inputs generates nothing is tests/flows/test_baseline_flow.py's.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import background, from_a_terminal, listening_addresses, log_tail, quiet_env, running_prefect_server

ROOT = Path(__file__).resolve().parents[2]
EXPECTED_FLOWS = {
    "prepare_data",
    "sft_data",
    "baseline_eval",
    "sft_experiment",
    "expert_iteration",
    "grpo",
    "grpo_lr_sweep",
    "grpo_baseline_ablation",
    "grpo_length_norm_ablation",
    "grpo_std_norm_ablation",
    "grpo_off_policy_sweep",
    "grpo_clip_ablation",
    "grpo_prompt_ablation",
    "grpo_dapo_ablation",
    "grpo_gspo_ablation",
    "grpo_kl_ablation",
    "grpo_question_sampling_ablation",
    "grpo_async_ablation",
}


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    with running_prefect_server(tmp_path_factory.mktemp("prefect_server")) as server:
        yield server


@pytest.mark.parametrize("config", [None, "baseline_eval: {limt: 2}\n"])
def test_serve_without_a_server_or_with_a_bad_config_ends_in_one_line(config, tmp_path):
    """`python -m flows.serve` with no Prefect server at its address, or with a --config that is not valid settings:
    one line saying which, no traceback."""
    from servers import free_port

    argv = ["--api-url", f"http://127.0.0.1:{free_port()}/api"]
    if config is not None:
        (tmp_path / "params.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "params.yaml")]
    done = subprocess.run(
        [sys.executable, "-m", "flows.serve", *argv],
        cwd=ROOT,
        env=quiet_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    expected = {
        None: f"flows.serve: error: Prefect API {argv[1]} (PREFECT_API_URL): no answer within 10 s (",
        "baseline_eval: {limt: 2}\n": "flows.serve: error: --config "
        f"{tmp_path}/params.yaml section `baseline_eval`: unknown setting 'limt' (did you mean limit?)",
    }[config]
    assert line.startswith(expected), line


def test_server_listens_on_loopback_only(prefect_api):
    assert listening_addresses(prefect_api["port"]) == {"127.0.0.1"}


def test_a_served_deployment_runs_from_the_api(prefect_api, tiny_lm_dir, shared_data, tmp_path):
    import mlflow
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = prefect_api["url"]
    serve_log = tmp_path / "serve.log"
    env = {**prefect_api["env"], "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    (tmp_path / "README.md").write_text("# the project\n")  # a file git tracks, where the flows run
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "README.md"], cwd=tmp_path, check=True)
    # The forms' defaults: a section, overridden by the selected profile's. The model and data it names are where a
    # deployment's runs may read (besides the project): a form's path elsewhere is refused.
    config = tmp_path / "params.yaml"
    config.write_text(
        f"profile: small\nbaseline_eval: {{limit: 3, max_tokens: 64, model: {tiny_lm_dir}, "
        f"data: {shared_data / 'math/validation.jsonl'}}}\nprofiles: {{small: {{baseline_eval: {{max_tokens: 5}}}}}}\n"
    )
    from flows.serve import deployment_name, discover_flows

    # Every flow a user runs has a deployment titled by what it does; no two share a title.
    titles = {name: deployment_name(flow) for name, flow in discover_flows().items()}
    assert set(titles) == EXPECTED_FLOWS | {"compare", "difficulty", "leaderboard", "report", "reproduce", "verdicts"}
    assert len(set(titles.values())) == len(titles) and titles["baseline_eval"] == "Zero-shot evaluation"
    assert titles["grpo_lr_sweep"] == "GRPO ablation: learning rate"
    with background(
        [sys.executable, "-m", "flows.serve", "--config", str(config)], serve_log, env, cwd=tmp_path
    ) as serve:
        deadline, waiting = time.monotonic() + 90, set(EXPECTED_FLOWS)
        while waiting:  # serve registers the deployments one by one
            assert serve.poll() is None and time.monotonic() < deadline, f"not served: {waiting}\n{log_tail(serve_log)}"
            waiting = {
                f for f in waiting if httpx.get(f"{url}/deployments/name/{f}/{titles[f]}", timeout=5).status_code != 200
            }
            time.sleep(0.5)
        assert httpx.get(f"{url}/deployments/name/sft_data/{titles['sft_data']}", timeout=5).json()["parameters"] == {
            "params": {"config": str(config)}
        }
        deployment = httpx.get(f"{url}/deployments/name/baseline_eval/{titles['baseline_eval']}", timeout=5).json()
        assert (
            deployment["enforce_parameter_schema"] and deployment["entrypoint"] == "flows.baseline_eval.baseline_eval"
        )
        # The UI's form: the settings in their groups, a field per setting.
        definitions = deployment["parameter_openapi_schema"]["definitions"]
        fields = definitions["BaselineEvalParams"]["properties"]
        assert {"engine", "generation", "grading", "outputs", "data", "extra_sets"} <= set(fields)
        assert {"limit", "sampling"} <= set(definitions["BaselineGeneration"]["properties"])
        assert {"temperature", "max_tokens"} <= set(definitions["BaselineSampling"]["properties"])
        assert "outputs under `output_dir/NAME/`" in fields["extra_sets"]["description"]  # no <name> for HTML to eat
        defaults = deployment["parameters"]["params"]["generation"]
        sampling = defaults["sampling"]
        assert (defaults["limit"], sampling["max_tokens"], sampling["temperature"]) == (3, 5, 1.0)

        params = {
            "model": str(tiny_lm_dir),
            "backend": "hf",
            "data": str(shared_data / "math/validation.jsonl"),
            "limit": 2,
            "max_tokens": 8,
            "output_dir": str(tmp_path / "out"),
            "metrics_path": str(tmp_path / "metrics.json"),
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        }
        with temporary_settings({PREFECT_API_URL: url}):
            with pytest.raises(Exception, match="temperature|minimum|Validation"):
                run_deployment(
                    f"baseline_eval/{titles['baseline_eval']}",
                    parameters={"params": {**params, "generation": {"sampling": {"temperature": -1}}}},
                    timeout=0,
                )
            # A misspelt setting, or one given in another group than its own, is refused as the run is asked for
            # (it ran on all 5,000 problems with `limt`, the key dropped).
            for wrong in ({"limt": 2}, {"generation": {"limt": 2}}, {"generation": {"model": "x"}}):
                with pytest.raises(Exception, match="limt|model"):
                    run_deployment(
                        f"baseline_eval/{titles['baseline_eval']}",
                        parameters={"params": {**params, **wrong}},
                        timeout=0,
                    )
            # What a deployment writes is checked by its settings, as the command line's are: sft_data's out
            # README.md (which it replaced with 1,767 lines and reported Completed) fails before anything is written.
            refused = run_deployment(
                f"sft_data/{titles['sft_data']}",
                parameters={"params": {"command": "math", "config": None, "out": "README.md"}},
                timeout=300,
                poll_interval=1,
            )
            assert refused.state is not None and refused.state.is_failed(), f"{refused.state}\n{log_tail(serve_log)}"
            assert "out README.md: a file git tracks" in str(refused.state.message), refused.state.message
            assert (tmp_path / "README.md").read_text() == "# the project\n"
            # What a deployment's run reads lies in the project or a data folder its settings name: not a server's
            # own files (a page's append: [/proc/self/environ] wrote the server's environment into it).
            (tmp_path.parent / "elsewhere.jsonl").write_text("a file of the machine's, outside the project\n")
            outside = run_deployment(
                f"baseline_eval/{titles['baseline_eval']}",
                parameters={"params": {**params, "data": str(tmp_path.parent / "elsewhere.jsonl")}},
                timeout=300,
                poll_interval=1,
            )
            assert outside.state is not None and outside.state.is_failed(), f"{outside.state}\n{log_tail(serve_log)}"
            assert "outside this project and the data folders its settings name" in str(outside.state.message)
            # Settings given by their own names, as on the command line, are taken too (and checked as the run
            # starts). A guard against a hung run, not a timing assertion: a loaded machine took over 150 s for this
            # tiny flow.
            flow_run = run_deployment(
                f"baseline_eval/{titles['baseline_eval']}", parameters={"params": params}, timeout=900, poll_interval=1
            )
        assert flow_run.state is not None and flow_run.state.is_completed(), f"{flow_run.state}\n{log_tail(serve_log)}"

    out = tmp_path / "out"
    assert len((out / "records.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "summary.json").read_text())["n_records"] == 2
    assert (out / "report.md").is_file() and (tmp_path / "metrics.json").is_file()
    runs = mlflow.MlflowClient(params["tracking_uri"]).search_runs(
        [mlflow.MlflowClient(params["tracking_uri"]).get_experiment_by_name("baseline_eval").experiment_id]
    )
    assert len(runs) == 1 and runs[0].data.metrics["n_records"] == 2
    task_runs = httpx.post(
        f"{url}/task_runs/filter", json={"flow_runs": {"id": {"any_": [str(flow_run.id)]}}}, timeout=10
    ).json()
    assert {"load_problems", "generate", "start_engine", "grade"} <= {
        t["task_key"].split("-")[0] for t in task_runs
    } | {t["name"].rsplit("-", 1)[0] for t in task_runs}
    # Started from the deployment, the run tells Prefect what it did, and MLflow where it was started.
    artifacts = httpx.post(
        f"{url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [str(flow_run.id)]}}}, timeout=10
    ).json()
    assert [a["key"] for a in artifacts] == ["baseline-eval-summary"]
    assert "| set | problems | accuracy |" in artifacts[0]["data"] and runs[0].info.run_id in artifacts[0]["data"]
    assert runs[0].data.tags["prefect.flow_run_id"] == str(flow_run.id)
    assert runs[0].data.tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run.id}")
    assert runs[0].data.tags["mlflow.source.name"] == "flows/baseline_eval.py"  # not Prefect's engine
    assert runs[0].data.tags["mlflow.source.git.commit"][:12] in runs[0].data.tags["mlflow.note.content"]
    assert runs[0].data.tags["prefect.flow_run_url"] in runs[0].data.tags["mlflow.note.content"]


def test_engine_start_is_retried_twice(prefect_harness):
    from prefect import flow

    from tasks.engines import start_engine

    calls = []

    def flaky(model, backend, dtype="auto", failures=2):
        calls.append((model, backend, dtype))
        if len(calls) <= failures:
            raise RuntimeError("address already in use")
        return f"engine {model} {backend} {dtype}"

    @flow
    def start(failures: int) -> str:
        return start_engine.with_options(retry_delay_seconds=0)(flaky, "m", "hf", dtype="float32", failures=failures)

    assert start(2) == "engine m hf float32" and calls == [("m", "hf", "float32")] * 3
    calls.clear()
    with pytest.raises(RuntimeError, match="address already in use"):
        start(3)
    assert len(calls) == 3


# A flow run as every flow's command line runs it (flows.cli.run_flow), without PREFECT_API_URL: Prefect
# starts its temporary server. The flow says when it runs, then waits to be killed.
HANGING_FLOW = """
import sys, time
from pathlib import Path
from prefect import flow
from pydantic import BaseModel
from flows.cli import run_flow

class Params(BaseModel):
    marker: str

@flow
def hang(params: Params) -> None:
    Path(params.marker).write_text("running")
    time.sleep(600)

run_flow(hang, Params(marker=sys.argv[1]))
"""


def test_a_killed_flow_leaves_no_prefect_server_running(tmp_path):
    import os
    import signal

    import psutil

    marker, log = tmp_path / "running", tmp_path / "flow.log"
    env = quiet_env(tmp_path, PYTHONPATH=str(ROOT))
    with background([sys.executable, "-c", HANGING_FLOW, str(marker)], log, env, cwd=tmp_path) as flow_process:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert flow_process.poll() is None and time.monotonic() < deadline, log_tail(log)
            time.sleep(0.2)
        servers = [
            p
            for p in psutil.Process(flow_process.pid).children(recursive=True)
            if any("uvicorn" in part for part in p.cmdline())
        ]
        assert len(servers) == 1, [p.cmdline() for p in psutil.Process(flow_process.pid).children(recursive=True)]
        os.kill(flow_process.pid, signal.SIGKILL)  # no exit handler runs
        try:
            servers[0].wait(timeout=60)
        except psutil.TimeoutExpired:
            servers[0].kill()
            raise AssertionError("the temporary Prefect server outlived its killed flow process by 60 s") from None


def test_a_watcher_ends_with_its_child_and_is_reaped():
    """The watcher beside a temporary server exits once the server has ended, and nobody needs to wait for it:
    it is reaped (no zombie stays for the rest of the flow's process)."""
    from tasks.prefect_server import stop_with_this_process

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    watcher = stop_with_this_process(child.pid)
    child.wait()
    deadline = time.monotonic() + 60  # a guard: it ends within half a second of the child
    while watcher.returncode is None and time.monotonic() < deadline:  # set by the reaping, not polled here
        time.sleep(0.2)
    assert watcher.returncode == 0  # waited for: no zombie left


INTERRUPTIBLE_FLOW = HANGING_FLOW.replace(
    "from flows.cli import run_flow", "from flows.cli import cli_main, run_flow"
).replace(
    "run_flow(hang, Params(marker=sys.argv[1]))",
    'cli_main("flows.hang")(lambda argv: run_flow(hang, Params(marker=argv[0])))(sys.argv[1:])',
)


# How a CI run started in the background (`.ci/run &` beside other work) starts what it runs: SIGINT ignored, an
# "ignore" every process below it inherits.
AS_A_BACKGROUND_JOB = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])"
)


def test_ctrl_c_ends_a_flow_at_once_with_one_line_and_stops_its_server(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group. The temporary server, in a session
    of its own, does not get it: the flow ends (status 130, one line, no traceback) instead of retrying a
    dead server for minutes, and stops its server on the way out.

    The flow is started as a terminal starts a command, SIGINT at its default (:func:`servers.from_a_terminal`),
    from a parent that ignores SIGINT, as a CI run started in the background does: a flow that inherits the
    "ignore" never sees the signal (what failed a CI run on a busy machine)."""
    import os
    import signal

    import psutil

    marker, log = tmp_path / "running", tmp_path / "flow.log"
    env = quiet_env(tmp_path, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", AS_A_BACKGROUND_JOB, *from_a_terminal([sys.executable, "-c", INTERRUPTIBLE_FLOW])]
    with background([*command, str(marker)], log, env, cwd=tmp_path) as flow_process:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert flow_process.poll() is None and time.monotonic() < deadline, log_tail(log)
            time.sleep(0.2)
        (server,) = [
            p
            for p in psutil.Process(flow_process.pid).children(recursive=True)
            if any("uvicorn" in part for part in p.cmdline())
        ]
        assert os.getpgid(server.pid) != os.getpgid(flow_process.pid)
        os.killpg(flow_process.pid, signal.SIGINT)  # what the terminal does
        try:
            flow_process.wait(timeout=60)  # a guard against the minutes of retries, not a timing assertion
        except Exception:
            raise AssertionError(f"the flow did not end on Ctrl-C:\n{log_tail(log)}") from None
        server.wait(timeout=30)
    output = log.read_text()
    assert flow_process.returncode == 130 and "Traceback" not in output, output[-3000:]
    assert [line for line in output.splitlines() if line.startswith("flows.hang: ")] == [
        "flows.hang: interrupted; what was written is intact (atomic writes, checkpoints): the same command resumes"
    ]


def test_the_test_sessions_prefect_server_is_watched(prefect_harness):
    """The harness's server (a test run's) is stopped with this process too: a run stopped with SIGTERM, which
    runs no exit handler, left it serving for the better part of an hour."""
    import os

    import psutil

    def command(process: psutil.Process) -> list[str]:  # [] for a process gone, or ended and not yet reaped
        try:
            return process.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return []

    # the harness's server, and any temporary one an earlier test of this process started: each is watched
    servers = [p for p in psutil.Process().children() if any("uvicorn" in part for part in command(p))]
    commands = [p.info["cmdline"] or [] for p in psutil.process_iter(["cmdline"])]
    watchers = [command[-2:] for command in commands if any(part.endswith("_orphan_watch.py") for part in command)]
    assert servers, "no Prefect server runs under this process"
    assert all([str(os.getpid()), str(server.pid)] in watchers for server in servers), (servers, watchers)


def test_an_engine_start_that_cannot_succeed_is_not_retried(prefect_harness):
    """A bad setting or a missing file fails the same way every time: one start, not three."""
    from prefect import flow

    from tasks.engines import EngineStartError, start_engine

    calls = []

    def bad_setting(model, backend, dtype="auto"):
        calls.append(dtype)
        raise ValueError(f"unknown dtype {dtype!r}")

    @flow
    def start() -> None:
        start_engine.with_options(retry_delay_seconds=0)(bad_setting, "m", "hf", dtype="float33")

    with pytest.raises(EngineStartError, match="unknown dtype 'float33'"):
        start()
    assert calls == ["float33"]
