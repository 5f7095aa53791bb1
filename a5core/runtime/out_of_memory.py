"""One clear error when a training pass runs out of GPU memory: which pass, the micro-batch's shape, and the
setting that makes micro-batches smaller (its value, and where docs/gpu.md says what fits which GPU); or, when
the micro-batch held one sequence, which no smaller micro-batch can split, what else frees memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


class MicrobatchOutOfMemoryError(torch.OutOfMemoryError):
    """A training pass ran out of GPU memory; the message names the pass, the micro-batch and the setting to
    change (a user's error: the command ends with it, the original CUDA error is its cause)."""


@contextlib.contextmanager
def naming_the_microbatch(
    where: str,
    budget: Callable[[], int | None],
    count_setting: str,
    shape: Callable[[], tuple[int, ...] | None],
) -> Iterator[None]:
    """Re-raise a ``torch.OutOfMemoryError`` from inside as a :class:`MicrobatchOutOfMemoryError` that says
    ``where`` (e.g. "GRPO step 12, training"), the last micro-batch's ``shape()`` (rows, positions) and what
    to change: for a micro-batch of one sequence, what the process holds or that sequence's length (no
    micro-batch setting splits it); else ``max_tokens_per_microbatch`` when micro-batches are cut by that
    ``budget()`` (a how-fast setting: the run resumes from its last checkpoint with a lower one), else
    ``count_setting`` (how many sequences a micro-batch holds, e.g. "microbatch_size 2: lower it")."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        size, budget_now = shape(), budget()
        tensor = f" of {size[0]} sequences × {size[1]} positions" if size else ""
        if size and size[0] == 1:
            fix = (
                f"one sequence of {size[1]:,} positions does not fit in the GPU memory left beside what the process "
                "holds (the policy's weights, gradients and optimizer state; a rollout engine's weights and cache), "
                "and no smaller micro-batch can split it: make sequences shorter (max_tokens; SFT: max_seq_len), "
                "hold less (policy_dtype: bfloat16; GRPO: engine_device, the engine on a GPU of its own), recompute "
                "activations (gradient_checkpointing: true), or use a GPU with more memory (docs/gpu.md, 'Memory plan "
                "for one GPU shared by policy and engine')"
            )
        elif budget_now is not None:
            fix = (
                f"micro-batches are cut by max_tokens_per_microbatch {budget_now:,}: set a lower number and run the "
                "same command again, it resumes from the last checkpoint (docs/gpu.md, 'Micro-batches by token "
                "budget': which budget fits which GPU)"
            )
        else:
            fix = (
                f"micro-batches are cut by count ({count_setting}), or set max_tokens_per_microbatch, "
                "gradient_checkpointing: true or compile_layers: true (docs/gpu.md)"
            )
        raise MicrobatchOutOfMemoryError(f"{where}: out of GPU memory in a micro-batch{tensor}; {fix}") from error
