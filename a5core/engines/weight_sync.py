"""Weight transport between one trainer process (rank 0) and one engine process (rank 1).

The pair forms its own two-rank group, built directly from a ``TCPStore`` without
``torch.distributed``'s default process group, so a trainer that is itself a torchrun/FSDP rank keeps
its own default group untouched: NCCL (``ProcessGroupNCCL``) when the engine is on a GPU, gloo
(``ProcessGroupGloo``) on CPU. Everything binds 127.0.0.1 only: the store listens on a socket bound
there, gloo uses a loopback device, and NCCL's bootstrap is pointed at ``lo`` (``NCCL_SOCKET_IFNAME``,
where unset); NVLink multicast is turned off (``NCCL_NVLS_ENABLE=0``).

A push is a list of :class:`WeightSpec` (name, shape, dtype), agreed once through a control channel,
then broadcasts from rank 0: consecutive tensors of one dtype are packed into flat buckets of at most
``bucket_bytes`` (a larger tensor travels alone; ``bucket_bytes=0``: every tensor alone)::

    trainer                                          engine
    store, port = open_store()                       (port reaches the engine process)
    group = WeightGroup(store, TRAINER, device)      group = WeightGroup(connect_store(port), ENGINE, device)
    weights = policy_weights(model)
    specs = specs_of(weights)        ── specs ──►
    group.send(weights, specs, B)                    for name, tensor in group.receive(specs, B): ...
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import distributed as dist

from a5core.policy.causal_lm import checkpoint_name
from a5core.runtime.distributed import full_tensor

TRAINER, ENGINE = 0, 1
HOST = "127.0.0.1"
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_TIMEOUT_S = 600.0
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # forced: never NVLink multicast
NCCL_ENV_DEFAULTS = {"NCCL_SOCKET_IFNAME": "lo"}  # bootstrap on loopback, unless the caller chose
_PREFIX = "a5-weights"


class WeightSpec(NamedTuple):
    """One tensor of a push: its HF name, shape and dtype name (e.g. ``"bfloat16"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def set_nccl_env() -> None:
    """NVLink multicast off (always) and NCCL's bootstrap on loopback (where unset), for this process."""
    os.environ.update(NCCL_ENV)
    for key, value in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def policy_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's tensors (parameters and persistent buffers) under HF names, in state-dict
    order, each tied tensor once (under its first name: ``model.embed_tokens.weight``, not
    ``lm_head.weight``). Tensors are the live ones, possibly FSDP2 ``DTensor`` shards."""
    seen: set[int] = set()
    weights = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            weights.append((checkpoint_name(name), tensor))
    return weights


def specs_of(weights: Sequence[tuple[str, torch.Tensor]]) -> list[WeightSpec]:
    """One spec per tensor (a DTensor's global shape)."""
    return [WeightSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in weights]


def gather_for_push(model: torch.nn.Module) -> None:
    """For the FSDP2 ranks that do *not* own the engine: take part in the all-gathers of a push, in the
    order the owning rank makes them (that rank calls ``engine.load_weights(model)`` meanwhile)."""
    for _, tensor in policy_weights(model):
        full_tensor(tensor.detach())


def plan_buckets(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[range]:
    """Split ``specs`` (in order) into buckets: runs of one dtype totalling at most ``bucket_bytes``;
    a tensor larger than that, or any tensor when ``bucket_bytes`` is 0, is a bucket of its own.
    Returns index ranges into ``specs``; both ends of a push compute the same plan."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    buckets: list[range] = []
    start, size = 0, 0
    for i, spec in enumerate(specs):
        fits = i > start and spec.dtype == specs[start].dtype and size + spec.nbytes <= bucket_bytes
        if i > start and not fits:
            buckets.append(range(start, i))
            start, size = i, 0
        size += spec.nbytes
    if specs:
        buckets.append(range(start, len(specs)))
    return buckets


def open_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, int]:
    """The trainer's rendezvous: a ``TCPStore`` server on a free port of 127.0.0.1 → (store, port)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        HOST,
        port,
        2,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here on
    )
    return store, port


def connect_store(port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The engine's end of the rendezvous: a client of the trainer's store on 127.0.0.1:``port``."""
    return dist.TCPStore(HOST, port, 2, False, datetime.timedelta(seconds=timeout_s))


class WeightGroup:
    """A two-rank group (``TRAINER`` sends, ``ENGINE`` receives) on ``device``: NCCL for a CUDA device,
    gloo for the CPU. Both ends must pass the same kind of device. Creating a gloo group blocks until
    the other rank creates its own; NCCL connects on the first push."""

    def __init__(self, store: dist.Store, rank: int, device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S):
        if rank not in (TRAINER, ENGINE):
            raise ValueError(f"rank must be {TRAINER} (trainer) or {ENGINE} (engine), got {rank!r}")
        self.rank = rank
        self.device = torch.device(device)
        self._store = store  # NCCL reads it again when it connects
        prefixed = dist.PrefixStore(_PREFIX, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            set_nccl_env()
            torch.cuda.set_device(self.device)
            self._group = dist.ProcessGroupNCCL(prefixed, rank, 2, timeout)
        elif self.device.type == "cpu":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            options._timeout = timeout
            options._threads = 2
            self._group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
        else:
            raise ValueError(f"weight transport runs on cuda (NCCL) or cpu (gloo), not {self.device}")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast([tensor], _root_options()).wait()

    def send(self, weights: Sequence[tuple[str, torch.Tensor]], specs: Sequence[WeightSpec], bucket_bytes: int) -> None:
        """Trainer: broadcast ``weights`` (matching ``specs``; DTensors are all-gathered one by one, in
        order) bucket by bucket. Returns once the last bucket is queued (NCCL: on the current stream)."""
        for bucket in plan_buckets(specs, bucket_bytes):
            tensors = [full_tensor(weights[i][1].detach()).to(self.device) for i in bucket]
            flat = tensors[0].contiguous() if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
            self._broadcast(flat)

    def receive(self, specs: Sequence[WeightSpec], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine: yield ``(name, tensor)`` per spec, in order, each a fresh tensor on this group's device
        (views of a bucket that is not reused). ``close()`` on the iterator before its end (do it when
        the consumer fails) still receives the remaining buckets, so the trainer never waits on a
        broadcast that nobody joins."""
        buckets = plan_buckets(specs, bucket_bytes)
        received = 0
        try:
            for bucket in buckets:
                flat = self._receive_bucket(specs, bucket)
                received += 1
                offset = 0
                for i in bucket:
                    spec = specs[i]
                    yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
                    offset += spec.numel
        except GeneratorExit:
            for bucket in buckets[received:]:
                self._receive_bucket(specs, bucket)
            raise

    def _receive_bucket(self, specs: Sequence[WeightSpec], bucket: range) -> torch.Tensor:
        """One bucket as a flat (Σ numel,) tensor."""
        total = sum(specs[i].numel for i in bucket)
        flat = torch.empty(total, dtype=specs[bucket[0]].torch_dtype, device=self.device)
        self._broadcast(flat)
        return flat

    def close(self) -> None:
        """Release the backend: gloo's connections; NCCL's communicator by ``abort`` (local, whereas
        ``shutdown`` would wait for the other rank, which may be gone). Call it with no push in flight."""
        group, self._group = self._group, None
        release = getattr(group, "abort" if self.device.type == "cuda" else "shutdown", None)  # torch >= 2.7
        if release is not None:
            release()


def _root_options() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = TRAINER
    options.rootTensor = 0
    return options
