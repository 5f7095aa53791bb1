"""FSDP2 with the global-token loss: the same gradient on 1 and 2 ranks (gloo, CPU), whatever the micro-batch."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def gradient(tmp_path, tiny_lm_dir, ranks: int, microbatch: int) -> dict[str, torch.Tensor]:
    out = tmp_path / f"grad_{ranks}_{microbatch}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:  # a free port for the rendezvous (port 0 is not accepted there)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--master-addr=127.0.0.1",
               f"--master-port={port}",
               str(REPO / "tests" / "distributed_target.py"), str(tiny_lm_dir), str(out), str(microbatch)]
    if ranks == 1:
        command = [sys.executable, str(REPO / "tests" / "distributed_target.py"), str(tiny_lm_dir), str(out), str(microbatch)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out)


def test_two_ranks_and_any_microbatch_give_the_one_rank_gradient(tmp_path, tiny_lm_dir):
    single = gradient(tmp_path, tiny_lm_dir, 1, 8)
    for ranks, micro in [(1, 3), (2, 4), (2, 1)]:
        other = gradient(tmp_path, tiny_lm_dir, ranks, micro)
        for name, value in single.items():
            torch.testing.assert_close(other[name], value, rtol=1e-5, atol=1e-7, msg=f"{name} ({ranks} ranks, micro {micro})")


def test_per_split_means_would_weigh_tokens_differently():
    """The reason for the global count: a masked mean per rank (or micro-batch) gives each token
    1/(splits · its split's tokens), which differs between splits of different response lengths; the
    global share gives every token 1/(the batch's tokens), as one process with one micro-batch does."""
    from a5core.distributed import global_token_loss

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)  # split 0: 2 tokens, split 1: 4
    weights = []
    for split in range(2):
        nll = torch.zeros(1, 4, requires_grad=True)
        global_token_loss(nll, mask[split : split + 1], global_tokens=6.0).backward()
        weights.append(nll.grad[mask[split : split + 1]])
    assert torch.allclose(torch.cat(weights), torch.full((6,), 1 / 6))
    per_split_mean = [1 / (2 * 2), 1 / (2 * 4)]
    assert per_split_mean[0] != per_split_mean[1]
