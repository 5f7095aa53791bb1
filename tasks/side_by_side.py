"""How many of a sweep's children run at once on this machine, and the share of the GPU each may use.

:func:`this_machine` reads the cores this process may use and the first visible GPU's total and free memory (from
``nvidia-smi``, so that this process holds no CUDA context of its own) and whether CUDA MPS is on; :func:`size_children`
turns that and what one child needs (:func:`child_bytes`) into a :class:`Sizing`: children at once, each child's
torch threads and its ``gpu_memory_fraction``. Each child keeps a core busy (a small model's step is bound by its
CPU process), so no more run at once than there are cores (less one for this process beside a GPU); on a GPU, no
more than its free memory holds, less :data:`GPU_RESERVE`, at what a child needs plus :data:`CONTEXT_BYTES`.
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from a5core.engines.colocate import GIB

GPU_RESERVE = 2 * GIB  # left free on the card: the MPS server, allocations that outgrow their share
CONTEXT_BYTES = GIB  # a process's CUDA context and what it holds beyond its allocator's share
# What a child needs beyond its policy's weights, gradients and optimizer state (policy_reserve_bytes): activations,
# logits and the engine's KV cache take about as much again (a 135M-parameter GRPO run held 6.3 GiB, its policy 4).
ACTIVATIONS_FACTOR = 2
MPS_PIPE = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's pipe folder unless CUDA_MPS_PIPE_DIRECTORY says otherwise


@dataclass(frozen=True)
class Machine:
    """The cores this process may use and the first visible GPU (memory in bytes; None: no GPU)."""

    cores: int
    gpu_name: str = ""
    gpu_total: int | None = None
    gpu_free: int | None = None
    mps: bool = False


@dataclass(frozen=True)
class Sizing:
    """Children at once, each child's torch threads and its share of the GPU (None: no GPU, or each its own
    ``gpu_memory_fraction``), and one line saying why."""

    at_once: int
    threads: int
    gpu_memory_fraction: float | None
    why: str


def this_machine() -> Machine:
    """This machine as :func:`size_children` reads it (see the module docstring)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    gpu = _first_gpu()
    if gpu is None:
        return Machine(cores)
    name, total, free = gpu
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE)
    return Machine(cores, name, total, free, mps=(pipe / "control").exists())


def _first_gpu() -> tuple[str, int, int] | None:
    """The first visible GPU's name, total and free bytes, or None when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={visible}", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.splitlines()[0]
        name, total, free = (part.strip() for part in out.split(","))
        return name, int(total.split()[0]) * 1024**2, int(free.split()[0]) * 1024**2
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):  # no nvidia-smi: ask CUDA (a context here)
        free, total = torch.cuda.mem_get_info()
        return torch.cuda.get_device_name(), total, free


def child_bytes(params: Any, machine: Machine) -> int | None:
    """What one child of ``params`` needs on the GPU: its ``gpu_memory_fraction`` of the card where set, else an
    estimate, :data:`ACTIVATIONS_FACTOR` times what its policy holds with gradients and optimizer state
    (:func:`a5core.engines.colocate.policy_reserve_bytes`); None without a GPU, or when the model's size cannot be
    read (then one child runs at a time, with the whole card)."""
    if machine.gpu_total is None:
        return None
    if params.gpu_memory_fraction is not None:
        return int(params.gpu_memory_fraction * machine.gpu_total)
    from a5core.engines.colocate import policy_reserve_bytes
    from a5core.policy.model_specs import resolve_model

    try:
        held = policy_reserve_bytes(
            resolve_model(params.model),
            getattr(params, "policy_dtype", "float32"),
            lora=bool(getattr(params, "lora_rank", 0)),
            reference=bool(getattr(params, "kl_coef", 0)),
        )
    except (OSError, ValueError):
        return None
    return ACTIVATIONS_FACTOR * held


def size_children(children: int, machine: Machine, need: int | None, at_most: int | None = None) -> Sizing:
    """How ``children`` children run on ``machine``, each needing ``need`` bytes of its GPU (None: unknown, or no
    GPU), at most ``at_most`` at once (None: no limit of the user's)."""
    limits = {"children": children}
    if at_most is not None:
        limits["at_once"] = at_most
    cores = machine.cores - (1 if machine.gpu_total else 0)  # beside a GPU, one for this process and the driver
    limits["cores"] = max(1, cores)
    fraction = None
    if machine.gpu_total is not None:
        if need is None:
            limits["GPU memory (a child's need unknown)"] = 1
        else:
            fits = (machine.gpu_free - GPU_RESERVE) // (need + CONTEXT_BYTES)
            limits["GPU memory"] = max(1, fits)
            fraction = min(1.0, math.floor(1000 * need / machine.gpu_total) / 1000)
    at_once = min(limits.values())
    bound = next(name for name, value in limits.items() if value == at_once)
    threads = max(1, machine.cores // at_once)
    if machine.gpu_total is None:
        place = f"{machine.cores} cores, no GPU"
    else:
        gib = f"{machine.gpu_total / GIB:.1f} GiB, {machine.gpu_free / GIB:.1f} free"
        share = "" if need is None else f"; {need / GIB:.1f} GiB a child (gpu_memory_fraction {fraction})"
        mps = "CUDA MPS on" if machine.mps else "no CUDA MPS: the children take turns at the GPU"
        place = f"{machine.cores} cores, {machine.gpu_name} ({gib}){share}; {mps}"
        if at_once == 1 and need is not None and machine.gpu_free - GPU_RESERVE < need + CONTEXT_BYTES:
            place += "; its free memory holds less than one child's need: one at a time"
    each = f"{threads} thread{'s' * (threads > 1)} each"
    why = f"{children} children, {at_once} at once (bound: {bound}), {each}: {place}"
    return Sizing(at_once, threads, fraction if at_once > 1 else None, why)
