"""A Ctrl-C (or a SIGTERM) ends a flow's command with one line and the shell's status for it, wherever it lands:
while a checkpoint is written (the write finishes first, so the run resumes from it), as the flow starts, and
while the process tears down after the work.

Each case runs the real command line in a child process (started as a terminal starts a command:
:func:`servers.from_a_terminal`) and makes the signal land at its point every time: from inside the
checkpoint's ``torch.save`` (tests/signal_target.py), from a parameter's serializer that Prefect calls as it
creates the flow run, from an exit handler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from servers import from_a_terminal, quiet_env
from test_bad_input import flags, inputs  # noqa: F401  (inputs: a fixture)
from test_flow_resume import flow_env  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
RESUMES = "what was written is intact (atomic writes, checkpoints): the same command resumes"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``command`` as a terminal runs it, in a session of its own (its process group is what a Ctrl-C reaches);
    a guard of 600 s against a hang, not a timing assertion."""
    return subprocess.run(
        from_a_terminal(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )


def assert_one_line(result: subprocess.CompletedProcess, status: int, line: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == status, output[-5000:]
    assert "Traceback" not in output, output[-5000:]
    assert result.stderr.strip().splitlines()[-1] == line, output[-5000:]


def checkpoint_of(output_dir: Path) -> Path:
    (state,) = output_dir.glob("runs-*/*/checkpoint/latest/state.json")
    return state.parent


def assert_whole_checkpoint(latest: Path, step: int) -> None:
    """``latest`` is the checkpoint of ``step``, every file of it readable; no half-written one beside it."""
    import torch

    assert json.loads((latest / "state.json").read_text())["step"] == step
    for name in ("model.pt", "optimizer.pt", "rng.pt"):
        torch.load(latest / name, weights_only=True)
    assert not (latest.parent / ".latest.partial").exists()


def test_ctrl_c_while_a_checkpoint_is_written_finishes_it_and_resumes(inputs, flow_env, tmp_path):  # noqa: F811
    """The terminal's SIGINT arrives as the second checkpoint's weights are being written: the write finishes,
    the command ends with its one line (status 130), and the same command resumes from that checkpoint."""
    argv = flags("sft_experiment", inputs, tmp_path, checkpoint_every=1, max_steps=4, eval_every=0)
    target = [sys.executable, str(REPO / "tests" / "signal_target.py"), "INT", "model.pt", "2"]
    result = run([*target, "flows.sft_experiment", *argv], tmp_path, flow_env)
    assert_one_line(result, 130, f"flows.sft_experiment: interrupted; {RESUMES}")
    assert_whole_checkpoint(checkpoint_of(tmp_path / "out"), step=2)

    again = run([sys.executable, "-m", "flows.sft_experiment", *argv], tmp_path, flow_env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert "at step 2" in again.stderr and "resuming from" in again.stderr, again.stderr[-5000:]


def test_sigterm_while_a_grpo_checkpoint_is_written_finishes_it(inputs, flow_env, tmp_path):  # noqa: F811
    """A SIGTERM (a scheduler stopping the job) as GRPO's first checkpoint is written: the write finishes and
    the command ends with one line, status 143."""
    argv = flags("grpo", inputs, tmp_path, checkpoint_every=1, eval_every=0)
    target = [sys.executable, str(REPO / "tests" / "signal_target.py"), "TERM", "model.pt", "1"]
    result = run([*target, "flows.grpo", *argv], tmp_path, flow_env)
    assert_one_line(result, 143, f"flows.grpo: stopped (SIGTERM); {RESUMES}")
    assert_whole_checkpoint(checkpoint_of(tmp_path / "out"), step=1)


# A flow's command line as the flows have theirs (flows.cli.cli_main around run_flow), whose parameter is
# serialized by Prefect as the flow run is created: the serializer sends the Ctrl-C ("flow start"). Or the
# flow, once it ran, leaves an exit handler that sends it as the process tears down ("teardown").
SIGNALLED_FLOW = """
import atexit, os, signal, sys, time
from pathlib import Path
from prefect import flow
from pydantic import BaseModel, field_serializer
from flows.cli import cli_main, run_flow

def ctrl_c():
    os.killpg(os.getpgrp(), signal.SIGINT)

class Params(BaseModel):
    at: str
    @field_serializer("at")
    def _serialize(self, value):
        if value == "start" and not os.environ.get("SENT"):
            os.environ["SENT"] = "1"
            ctrl_c()
        return value

@flow
def signalled(params: Params) -> str:
    Path("started").write_text(params.at)
    if params.at == "teardown":
        atexit.register(lambda: (ctrl_c(), time.sleep(5)))
    else:
        time.sleep(120)  # the Ctrl-C, had it been lost, lets the flow run to its end
    Path("finished").write_text(params.at)
    return "done"

main = cli_main("flows.signalled")(lambda argv: print(run_flow(signalled, Params(at=argv[0]))))
if __name__ == "__main__":
    main(sys.argv[1:])
"""


def test_ctrl_c_as_the_flow_starts_is_not_lost(flow_env, tmp_path):  # noqa: F811
    """A Ctrl-C that lands inside a pydantic serializer as Prefect creates the flow run becomes pydantic's error,
    which Prefect catches (it stores the parameter as unserializable) and goes on: the interrupt is raised
    again, and the flow ends, one line and status 130, instead of running to its end."""
    result = run([sys.executable, "-c", SIGNALLED_FLOW, "start"], tmp_path, flow_env)
    assert_one_line(result, 130, f"flows.signalled: interrupted; {RESUMES}")
    assert not (tmp_path / "finished").exists()


def test_ctrl_c_while_the_command_tears_down_ends_in_one_line(tmp_path):
    """After the flow's work (its result printed), the process stops its temporary Prefect server and drains
    its logs: a Ctrl-C then ends it at once with one line and status 130, not a traceback out of an exit
    handler; the server is stopped all the same."""
    import psutil

    env = quiet_env(tmp_path, PYTHONPATH=str(REPO))
    result = run([sys.executable, "-c", SIGNALLED_FLOW, "teardown"], tmp_path, env)
    assert_one_line(result, 130, f"flows.signalled: interrupted; {RESUMES}")
    assert result.stdout.strip() == "done"
    servers = [
        p
        for p in psutil.process_iter(["cmdline", "environ"])
        if any("uvicorn" in part for part in p.info["cmdline"] or [])
        and (p.info["environ"] or {}).get("PREFECT_HOME") == env["PREFECT_HOME"]
    ]
    psutil.wait_procs(servers, timeout=60)  # its watcher stops it within half a second (+5 s to terminate)
    assert not [p for p in servers if p.is_running()], "the temporary Prefect server outlived the command"
