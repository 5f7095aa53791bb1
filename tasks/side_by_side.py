"""How many of a sweep's children run at once on this machine, and the share of the GPU each may use.

:func:`this_machine` reads the cores this process may use, the memory this machine has available, the first visible
GPU's total and free memory (from ``nvidia-smi``, so that this process holds no CUDA context of its own) and whether
CUDA MPS is on; :func:`child_need` says what one child needs (:class:`Need`) and :func:`size_children` turns both
into a :class:`Sizing`: children at once, each child's torch threads and its ``gpu_memory_fraction``. Three bounds:

- the cores: each child keeps a core busy (a small model's step is bound by its CPU process), so no more run at
  once than there are cores (beside a GPU, one is left for this process);
- the GPU's free memory, less :data:`GPU_RESERVE`, at what a child needs there plus :data:`CONTEXT_BYTES`;
- this machine's available memory, less :data:`HOST_RESERVE`, at what a child needs here: on the CPU its whole run,
  beside a GPU its process and its model's weights as they are loaded.

The needs are estimates from the model's size (the records' runs bear them out); a child's own
``gpu_memory_fraction`` replaces the GPU's, and ``at_once`` caps the children at once.
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
HOST_RESERVE = 2 * GIB  # left free on this machine: this process, the Prefect and MLflow clients
PROCESS_BYTES = 2 * GIB  # a child's process: torch and the libraries, an engine's process-wide state
# What a child needs of a GPU beyond what its policy holds there (policy_reserve_bytes): activations, logits and the
# engine's KV cache take about as much again (a 135M-parameter GRPO run held 6.3 GiB of a GPU, its policy 4).
ACTIVATIONS_FACTOR = 2
# On the CPU, a run's fp32 logits and activations take about three times its policy's states (weights, gradients,
# AdamW's moments) again: a cpu-profile GRPO run of SmolLM2-135M (2.2 GB of states) held 8-10 GB beside vLLM's CPU
# engine.
CPU_ACTIVATIONS_FACTOR = 4
MPS_PIPE = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's pipe folder unless CUDA_MPS_PIPE_DIRECTORY says otherwise


@dataclass(frozen=True)
class Machine:
    """The cores this process may use, the memory available here, and the first visible GPU (bytes; None: no GPU,
    or not known)."""

    cores: int
    memory_free: int | None = None
    gpu_name: str = ""
    gpu_total: int | None = None
    gpu_free: int | None = None
    mps: bool = False


@dataclass(frozen=True)
class Need:
    """What one child needs: of the GPU (None: no GPU, or not known) and of this machine's memory (None: not known)."""

    gpu: int | None = None
    host: int | None = None


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
    memory = _memory_available()
    gpu = _first_gpu()
    if gpu is None:
        return Machine(cores, memory)
    name, total, free = gpu
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE)
    return Machine(cores, memory, name, total, free, mps=(pipe / "control").exists())


def _memory_available() -> int | None:
    """The memory this machine can give new processes (``MemAvailable``), or its free pages where that is unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


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


def child_need(params: Any, machine: Machine) -> Need:
    """What one child of ``params`` needs. Of the GPU: its ``gpu_memory_fraction`` of the card where set, else
    :data:`ACTIVATIONS_FACTOR` times what its policy holds there (:func:`a5core.engines.colocate.policy_reserve_bytes`).
    Here: on the CPU, :data:`CPU_ACTIVATIONS_FACTOR` times its policy's states and :data:`PROCESS_BYTES`; beside a
    GPU, :data:`PROCESS_BYTES` and the model's weights. None where the model's size cannot be read (then one child
    runs at a time)."""
    from a5core.engines.colocate import POLICY_MARGIN, policy_reserve_bytes
    from a5core.policy.model_specs import parameter_count, resolve_model

    try:
        model = resolve_model(params.model)
        weights = parameter_count(model) * (2 if getattr(params, "policy_dtype", "float32") == "bfloat16" else 4)
        held = policy_reserve_bytes(
            model,
            getattr(params, "policy_dtype", "float32"),
            lora=bool(getattr(params, "lora_rank", 0)),
            reference=bool(getattr(params, "kl_coef", 0)),
        )
    except (OSError, ValueError):
        return Need()
    if machine.gpu_total is None:
        return Need(host=CPU_ACTIVATIONS_FACTOR * (held - POLICY_MARGIN) + PROCESS_BYTES)
    if params.gpu_memory_fraction is not None:
        return Need(int(params.gpu_memory_fraction * machine.gpu_total), PROCESS_BYTES + weights)
    return Need(ACTIVATIONS_FACTOR * held, PROCESS_BYTES + weights)


def size_children(children: int, machine: Machine, need: Need, at_most: int | None = None) -> Sizing:
    """How ``children`` children run on ``machine``, each needing ``need``, at most ``at_most`` at once (None: no
    limit of the user's)."""
    limits = {"children": children}
    if at_most is not None:
        limits["at_once"] = at_most
    limits["cores"] = max(1, machine.cores - (1 if machine.gpu_total else 0))  # beside a GPU, one for this process
    fraction = None
    if machine.gpu_total is not None:
        if need.gpu is None:
            limits["GPU memory (a child's need unknown)"] = 1
        else:
            limits["GPU memory"] = max(1, (machine.gpu_free - GPU_RESERVE) // (need.gpu + CONTEXT_BYTES))
            fraction = min(1.0, math.floor(1000 * need.gpu / machine.gpu_total) / 1000)
    if machine.memory_free is not None:
        if need.host is None:
            limits["memory (a child's need unknown)"] = 1
        else:
            limits["memory"] = max(1, (machine.memory_free - HOST_RESERVE) // need.host)
    at_once = min(limits.values())
    bound = next(name for name, value in limits.items() if value == at_once)
    threads = max(1, machine.cores // at_once)
    place = f"{machine.cores} cores"
    if machine.memory_free is not None:
        place += f", {machine.memory_free / GIB:.1f} GiB of memory available"
        if need.host is not None:
            place += f" ({need.host / GIB:.1f} a child)"
    if machine.gpu_total is None:
        place += ", no GPU"
    else:
        gib = f"{machine.gpu_total / GIB:.1f} GiB, {machine.gpu_free / GIB:.1f} free"
        share = "" if need.gpu is None else f"; {need.gpu / GIB:.1f} GiB a child (gpu_memory_fraction {fraction})"
        mps = "CUDA MPS on" if machine.mps else "no CUDA MPS: the children take turns at the GPU"
        place += f", {machine.gpu_name} ({gib}){share}; {mps}"
    short = [name for name in ("GPU memory", "memory") if limits.get(name) == 1 and _under_one(name, machine, need)]
    if short:
        holds = "holds" if len(short) == 1 else "hold"
        place += f"; the {' and '.join(short)} available {holds} less than one child's need: one at a time"
    each = f"{threads} thread{'s' * (threads > 1)} each"
    why = f"{children} children, {at_once} at once (bound: {bound}), {each}: {place}"
    return Sizing(at_once, threads, fraction if at_once > 1 else None, why)


def _under_one(bound: str, machine: Machine, need: Need) -> bool:
    if bound == "GPU memory":
        return machine.gpu_free - GPU_RESERVE < need.gpu + CONTEXT_BYTES
    return machine.memory_free - HOST_RESERVE < need.host
