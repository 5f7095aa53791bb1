"""FSDP2 on CPU (gloo): the global-token loss gives the same gradient on 1 and 2 ranks whatever the
micro-batch, and the SFT and GRPO loops on 2 ranks give the one-process updates, metrics and resumes."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def torchrun(script: str, *args: str, ranks: int = 2) -> None:
    """Run ``tests/<script> args`` on ``ranks`` gloo processes through torchrun, on a free local port
    (GPUs hidden: init_from_env would pick NCCL, and these models live on the CPU)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    with socket.socket() as probe:  # a free port for the rendezvous (port 0 is not accepted there)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(REPO / "tests" / script),
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def gradient(tmp_path, tiny_lm_dir, ranks: int, microbatch: int) -> dict[str, torch.Tensor]:
    """The full gradient of distributed_target.py's step (one rank: in this process)."""
    import distributed_target

    out = tmp_path / f"grad_{ranks}_{microbatch}.pt"
    if ranks == 1:
        distributed_target.main(str(tiny_lm_dir), str(out), str(microbatch))
    else:
        torchrun("distributed_target.py", str(tiny_lm_dir), str(out), str(microbatch), ranks=ranks)
    return torch.load(out)


def test_two_ranks_and_any_microbatch_give_the_one_rank_gradient(tmp_path, tiny_lm_dir):
    single = gradient(tmp_path, tiny_lm_dir, 1, 8)
    for ranks, micro in [(1, 3), (2, 4), (2, 1)]:
        other = gradient(tmp_path, tiny_lm_dir, ranks, micro)
        for name, value in single.items():
            torch.testing.assert_close(
                other[name], value, rtol=1e-5, atol=1e-7, msg=f"{name} ({ranks} ranks, micro {micro})"
            )


def test_per_split_means_would_weigh_tokens_differently():
    """The reason for the global count: a masked mean per rank (or micro-batch) gives each token
    1/(splits · its split's tokens), which differs between splits of different response lengths; the
    global share gives every token 1/(the batch's tokens), as one process with one micro-batch does."""
    from a5core.runtime.distributed import global_token_loss

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)  # split 0: 2 tokens, split 1: 4
    weights = []
    for split in range(2):
        nll = torch.zeros(1, 4, requires_grad=True)
        global_token_loss(nll, mask[split : split + 1], global_tokens=6.0).backward()
        weights.append(nll.grad[mask[split : split + 1]])
    assert torch.allclose(torch.cat(weights), torch.full((6,), 1 / 6))
    per_split_mean = [1 / (2 * 2), 1 / (2 * 4)]
    assert per_split_mean[0] != per_split_mean[1]


# ------------------------------------------------------------------------------ the training loops


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory, tiny_lm_dir, one_torch_thread):
    """distributed_loops_target.py's runs: one rank in this process with whole-batch micro-batches,
    then two ranks with micro-batches of 1 (uneven shares) that also resume the one-rank checkpoint."""
    import distributed_loops_target

    one_dir, two_dir = tmp_path_factory.mktemp("one_rank"), tmp_path_factory.mktemp("two_ranks")
    one = distributed_loops_target.run(str(tiny_lm_dir), str(one_dir), None)
    torchrun("distributed_loops_target.py", str(tiny_lm_dir), str(two_dir), "1", str(one_dir / "sft_crashed"))
    return one, torch.load(two_dir / "results.pt", weights_only=False)


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


def assert_same_metrics(a: dict, b: dict, rel: float) -> None:
    """Every metric of ``a`` but the timings, padded token counts and micro-batch passes and shapes
    (micro-batches pad and cut differently)."""
    skip = ("time_", "wall_seconds", "tokens_per_s", "train_tokens", "microbatch")
    keys = [k for k in a if not any(part in k for part in skip)]
    assert keys and set(keys) <= set(b)
    for key in keys:
        assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-6), key


def test_sft_on_two_ranks_updates_and_logs_like_one(loop_runs):
    one, two = loop_runs
    assert_same_weights(one["sft"]["weights"], two["sft"]["weights"], atol=2e-5)
    assert [s for s, _ in two["sft"]["log"]] == [1, 2]  # rank 0 logs, once per step
    for (_, want), (_, got) in zip(one["sft"]["log"], two["sft"]["log"], strict=True):
        assert_same_metrics(want, got, rel=1e-5)
    assert two["sft"]["returned"]["tokens"] == one["sft"]["returned"]["tokens"]  # summed over the ranks


def test_weights_kept_gathered_from_forward_to_backward_train_alike(loop_runs):
    one, two = loop_runs
    assert_same_weights(one["sft"]["weights"], two["sft_gathered"]["weights"], atol=2e-5)


def test_sft_checkpoints_of_two_ranks_resume_and_are_the_one_process_layout(loop_runs):
    one, two = loop_runs
    assert_same_weights(two["sft"]["weights"], two["sft_resumed"]["weights"], atol=0)  # 2 ranks → 2 ranks
    assert [s for s, _ in two["sft_resumed"]["log"]] == [2]
    assert_same_weights(one["sft"]["weights"], two["sft_foreign"]["weights"], atol=2e-5)  # 1 rank → 2 ranks


def test_grpo_on_two_ranks_updates_and_logs_like_one(loop_runs):
    one, two = loop_runs
    assert_same_weights(one["grpo"]["weights"], two["grpo"]["weights"], atol=2e-4)
    assert two["grpo"]["pushes"] == pytest.approx(one["grpo"]["pushes"], rel=1e-6)  # whole weights reach the engine
    assert [s for s, _ in two["grpo"]["log"]] == [1, 2]
    for want, got in zip(one["grpo"]["history"], two["grpo"]["history"], strict=True):
        assert got["optimizer_steps"] == 4 and got["clip_fraction"] > 0
        assert_same_metrics(want, got, rel=1e-4)


def test_token_budget_micro_batches_on_two_ranks_update_like_one_process(loop_runs):
    """Micro-batches by token budget, dealt to two ranks by tokens: the one-process whole-batch update."""
    one, two = loop_runs
    assert_same_weights(one["sft"]["weights"], two["sft_budget"]["weights"], atol=2e-5)
    assert_same_weights(one["grpo"]["weights"], two["grpo_budget"]["weights"], atol=2e-4)
    for want, got in zip(one["grpo"]["history"], two["grpo_budget"]["history"], strict=True):
        assert_same_metrics(want, got, rel=1e-4)


def test_grpo_stopped_by_one_rank_resumes_on_two(loop_runs):
    _, two = loop_runs
    run = two["grpo_resumed"]
    assert [h["step"] for h in run["first"]] == [1] and [h["step"] for h in run["history"]] == [1, 2]
    assert_same_weights(two["grpo"]["weights"], run["weights"], atol=0)


def test_torchrun_without_a_process_group_is_refused(monkeypatch, tiny_model):
    """Each rank would train its own copy and write the same checkpoints: one message says what to call."""
    from a5core.data.files import Trace
    from a5core.loops.sft import SFTConfig, train_sft

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        RuntimeError, match=r"WORLD_SIZE=2 .*call a5core.runtime.distributed.init_from_env\(\) before loading"
    ):
        train_sft(tiny_model, None, [Trace("q", "a", "a")], SFTConfig())
