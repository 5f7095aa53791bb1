"""Two identical runs started together do not share a run: the second is refused at once, naming the folder
and the process working there; a lock left by a dead process is no lock."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_bad_input import flags, inputs  # noqa: F401  (inputs: a fixture)
from test_flow_resume import flow_env, grpo_flags, kill_mid_run  # noqa: F401  (flow_env: a fixture)

from tasks.run_lock import LOCK_FILE, RunInUseError, run_lock

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_second_identical_run_is_refused_while_the_first_trains(tiny_lm_dir, flow_env, tmp_path):  # noqa: F811
    from mlflow import MlflowClient

    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = grpo_flags(tiny_lm_dir, tracking_uri)
    refusals = []

    def second_run() -> None:  # the first is frozen after step 1's metrics, its run folder locked
        result = subprocess.run(
            [sys.executable, "-m", "flows.grpo", *flags],
            cwd=tmp_path,
            env=flow_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        refusals.append(result)

    kill_mid_run("flows.grpo", flags, "reward_mean", 1, tmp_path, flow_env, second_run)
    (refused,) = refusals
    (run_dir,) = (tmp_path / "out").glob("runs-*/single")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    # the one error line (Prefect's event worker may log after it): the output folder, which holds the run's, is
    # held by the first run
    message = next(line for line in refused.stderr.splitlines() if line.startswith("flows.grpo: error:"))
    assert message.startswith("flows.grpo: error: output_dir out is in use by process "), message
    assert "flow_kill_target.py flows.grpo" in message  # the first run's command
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    child = (run_dir / "mlflow_run_id").read_text().strip()
    assert len(runs) == 2 and child in {run.info.run_id for run in runs}  # the first run's parent and child only
    assert sorted(m.step for m in client.get_metric_history(child, "reward_mean")) == [1]


def test_a_lock_left_by_a_dead_process_is_taken(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(f"process {dead.stdout.strip()} on host (python -m flows.grpo)\n")
    with run_lock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"process {os.getpid()} on ")


def test_the_lock_names_its_holder_and_is_released(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tasks.run_lock import run_lock\n"
            "with run_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunInUseError, match=rf"run folder {tmp_path} is in use by process {holder.pid} on "):
            with run_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(tmp_path):  # its holder is gone: the kernel dropped the lock
        pass
    assert (tmp_path / LOCK_FILE).read_text() == ""  # emptied on release


def test_a_lock_path_that_cannot_be_a_file_is_named(tmp_path):
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(
        ValueError, match=rf"^{tmp_path / LOCK_FILE}: cannot be opened as the run's lock file \(Is a directory\)"
    ):
        with run_lock(tmp_path):
            pass


# ------------------------------------------------------------------------------ output folders


def test_a_flow_on_an_output_folder_another_flow_writes_into_is_refused(inputs, flow_env, tmp_path):  # noqa: F811
    """Two flows started together on one output folder both wrote into it (the second's summary replaced the
    first's): while one holds it, a second flow is refused in one line naming the holder, and writes nothing."""
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from flows.params import BaselineEvalParams; from tasks.outputs import outputs_held\n"
            "with outputs_held(BaselineEvalParams(output_dir=sys.argv[1])):\n"
            "    print('held', flush=True); time.sleep(300)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=flow_env,
        cwd=tmp_path,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        argv = flags("baseline_eval", inputs, tmp_path, output_dir=str(out), metrics_path=None)
        refused = subprocess.run(
            [sys.executable, "-m", "flows.baseline_eval", *argv],
            cwd=tmp_path,
            env=flow_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    message = next(line for line in refused.stderr.splitlines() if line.startswith("flows.baseline_eval: error:"))
    assert message.startswith(f"flows.baseline_eval: error: output_dir {out} is in use by process {holder.pid} on ")
    assert sorted(p.name for p in out.iterdir()) == [".a5-outputs", ".a5-outputs.lock"]  # nothing of the second's


def test_of_two_flows_claiming_a_new_folder_at_once_one_gets_it(tmp_path, monkeypatch):
    """The claim is made whole or not at all: another kind of flow that marks the folder between this one's look
    and its mark (here, as this one writes its mark) keeps it, and this one is refused."""
    import tasks.outputs
    from tasks.outputs import OUTPUT_MARKER, claim_output_dir

    write = tasks.outputs.write_text_atomic

    def the_other_claims_first(path, text):
        (tmp_path / OUTPUT_MARKER).write_text("Difficulty\n")
        return write(path, text)

    monkeypatch.setattr(tasks.outputs, "write_text_atomic", the_other_claims_first)
    with pytest.raises(ValueError, match=r"holds the outputs of another kind of run \(Difficulty"):
        claim_output_dir(tmp_path, "BaselineEval")
    assert (tmp_path / OUTPUT_MARKER).read_text() == "Difficulty\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUT_MARKER]  # its own partial mark removed
