"""Engine start as a Prefect task with retries: the step of a flow most likely to fail transiently
(vLLM's start-up while a previous process still holds GPU memory or a port, a model read from a slow
or busy filesystem). Each flow calls ``start_engine(make_engine, ...)`` with its own ``make_engine``,
so what starts, and with which arguments, is exactly what a direct ``make_engine(...)`` call starts.

:func:`rollout_engine` is what the training flows call: it picks where the engine runs (in this
process, or with ``engine_device`` a :class:`~a5core.engines.remote.RemoteEngine` in its own process
and device), checks that choice against the torchrun ranks, and starts it through ``start_engine``
(a Prefect task on rank 0; the other ranks of a torchrun launch call its plain function). Under
several ranks every rank gets its own engine, with a full copy of the model.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from safetensors import SafetensorError

from a5core.engines import make_engine, vllm_available
from a5core.engines.colocate import colocated_memory_fraction, policy_reserve_bytes, rollout_tokens
from a5core.engines.remote import RemoteEngine
from a5core.runtime.distributed import rank_and_world

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The rollout engine could not be started (after the retries)."""


# Errors a retry cannot mend: a bad setting, a damaged file, a missing package, weights that need code to load
# (torch refuses such a pickle); and an OSError but those of TRANSIENT_ERRNOS (a missing or unreadable file).
# Anything else (GPU memory still held by a process that is ending, a busy port, a slow filesystem) is retried.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    SafetensorError,  # a weights file damaged
    pickle.UnpicklingError,
    ValueError,
    TypeError,
    LookupError,
    ImportError,
)
# The OSErrors a retry may mend: a busy port or device, a resource short for now, a connection or a wait that
# failed. Any other OSError (a missing file; a library's "no file named model.safetensors", errno None) is the
# same next time.
TRANSIENT_ERRNOS = {errno.EADDRINUSE, errno.EBUSY, errno.EAGAIN, errno.ENOMEM, errno.EINTR, errno.ETIMEDOUT}

# vLLM's ValueErrors when the GPU's free memory changed while it started: another process allocating during its
# memory profiling (two engines started at once on one GPU: one of them finds no memory for its cache), or one
# still ending. A later try finds the memory settled.
MEMORY_RACES = ("No available memory for the cache blocks", "is less than desired GPU memory utilization")


def retry_unless_deterministic(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed engine start or generation unless its cause is one
    of :data:`DETERMINISTIC_ERRORS` other than vLLM's :data:`MEMORY_RACES`, or an OSError not of
    :data:`TRANSIENT_ERRNOS` (a bad dtype, a model path, weights torch refuses to unpickle: each failed 6 engine
    starts, 71–121 s, when retried)."""
    error = state.result(raise_on_failure=False)
    cause = error.__cause__ if isinstance(error, EngineStartError) and error.__cause__ is not None else error
    if isinstance(cause, ValueError) and any(race in str(cause) for race in MEMORY_RACES):
        return True
    if isinstance(cause, OSError) and not isinstance(cause, (ConnectionError, TimeoutError)):
        return cause.errno in TRANSIENT_ERRNOS
    return not isinstance(cause, DETERMINISTIC_ERRORS)


@task(
    name="start_engine",
    retries=2,
    retry_delay_seconds=[10, 30],  # the second wait outlasts another engine's start beside this one
    retry_condition_fn=retry_unless_deterministic,
    cache_policy=NO_CACHE,
    persist_result=False,
)
def start_engine(factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``factory(*args, **kwargs)``, retried twice (10 and 30 s later) if it raises what a retry can mend
    (:func:`retry_unless_deterministic`); the engine is never cached. A failure raises
    :class:`EngineStartError` naming the model, the settings and the cause."""
    import gc

    # An engine dropped earlier in this process and not yet collected (a flow before this one) tears down
    # vLLM's process-wide distributed state when the collector finalizes it: finalized now, not under the new one.
    gc.collect()
    try:
        return factory(*args, **kwargs)
    except Exception as error:
        settings = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
        raise EngineStartError(
            f"could not start the rollout engine ({settings}): {type(error).__name__}: {error}"
        ) from error


def parse_engine_devices(engine_device: str) -> list[str]:
    """``engine_device`` as a list of devices: one (``"cuda:1"``, ``"cpu"``) or a comma-separated list,
    one per torchrun rank on this host (``"cuda:4,cuda:5"``). ValueError for anything but cuda/cpu."""
    devices = [item.strip() for item in engine_device.split(",")]
    for device in devices:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            kind = None
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"engine_device {engine_device!r}: {device!r} is not a cuda device or cpu")
    return [str(torch.device(device)) for device in devices]


def engine_device_of_rank(engine_device: str | None) -> str | None:
    """This rank's engine device (None: the engine runs in this process). A list gives local rank r its
    r-th entry, and must have one per rank (``LOCAL_WORLD_SIZE``); one device serves every rank. This rank's
    own training GPU is allowed (one-step-off on one GPU): the weights then travel through host memory."""
    if engine_device is None:
        return None
    devices = parse_engine_devices(engine_device)
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if len(devices) not in (1, local_world):
        raise ValueError(
            f"engine_device {engine_device!r}: {len(devices)} devices for {local_world} ranks; "
            "give one device, or one per rank"
        )
    device = devices[0] if len(devices) == 1 else devices[local_rank]
    index = torch.device(device).index or 0
    if device.startswith("cuda") and index >= torch.cuda.device_count():
        raise ValueError(
            f"engine_device {engine_device!r}: {device} is not one of the {torch.cuda.device_count()} "
            "GPUs this process sees"
        )
    if device.startswith("cuda") and index == torch.cuda.current_device():
        logger.info("engine_device %s: the engine shares this rank's GPU; weights go through host memory", device)
    return device


def in_process_backend(backend: str) -> str:
    """The backend of an engine in the trainer's process. Under several ranks that is hf (each rank's
    engine on its own GPU): ``auto`` becomes hf; ``vllm`` is refused (an in-process vLLM does not
    keep to its rank's GPU and process group), with what to do instead."""
    if rank_and_world()[1] == 1 or backend == "hf":
        return backend
    if backend == "vllm":
        raise ValueError(
            "backend vllm under several ranks (torchrun): an in-process vLLM engine per rank is not "
            "supported; use --backend hf (each rank's engine on its GPU), or, in the grpo flow, "
            "--engine-device with a GPU per rank (vLLM in its own process)"
        )
    logger.info("backend auto under several ranks: each rank's engine is an hf engine in its process")
    return "hf"


def colocated_vllm_kwargs(
    memory_fraction: float | None, policy_reserve: Callable[[], int], kv_cache_tokens: int | None = None
) -> dict[str, Any]:
    """``make_engine`` arguments for a vLLM engine in the trainer's process. On CUDA it sleeps while the policy
    trains (``sleep_when_idle``); ``memory_fraction`` None bounds its share by the memory free now (within the
    run's :func:`claim_gpu_share`) less ``policy_reserve()`` bytes
    (:func:`~a5core.engines.colocate.colocated_memory_fraction`) and sizes its KV cache to ``kv_cache_tokens``.
    On the CPU, vLLM's own defaults (or ``memory_fraction``) hold."""
    if not torch.cuda.is_available():
        return {} if memory_fraction is None else {"gpu_memory_utilization": memory_fraction}
    kwargs: dict[str, Any] = {"sleep_when_idle": True}
    if memory_fraction is None:
        free, total = torch.cuda.mem_get_info()
        share = int(torch.cuda.get_per_process_memory_fraction() * total)  # gpu_memory_fraction's, else all
        free = min(free, max(share - torch.cuda.memory_reserved(), 0))
        memory_fraction = colocated_memory_fraction(free, total, policy_reserve())
        kwargs["kv_cache_tokens"] = kv_cache_tokens
        logger.info(
            "rollout engine: gpu_memory_utilization at most %.3f (%d of %d MiB free), KV cache for %s tokens",
            memory_fraction,
            free >> 20,
            total >> 20,
            kv_cache_tokens,
        )
    return {**kwargs, "gpu_memory_utilization": memory_fraction}


def colocated_backend(backend: str) -> str:
    """``auto`` for an engine in the trainer's process: on CUDA the hf engine, which decodes the policy's own
    weights and needs no push (faster in a GRPO step than vLLM beside the policy, asleep or awake: ``docs/gpu.md``);
    elsewhere vLLM where it is installed."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available():
        logger.info("backend auto beside the policy on a GPU: the hf engine (the faster training step measured)")
        return "hf"
    return "vllm" if vllm_available() else "hf"


def rollout_engine(
    model: str,
    backend: str,
    *,
    dtype: str,
    memory_fraction: float | None,
    engine_device: str | None = None,
    policy_reserve: Callable[[], int] = lambda: 0,
    kv_cache_tokens: int | None = None,
) -> Any:
    """A training flow's engine for ``model``, through the retried :func:`start_engine`: in this process
    (``engine_device`` None), else a RemoteEngine on this rank's ``engine_device`` (weights pushed over
    NCCL from a GPU, gloo from the CPU). ``memory_fraction``: vLLM's gpu_memory_utilization; None: in this
    process on CUDA, sized by :func:`colocated_vllm_kwargs` from ``policy_reserve()`` and ``kv_cache_tokens``,
    elsewhere vLLM's default. A placement that cannot work raises ValueError before anything starts. Close it with
    :func:`closing_engine`."""
    start = start_engine if rank_and_world()[0] == 0 else start_engine.fn
    device = engine_device_of_rank(engine_device)
    if device is None:
        backend = colocated_backend(in_process_backend(backend))
        kwargs = colocated_vllm_kwargs(memory_fraction, policy_reserve, kv_cache_tokens) if backend == "vllm" else {}
        return start(make_engine, model, backend, dtype=dtype, **kwargs)
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    kwargs = {"gpu_memory_utilization": memory_fraction} if backend == "vllm" and memory_fraction else {}
    threads = torch.get_num_threads() if device == "cpu" else None  # the trainer waits meanwhile
    return start(RemoteEngine, model, backend, device=device, dtype=dtype, threads=threads, **kwargs)


def claim_gpu_share(fraction: float | None) -> None:
    """Bound what this process's PyTorch allocator may hold on its GPU to ``fraction`` of the GPU's memory
    (``gpu_memory_fraction``; None: no bound), before anything is allocated: so that runs side by side on one GPU
    each size their ``auto`` micro-batches and in-process engine from their own share (both read the bound),
    and one run's peak cannot take another's memory. Nothing on the CPU."""
    if fraction is not None and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
        logger.info("this run may allocate %.3g of the GPU's memory (gpu_memory_fraction)", fraction)


def engine_for(params: Any) -> Any:
    """A training run's rollout engine for its ``model`` (see :func:`rollout_engine`): ``backend``,
    ``engine_dtype``, ``engine_memory_fraction`` and, where the parameters have it, ``engine_device``; first the
    run's share of the GPU (:func:`claim_gpu_share`)."""
    from a5core.policy.model_specs import resolve_model

    claim_gpu_share(params.gpu_memory_fraction)
    model = resolve_model(params.model)
    return rollout_engine(
        model,
        params.backend,
        dtype=params.engine_dtype,
        memory_fraction=params.engine_memory_fraction,
        engine_device=getattr(params, "engine_device", None),
        policy_reserve=lambda: policy_reserve_bytes(
            model,
            getattr(params, "policy_dtype", "float32"),
            lora=bool(getattr(params, "lora_rank", 0)),
            reference=bool(getattr(params, "kl_coef", 0)),
        ),
        kv_cache_tokens=rollout_tokens(rollouts_at_once(params), getattr(params, "max_tokens", None)),
    )


def rollouts_at_once(params: Any) -> int | None:
    """The sequences a run samples at once: GRPO's ``rollout_batch_size``, Expert Iteration's questions × rollouts
    per question; None for a run of neither."""
    if hasattr(params, "rollout_batch_size"):
        return params.rollout_batch_size
    if hasattr(params, "questions_per_step"):
        return params.questions_per_step * params.rollouts_per_question
    return None


@contextlib.contextmanager
def closing_engine(engine: Any) -> Iterator[Any]:
    """``with closing_engine(engine) as engine:`` closes it at the end when it can be closed: a vLLM engine
    stops and frees its memory and vLLM's process-wide state (before the next engine in this process starts), a
    RemoteEngine's server process stops; an hf engine is left to the garbage collector."""
    try:
        yield engine
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
