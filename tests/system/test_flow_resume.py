"""The training flows survive a real ``kill -9``: their command line, killed mid-run and started again
with the same flags, finishes in the same MLflow runs without redoing finished work or logging a step twice.

Each test starts the flow's CLI in a subprocess (through tests/flow_kill_target.py, which freezes it
right after a chosen metric reaches the MLflow store), checks the checkpoint files that make the
kill "mid-run", SIGKILLs the process group, then runs ``python -m flows.<flow>`` with the same flags
to completion. The kill points are the worst cases for bookkeeping: a step or round whose metrics
are already logged but whose checkpoint/state is not yet written, so the resumed run repeats it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
from kill9 import kill_at_marker

from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Trace
from a5core.data.prompts import load_prompt
from a5core.runtime.writing import write_jsonl_atomic
from flows.expert_iteration import SUMMARY_KEYS as EI_SUMMARY
from flows.grpo import SUMMARY_KEYS as GRPO_SUMMARY
from tasks.tables import headline_metrics

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = load_prompt("r1_zero")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def flow_env(prefect_harness, tmp_path) -> dict[str, str]:
    """The flow tests' environment for a child process: offline hub, the session's Prefect API (no
    ephemeral server per child), Prefect's files in tmp_path, the repository importable, and one
    torch thread (see conftest's one_torch_thread: two threads crawl when another process holds a core). Without
    torchrun's launch variables: an in-process vLLM engine on the CPU sets LOCAL_WORLD_SIZE in this process
    (vllm.platforms.cpu), which a child would read as another launch's leftover."""
    import prefect.settings

    from a5core.runtime.distributed import LAUNCH_VARIABLES

    return {
        **{k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES},
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PREFECT_API_URL": str(prefect.settings.PREFECT_API_URL.value()),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p),
    }


def cli_flags(**params) -> list[str]:
    """``--flag value`` pairs for flows.cli (values are read as YAML, so JSON works)."""
    return [arg for name, value in params.items() for arg in ("--" + name.replace("_", "-"), json.dumps(value))]


def kill_mid_run(
    module: str, flags: list[str], key: str, step: int, cwd: Path, env: dict[str, str], check_mid_run
) -> None:
    """Run the flow until it has logged ``key`` at ``step``, assert ``check_mid_run()``, then SIGKILL it
    (its whole process group: grading workers included)."""
    marker, log = cwd / "frozen", cwd / "killed_run.log"
    with open(log, "wb") as out:
        child = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "flow_kill_target.py"), module, str(marker), key, str(step), *flags],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    kill_at_marker(child, marker, log.read_text, group=True, before_kill=check_mid_run)


def run_to_completion(module: str, flags: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result.stdout


def snapshot(*paths: Path) -> dict[Path, tuple[int, bytes]]:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in paths}


def steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def table_rows(client, run_id: str, path: str, tmp_path: Path) -> int:
    local = client.download_artifacts(run_id, path, str(tmp_path / "downloads"))
    return len(json.loads(Path(local).read_text())["data"])


@pytest.fixture(scope="module")
def warm_policy_dir(tiny_lm_dir, tmp_path_factory) -> Path:
    """A tiny policy that writes the r1_zero format and gets some of the 8 training sums right at
    temperature 1 (the planted tiny LM never answers, so Expert Iteration would keep nothing and never
    fine-tune): 40 SFT steps on the questions of ``arithmetic:8:1``, ~3 s."""
    from tiny_loops import make_model
    from transformers import AutoTokenizer

    from a5core.loops.sft import SFTConfig, train_sft

    tokenizer = AutoTokenizer.from_pretrained(tiny_lm_dir)
    model = make_model(tokenizer, hidden=64, layers=1)
    traces = [
        Trace(TEMPLATE.format(p.problem), f" </think> <answer> {p.answer} </answer>", p.answer)
        for p in arithmetic_problems(8, digits=1, split="train", seed=0)
    ]
    train_sft(
        model,
        tokenizer,
        traces,
        SFTConfig(learning_rate=5e-3, batch_size=8, microbatch_size=8, epochs=40, lr_schedule="constant"),
    )
    directory = tmp_path_factory.mktemp("warm_policy")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_expert_iteration_resumes_after_kill_9(warm_policy_dir, flow_env, tmp_path):
    """Killed after round 1's metrics reached MLflow but before state.json recorded the round: the rerun
    keeps round 0 and round 1's kept set and fine-tuned weights, re-evaluates round 1 without logging it
    twice, runs round 2 and the final evaluation, all in the one MLflow run."""
    from mlflow import MlflowClient

    n_rounds, batch_size, epochs, val_subset, val_limit = 3, 4, 1, 2, 3
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = cli_flags(
        model=str(warm_policy_dir),
        backend="hf",
        train_data="arithmetic:8:1",
        validation_data="arithmetic:4:1",
        val_subset=val_subset,
        val_limit=val_limit,
        n_ei_steps=n_rounds,
        questions_per_step=8,
        rollouts_per_question=4,
        epochs=epochs,
        min_tokens=0,
        max_tokens=24,
        learning_rate=1e-3,
        batch_size=batch_size,
        microbatch_size=2,
        max_seq_len=256,  # the tiny tokenizer's r1_zero prompts are 215 tokens: room for the responses
        output_dir="out",
        metrics_path="metrics.json",
        tracking_uri=tracking_uri,
    )

    def mid_run() -> None:
        (run_dir,) = (tmp_path / "out").glob("runs-*/single")
        state = json.loads((run_dir / "checkpoint/state.json").read_text())
        assert len(state["rounds"]) == 1 and state["rounds"][0]["kept"] > 0  # round 0 fine-tuned on something
        assert (run_dir / "checkpoint/round-1/kept.jsonl").stat().st_size > 0
        assert json.loads((run_dir / "checkpoint/round-1/sft/latest/state.json").read_text())["finished"]
        assert not (run_dir / "checkpoint/round-0/sft").exists()  # round 0 is in model.pt: its SFT state went
        assert not (run_dir / "done.json").exists()

    kill_mid_run("flows.expert_iteration", flags, "kept_fraction", 2, tmp_path, flow_env, mid_run)  # round 1: step 2
    (run_dir,) = (tmp_path / "out").glob("runs-*/single")
    checkpoint = run_dir / "checkpoint"
    before = snapshot(
        run_dir / "mlflow_run_id",
        checkpoint / "round-0/kept.jsonl",
        checkpoint / "round-0/rollouts.json",
        checkpoint / "round-1/kept.jsonl",
        checkpoint / "round-1/rollouts.json",
    )
    round_0 = json.loads((checkpoint / "state.json").read_text())["rounds"][0]
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri)
    assert steps(client, run_id, "kept_fraction") == [1, 2]  # the kill point: round 1 logged, not in state.json

    stdout = run_to_completion("flows.expert_iteration", flags, tmp_path, flow_env)

    parent_id = client.get_run(run_id).data.tags["mlflow.parentRunId"]  # the flow's run, its parent
    assert f"mlflow run {parent_id}" in stdout
    assert snapshot(*before) == before  # round 0 and round 1's rollouts were not redone (fine-tuning: sft/loss below)
    assert not list(checkpoint.glob("round-*/sft"))  # every round is in model.pt: no SFT state is kept
    rounds = json.loads((checkpoint / "state.json").read_text())["rounds"]
    assert len(rounds) == n_rounds and rounds[0] == round_0
    done = json.loads((run_dir / "done.json").read_text())
    assert done["mlflow_run_id"] == run_id and [p["step"] for p in done["curve"]] == list(range(1, n_rounds + 1))
    assert json.loads((tmp_path / "out/summary.json").read_text()) == [{k: done.get(k) for k in EI_SUMMARY}]
    assert json.loads((tmp_path / "metrics.json").read_text()) == headline_metrics(done)
    assert done["initial_accuracy"] is not None  # the starting policy, evaluated before round 0 (step 0)

    found = client.search_runs([client.get_experiment_by_name("expert_iteration").experiment_id])
    runs = [r for r in found if "mlflow.parentRunId" in r.data.tags]  # the flow's parent run holds the comparison
    assert [r.info.run_id for r in runs] == [run_id] and len(found) == 2  # no second run
    assert runs[0].info.status == "FINISHED"
    for key in ("kept_fraction", "rollout_mean_token_entropy"):  # step k: after k rounds
        assert steps(client, run_id, key) == list(range(1, n_rounds + 1)), key  # round 1 logged once, not twice
    for key in ("val_accuracy", "val_mean_token_entropy"):  # and the starting policy at step 0
        assert steps(client, run_id, key) == list(range(n_rounds + 1)), key
    assert steps(client, run_id, "final_val_accuracy") == [n_rounds]
    # SFT metrics are logged at the round's step, one entry per SFT step of that round's fine-tuning.
    sft_steps = [math.ceil(r["kept"] / batch_size) * epochs for r in rounds]
    assert steps(client, run_id, "sft/loss") == [r + 1 for r, n in enumerate(sft_steps) for _ in range(n)]
    tables = sorted(a.path for a in client.list_artifacts(run_id, "generations"))
    assert tables == [f"generations/subset{val_subset}_step_{r:06d}.json" for r in range(n_rounds + 1)] + [
        f"generations/subset{val_limit}_step_{n_rounds:06d}.json"
    ]  # the final evaluation's
    assert [table_rows(client, run_id, t, tmp_path) for t in tables] == [val_subset] * (n_rounds + 1) + [val_limit]


def test_sft_experiment_resumes_after_kill_9(tiny_lm_dir, flow_env, tmp_path):
    """Killed in the second setting after step 3 was logged (its checkpoint is at step 2): the rerun skips
    the finished setting, resumes the second from step 2 in the same child run, and every step of every
    metric is logged once; the summary, curves and plot cover both settings."""
    from mlflow import MlflowClient

    traces = [
        Trace(TEMPLATE.format(p.problem), f" {p.solution} </think> <answer> {p.answer} </answer>", p.answer)
        for p in arithmetic_problems(8, digits=1, split="train")
    ]
    write_jsonl_atomic(tmp_path / "train.jsonl", [asdict(t) for t in traces])
    validation = [p.__dict__ | {"type": "arithmetic"} for p in arithmetic_problems(5, digits=1, split="validation")]
    write_jsonl_atomic(tmp_path / "val.jsonl", validation)
    val_subset, val_limit = 2, 3  # the selection split: the last 2; the score split: the other 3
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = cli_flags(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="train.jsonl",
        filtered_data=None,
        sizes=[4, 8],
        validation_data="val.jsonl",
        val_subset=val_subset,
        val_limit=val_limit,
        learning_rate=1e-3,
        batch_size=2,
        microbatch_size=2,
        epochs=1,
        eval_every=1,
        checkpoint_every=2,
        max_tokens=12,
        max_seq_len=256,
        output_dir="out",
        metrics_path="metrics.json",
        tracking_uri=tracking_uri,
    )

    def mid_run() -> None:
        (root,) = (tmp_path / "out").glob("runs-*")
        assert (root / "4/done.json").is_file() and not (root / "8/done.json").exists()
        state = json.loads((root / "8/checkpoint/latest/state.json").read_text())
        assert state["step"] == 2 and not state["finished"]

    kill_mid_run("flows.sft_experiment", flags, "loss", 3, tmp_path, flow_env, mid_run)
    (root,) = (tmp_path / "out").glob("runs-*")
    before = snapshot(
        root / "mlflow_run_id",
        root / "4/mlflow_run_id",
        root / "8/mlflow_run_id",
        root / "4/done.json",
        root / "4/checkpoint/latest/state.json",
    )
    assert not list((root / "4").glob("**/*.pt"))  # a finished run keeps no checkpoint tensors
    parent_id, small_id, large_id = (
        p.read_text().strip() for p in (root / "mlflow_run_id", root / "4/mlflow_run_id", root / "8/mlflow_run_id")
    )
    client = MlflowClient(tracking_uri)
    assert steps(client, large_id, "loss") == [1, 2, 3]  # the kill point: step 3 logged, checkpoint at 2

    stdout = run_to_completion("flows.sft_experiment", flags, tmp_path, flow_env)

    assert f"mlflow parent run {parent_id}" in stdout
    assert snapshot(*before) == before  # the finished setting was not trained again
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert [(r["setting"], r["n_examples"], r["steps"]) for r in summary] == [("4", 4, 2), ("8", 8, 4)]
    assert json.loads((tmp_path / "out/summary.json").read_text()) == summary
    assert (tmp_path / "out/accuracy_vs_step.png").stat().st_size > 1000
    curves = (tmp_path / "out/curves.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in curves[1:]] == [["4", str(s)] for s in range(3)] + [
        ["8", str(s)] for s in range(5)
    ]
    assert json.loads((root / "8/done.json").read_text())["steps"] == 4

    experiment = client.get_experiment_by_name("sft_experiment").experiment_id
    runs = {r.info.run_id: r for r in client.search_runs([experiment])}
    assert set(runs) == {parent_id, small_id, large_id}  # no duplicate parent or child
    assert {runs[i].data.tags.get("mlflow.parentRunId") for i in (small_id, large_id)} == {parent_id}
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    for run_id, n_steps in ((small_id, 2), (large_id, 4)):
        for key in ("loss", "lr", "grad_norm"):
            assert steps(client, run_id, key) == list(range(1, n_steps + 1)), (run_id, key)
        for key in ("val_accuracy", "val_mean_token_entropy"):  # and the base model at step 0
            assert steps(client, run_id, key) == list(range(n_steps + 1)), (run_id, key)
        assert steps(client, run_id, "final_val_accuracy") == [n_steps]
        tables = sorted(a.path for a in client.list_artifacts(run_id, "generations"))
        assert tables == [f"generations/full_step_{n_steps:06d}.json"] + [  # the final evaluation's: the score split
            f"generations/subset{val_subset}_step_{s:06d}.json" for s in range(n_steps + 1)
        ]  # the final evaluation's, at the last step too
        assert [table_rows(client, run_id, t, tmp_path) for t in tables] == [val_limit] + [val_subset] * (n_steps + 1)
    for setting in ("4", "8"):
        assert steps(client, parent_id, f"final_accuracy_{setting}") == [0]


def run_to_completion_logged(module: str, flags: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, str]:
    """Like run_to_completion, also returning stderr (the flows' INFO log: resumes and per-step lines)."""
    result = subprocess.run(
        [sys.executable, "-m", module, *flags], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result.stdout, result.stderr


def grpo_flags(tiny_lm_dir: Path, tracking_uri: str, **overrides) -> list[str]:
    """A tiny GRPO run (tests/flows/test_grpo_flows.py's settings): arithmetic data, hf engine, a checkpoint
    and a validation every step."""
    return cli_flags(
        **{
            "model": str(tiny_lm_dir),
            "backend": "hf",
            "train_data": "arithmetic:30:1",
            "validation_data": "arithmetic:6:1",
            "reward_fn": "arithmetic",
            "val_subset": 3,
            "val_limit": 4,
            "eval_every": 1,
            "n_grpo_steps": 3,
            "rollout_batch_size": 4,
            "group_size": 2,
            "train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_tokens": 12,
            "min_tokens": 1,
            "checkpoint_every": 1,
            "output_dir": "out",
            "metrics_path": "metrics.json",
            "tracking_uri": tracking_uri,
            **overrides,
        }
    )


def assert_one_point_per_validation(client, run_id: str, n_steps: int) -> None:
    """val_accuracy_by_wall_seconds holds one point per validated step: at the second the run first
    recorded for that step (its wall_seconds), with that step's val_accuracy."""
    wall = {m.step: m.value for m in client.get_metric_history(run_id, "wall_seconds")}
    accuracy = {m.step: m.value for m in client.get_metric_history(run_id, "val_accuracy")}
    points = client.get_metric_history(run_id, "val_accuracy_by_wall_seconds")
    assert Counter((m.step, m.value) for m in points) == Counter(
        (int(wall[s]), accuracy[s]) for s in range(n_steps + 1)
    )


def test_grpo_resumes_after_kill_9(tiny_lm_dir, flow_env, tmp_path):
    """Killed after step 2's metrics (its validation included) reached MLflow, before its checkpoint and
    before its accuracy-by-wall-clock point: the rerun continues the same run from the step-1 checkpoint,
    replays step 2 without logging it twice, writes the missing wall-clock point once (at step 2's
    first wall-clock second, not the replay's), runs step 3 and the final evaluation."""
    from mlflow import MlflowClient

    n_steps, val_subset, val_limit = 3, 3, 4
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = grpo_flags(tiny_lm_dir, tracking_uri, n_grpo_steps=n_steps, val_subset=val_subset, val_limit=val_limit)

    def mid_run() -> None:
        (run_dir,) = (tmp_path / "out").glob("runs-*/single")
        state = json.loads((run_dir / "checkpoint/latest/state.json").read_text())
        assert state["step"] == 1 and not state["finished"]
        assert not (run_dir / "done.json").exists()

    kill_mid_run("flows.grpo", flags, "val_accuracy", 2, tmp_path, flow_env, mid_run)
    (run_dir,) = (tmp_path / "out").glob("runs-*/single")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    checkpointed = json.loads((run_dir / "checkpoint/latest/state.json").read_text())["history"]
    client = MlflowClient(tracking_uri)
    assert steps(client, run_id, "reward_mean") == [1, 2]  # the kill point: step 2 logged, checkpoint at 1
    assert len(client.get_metric_history(run_id, "val_accuracy_by_wall_seconds")) == 2  # steps 0 and 1

    stdout, log = run_to_completion_logged("flows.grpo", flags, tmp_path, flow_env)

    parent_id = client.get_run(run_id).data.tags["mlflow.parentRunId"]  # the flow's run, its parent
    assert f"mlflow run {parent_id}" in stdout
    # Steps 0 and 1 came from the checkpoint: not trained again (the per-step INFO lines say which ran).
    assert "GRPO: resuming from" in log and "after step 1" in log
    assert [f"GRPO step {s}/{n_steps}:" in log for s in range(n_steps + 1)] == [False, False, True, True]
    state = json.loads((run_dir / "checkpoint/latest/state.json").read_text())
    assert state["finished"] and state["step"] == n_steps
    assert [h["step"] for h in state["history"]] == list(range(n_steps + 1))
    assert state["history"][:2] == checkpointed
    done = json.loads((run_dir / "done.json").read_text())
    assert done["mlflow_run_id"] == run_id and [p["step"] for p in done["curve"]] == list(range(n_steps + 1))
    assert [p["step"] for p in done["trends"]] == list(range(1, n_steps + 1))
    assert json.loads((tmp_path / "out/summary.json").read_text()) == [{k: done.get(k) for k in GRPO_SUMMARY}]
    assert json.loads((tmp_path / "metrics.json").read_text()) == headline_metrics(done)
    for name in (
        "summary.json",
        "curves.csv",
        "train_curves.csv",
        "accuracy_vs_step.png",
        "accuracy_vs_wall_clock.png",
    ):
        assert (tmp_path / "out" / name).stat().st_size > 0, name

    found = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    runs = [r for r in found if "mlflow.parentRunId" in r.data.tags]  # the flow's parent run holds the comparison
    assert [r.info.run_id for r in runs] == [run_id] and len(found) == 2  # no second run
    assert runs[0].info.status == "FINISHED"
    for key in ("reward_mean", "loss", "grad_norm", "token_entropy", "time_train"):
        assert steps(client, run_id, key) == list(range(1, n_steps + 1)), key  # step 2 logged once, not twice
    for key in ("val_accuracy", "val_format_rate", "wall_seconds"):
        assert steps(client, run_id, key) == list(range(n_steps + 1)), key
    assert steps(client, run_id, "final_val_accuracy") == [n_steps]
    assert_one_point_per_validation(client, run_id, n_steps)
    tables = sorted(a.path for a in client.list_artifacts(run_id, "generations"))
    assert tables == [f"generations/subset{val_subset}_step_{s:06d}.json" for s in range(n_steps + 1)] + [
        f"generations/subset{val_limit}_step_{n_steps:06d}.json"
    ]
    assert [table_rows(client, run_id, t, tmp_path) for t in tables] == [val_subset] * (n_steps + 1) + [val_limit]


def test_grpo_ablation_resumes_after_kill_9(tiny_lm_dir, flow_env, tmp_path):
    """The baseline ablation killed in its first setting (step 1 logged, no checkpoint yet): the rerun
    continues the parent run and that child run, runs the second setting as a new child, and every
    child's metrics hold each step once; the parent gets the summary of both."""
    from mlflow import MlflowClient

    n_steps = 2
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    flags = grpo_flags(
        tiny_lm_dir, tracking_uri, n_grpo_steps=n_steps, ablation="grpo_baseline_ablation", checkpoint_every=2
    )

    out = tmp_path / "out"  # runs-<parent key>/mlflow_run_id, runs-<setting key>/<setting>/...

    def mid_run() -> None:
        assert len(list(out.glob("runs-*/mlflow_run_id"))) == 1
        assert not list(out.glob("runs-*/*/done.json")) and not list(out.glob("runs-*/*/checkpoint/latest"))

    kill_mid_run("flows.grpo", flags, "reward_mean", 1, tmp_path, flow_env, mid_run)
    (parent_id_file,) = out.glob("runs-*/mlflow_run_id")
    (first_id_file,) = out.glob("runs-*/no_baseline/mlflow_run_id")
    parent_id, first_id = parent_id_file.read_text().strip(), first_id_file.read_text().strip()

    stdout, _ = run_to_completion_logged("flows.grpo", flags, tmp_path, flow_env)

    assert f"mlflow run {parent_id}" in stdout
    assert (
        list(out.glob("runs-*/mlflow_run_id")) == [parent_id_file] and parent_id_file.read_text().strip() == parent_id
    )
    assert first_id_file.read_text().strip() == first_id
    (second_id_file,) = out.glob("runs-*/reinforce_with_baseline/mlflow_run_id")
    second_id = second_id_file.read_text().strip()
    summary = json.loads((out / "summary.json").read_text())
    assert [r["setting"] for r in summary] == ["no_baseline", "reinforce_with_baseline"]

    client = MlflowClient(tracking_uri)
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("grpo").experiment_id])}
    assert set(runs) == {parent_id, first_id, second_id}  # no duplicate parent or child
    assert {runs[i].data.tags.get("mlflow.parentRunId") for i in (first_id, second_id)} == {parent_id}
    assert {r.info.status for r in runs.values()} == {"FINISHED"}
    for run_id in (first_id, second_id):
        assert steps(client, run_id, "reward_mean") == list(range(1, n_steps + 1)), run_id
        assert steps(client, run_id, "val_accuracy") == list(range(n_steps + 1)), run_id
        assert steps(client, run_id, "final_val_accuracy") == [n_steps], run_id
        assert_one_point_per_validation(client, run_id, n_steps)
    assert {"summary.json", "accuracy_vs_step.png", "train_curves.csv"} <= {
        a.path for a in client.list_artifacts(parent_id)
    }
