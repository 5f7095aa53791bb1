"""One GPU for the training policy and a vLLM engine that sleeps while it trains: how much the engine may take
while awake, and how large a KV cache the rollouts need.

Sizes, not guesses: the policy's share is what its weights, gradients and optimizer state will take (counted
from the model's config), the engine's what is free beside that, and its KV cache what the run's rollout batch
takes at once (a prompt allowance plus ``max_tokens`` per sequence).
"""

from __future__ import annotations

import torch

from a5core.engines.engine import ENGINE_SAMPLING

PROMPT_TOKENS = 1024  # a rollout's prompt, as the KV cache is sized (MATH problems in r1_zero: under 600)
MAX_SEQUENCES = 512  # sequences the KV cache holds at once; more wait their turn
GIB = 2**30


def colocated_memory_fraction(free_bytes: int, total_bytes: int, reserve_bytes: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for an engine that shares its GPU with a policy it sleeps beside.

    vLLM counts the fraction of the GPU's *total* memory, and refuses to start when less than that is free;
    its share is what is free now less ``reserve_bytes`` (what the policy will still allocate and keep while
    the engine is awake: its weights if not yet loaded, gradients, optimizer state, a margin). ValueError,
    naming the three figures, when that leaves the engine under 1 GiB.
    """
    share = free_bytes - reserve_bytes
    if share < GIB:
        raise ValueError(
            f"the rollout engine cannot share this GPU with the policy: {free_bytes / GIB:.1f} GiB free of "
            f"{total_bytes / GIB:.1f} GiB, and the policy needs {reserve_bytes / GIB:.1f} GiB; use a smaller model, "
            "lora_rank > 0 (adapters only in the optimizer), or give the engine a GPU of its own (engine_device)"
        )
    return share / total_bytes


def kv_bytes_per_token(model: str, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in ``model`` (a folder or hub id) at ``dtype``: a key and a value of
    ``head_dim`` per key/value head per layer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model, trust_remote_code=False)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


POLICY_MARGIN = 2 * GIB  # what a policy holds on the GPU beyond its states: activations of a micro-batch, fragments


def policy_reserve_bytes(model: str, policy_dtype: str, *, lora: bool = False, reference: bool = False) -> int:
    """What the training policy of ``model`` (a folder or hub id) will hold on the GPU beside an awake engine:
    its weights in ``policy_dtype``, their gradients and AdamW's two fp32 moments (of the adapters alone under
    ``lora``: counted as 2% of the weights), a frozen ``reference`` copy for a KL penalty, and
    :data:`POLICY_MARGIN` more."""
    from a5core.policy.model_specs import parameter_count

    count = parameter_count(model)
    weight = 2 if policy_dtype == "bfloat16" else 4
    trained = count // 50 if lora else count
    return count * weight + trained * (weight + 8) + (count * weight if reference else 0) + POLICY_MARGIN


def rollout_tokens(sequences: int | None, max_tokens: int | None) -> int:
    """Tokens of KV cache a run's rollouts take at once: its batch of ``sequences`` (None: 256; at most
    :data:`MAX_SEQUENCES`, more wait their turn) times ``max_tokens`` (None: the engines' default) plus
    :data:`PROMPT_TOKENS`."""
    return min(sequences or 256, MAX_SEQUENCES) * ((max_tokens or ENGINE_SAMPLING.max_tokens) + PROMPT_TOKENS)
