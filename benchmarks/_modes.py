"""The named configurations the step benchmarks measure (``--modes`` of ``grpo_step.py`` and ``sft_step.py``),
and what measuring them takes: a cap on the process's GPU memory, and the token budget ``auto`` settled on.

The modes: the ``a5`` profile as it shipped before the ``auto`` defaults (fp32 policy, eager layers,
micro-batches by count), the defaults now (fp32 policy; ``compile_layers`` and ``max_tokens_per_microbatch``
``auto``: on CUDA compiled layers and a budget sized to the GPU), the best hand-set configuration measured (bf16
policy, compiled layers, budget 32,768), and the defaults with the process capped to 80 and 40 GiB.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import NamedTuple

import torch


class Mode(NamedTuple):
    """Training layers (``eager``; ``layers``: compiled decoder layers, activation budget 0.8; ``auto``: the
    loop's ``compile_layers`` default), ``max_tokens_per_microbatch`` (None: micro-batches by count), the
    policy's dtype, and a cap on the process's GPU memory in GiB (None: the whole GPU)."""

    layers: str
    budget: int | str | None
    policy_dtype: str
    cap_gib: float | None


MODES = {
    "shipped": Mode("eager", None, "float32", None),  # the a5 profile before auto: eager, micro-batches by count
    "defaults": Mode("auto", "auto", "float32", None),  # the defaults now: compiled layers, a budget sized to the GPU
    "best": Mode("layers", 32768, "bfloat16", None),  # the fastest hand-set configuration measured
    "defaults-80g": Mode("auto", "auto", "float32", 80.0),
    "defaults-40g": Mode("auto", "auto", "float32", 40.0),
}


# The table columns of a mode's steps that both benchmarks print: its timings, then its graphs and memory.
TIMING_COLUMNS = ("first step s", "warm median s", "warm max s")
MEMORY_COLUMNS = ("graphs compiled: first step → last", "peak GiB", "memory cap GiB")


@contextlib.contextmanager
def memory_cap(gib: float | None) -> Iterator[None]:
    """The process's GPU memory capped to ``gib`` GiB inside (nothing on the CPU, or without a cap)."""
    if gib is None or not torch.cuda.is_available():
        yield
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@contextlib.contextmanager
def budgets_seen(loop: ModuleType) -> Iterator[list]:
    """The token budgets (a5core.runtime.token_budget.TokenBudget) that ``loop``, the module constructing them
    (``a5core.loops.training``, for SFT and GRPO alike), makes inside: to read what auto settled on."""
    from a5core.runtime.token_budget import TokenBudget

    made: list[TokenBudget] = []
    real = loop.TokenBudget

    def recording(*args, **kwargs) -> TokenBudget:
        made.append(real(*args, **kwargs))
        return made[-1]

    loop.TokenBudget = recording
    try:
        yield made
    finally:
        loop.TokenBudget = real


def cut_of(budget: int | str | None, settled: int | None, by_count: str) -> str:
    """How micro-batches were cut: ``by_count`` (no budget), a fixed budget, or what auto settled on."""
    if budget is None:
        return by_count
    if budget == "auto":
        return f"budget auto → {settled:,}" if settled is not None else "auto: by count (CPU)"
    return f"budget {budget:,}"
