"""The training flows on two torchrun ranks (gloo, CPU), and the grpo flow's engine in a process of its own.

Flow command lines run through tests/flows_distributed_target.py, whose engines sample each prompt
alone (so rollouts do not depend on the ranks) and whose reward varies for the tiny model: the grpo
and expert_iteration flows in one process, then in one two-rank torchrun launch, and the grpo flow in
one process with ``engine_device: cpu`` (a RemoteEngine fed over gloo). The two-rank and remote-engine
runs must log one MLflow run with what the one-process run logs, and train the same weights.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import flows_distributed_target
import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# Differ between runs by nature (timings), or by how each rank cuts its share (micro-batch passes and shapes).
TIMINGS = ("time_", "wall_seconds", "tokens_per_s", "train_tokens", "system/", "microbatch")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def flags(run_dir: Path, model: Path, **overrides) -> list[str]:
    """flows.grpo's flags for a two-step run on the tiny model and arithmetic problems."""
    settings = dict(
        model=model,
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        val_limit=4,
        eval_every=1,
        n_grpo_steps=2,
        rollout_batch_size=8,  # two groups of 4: some group's rewards vary, whatever the sampler draws
        group_size=4,
        train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=0.01,
        max_tokens=12,
        min_tokens=1,
        checkpoint_every=1,
        reward_fn="arithmetic",
        output_dir=run_dir / "out",
        metrics_path=run_dir / "metrics.json",
        tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}",
    )
    return [
        part for key, value in {**settings, **overrides}.items() for part in (f"--{key.replace('_', '-')}", str(value))
    ]


def ei_flags(run_dir: Path, model: Path) -> list[str]:
    """flows.expert_iteration's flags for two rounds (each keeping some rollouts and training on them)."""
    settings = dict(
        model=model,
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        val_limit=4,
        n_ei_steps=2,
        questions_per_step=4,
        rollouts_per_question=2,
        max_tokens=12,
        min_tokens=1,
        learning_rate=0.01,
        batch_size=4,
        microbatch_size=1,
        reward_fn="arithmetic",
        output_dir=run_dir / "ei_out",
        metrics_path=run_dir / "ei_metrics.json",
        tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}",
    )
    return [part for key, value in settings.items() for part in (f"--{key.replace('_', '-')}", str(value))]


def run_in_process(run_dir: Path, runs: list) -> None:
    run_dir.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(run_dir)  # MLflow artifacts under ./mlruns
        flows_distributed_target.main(runs)


def run_on_two_ranks(run_dir: Path, runs: list, marker: str) -> None:
    """torchrun, 2 gloo ranks (GPUs hidden); rank 0's Prefect flow runs report to the test's API."""
    from prefect.settings import PREFECT_API_URL

    run_dir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "A5_TEST_MARKER": marker,
    }
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(REPO / "tests" / "flows_distributed_target.py"),
        json.dumps(runs),
    ]
    launch = subprocess.Popen(
        command,
        env=env,
        cwd=run_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = launch.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)  # the agent and its ranks
        output, _ = launch.communicate()
        pytest.fail("the two-rank launch did not finish in 300 s:\n" + output[-5000:])
    assert launch.returncode == 0, output[-8000:]


def logged(run_dir: Path, experiment: str = "grpo") -> dict:
    """The one MLflow run of ``experiment``: its metrics (name → [(step, value)]), params and tags, the
    final weights (the saved model folder) and every rank's push count."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    runs = [r for r in found if "mlflow.parentRunId" in r.data.tags]  # the training run, under the flow's parent
    assert len(runs) == 1 and len(found) == 2, [r.info.run_name for r in found]
    run_id = runs[0].info.run_id
    metrics = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in runs[0].data.metrics
        if not any(part in key for part in TIMINGS)
    }
    from safetensors.torch import load_file

    out = run_dir / ("out" if experiment == "grpo" else "ei_out")
    (weights,) = out.glob("runs-*/single/model/model.safetensors")  # the finished run's saved policy
    assert not list(out.glob("runs-*/single/**/*.pt"))  # its checkpoint tensors are gone
    pushes = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("pushes-*.json"))}
    kept = {
        p.parent.name: [(t["prompt"], t["response"]) for t in map(json.loads, p.read_text().splitlines())]
        for p in sorted(out.glob("runs-*/single/checkpoint/round-*/kept.jsonl"))
    }  # EI: each round's SFT set
    return {
        "metrics": metrics,
        "weights": load_file(weights),
        "pushes": pushes,
        "params": runs[0].data.params,
        "tags": runs[0].data.tags,
        "kept": kept,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_lm_dir, prefect_harness):
    """The GRPO flow in one process, with a remote engine, and (with the EI flow after it, in the same
    launch) on two ranks; the EI flow in one process."""
    root = tmp_path_factory.mktemp("flows_distributed")
    marker = uuid.uuid4().hex
    run_in_process(
        root / "one",
        [
            ("flows.grpo", flags(root / "one", tiny_lm_dir)),
            ("flows.expert_iteration", ei_flags(root / "one", tiny_lm_dir)),
        ],
    )
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    run_in_process(root / "remote", [("flows.grpo", flags(root / "remote", tiny_lm_dir, engine_device="cpu"))])
    left = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in children and p.is_running() and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())
    ]  # spawn's helper, one per process
    run_on_two_ranks(
        root / "two",
        [
            ("flows.grpo", flags(root / "two", tiny_lm_dir)),
            ("flows.expert_iteration", ei_flags(root / "two", tiny_lm_dir)),
        ],
        marker,
    )
    from transformers import AutoModelForCausalLM

    initial = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_lm_dir).state_dict().items()}
    return {
        "one": logged(root / "one"),
        "remote": logged(root / "remote"),
        "two": logged(root / "two"),
        "one_ei": logged(root / "one", "expert_iteration"),
        "two_ei": logged(root / "two", "expert_iteration"),
        "initial": initial,
        "left_by_remote": left,
        "marker": marker,
    }


def assert_same_metrics(want: dict, got: dict, rel: float) -> None:
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, points in want["metrics"].items():
        assert [s for s, _ in got["metrics"][key]] == [s for s, _ in points], key  # each step logged once
        for (_, a), (_, b) in zip(points, got["metrics"][key], strict=True):
            assert b == pytest.approx(a, rel=rel, abs=1e-6), key


def assert_same_run(want: dict, got: dict, rel: float, atol: float) -> None:
    assert_same_metrics(want, got, rel)
    assert want["weights"].keys() == got["weights"].keys()
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=atol, msg=name)


def assert_same_updates(want: dict, got: dict, initial: dict, rel: float = 0.05) -> None:
    """Per tensor, the two runs' weights differ by at most ``rel`` of how far training moved the tensor:
    ‖got − want‖ ≤ rel · ‖want − initial‖ (Frobenius norms).

    Why not entry by entry: AdamW divides each gradient entry by its own magnitude, so an entry whose
    gradient is of the order of Adam's eps (1e-8) turns a rounding difference between two float paths
    (two ranks add their gradients in another order; even one sequence's gradient, one per rank, is not
    bitwise the one-process gradient under FSDP2: measured) into a
    step difference of up to a fraction of the learning rate. Measured (EI at lr 0.01, the same kept
    sets; native, AVX2 and no-SIMD kernels): 4 to 9 entries of 205,376 differ by 1e-5 to 1.6e-4, the worst
    in model.layers.1.self_attn.o_proj.weight (an entry whose second step was 0.31 of the learning rate:
    its gradient was 0.45·eps), the rest by less than 1e-5; an absolute 2e-4 failed there on another
    CPU. Per tensor that is at most 5e-4 of the update (0.03 even with the two sides on deliberately
    different CPU kernels); a tensor left untrained differs by 100% of its update, one that missed a
    round or was trained on other data by a large part of it."""
    assert want["weights"].keys() == got["weights"].keys()
    for name, tensor in want["weights"].items():
        moved = torch.linalg.vector_norm(tensor - initial[name]).item()
        departed = torch.linalg.vector_norm(got["weights"][name] - tensor).item()
        assert departed <= rel * moved + 1e-6, (
            f"{name}: the runs differ by {departed:.3g}, training moved it by {moved:.3g}"
        )


def test_the_one_process_run_trains_and_logs(runs):
    one = runs["one"]
    assert [s for s, _ in one["metrics"]["reward_mean"]] == [1, 2]
    assert [s for s, _ in one["metrics"]["val_accuracy"]] == [0, 1, 2]
    # some group's rewards varied (non-zero advantages): the run learns something
    assert min(value for _, value in one["metrics"]["frac_groups_all_equal"]) < 1
    assert one["pushes"] == {"pushes-0.json": 6}  # 3 validations, 2 steps, the final evaluation


def test_two_ranks_log_one_run_like_one_process(runs):
    assert_same_run(runs["one"], runs["two"], rel=1e-4, atol=2e-4)
    assert runs["two"]["pushes"] == {"pushes-0.json": 6, "pushes-1.json": 6}  # each rank's engine, whole weights


def test_expert_iteration_on_two_ranks_keeps_trains_and_saves_like_one_process(runs):
    """The same rollouts kept in each round (the sampled tokens, graded), then the same training on them: the
    same logged metrics, and model.pt (whole weights, written by rank 0) updated alike (see
    assert_same_updates for why not to an absolute tolerance)."""
    one, two = runs["one_ei"], runs["two_ei"]
    assert [s for s, _ in one["metrics"]["kept_fraction"]] == [1, 2]  # step k: after k rounds
    assert 0 < one["metrics"]["kept_fraction"][0][1] < 1 and one["metrics"]["sft/loss"]  # kept some, trained
    assert sorted(one["kept"]) == ["round-0", "round-1"] and one["kept"]["round-0"]
    for name, kept in one["kept"].items():
        assert two["kept"][name] == kept, f"{name}: two ranks kept other rollouts (a sampled token differs)"
    assert_same_metrics(one, two, rel=1e-4)
    assert_same_updates(one, two, runs["initial"])
    assert two["pushes"] == {
        "pushes-0.json": 6,
        "pushes-1.json": 6,
    }  # 2 rounds + 3 validations (the start too) + the final one


def test_two_ranks_leave_no_process_behind(runs):
    """torchrun's agent, both ranks, their engines and grader workers: all gone once the command returns."""
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("A5_TEST_MARKER") == runs["marker"]:
                left.append(process.cmdline())
    assert not left


def test_an_engine_on_its_own_device_gets_every_push(runs):
    """engine_device cpu: a RemoteEngine (own process, gloo) samples what the in-process engine samples
    from the same pushed weights, so the run is the one-process run; its server is gone at the end."""
    assert_same_run(runs["one"], runs["remote"], rel=1e-5, atol=1e-6)
    assert runs["remote"]["pushes"] == {"pushes-0.json": 6}
    assert runs["remote"]["params"]["engine_device"] == "cpu"
    assert not runs["left_by_remote"], [p.cmdline() for p in runs["left_by_remote"]]


def test_engine_device_gives_each_rank_its_device_and_refuses_what_cannot_work(monkeypatch):
    from flows.params import EIParams, GRPOParams
    from tasks.checks import check_placement
    from tasks.engines import engine_device_of_rank, in_process_backend

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert engine_device_of_rank("cpu") == "cpu" and engine_device_of_rank(None) is None
    with pytest.raises(ValueError, match="not one of the 0 GPUs"):
        engine_device_of_rank("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # rank 1 trains on cuda:1
    assert engine_device_of_rank("cuda:4, cuda:5") == "cuda:5"
    assert engine_device_of_rank("cuda:0,cuda:1") == "cuda:1"  # its own GPU: the weights go through host memory
    with pytest.raises(ValueError, match="3 devices for 2 ranks"):
        engine_device_of_rank("cuda:4,cuda:5,cuda:6")
    with pytest.raises(ValueError, match="not a cuda device or cpu"):
        GRPOParams(engine_device="tpu:0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="does not combine with torchrun"):
        check_placement(GRPOParams(ablation="grpo_lr_sweep", runner="ray"))
    with pytest.raises(ValueError, match="does not combine with torchrun"):
        check_placement(EIParams(sweep=True, runner="ray"))
    check_placement(EIParams(sweep=False, runner="ray"))  # one run: no children to place
    monkeypatch.setattr("tasks.engines.rank_and_world", lambda: (1, 2))
    assert in_process_backend("auto") == "hf" and in_process_backend("hf") == "hf"
    with pytest.raises(ValueError, match="backend vllm under several ranks"):
        in_process_backend("vllm")
