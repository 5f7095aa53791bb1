"""An engine in its own process (and GPU), fed the trainer's weights over NCCL: no file round-trip.

``RemoteEngine`` implements the ``Engine`` protocol in the trainer process. It spawns a server process
that builds ``make_engine(model, backend, device=..., dtype=...)`` on its device (e.g. ``"cuda:1"``)
and answers over a control pipe (pickled ``SamplingSettings`` / ``Completion``s)::

    with RemoteEngine(model_dir, "hf", device="cuda:1") as engine:   # policy on cuda:0
        engine.load_weights(policy)         # names/shapes/dtypes on the pipe, tensors over NCCL
        groups = engine.generate(prompts, SamplingSettings(n=8))

Weights travel through :mod:`a5core.engines.weight_sync`: a two-rank group of its own (NCCL when the engine is on
a GPU, gloo on CPU), so a trainer that is a torchrun/FSDP rank keeps its default group to itself.
Receiving ends:

- hf: the server copies each received tensor into its model's parameters, in place.
- vllm: vLLM's worker is extended (``worker_extension_cls`` = :class:`VLLMWeightReceiver`); it joins the
  group and reloads its weights from the received tensors (``reload_weights``), then re-packs a tied
  ``lm_head``; the server resets the prefix cache: the steps of ``VLLMEngine.load_weights``. vLLM
  picks its own GPU, so the server shows it only the requested one (``CUDA_VISIBLE_DEVICES``).

An error in the server (bad model path, out of memory, mismatched weights) reaches the trainer as one
:class:`RemoteEngineError` naming the engine. The server stops on ``close()``, on leaving a ``with``
block, when the engine is garbage-collected, at the trainer's exit, and by itself when the trainer
process disappears (it watches its parent), so no process is left behind.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit hook (joining children) registers before ours, so ours runs first
import os
import threading
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from a5core.engines import make_engine, vllm_available
from a5core.engines.engine import BACKENDS, Completion, SamplingSettings, check_prompts
from a5core.engines.weight_sync import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    ENGINE,
    TRAINER,
    WeightGroup,
    WeightSpec,
    connect_store,
    open_store,
    plan_buckets,
    policy_weights,
    set_nccl_env,
    specs_of,
)

__all__ = ["RemoteEngine", "RemoteEngineError", "VLLMWeightReceiver"]

# torchrun's variables: a server spawned by a rank is no rank itself (vLLM would read them)
_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
_CLOSE_TIMEOUT_S = 30.0


class RemoteEngineError(RuntimeError):
    """A remote engine failed (to start, generate or load weights); ``remote_traceback`` is the
    server's traceback text when the error happened there."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class _ServerConfig:
    model: str
    backend: str  # "hf" or "vllm"
    device: str
    dtype: str | torch.dtype
    backend_kwargs: dict[str, Any]
    port: int
    timeout_s: float
    threads: int | None
    parent_pid: int
    transport: str  # the weight transport's device type: "cuda" (NCCL) or "cpu" (gloo)


def weight_transport(engine_device: str | torch.device, trainer_device: str | torch.device | None) -> str:
    """The device type the weights travel on from a trainer on ``trainer_device`` (None: the CPU) to an
    engine on ``engine_device``: ``"cuda"`` (NCCL, GPU to GPU) when both are on CUDA and apart; ``"cpu"``
    (gloo) when either is on the CPU, or when they share a GPU (NCCL cannot send from a GPU to itself: the
    weights go through host memory, one copy out and one in)."""
    engine, trainer = torch.device(engine_device), torch.device(trainer_device or "cpu")
    if engine.type == "cuda" and trainer.type == "cuda" and (engine.index or 0) != (trainer.index or 0):
        return "cuda"
    return "cpu"


class RemoteEngine:
    """Rollouts from an engine in a server process; see ``a5core.engines`` for the shared semantics.

    ``model``: local directory or hub id. ``backend``: ``"hf"``, ``"vllm"`` or ``"auto"`` (vllm where it
    can be imported, else hf). ``device``: the engine's device (``"cuda:1"``, ``"cpu"``): another CUDA
    device than this process's current one makes the weights travel over NCCL; the CPU, or this process's own
    GPU (the engine beside the trainer on one GPU), over gloo through host memory (:func:`weight_transport`).
    ``dtype`` and ``backend_kwargs``: as for ``make_engine``. ``bucket_bytes`` (an attribute, may be
    changed between pushes): weights are broadcast in flat buffers of at most this many bytes per
    dtype (0: tensor by tensor). ``threads``: the server's torch thread count (None: torch's
    default). ``start_timeout_s``: how long the engine may take to start; ``timeout_s``: the
    transport's limit for one broadcast. Raises :class:`RemoteEngineError` (naming the engine) when
    the server fails to start.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        backend: str = "auto",
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        threads: int | None = None,
        start_timeout_s: float = 600.0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **backend_kwargs: Any,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        engine_device = torch.device(device)
        if engine_device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a cuda device or cpu, got {device!r}")
        plan_buckets([], bucket_bytes)  # validates it
        if backend == "auto":
            backend = "vllm" if vllm_available() else "hf"
        self.backend, self.device, self.bucket_bytes = backend, str(engine_device), bucket_bytes
        self.name = f"remote {backend} engine for {str(model)!r} on {self.device}"
        trainer = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        transport = weight_transport(self.device, trainer)
        self._lock = threading.Lock()
        self._sent_specs: list[WeightSpec] | None = None
        store, port = open_store(timeout_s)
        config = _ServerConfig(
            str(model), backend, self.device, dtype, backend_kwargs, port, timeout_s, threads, os.getpid(), transport
        )
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, config), name="a5-remote-engine")
        self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop_server, self._process, self._conn)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)  # before multiprocessing's own hook, which would wait for the server
        try:
            self._reply("start", start_timeout_s)
            self._group = WeightGroup(store, TRAINER, trainer if transport == "cuda" else "cpu", timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ Engine protocol

    def generate(self, prompts: Sequence[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """``len(prompts)`` lists of ``sampling.n`` completions each, in prompt order (computed remotely)."""
        prompts = check_prompts(prompts)
        if not isinstance(sampling, SamplingSettings):
            raise TypeError(f"sampling must be a SamplingSettings, got {type(sampling).__name__}")
        with self._lock:
            self._request(("generate", prompts, sampling))
            return self._reply("generate")

    def load_weights(self, policy_model: torch.nn.Module) -> None:
        """Push ``policy_model``'s parameters and persistent buffers (HF names; ``module.``/``_orig_mod.``
        stripped; tied tensors once) into the remote engine; returns once the engine holds them.

        The names, shapes and dtypes go over the pipe when they differ from the last push; the tensors
        are broadcast. An error on this side in the middle of the broadcasts closes the engine (the
        server would wait for the rest of the push). An FSDP2-sharded policy (DTensor parameters) is
        all-gathered tensor by tensor with ``full_tensor()``, a collective: call this on the rank that owns
        the engine while every other rank calls ``a5core.engines.weight_sync.gather_for_push(policy_model)``.
        """
        bucket_bytes = self.bucket_bytes
        plan_buckets([], bucket_bytes)  # validates it (an attribute: it may change between pushes)
        weights = policy_weights(policy_model)
        specs = specs_of(weights)
        with self._lock:
            self._request(("load", None if specs == self._sent_specs else specs, bucket_bytes))
            self._sent_specs = None
            self._reply("load_weights (checking names and shapes)")
            try:
                self._group.send(weights, specs, bucket_bytes)
            except BaseException:  # the server waits inside a push: nothing can go on from here
                self.close()
                raise
            self._reply("load_weights")
            self._sent_specs = specs

    def release_memory(self) -> bool:
        """Nothing to release in this process: the engine's memory is its own process's, on its own device.
        False."""
        return False

    # ------------------------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the server process (asking first, then terminating it) and release the transport."""
        group = getattr(self, "_group", None)
        self._finalizer()
        atexit.unregister(self._finalizer)
        if group is not None:
            group.close()
            self._group = None

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- control channel

    def _request(self, message: tuple) -> None:
        if not self._finalizer.alive:
            raise RemoteEngineError(f"{self.name} is closed")
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._exited("a request") from None

    def _reply(self, what: str, timeout_s: float | None = None) -> Any:
        """The server's answer to the last request; a RemoteEngineError for its error, its death or silence."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if not self._process.is_alive() and not self._conn.poll(0):
                raise self._exited(what)
            if deadline is not None and time.monotonic() > deadline:
                raise RemoteEngineError(f"{self.name}: no answer to {what} within {timeout_s:g} s")
        try:
            status, *payload = self._conn.recv()
        except EOFError:
            raise self._exited(what) from None
        if status == "error":
            kind, message, remote_traceback = payload
            raise RemoteEngineError(f"{self.name}: {what} failed: {kind}: {message}", remote_traceback)
        return payload[0]

    def _exited(self, what: str) -> RemoteEngineError:
        self._process.join(1)  # its exit code, if it is exiting
        return RemoteEngineError(
            f"{self.name}: the server process exited (code {self._process.exitcode}) during {what}"
        )


def _stop_server(process: multiprocessing.Process, conn: Any) -> None:
    """Ask the server to stop; terminate, then kill it if it does not. Idempotent (a weakref finalizer)."""
    try:
        conn.send(("close",))
    except (OSError, EOFError):
        pass
    process.join(_CLOSE_TIMEOUT_S)
    for stop in (process.terminate, process.kill):
        if process.is_alive():
            stop()
            process.join(5)
    conn.close()


# ================================================================================= server process


def _serve(conn: Any, config: _ServerConfig) -> None:
    """The server's main: build the engine, join the transport, answer requests until told to stop."""
    _exit_with_parent(config.parent_pid)
    try:
        receiver = _start(config)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the trainer
        conn.send(_error(exc))
        return
    conn.send(("ok", None))
    receiver.join(config.port, config.timeout_s)
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if op == "close":
            receiver.leave()
            return
        try:
            if op == "generate":
                conn.send(("ok", receiver.engine.generate(*args)))
            elif op == "load":
                receiver.load(conn, *args)
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, the server keeps serving
            conn.send(_error(exc))


def _error(exc: BaseException) -> tuple[str, str, str, str]:
    return ("error", type(exc).__name__, str(exc), traceback.format_exc())


def _exit_with_parent(parent_pid: int) -> None:
    """Exit this process as soon as the trainer (our parent) has gone, whatever we are doing."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _start(config: _ServerConfig) -> _HFReceiver | _VLLMReceiver:
    """Set this process up (environment, threads), then build the engine and its receiving end."""
    for key in _LAUNCHER_ENV:
        os.environ.pop(key, None)
    set_nccl_env()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if config.backend == "vllm":
        return _VLLMReceiver(config)
    return _HFReceiver(config)


class _HFReceiver:
    """hf backend: the engine lives in this process; received tensors are copied into its parameters."""

    def __init__(self, config: _ServerConfig):
        self.backend = "hf"
        if torch.device(config.device).type == "cuda":
            torch.cuda.set_device(config.device)  # the engine's GPU is this process's current device
        self.engine = make_engine(config.model, "hf", dtype=config.dtype, device=config.device, **config.backend_kwargs)
        self._targets = self.engine.model.state_dict(keep_vars=True)
        self._specs: list[WeightSpec] | None = None
        self._transport = self.engine.model.device if config.transport == "cuda" else torch.device("cpu")

    def join(self, port: int, timeout_s: float) -> None:
        self._group = WeightGroup(connect_store(port, timeout_s), ENGINE, self._transport, timeout_s)

    def leave(self) -> None:
        self._group.close()

    def _check(self, specs: list[WeightSpec]) -> None:
        """Every spec names one of the model's tensors with its shape, and covers all of them (tied
        tensors count once)."""
        covered = set()
        for spec in specs:
            target = self._targets.get(spec.name)
            if target is None:
                raise KeyError(f"the engine's model has no tensor {spec.name!r}")
            if tuple(target.shape) != tuple(spec.shape):
                raise ValueError(
                    f"{spec.name}: the policy's shape {tuple(spec.shape)} is not the engine's {tuple(target.shape)}"
                )
            covered.add(id(target))
        missing = [name for name, t in self._targets.items() if id(t) not in covered]
        if missing:
            more = " ..." if len(missing) > 5 else ""
            raise KeyError(f"the policy has no tensor for the engine's {', '.join(missing[:5])}{more}")

    @torch.no_grad()
    def load(self, conn: Any, specs: list[WeightSpec] | None, bucket_bytes: int) -> None:
        """Check new specs, say ready, receive every tensor into the model, say done."""
        if specs is not None:
            self._specs = None
            self._check(specs)
            self._specs = specs
        if self._specs is None:
            raise RuntimeError("no weight specs: the trainer must send them with its first push")
        conn.send(("ok", None))
        weights = self._group.receive(self._specs, bucket_bytes)
        try:
            for name, tensor in weights:
                self._targets[name].copy_(tensor)  # from host memory when the transport is gloo
        finally:
            weights.close()
        if self.engine.model.device.type == "cuda":
            torch.cuda.synchronize(self.engine.model.device)
        conn.send(("ok", None))


class _VLLMReceiver:
    """vllm backend: the engine lives in this process, its worker (extended with
    :class:`VLLMWeightReceiver`) joins the transport and reloads the received tensors."""

    def __init__(self, config: _ServerConfig):
        self.backend = "vllm"
        device = torch.device(config.device)
        if device.type == "cuda":
            _show_only_gpu(0 if device.index is None else device.index)
        self.engine = make_engine(
            config.model,
            "vllm",
            dtype=config.dtype,
            worker_extension_cls=f"{__name__}.VLLMWeightReceiver",
            **config.backend_kwargs,
        )
        self._specs: list[tuple[str, list[int], str]] | None = None
        self._transport = config.transport

    def join(self, port: int, timeout_s: float) -> None:
        self.engine.llm.collective_rpc("a5_join_weight_group", args=(port, timeout_s, self._transport))

    def leave(self) -> None:
        self.engine.llm.collective_rpc("a5_leave_weight_group")

    def load(self, conn: Any, specs: list[WeightSpec] | None, bucket_bytes: int) -> None:
        """Say ready, have the worker receive and reload, drop the prefix cache (stale KV), say done."""
        if specs is not None:
            self._specs = [(s.name, list(s.shape), s.dtype) for s in specs]  # plain data for the worker RPC
        if self._specs is None:
            raise RuntimeError("no weight specs: the trainer must send them with its first push")
        conn.send(("ok", None))
        self.engine.llm.collective_rpc("a5_receive_weights", args=(self._specs, bucket_bytes))
        self.engine.llm.reset_prefix_cache()
        conn.send(("ok", None))


def _show_only_gpu(index: int) -> None:
    """Make GPU ``index`` (as this process sees them now) the only visible one: vLLM uses the first."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(index + 1)]
    if index >= len(ids):
        raise ValueError(f"cuda:{index} is not visible here (CUDA_VISIBLE_DEVICES={visible!r})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index]


class VLLMWeightReceiver:
    """vLLM worker extension (``worker_extension_cls``): the engine rank of the weight transport.

    ``collective_rpc("a5_join_weight_group", args=(port, timeout_s, transport))`` joins the trainer's group on
    the worker's device (transport ``"cuda"``) or the CPU (``"cpu"``); ``"a5_leave_weight_group"`` leaves it.
    ``collective_rpc("a5_receive_weights", args=(specs, bucket_bytes))`` receives one push (specs:
    ``(name, shape, dtype)`` triples) straight into ``reload_weights`` (checkpoint format, vLLM's per-layer
    post-processing redone) and re-packs a tied ``lm_head``. The caller then resets the prefix cache.
    """

    def a5_join_weight_group(self, port: int, timeout_s: float, transport: str) -> None:
        device = self.device if transport == "cuda" else "cpu"
        self.a5_weight_group = WeightGroup(connect_store(port, timeout_s), ENGINE, device, timeout_s)

    def a5_leave_weight_group(self) -> None:
        self.a5_weight_group.close()

    def a5_receive_weights(self, specs: list[tuple[str, list[int], str]], bucket_bytes: int) -> None:
        from a5core.engines.vllm import _reprocess_tied_lm_head

        weights = self.a5_weight_group.receive([WeightSpec(n, tuple(s), d) for n, s, d in specs], bucket_bytes)
        try:
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        finally:
            weights.close()
        _reprocess_tied_lm_head(self.get_model())
