"""A comparison decided in one command: two arms × three seeds of a tiny GRPO ablation run side by side, a process
each (``--seeds``), killed mid-way and run again (nothing trained twice, nothing lost), then decided (``--decide``);
``--until-decided`` stops once a planted large effect is decided; the same on a local Ray.

The kill test runs the command through tests/side_by_side_target.py, which freezes one child once it has
checkpointed step 1 (tests/flow_kill_target.py): the kill point is known, not a race against a tiny run.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.ablations import ablation_settings
from flows.params import GRPOParams
from flows.seeds import with_seed
from tasks.runs import run_folder

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
ARMS = ["grpo", "dapo"]
DEADLINE_S = 300  # a guard against a hung command, not a timing assertion

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(tmp_path: Path, model: Path) -> dict:
    """A tiny GRPO ablation's settings: two steps, a checkpoint after each."""
    return dict(
        model=str(model),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        val_limit=4,
        eval_every=0,
        n_grpo_steps=2,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=12,
        min_tokens=1,
        checkpoint_every=1,
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        ablation="grpo_dapo_ablation",
        ablation_only=ARMS,
        at_once=2,
    )


def flags(settings: dict) -> list[str]:
    return [arg for name, value in settings.items() for arg in ("--" + name.replace("_", "-"), json.dumps(value))]


def folders(settings: dict, seeds: list[int]) -> dict[str, Path]:
    """Each child's run folder, by its label: the single-seed command's own."""
    params = GRPOParams(**settings)
    children = ablation_settings(params.ablation, params)
    return {f"{arm}/seed{s}": run_folder(with_seed(children[arm], s), arm) for s in seeds for arm in ARMS}


def released(lock: Path) -> bool:
    """Whether no process holds the run lock ``lock`` (a child still running holds its folder's)."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def wait_for(condition, what: str, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {DEADLINE_S} s; the command's output ends:\n{log.read_text()[-5000:]}")
        time.sleep(0.2)


@pytest.fixture
def command_env(prefect_harness, tmp_path) -> dict[str, str]:
    """A command's environment: offline hub, the session's Prefect API, the repository importable, one thread."""
    import prefect.settings

    from a5core.runtime.distributed import LAUNCH_VARIABLES

    return {
        **{k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES},
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "A5_SYSTEM_METRICS": "0",
        "PREFECT_API_URL": str(prefect.settings.PREFECT_API_URL.value()),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
    }


def test_two_arms_three_seeds_side_by_side_killed_and_run_again_give_a_verdict(
    tiny_lm_dir, command_env, tmp_path, monkeypatch, capsys
):
    """The command, a process of its own, killed (SIGKILL) once five children finished and the sixth checkpointed
    step 1; run again (here, its command line in this process): the five are read back, the sixth resumes its
    checkpoint in its MLflow run, each step is logged once, and the verdict over the six is printed."""
    from mlflow import MlflowClient

    from flows.grpo import main

    settings = {**tiny(tmp_path, tiny_lm_dir), "seeds": [0, 1, 2], "decide": "dapo >= grpo"}
    children = folders(settings, [0, 1, 2])
    cut, finished = "dapo/seed2", [name for name in children if name != "dapo/seed2"]
    marker, log = tmp_path / "frozen", tmp_path / "killed.log"
    with open(log, "wb") as out:
        command = subprocess.Popen(
            [sys.executable, str(TESTS / "side_by_side_target.py"), cut, str(marker), "flows.grpo", *flags(settings)],
            cwd=tmp_path,
            env=command_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:  # mid-way: five children finished, the sixth frozen after its step-1 checkpoint
        wait_for(
            lambda: all((children[n] / "done.json").is_file() for n in finished) and marker.is_file(),
            "five children finished and the sixth frozen mid-run",
            log,
        )
        os.killpg(command.pid, signal.SIGKILL)
        assert command.wait() == -signal.SIGKILL
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    # the killed command's child is stopped by its watcher: its folder's lock comes free
    wait_for(lambda: released(children[cut] / "run.lock"), "the cut child stopped", log)
    before = {n: (children[n] / "done.json").read_bytes() for n in finished}
    mtimes = {n: (children[n] / "done.json").stat().st_mtime_ns for n in finished}
    run_ids = {n: (children[n] / "mlflow_run_id").read_text() for n in children}
    assert (children[cut] / "checkpoint").is_dir() and not (children[cut] / "done.json").exists()

    monkeypatch.chdir(tmp_path)
    for key in ("A5_SYSTEM_METRICS", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, command_env[key])
    main(flags(settings))
    printed = capsys.readouterr().out

    # nothing trained twice: the finished children were not started again, the cut one resumed its checkpoint
    for name in finished:
        assert (children[name] / "done.json").read_bytes() == before[name], name
        assert (children[name] / "done.json").stat().st_mtime_ns == mtimes[name], name
        assert (children[name] / "child.log").read_text().count("\n== ") == 0, name  # one attempt
    text = (children[cut] / "child.log").read_text()
    assert text.count("\n== ") == 1 and "GRPO: resuming from" in text, text[-3000:]
    # nothing lost: every child's one MLflow run, each step logged once, under the one parent run
    client = MlflowClient(settings["tracking_uri"])
    rows = {row["setting"]: row for row in json.loads((tmp_path / "out/summary.json").read_text())}
    assert list(rows) == [f"{arm}/seed{s}" for s in (0, 1, 2) for arm in ARMS]
    parents = set()
    for name, folder in children.items():
        done = json.loads((folder / "done.json").read_text())
        assert done["mlflow_run_id"] == run_ids[name] and done["setting"] == name.split("/")[0]
        run = client.get_run(run_ids[name])
        assert run.info.status == "FINISHED" and run.data.params["seed"] == name[-1]
        assert sorted(m.step for m in client.get_metric_history(run_ids[name], "reward_mean")) == [1, 2], name
        parents.add(run.data.tags["mlflow.parentRunId"])
    (parent,) = parents
    assert f"mlflow run {parent}" in printed
    # the verdict, printed with its pairs
    found = json.loads((tmp_path / "out/verdicts/verdicts.json").read_text())
    (verdict,) = found["verdicts"]
    assert verdict["expectation"] == "dapo >= grpo" and verdict["pairs"] == 3
    assert f"dapo >= grpo: {verdict['verdict']}" in printed, printed[-3000:]
    assert f"verdicts  {tmp_path / 'out/verdicts/verdicts.md'}" in printed


def test_until_decided_stops_once_a_planted_large_effect_is_decided(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, caplog
):
    """Each child's final accuracy is planted (tests/planted_children.py: dapo 0.4 above grpo, little noise; the
    children made in this process, in place of the local runner's processes). The first wave makes the 3 pairs a
    verdict needs, too few for the confidence sequence; the next wave's pair decides it: the command stops at 4 pairs
    of the 8 it was allowed, and the verdict reads the parent's children alone."""
    import logging

    from planted_children import run_planted

    import flows.seeds
    from flows.grpo import grpo_flow

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(flows.seeds, "children_in_processes", run_planted)
    params = GRPOParams(**{**tiny(tmp_path, tiny_lm_dir), "decide": ["dapo >= grpo"], "until_decided": 8, "seed": 10})
    with caplog.at_level(logging.INFO, logger="flows"):
        result = grpo_flow(params)
    assert [row["setting"] for row in result["summary"]] == [f"{arm}/seed{s}" for s in range(10, 14) for arm in ARMS]
    (verdict,) = result["verdicts"]["verdicts"]
    assert (verdict["verdict"], verdict["pairs"]) == ("agrees", 4)
    assert verdict["mean"] == pytest.approx(0.4, abs=0.05)
    assert result["verdicts"]["runs_read"] == 8  # the parent's children alone
    lines = [r.getMessage() for r in caplog.records]
    assert "after 3 pairs, not decided yet: dapo >= grpo" in lines, lines
    assert "every expectation decided after 4 pairs: no more seeds" in lines, lines


def test_the_same_comparison_on_a_local_ray(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """runner ray: the children (two arms × three seeds) run on a local Ray's workers, each the single-seed
    command's run in its own folder; run again, nothing runs (no Ray started) and the verdict is the same."""
    import flows.fanout
    from flows.grpo import grpo_flow

    monkeypatch.chdir(tmp_path)
    settings = {**tiny(tmp_path, tiny_lm_dir), "seeds": [0, 1, 2], "decide": ["dapo >= grpo"], "runner": "ray"}
    settings |= {"ray_gpus_per_child": 0, "n_grpo_steps": 1}
    result = grpo_flow(GRPOParams(**settings))
    labels = [f"{arm}/seed{s}" for s in (0, 1, 2) for arm in ARMS]
    assert [row["setting"] for row in result["summary"]] == labels
    for name, folder in folders(settings, [0, 1, 2]).items():
        assert json.loads((folder / "done.json").read_text())["setting"] == name.split("/")[0]
    (verdict,) = result["verdicts"]["verdicts"]
    assert verdict["pairs"] == 3
    monkeypatch.setattr(flows.fanout, "run_children_on_ray", lambda *a, **k: pytest.fail("a finished child ran again"))
    again = grpo_flow(GRPOParams(**settings))
    assert again["mlflow_run_id"] == result["mlflow_run_id"] and again["summary"] == result["summary"]
    assert again["verdicts"]["verdicts"][0]["verdict"] == verdict["verdict"]
