"""Rollouts: one ``Engine`` protocol (:mod:`a5core.engines.engine`), two backends (vLLM in-process,
transformers ``generate``) and :func:`make_engine` to pick one; an engine in another process and its weight
pushes; a served teacher (:mod:`a5core.engines.teacher`).

    engine = make_engine("Qwen/Qwen2.5-Math-1.5B")            # vllm if importable, else hf
    groups = engine.generate(prompts, SamplingSettings(n=8, temperature=1.0, max_tokens=1024))
"""

from __future__ import annotations

import torch

from a5core.engines.engine import (
    BACKENDS,
    DTYPES,
    Completion,
    Engine,
    SamplingSettings,
    check_prompts,
    full_weights,
    resolve_dtype,
)

__all__ = [
    "BACKENDS",
    "DTYPES",
    "Completion",
    "Engine",
    "SamplingSettings",
    "check_prompts",
    "full_weights",
    "make_engine",
    "resolve_dtype",
    "vllm_available",
]


def vllm_available() -> bool:
    """Whether ``import vllm`` works (it is imported: a few seconds, paid anyway when vllm is then used).

    The CPU environment variables the vllm backend needs are set first (see ``rollout.vllm``).
    """
    from a5core.engines.vllm import set_vllm_env

    set_vllm_env()
    try:
        import vllm  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def make_engine(
    model: str,
    backend: str = "auto",
    *,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    **backend_kwargs,
) -> Engine:
    """Build a rollout engine for ``model`` (a local directory or a hub id; remote code never trusted).

    ``backend``: ``"auto"`` (vllm if it can be imported, else hf), ``"vllm"`` or ``"hf"``.
    ``dtype``: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), a dtype name, or a torch.dtype.
    ``device``: hf: where the model lives (default ``cuda`` if available, else ``cpu``); vllm: must
    be None or vLLM's own platform device type. ``backend_kwargs`` go to the backend: for vllm,
    ``vllm.LLM`` arguments (``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``, ...); for
    hf, ``batch_size`` (sequences per ``generate`` call).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "vllm" if vllm_available() else "hf"
    if backend == "vllm":
        from a5core.engines.vllm import VLLMEngine

        return VLLMEngine(model, dtype=dtype, device=device, **backend_kwargs)
    from a5core.engines.hf import HFEngine

    return HFEngine.from_pretrained(model, dtype=dtype, device=device, **backend_kwargs)
