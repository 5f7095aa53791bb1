"""Whether CUDA MPS lets several small-model processes share one GPU better than time-slicing (device_run.sh mps).

N processes each run a loop of the small kernels a 135M model's decode is made of (a 256 x 576 activation through
576 x 576 and 576 x 1536 matrices, bf16) for SECONDS; the aggregate loop rate is measured with one process, with N
without MPS, and with N under an MPS control daemon started here. MPS stays on when it gives at least KEEP times
the rate without it (the flows launched after this call then share the GPU through it), else it is shut down.

    python lab/mps_probe.py [N] [SECONDS]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time

KEEP = 1.3


def work(seconds: float, queue: mp.Queue) -> None:
    import torch

    x = torch.randn(256, 576, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(576, 1536, device="cuda", dtype=torch.bfloat16) / 40
    w2 = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16) / 40
    for _ in range(20):
        x = torch.nn.functional.silu(x @ w1) @ w2
    torch.cuda.synchronize()
    n, start = 0, time.time()
    while time.time() - start < seconds:
        for _ in range(30):  # about one layer's kernels a decode step, a few times over
            x = torch.nn.functional.rms_norm(torch.nn.functional.silu(x @ w1) @ w2, (576,))
        torch.cuda.synchronize()
        n += 30
    queue.put(n / (time.time() - start))


def rate(processes: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=work, args=(seconds, queue)) for _ in range(processes)]
    for p in workers:
        p.start()
    total = sum(queue.get(timeout=seconds + 120) for _ in workers)
    for p in workers:
        p.join()
    return total


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 8.0
    one = rate(1, seconds)
    plain = rate(n, seconds)
    print(f"1 process: {one:,.0f} loops/s; {n} processes without MPS: {plain:,.0f} loops/s ({plain / one:.2f}x one)")
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        print("MPS: nvidia-cuda-mps-control not found; not used")
        return
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps", "CUDA_MPS_LOG_DIRECTORY": "/tmp/nvidia-mps-log"}
    os.makedirs("/tmp/nvidia-mps-log", exist_ok=True)
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=30)
    print(f"MPS daemon: rc {started.returncode} {started.stdout.strip()} {started.stderr.strip()}")
    os.environ.update(env)
    try:
        shared = rate(n, seconds)
    except Exception as error:  # noqa: BLE001 - any failure under MPS means: do not use it
        shared = 0.0
        print(f"MPS: {n} processes failed: {error!r}")
    print(f"{n} processes under MPS: {shared:,.0f} loops/s ({shared / max(plain, 1):.2f}x without)")
    if shared < KEEP * plain:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
        print("MPS: shut down (not worth it)")
    else:
        print("MPS: left running for the flows (CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps)")


if __name__ == "__main__":
    main()
