"""What every rollout engine shares: the ``Engine`` protocol, its sampling settings and completions.

An engine turns prompts into sampled completions and can be refreshed with a training policy's
current weights::

    engine = make_engine("Qwen/Qwen2.5-Math-1.5B")            # vllm if importable, else hf
    groups = engine.generate(prompts, SamplingSettings(n=8, temperature=1.0, max_tokens=1024))
    groups[i][j].text, groups[i][j].token_ids, groups[i][j].finish_reason
    engine.load_weights(policy)                                # after an optimiser step
    engine.release_memory()                                    # its cache, while a training pass needs it

Both backends share these semantics:

- ``generate(prompts, s)`` returns one list of ``s.n`` completions per prompt, prompt order kept.
  Prompts are tokenised without special tokens, exactly as ``a5core.policy.causal_lm.tokenize_prompt_and_output``
  does, so engine log-probs and the policy's teacher-forced log-probs see the same token ids.
- Stop strings (vLLM rules): generation stops at the first stop string that *completes* after the
  first ``min_tokens`` generated tokens; ``text`` is cut right after it (stop string kept),
  ``token_ids`` end with the token that completes it (if the stop string ends inside a token, that
  whole token is kept, so the decoded ids may run a few characters past ``text``).
  ``finish_reason`` is ``"stop"``.
- An EOS token (the tokenizer's, plus any in the model's generation config) ends generation with
  ``finish_reason="stop"``; the EOS id is the last of ``token_ids`` and is not in ``text``.
- Hitting ``max_tokens`` gives ``finish_reason="length"``. ``min_tokens`` blocks EOS and stop strings
  for the first ``min_tokens`` tokens.
- ``temperature == 0`` is greedy (the ``n`` completions are then identical copies). ``top_p`` < 1 is
  nucleus sampling. No top-k, no repetition penalty, and the model's own generation-config sampling
  defaults are ignored.
- ``seed``: the same seed, prompts and settings give the same completions on the same engine.
  The two backends draw different random streams (vLLM seeds each request, sample ``j`` of a
  prompt with ``seed + j``; hf seeds one generator for the whole call), so only greedy output is
  comparable across backends.
- ``logprobs=True`` fills ``Completion.log_probs``: per generated token, log p(token | prefix) under
  the *raw* model distribution (log-softmax of the logits at temperature 1, before top-p), in fp32:
  the quantity ``a5core.policy.causal_lm.get_response_log_probs`` computes, i.e. the "old log-probs" of GRPO
  when rollouts are sampled at temperature 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import Field, model_validator

from a5core.policy.lora import MergedPolicy, has_adapters
from a5core.runtime import distributed
from a5core.runtime.settings import Settings

BACKENDS = ("auto", "vllm", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample: a backend-neutral subset of ``vllm.SamplingParams`` (see the module docstring).

    ``stop`` may be given as any sequence of non-empty strings; it is stored as a tuple.
    Invalid values raise ``ValueError`` (or ``TypeError`` for a wrong type) naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    min_tokens: int = 0
    stop: tuple[str, ...] = ("</answer>",)
    seed: int | None = None
    logprobs: bool = False

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths()
        if isinstance(self.stop, str):
            raise TypeError(f"stop must be a sequence of strings, not a single string: use stop=({self.stop!r},)")
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must contain only non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {self.logprobs!r}")

    def _check_sampling(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {self.top_p!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def _check_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# The engines' own sampling defaults: the settings below that pass a value straight to an engine take their
# default from here, so the two cannot disagree.
ENGINE_SAMPLING = SamplingSettings()


class SamplingFields(Settings):
    """How responses are sampled, as a run's settings (the stop strings come with the prompt template)."""

    temperature: float = Field(
        ENGINE_SAMPLING.temperature, ge=0, allow_inf_nan=False, description="sampling temperature (0: greedy)"
    )
    max_tokens: int = Field(ENGINE_SAMPLING.max_tokens, ge=1, description="response cap")

    def engine_settings(self, stop: Sequence[str], **overrides: Any) -> SamplingSettings:
        """These settings as SamplingSettings, with the prompt template's ``stop`` strings (and ``n``, ``seed``
        and the like from ``overrides``)."""
        return SamplingSettings(temperature=self.temperature, max_tokens=self.max_tokens, stop=tuple(stop), **overrides)


class RolloutSamplingFields(SamplingFields):
    """Sampling for training rollouts, which may not stop before ``min_tokens``."""

    min_tokens: int = Field(4, ge=0, description="minimum response tokens (no stop before)")

    @model_validator(mode="after")
    def _min_within_max(self) -> "RolloutSamplingFields":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def engine_settings(self, stop: Sequence[str], **overrides: Any) -> SamplingSettings:
        return super().engine_settings(stop, min_tokens=self.min_tokens, **overrides)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt.

    ``text`` includes the stop string when generation stopped on one; ``token_ids`` are the generated
    ids (ending with the EOS id when EOS stopped it); ``finish_reason`` is ``"stop"`` (stop string or
    EOS) or ``"length"`` (``max_tokens``); ``log_probs`` has one fp32 value per ``token_ids`` entry when
    ``SamplingSettings.logprobs`` was set, else None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    log_probs: tuple[float, ...] | None = None


@runtime_checkable
class Engine(Protocol):
    """What the training loops and evaluation need from a rollout backend."""

    def generate(self, prompts: Sequence[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """``len(prompts)`` lists of ``sampling.n`` completions each, in prompt order."""
        ...

    def load_weights(self, policy_model: torch.nn.Module) -> None:
        """Copy a training policy's current weights (same architecture, HF names) into the engine."""
        ...

    def release_memory(self) -> bool:
        """Free the GPU memory the engine keeps in this process between calls (the hf engine's compiled
        KV cache; the next ``generate`` builds it again); True if it freed any. A training pass that ran
        out of memory asks it before running again (:meth:`a5core.runtime.token_budget.TokenBudget.retrying`)."""
        ...


def full_weights(model: torch.nn.Module) -> Any:
    """What ``load_weights`` takes of a training ``model``: the model itself in one process (with LoRA adapters,
    the merged model: :class:`a5core.policy.lora.MergedPolicy`); with several ranks, an object whose
    ``state_dict()`` holds every tensor whole, on the model's device (a collective: every rank calls it; each
    rank's engine gets a full copy)."""
    if has_adapters(model):
        return MergedPolicy(model)
    return distributed.whole(model)


def check_prompts(prompts: Sequence[str]) -> list[str]:
    """The prompts as a list, or a TypeError for a bare string / non-string items."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not a single string: wrap it in a list")
    prompts = list(prompts)
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must all be strings")
    return prompts


def resolve_dtype(dtype: str | torch.dtype, device_type: str) -> torch.dtype:
    """``"auto"`` → bfloat16 on CUDA, float32 elsewhere (CPUs here lack fast bf16); names → torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)} or a torch.dtype")
    return getattr(torch, dtype)
