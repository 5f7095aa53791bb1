"""Policy training over several processes (GPUs) with FSDP2, normalised so results do not depend on them.

Who does what:

- **The caller** launches with ``torchrun --nproc-per-node N ...`` and calls :func:`init_from_env`
  once, *before* loading the model: it joins the process group and makes ``"cuda"`` this rank's GPU.
- **The loops** (:func:`a5core.loops.sft.train_sft`, :func:`a5core.loops.grpo.grpo`) call :func:`setup_model`:
  under N > 1 ranks it FSDP2-shards the model in place (it stays sharded after the loop; an already
  sharded model is resharded). Each rank then trains on its share of every batch
  (:func:`rank_microbatches`); FSDP2 reduces the gradients; only rank 0 calls ``log``; every rank
  calls ``evaluate`` (a forward pass of a sharded model is a collective); checkpoints hold full
  tensors in the one-process layout (:func:`a5core.runtime.checkpoint.save_checkpoint`), so a run resumes on
  any number of ranks.
  Outside torchrun all of this reduces to the one-process loop.

Normalisation: a batch's loss is a mean over its sequences (the loops' per-sequence reductions are
unchanged), and each rank divides by the *global* number of sequences, so the update is the one
process's whatever the number of ranks or the micro-batch size. Where a loss is a mean over tokens,
the divisor is the global token count (:func:`global_token_loss`). FSDP2 averages gradients over
ranks (divides their sum by N), so each rank's share is multiplied by N first (gloo cannot reduce
with FSDP2's pre-multiplied sum). Tested on CPU with the gloo backend (tests/test_distributed*.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

# What torchrun tells each rank (with TORCHELASTIC_RUN_ID, which only torchrun sets).
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env() -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…); returns
    ``(rank, world_size)``, ``(0, 1)`` when not launched by torchrun. NCCL on CUDA (this rank's GPU,
    ``LOCAL_RANK``, becomes the current device), gloo on CPU. Ranks other than 0 draw no progress
    bars (``A5_PROGRESS=0``), so a terminal shows one set. ValueError for ``RANK`` set in a process torchrun
    did not start (variables left from another launch: joining would wait for ever, deaf to Ctrl-C)."""
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        check_launch_variables()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    if dist.get_rank() != 0:
        os.environ["A5_PROGRESS"] = "0"
    return dist.get_rank(), dist.get_world_size()


# The variables only torchrun's agent sets (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, ...), and the agent as
# its processes show it: the torchrun script, or `python -m torch.distributed.run` (or the older .launch).
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)
TORCHRUN_PROGRAMS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def started_by_torchrun() -> bool:
    """Whether torchrun started this process: its variables (``TORCHELASTIC_RUN_ID``) are set and, where the
    system shows the processes (``/proc``), its agent is among the processes that started this one. Variables left
    in a shell by another launch, ``TORCHELASTIC_RUN_ID`` among them, are not a launch: joining would wait for ranks
    that never come (half an hour, deaf to Ctrl-C and SIGTERM)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if not os.path.isdir("/proc/self"):  # no /proc to tell (not Linux): the variables alone say
        return True
    pid, seen = os.getppid(), set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")[:4]
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the process is gone: no agent waits for this one
            return False
        if any(os.path.basename(w.decode(errors="replace")) in TORCHRUN_PROGRAMS for w in words):
            return True
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # the parent's: the field after the state
    return False


def check_launch_variables() -> None:
    """ValueError naming torchrun's variables (``RANK``, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` ...) set in a
    process torchrun did not start (:func:`started_by_torchrun`): left from another launch, they would make it wait
    for ranks that never come. A command checks this first, before it writes anything."""
    if "RANK" not in os.environ or dist.is_initialized() or started_by_torchrun():
        return
    leftovers = [*LAUNCH_VARIABLES, *sorted(k for k in os.environ if k.startswith(TORCHRUN_PREFIXES))]
    named = ", ".join(f"{k}={os.environ[k]}" for k in leftovers if k in os.environ)
    raise ValueError(
        f"{named} in the environment, but this process was not started by torchrun: it would wait for ranks "
        f"that never come. Unset them (unset {' '.join(leftovers)}), or start it with torchrun"
    )


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, ``(0, 1)`` without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def shard(model: torch.nn.Module, reshard_after_forward: bool = True) -> torch.nn.Module:
    """FSDP2-shard a transformers causal LM: each decoder layer, then the root (gradients are averaged
    over ranks, which :func:`global_token_loss` accounts for). Returns the same module, now sharded.

    ``reshard_after_forward=False`` keeps each layer's gathered weights from its forward to its backward
    (one all-gather per micro-batch instead of two, at the memory of the whole weights: ZeRO-2-like)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def setup_model(model: torch.nn.Module, reshard_after_forward: bool = True) -> tuple[int, int]:
    """What a training loop calls first: ``(rank, world_size)``, with ``model`` FSDP2-sharded in place
    when there are several ranks (``reshard_after_forward``: see :func:`shard`). An already sharded model
    keeps its sharding and is resharded: a forward without a backward
    (an evaluation, the rollouts' entropies) leaves the root's parameters gathered, and an optimizer built
    from ``model.parameters()`` then would step those whole copies instead of the shards.

    Raises RuntimeError when torchrun started several ranks but no process group was joined (each
    would train its own copy and write the same checkpoints), or when the model is not on this rank's
    GPU (it was loaded before :func:`init_from_env` picked the device).
    """
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(
                f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group was joined: call "
                "a5core.runtime.distributed.init_from_env() before loading the model"
            )
        return 0, 1
    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(model, FSDPModule):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    elif world > 1:
        device = next(model.parameters()).device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            raise RuntimeError(
                f"rank {rank}: the model is on {device} but this rank's GPU is cuda:{torch.cuda.current_device()}; "
                "call a5core.runtime.distributed.init_from_env() before loading the model"
            )
        shard(model, reshard_after_forward)
    return rank, world


def accumulating(model: torch.nn.Module, microbatches: list[list[int]]) -> Iterator[list[int]]:
    """Iterate an optimizer step's micro-batches; under FSDP2, all but the last keep their gradients
    unreduced and the weights gathered after backward, so the step reduce-scatters gradients once
    instead of once per micro-batch (the last micro-batch reduces and reshards). One process: plain
    iteration."""
    from torch.distributed.fsdp import FSDPModule

    sharded = isinstance(model, FSDPModule)
    for number, microbatch in enumerate(microbatches, start=1):
        if sharded:
            last = number == len(microbatches)
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        yield microbatch


def rank_microbatches(
    items: Sequence[int],
    microbatch_size: int,
    lengths: Sequence[int] | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """This rank's micro-batches of a batch. Every rank gets the same number of micro-batches (FSDP2 pairs
    each forward and backward with the other ranks'), so a rank with a smaller share ends with empty
    lists: it must still run a pass, at zero weight. One process: all of ``items``.

    By count (``max_tokens`` None): rank r takes ``items[r::world]``, cut into lists of ``microbatch_size``.

    By token budget (``max_tokens``; ``lengths[i]``: item i's sequence length in tokens): the items,
    longest first, are dealt to the rank with the fewest tokens so far, and each rank fills micro-batches
    in that order while rows × the first (longest) row's :func:`padded_length` stays within
    ``max_tokens`` (an item longer than the budget gets a micro-batch of its own). Every rank computes
    every rank's packing from the same lengths, so all agree on the count without communicating.
    """
    rank, world = rank_and_world()
    if max_tokens is None:
        share = list(items[rank::world])
        longest_share = -(-len(items) // world)  # ceil
        count = -(-longest_share // microbatch_size)
        return [share[i * microbatch_size : (i + 1) * microbatch_size] for i in range(count)]
    if lengths is None:
        raise ValueError("micro-batches by token budget need the items' lengths")
    shares: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for item in sorted(items, key=lambda i: (-lengths[i], i)):
        lightest = loads.index(min(loads))
        shares[lightest].append(item)
        loads[lightest] += lengths[item]
    packed = [_fill(share, lengths, max_tokens) for share in shares]
    count = max(len(p) for p in packed)
    return packed[rank] + [[] for _ in range(count - len(packed[rank]))]


# Sequence lengths are padded up to a multiple of this under token budgets: the compiled layers see a
# bounded set of shapes (rows × a multiple of 64 up to the longest sequence) instead of every length.
PAD_MULTIPLE = 64


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


def _fill(share: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """``share`` (longest first) cut into micro-batches of at most ``max_tokens`` padded tokens each."""
    out: list[list[int]] = []
    for item in share:
        if out and (len(out[-1]) + 1) * padded_length(lengths[out[-1][0]]) <= max_tokens:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def rank_slice(n: int) -> slice:
    """This rank's contiguous block of ``n`` items (sizes differ by at most one; rank order is item order)."""
    rank, world = rank_and_world()
    return slice(rank * n // world, (rank + 1) * n // world)


def gather_lists(items: list[Any]) -> list[Any]:
    """The concatenation, in rank order, of every rank's ``items`` (picklable objects); ``items``
    itself in one process."""
    world = rank_and_world()[1]
    if world == 1:
        return items
    gathered: list[list[Any] | None] = [None] * world
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def _all_reduce(value: torch.Tensor | float | int, op: dist.ReduceOp) -> torch.Tensor:
    total = torch.as_tensor(value).to(torch.float64, copy=True)
    if not dist.is_initialized():
        return total
    device = total.device
    if dist.get_backend() == "nccl":
        total = total.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(total, op=op)
    return total.to(device)


def global_sum(value: torch.Tensor | float | int) -> torch.Tensor:
    """Sum of ``value`` (any shape) over all ranks (itself when not distributed), as a float64 tensor
    on ``value``'s device (CPU for a number)."""
    return _all_reduce(value, dist.ReduceOp.SUM)


def global_max(value: torch.Tensor | float | int) -> torch.Tensor:
    """Elementwise maximum of ``value`` over all ranks, like :func:`global_sum`."""
    return _all_reduce(value, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any (e.g. a wall-clock stop that all must agree on)."""
    return bool(global_sum(float(flag)).item() > 0)


def global_token_loss(per_token_loss: torch.Tensor, response_mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """This rank's (or micro-batch's) share of the batch loss, to back-propagate: Σ masked per-token
    loss × world size / ``global_tokens`` (× world size because FSDP2 averages gradients over ranks).

    per_token_loss, response_mask: (B, T); global_tokens: response tokens of the whole batch on all
    ranks (:func:`global_sum` of the local counts). The gradients of these shares, summed over
    micro-batches and averaged over ranks, are the gradient of the batch loss, whatever the split.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    masked = torch.where(
        response_mask.bool(), per_token_loss, torch.zeros((), dtype=per_token_loss.dtype, device=per_token_loss.device)
    )
    return masked.sum() * world / global_tokens


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor`` is gathered (a collective: every rank must call it), any other
    tensor is returned as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _gather_state(state: Any, keep: bool) -> Any:
    """``state`` (a state dict, nested dicts/lists) with every DTensor gathered whole; on CPU if
    ``keep``, else dropped right after the collective (None)."""
    if isinstance(state, dict):
        return {k: _gather_state(v, keep) for k, v in state.items()}
    if isinstance(state, list):
        return [_gather_state(v, keep) for v in state]
    if isinstance(state, torch.Tensor):
        whole = full_tensor(state.detach())
        return whole.cpu() if keep else None
    return state


def gathered(target: torch.nn.Module | torch.optim.Optimizer, keep: bool) -> Any:
    """``target`` (a sharded model or its optimizer) as an object whose ``state_dict()`` holds every tensor whole
    (a collective: every rank calls it), on the CPU where ``keep`` (the rank that writes), else dropped."""
    return _Full(_gather_state(target.state_dict(), keep))


class _Full:
    """Full (unsharded) state, gathered beforehand, behind the ``state_dict()`` that a checkpoint's writer
    (:func:`a5core.runtime.checkpoint.save_checkpoint`) and the engines' ``load_weights`` call."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # keep_vars etc.: the tensors are copies
        return self._state


def whole(model: torch.nn.Module) -> Any:
    """The model itself in one process; with several ranks an object whose ``state_dict()`` holds every tensor
    whole, on the model's device (a collective: every rank calls it)."""
    if rank_and_world()[1] == 1:
        return model
    return _Full({name: full_tensor(t.detach()) for name, t in model.state_dict().items()})


def write_whole(model: torch.nn.Module, write: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """``write(state)`` with ``model``'s state dict whole (as it is: adapters included), called by every
    rank: the tensors are gathered (a collective), rank 0 writes, the other ranks wait until it has (they
    may read what it wrote)."""
    state = whole(model).state_dict()
    rank, world = rank_and_world()
    if rank == 0:
        write(state)
    if world > 1:
        dist.barrier()


def _shard_like(value: Any, reference: Any) -> Any:
    """``value`` (a whole tensor) cut like ``reference`` when that is a DTensor of its shape (this rank's
    shard, no communication); anything else unchanged."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(reference, DTensor) and isinstance(value, torch.Tensor) and value.shape == reference.shape:
        return distribute_tensor(
            value.to(reference.device), reference.device_mesh, reference.placements, src_data_rank=None
        )
    return value


class Sharding:
    """A sharded model or its optimizer as :func:`a5core.runtime.checkpoint.load_checkpoint` sees an unsharded
    one: ``load_state_dict`` takes full tensors and keeps this rank's shards."""

    def __init__(self, target: torch.nn.Module | torch.optim.Optimizer):
        self.target = target

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.target.parameters()

    def load_state_dict(self, full: dict[str, Any]) -> None:
        if isinstance(self.target, torch.optim.Optimizer):
            params = [p for group in self.target.param_groups for p in group["params"]]
            state = {i: {k: _shard_like(v, params[int(i)]) for k, v in s.items()} for i, s in full["state"].items()}
            self.target.load_state_dict({**full, "state": state})
        else:
            reference = self.target.state_dict()
            self.target.load_state_dict({k: _shard_like(v, reference.get(k)) for k, v in full.items()})


def load_whole_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load whole tensors into ``model``: a sharded model keeps this rank's shards of them."""
    from torch.distributed.fsdp import FSDPModule

    (Sharding(model) if isinstance(model, FSDPModule) else model).load_state_dict(state)


@contextlib.contextmanager
def rank0_first() -> Iterator[None]:
    """Run the body on rank 0, then (even if it raised there) on the other ranks."""
    rank = dist.get_rank()
    if rank != 0:
        dist.barrier()
    try:
        yield
    finally:
        if rank == 0:
            dist.barrier()
