"""vLLM rollout backend: ``vllm.LLM`` in this process (V1 engine, single worker).

vLLM is imported lazily, inside the engine, after ``set_vllm_env`` has set (only where unset):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, so ``load_weights``
  can hand it a plain iterator of tensors (with the multiprocess engine it would have to be
  serialised); this is also what the A5 handout's weight-sync recipe assumes.
- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache on CPU; ignored on GPU), ``VLLM_NO_USAGE_STATS=1``.
- ``VLLM_LOGGING_LEVEL=WARNING``: vLLM's start-up report (a few hundred INFO lines) stays out of the log;
  ``VLLM_LOGGING_LEVEL=INFO`` in the environment brings it back.

vLLM's warning "RotaryEmbedding: Failed to load weights" on every weight push is dropped: the rotary
embedding's cos/sin table is computed from the config, never loaded, so nothing failed.

Defaults chosen here (each can be overridden through ``backend_kwargs``):

- CPU: ``enforce_eager=True`` (compiled mode takes minutes to start on CPU) and
  ``enable_chunked_prefill=False``: on CPU a request with a per-request ``seed`` crashes when its
  prompt is prefilled in chunks (vLLM rewinds the request's generator with ``set_offset``, which a
  CPU generator does not support). Without chunked prefill no prompt is ever split: a prompt that
  does not fit into this step's token budget (``max_num_batched_tokens``, at least ``max_model_len``)
  waits for the next step.
- ``seed=0`` for the engine (requests without a seed still differ from one another).

On CPU, vLLM's worker replaces ``torch.set_num_threads`` with a no-op for the whole process (it
binds OpenMP threads to cores); the engine puts the real function back once vLLM has started, so
training code in the same process still controls its thread count.

Sharing one GPU with the training policy (``sleep_when_idle=True``, CUDA only), as verl and TRL colocate
them: the engine sleeps between calls (vLLM's sleep level 1: the KV cache is released and the weights
wait in host memory), so the policy's training pass has the whole GPU; ``generate`` and ``load_weights``
wake it first, after returning the training pass's cached blocks to the driver. What the engine may take
while awake is ``gpu_memory_utilization``; ``a5core.engines.colocate`` derives it from the memory free at
start and what the policy will hold, instead of a guessed fraction. ``kv_cache_tokens`` sizes the
KV cache to the rollouts at hand (vLLM's ``kv_cache_memory_bytes``) rather than to all of that share: waking
maps the cache anew each time, so a cache far larger than the rollouts need costs seconds a step
(``benchmarks/RESULTS.md``, vLLM beside the hf engine).

vLLM's distributed state (its process groups) belongs to the process, not to one engine: an engine's teardown
destroys it. ``close`` an engine before the next one starts in the same process; dropped instead, the engine is
torn down whenever the garbage collector reaches it, possibly under the next engine, which then fails
("pipeline model parallel group is not initialized", "not initialized in the world group map").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from a5core.engines.colocate import kv_bytes_per_token
from a5core.engines.engine import Completion, SamplingSettings, check_prompts, resolve_dtype
from a5core.policy.causal_lm import checkpoint_name
from a5core.runtime import progress

_VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
# vLLM's logger that warns of every layer a weight push left without weights, and the layers that have none to load.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_COMPUTED_LAYERS = ("RotaryEmbedding",)


def set_vllm_env() -> None:
    """Set the environment vLLM needs here, where the caller has not set it (before importing vllm)."""
    for key, value in _VLLM_ENV.items():
        os.environ.setdefault(key, value)


class _ComputedLayersLoaded(logging.Filter):
    """Drops vLLM's "X: Failed to load weights" for the layers of :data:`_COMPUTED_LAYERS` (their tensors are
    computed from the config, not loaded); any other layer's still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in _COMPUTED_LAYERS)


def _quiet_computed_layers() -> None:
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _ComputedLayersLoaded) for f in reload_logger.filters):
        reload_logger.addFilter(_ComputedLayersLoaded())


def _eager_count_greater_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (x >= values).sum(-1)


class VLLMEngine:
    """Rollouts with an in-process ``vllm.LLM``; see ``a5core.engines`` for the shared semantics.

    ``model``: local directory or hub id. ``dtype``: as in ``make_engine``. ``device``: None, or the
    device type vLLM's platform uses (``"cuda"``, ``"cpu"``); vLLM picks the device itself.
    ``llm_kwargs`` go to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enforce_eager``, ``seed``). ``sleep_when_idle`` (CUDA):
    sleep between calls beside a training policy; ``kv_cache_tokens`` (CUDA): a KV cache of that many tokens
    (see the module docstring).
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        sleep_when_idle: bool = False,
        kv_cache_tokens: int | None = None,
        **llm_kwargs: Any,
    ):
        set_vllm_env()
        import vllm
        from vllm.platforms import current_platform

        _quiet_computed_layers()

        platform_device = current_platform.device_type
        if device is not None and torch.device(device).type != platform_device:
            raise ValueError(
                f"device {device!r} is not what vLLM runs on here ({platform_device!r}); "
                "pass device=None or use the hf backend"
            )
        self.device_type = platform_device
        self.dtype = resolve_dtype(dtype, platform_device)
        on_cpu = current_platform.is_cpu()
        llm_kwargs.setdefault("seed", 0)
        llm_kwargs.setdefault("logprobs_mode", "raw_logprobs")  # before temperature/top-p (the default)
        if sleep_when_idle and on_cpu:
            raise ValueError("sleep_when_idle needs vLLM on CUDA (its sleep mode maps GPU memory), not on the CPU")
        self.sleep_when_idle = sleep_when_idle
        self._awake = {"weights", "kv_cache"}  # what of the engine's GPU memory is mapped now
        if sleep_when_idle:
            llm_kwargs["enable_sleep_mode"] = True
        if kv_cache_tokens is not None and not on_cpu:
            llm_kwargs.setdefault("kv_cache_memory_bytes", kv_cache_tokens * kv_bytes_per_token(str(model), self.dtype))
        if on_cpu:
            llm_kwargs.setdefault("enforce_eager", True)
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            self._use_eager_logprob_ranks()
        set_num_threads = torch.set_num_threads
        try:
            self.llm = vllm.LLM(
                model=str(model), dtype=str(self.dtype).removeprefix("torch."), trust_remote_code=False, **llm_kwargs
            )
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; the
            # training code sharing this process keeps control of its own thread count.
            torch.set_num_threads = set_num_threads
        self.tokenizer = self.llm.get_tokenizer()
        self._vllm = vllm
        self._sleep()

    @staticmethod
    def _use_eager_logprob_ranks() -> None:
        """CPU only: vLLM ranks each sampled token with a ``torch.compile``d helper, which on CPU
        costs ~15 s of C++ compilation on first use and a few seconds again for each new batch
        shape. The ranks are not used here; the eager expression is the same computation."""
        try:
            from vllm.v1.sample import sampler
        except ImportError:  # layout changed: keep vLLM's own (slow but correct) helper
            return
        if hasattr(sampler, "batched_count_greater_than"):
            sampler.batched_count_greater_than = _eager_count_greater_equal

    def _sampling_params(self, s: SamplingSettings):
        return self._vllm.SamplingParams(
            n=1 if s.greedy else s.n,  # vLLM refuses n > 1 for greedy; copies are made below
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=0,
            max_tokens=s.max_tokens,
            min_tokens=s.min_tokens,
            stop=list(s.stop),
            include_stop_str_in_output=True,
            seed=s.seed,
            logprobs=0 if s.logprobs else None,  # 0: just the sampled token's log-prob
            skip_special_tokens=True,
        )

    def generate(self, prompts: Sequence[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """``len(prompts)`` lists of ``sampling.n`` Completions, prompt order kept."""
        prompts = check_prompts(prompts)
        self._check_open()
        if not prompts:
            return []
        token_prompts = [
            {"prompt_token_ids": ids} for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        ]
        self._wake(("weights", "kv_cache"))
        try:
            outputs = self.llm.generate(token_prompts, self._sampling_params(sampling), use_tqdm=progress.engine_bar)
        finally:
            self._sleep()
        groups = []
        for output in outputs:
            completions = [self._completion(c, sampling.logprobs) for c in output.outputs]
            if sampling.greedy:
                completions = completions * sampling.n
            if len(completions) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(completions)} completions for a prompt, expected {sampling.n}")
            groups.append(completions)
        return groups

    @staticmethod
    def _completion(c: Any, logprobs: bool) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with reason {c.finish_reason!r}")
        token_ids = tuple(int(t) for t in c.token_ids)
        log_probs = None
        if logprobs:
            log_probs = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, token_ids, strict=True))
        return Completion(text=c.text, token_ids=token_ids, finish_reason=c.finish_reason, log_probs=log_probs)

    def load_weights(self, policy_model: torch.nn.Module) -> None:
        """Push ``policy_model``'s current parameters (HF names, any device/dtype) into the engine.

        The V1 recipe: ``reload_weights`` on the worker (runs the model's ``load_weights`` between
        vLLM's layerwise reload hooks, which redo the per-layer post-processing such as CPU weight
        packing), then re-process a tied ``lm_head`` (it shares the embedding, which was reloaded,
        but its packed copy is not refreshed otherwise), then drop the prefix cache (its KV entries
        came from the old weights). Skipping either of the last two steps leaves outputs that
        silently differ from the policy's. Needs the in-process engine (see the module docstring).
        """
        self._check_open()
        self._wake(("weights",))  # the KV cache stays released: the next generate takes it
        state = policy_model.state_dict()
        weights = ((checkpoint_name(name), tensor.detach()) for name, tensor in state.items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.apply_model(_reprocess_tied_lm_head)
        self.llm.reset_prefix_cache()

    def release_memory(self) -> bool:
        """Nothing more to release: with ``sleep_when_idle`` the engine already sleeps once ``generate``
        returns (its KV cache released, its weights in host memory); without it, vLLM holds its share for good
        (sleep mode is chosen when it starts). False."""
        return False

    def close(self) -> None:
        """Stop the engine now: its memory is freed and vLLM's process-wide distributed state torn down, here
        rather than whenever the garbage collector reaches it (see the module docstring). Idempotent; a closed
        engine refuses to generate or load weights."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # also disarms the teardown the collector would run

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this vLLM engine is closed; start a new one")

    def _sleep(self) -> None:
        """With ``sleep_when_idle``: release the KV cache and move the weights to host memory (level 1)."""
        if self.sleep_when_idle and self._awake:
            self.llm.sleep(level=1)
            self._awake = set()

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Map back what ``tags`` name (``weights``, ``kv_cache``) that is asleep, after returning the blocks the
        training pass left in PyTorch's cache to the driver (vLLM maps memory of its own)."""
        wanted = [tag for tag in tags if tag not in self._awake]
        if wanted:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=wanted)
            self._awake.update(wanted)


def _reprocess_tied_lm_head(model: torch.nn.Module) -> None:
    lm_head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    method = getattr(lm_head, "quant_method", None)
    if tied and method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)
