"""``max_tokens_per_microbatch: auto``: a micro-batch token budget sized to the GPU a run finds.

Setting ``auto`` (the default) on CUDA: the first training step runs at :data:`PROBE_TOKENS`; its passes
measure what a padded token costs (the peak memory allocated during a forward and backward above what was
allocated before it, less the gradients that pass allocates for the first time, ÷ its rows × positions;
the largest over the passes). After that step's first optimizer step (AdamW's moments then exist) the budget
becomes :func:`size_budget` of the memory then free for activations (the device's free memory plus what the
allocator holds unused; an engine in the same process already holds its share) and that cost: a power of
two, so micro-batches keep the few shapes compiled layers already met. On several ranks every rank takes the
smallest rank's budget (each must cut the same number of micro-batches).

A training pass that still runs out of memory (longer sequences than the first step's, another process)
is run again (:meth:`TokenBudget.retrying`). First, once, a rollout engine in the same process is asked to
release what it keeps between calls (the hf engine's compiled KV cache, rebuilt at its next generate): if it
held anything, the pass runs again at the same budget. Otherwise, or if that fails too, it runs again at half
the budget, with a warning naming the new budget, which stays there; halving stops once the budget is at or
below the pass's longest row (padded): a micro-batch holds at least one row, so a smaller budget cannot shrink
that row's micro-batch, and the error raised then names that one sequence (:mod:`a5core.runtime.out_of_memory`). What
is run again is one optimizer step's accumulation (its gradients are dropped first), or one pass of log-probs
without gradients: never an optimizer step that already happened, never the rollouts, so nothing is lost and
nothing counted twice; the micro-batches at the halved budget give the same update, to float rounding. On
several ranks an out-of-memory error is raised as it is (one rank cannot run a pass again alone). A number
fixes the budget; ``None`` cuts micro-batches by count; ``auto`` on the CPU is ``None``, exactly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, Protocol, TypeVar

import torch

from a5core.runtime import distributed

logger = logging.getLogger(__name__)

AUTO = "auto"
PROBE_TOKENS = 4096  # the first step's budget under auto, before a token's cost is measured
LARGEST = 32768  # the largest auto budget: the fastest measured (benchmarks/RESULTS.md); larger gained nothing
MARGIN = 0.1  # the share of the free memory left unplanned (fragmentation, a longer sequence than measured)
Setting = int | Literal["auto"] | None
T = TypeVar("T")


class MemoryReader(Protocol):
    """What sizing reads of a device's memory, in bytes (a fake one in tests)."""

    def start(self) -> int:
        """Reset the peak; the bytes allocated now."""

    def peak(self) -> int:
        """The most bytes allocated since :meth:`start`."""

    def free(self) -> int:
        """Bytes free for activations: free on the device plus held by the allocator unused (within the
        process's share, ``torch.cuda.set_per_process_memory_fraction``)."""

    def release(self) -> None:
        """Return cached, unused memory (after an out-of-memory error)."""


class CudaMemory:
    """:class:`MemoryReader` of a CUDA device, through torch's caching allocator."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def free(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(self.device)
        usable = min(free + torch.cuda.memory_reserved(self.device), int(fraction * total))  # the process's cap
        return usable - torch.cuda.memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.empty_cache()


def size_budget(
    free_bytes: float,
    bytes_per_token: float,
    margin: float = MARGIN,
    bucket: int = distributed.PAD_MULTIPLE,
    largest: int = LARGEST,
) -> int:
    """The budget (padded tokens per micro-batch) whose activations fit in ``free_bytes`` less ``margin`` of
    it, at ``bytes_per_token`` each: rounded down to a power of two, at least ``bucket`` (a power of two
    itself: one padded position bucket), at most ``largest``."""
    if bytes_per_token <= 0:
        return largest
    tokens = int(max(free_bytes, 0) * (1 - margin) / bytes_per_token)
    power = 1 << max(tokens, 1).bit_length() - 1
    return max(bucket, min(largest, power))


class TokenBudget:
    """The budget a run's micro-batches are cut by (:attr:`value`: padded tokens, or None: by count), from the
    setting ``max_tokens_per_microbatch`` on ``device``; ``params``: the trained parameters (their gradients
    are not activations). ``memory``: how the device's memory is read (CUDA's on a CUDA device; one given
    sizes ``auto`` on any device, as tests do on the CPU)."""

    def __init__(
        self,
        setting: Setting,
        device: torch.device,
        params: Sequence[torch.nn.Parameter] = (),
        memory: MemoryReader | None = None,
    ) -> None:
        self.auto = setting == AUTO and (device.type == "cuda" or memory is not None)
        self.value: int | None = PROBE_TOKENS if self.auto else (None if setting == AUTO else setting)
        self.params, self.sized = list(params), not self.auto
        self.memory = memory if memory is not None else (CudaMemory(device) if self.auto else None)
        self.cost: float | None = None  # measured bytes per padded token
        self.release_first = False  # a release let a pass fit: the engine releases before every later pass

    @contextlib.contextmanager
    def measuring(self, tokens: int) -> Iterator[None]:
        """Around one training pass (forward and backward) of ``tokens`` padded tokens: until the budget is
        sized, the pass's activation cost per token is measured."""
        if self.sized:
            yield
            return
        gradients = sum(p.numel() * p.element_size() for p in self.params if p.grad is None)
        before = self.memory.start()
        yield
        cost = max(self.memory.peak() - before - gradients, 0) / max(tokens, 1)
        self.cost = max(self.cost or 0.0, cost)

    def settle(self) -> None:
        """After an optimizer step: under auto, the budget sized from the cost measured (once)."""
        if self.sized or self.cost is None:
            return
        self.sized = True
        budget = size_budget(self.memory.free(), self.cost)
        self.value = -int(distributed.global_max(-budget).item())  # the smallest rank's
        logger.info(
            "max_tokens_per_microbatch auto: %s padded tokens (%.2f MiB of activations a token, %.1f GiB free)",
            f"{self.value:,}",
            self.cost / 2**20,
            self.memory.free() / 2**30,
        )

    def retrying(
        self,
        attempt: Callable[[], T],
        where: str,
        lengths: Sequence[int],
        release: Callable[[], bool] | None = None,
    ) -> T:
        """``attempt()`` (one optimizer step's accumulation, or a pass without gradients: something that
        starts from scratch when called again) over rows of ``lengths`` positions each (before padding).
        Under auto on one rank, on running out of GPU memory: ``release()`` is asked once (a rollout engine's
        :meth:`~a5core.engines.Engine.release_memory`: True if it freed memory), and if it freed memory
        ``attempt`` runs again at the same budget, and every later call releases first (the engine rebuilds
        its cache at its next generate, so a pass that needed the room would otherwise fail once every step);
        otherwise the budget is halved, with a warning naming it and ``where``, and ``attempt`` runs again, as
        long as the budget exceeds the longest row's padded length (at or below it, the micro-batch of that row
        alone is as large: halving changes nothing)."""
        if self.release_first and release is not None:
            release()  # the room an earlier pass needed, freed before this one rather than after it fails
            release = None
        while True:
            try:
                return attempt()
            except torch.OutOfMemoryError:
                if not self.auto or distributed.rank_and_world()[1] > 1:
                    raise
                released, release = release is not None and release(), None
                if not released and self.value <= distributed.padded_length(max(lengths)):
                    raise
            self.memory.release()  # outside the handler: the failed attempt's tensors are unreferenced by now
            if released:
                self.release_first = True
                logger.warning(
                    "%s: out of GPU memory; the rollout engine released its cache; running it again with "
                    "max_tokens_per_microbatch %s (the engine releases it before every later pass)",
                    where,
                    f"{self.value:,}",
                )
                continue
            self.sized, self.value = True, self.value // 2
            logger.warning(
                "%s: out of GPU memory; running it again with max_tokens_per_microbatch %s (auto halved it)",
                where,
                f"{self.value:,}",
            )
