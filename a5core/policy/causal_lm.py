"""The policy: loading a causal LM, tokenising prompt/response pairs, per-token log-probs, the SFT train step
(GRPO's: :func:`a5core.handout.grpo_microbatch_train_step`).

Shapes: ``B`` sequences, ``T`` token positions (prompt + response − 1), ``V`` vocabulary entries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from a5core.policy.lm_head_log_probs import FUSABLE_MODEL_TYPES, linear_log_probs
from a5core.policy.losses import compute_entropy, masked_mean, masked_normalize

LOGPROB_CHUNK_TOKENS = 4096  # positions per chunk when reducing logits: bounds fp32 temporaries
# The loops' activation-memory budget for compiled layers: the share of activations kept for backward, the
# rest recomputed; it keeps the speed and cuts the peak memory (benchmarks/RESULTS.md, policy micro-batch step).
COMPILED_ACTIVATION_BUDGET = 0.8


def load_policy(
    model_name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a hub id (e.g. ``Qwen/Qwen2.5-Math-1.5B``), a local directory,
    or the embedded default (see :func:`a5core.policy.model_specs.resolve_model`).

    Never trusts remote code. A path-like argument that does not exist fails here with its name,
    instead of being sent to the hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a5core.policy.model_specs import resolve_model
    from a5core.runtime import progress

    progress.quiet_library_bars()
    name = resolve_model(model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    model, loading = AutoModelForCausalLM.from_pretrained(
        name, dtype=dtype, trust_remote_code=False, output_loading_info=True
    )
    missing = loading["missing_keys"]
    if missing:  # transformers starts them from random values, and says so only in a log table
        shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"model {name}: its weight files lack {len(missing)} of the weights its config.json asks for ({shown}); "
            "those would start from random values: copy the model folder again"
        )
    return model.to(device), tokenizer


def compiled_graphs() -> int:
    """How many graphs torch.compile has built in this process so far (its first compilation and every
    recompilation, e.g. for a new input shape)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_decoder_layers(model: Any, activation_memory_budget: float | None = None, one_graph: bool = False) -> Any:
    """``torch.compile`` each decoder layer of a transformers causal LM in place; returns the model.

    Inductor fuses each layer's norms, rotary embedding and activation and, in backward, recomputes
    those cheap element-wise results instead of keeping them: less activation memory and fewer kernel
    launches (benchmarks/policy_step.py). ``one_graph``: compile the whole decoder stack (embedding,
    layers, final norm; not the LM head) as one unit instead, which saves the per-layer Python overhead
    that dominates small micro-batches (benchmarks/grpo_step.py). ``activation_memory_budget`` (0–1,
    torch's partitioner setting, process-wide) keeps at most that fraction of the saved activations,
    recomputing the cheapest others in backward. Shapes may vary from call to call (dynamic after the
    first recompilation). Names, parameters and state dicts are unchanged; compiling a compiled model
    again changes nothing.
    """
    decoder = getattr(model, "model", None)
    if getattr(decoder, "layers", None) is None:
        raise ValueError(f"compile_decoder_layers needs a model with model.layers, not {type(model).__name__}")
    if activation_memory_budget is not None:
        if not 0 < activation_memory_budget <= 1:
            raise ValueError(f"activation_memory_budget must be in (0, 1], got {activation_memory_budget!r}")
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = activation_memory_budget
    for module in [decoder] if one_graph else decoder.layers:
        if getattr(module, "_compiled_call_impl", None) is None:  # once: EI calls the SFT loop every round
            module.compile()
    return model


def tokenize_prompt_and_output(
    prompt_strs: list[str], output_strs: list[str], tokenizer: Any, append_eos: bool = False
) -> dict[str, torch.Tensor]:
    """Tokenise each prompt and output separately (no special tokens), concatenate, right-pad.

    Returns input_ids (B, L−1) = ids[:, :-1], labels (B, L−1) = ids[:, 1:], and response_mask
    (B, L−1) bool, true where the label is an output token. L is the longest prompt+output length;
    padding uses the tokenizer's pad id (its eos id if it has no pad token). With ``append_eos`` each output
    is followed by the tokenizer's EOS token, a label in the response mask (:func:`output_ids`).
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"{len(prompt_strs)} prompts but {len(output_strs)} outputs")
    prompts = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    return pack_prompt_and_output_ids(prompts, output_ids(output_strs, tokenizer, append_eos), pad_id_of(tokenizer))


def output_ids(output_strs: Sequence[str], tokenizer: Any, append_eos: bool = False) -> list[list[int]]:
    """Each output's token ids (no special tokens), followed by the tokenizer's EOS id with ``append_eos`` (so a
    model trained on them learns to stop where an output ends); ValueError for a tokenizer without one."""
    outputs = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    if not append_eos:
        return outputs
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "append_eos: the tokenizer has no EOS token (eos_token_id is None) to end each response with; "
            "set append_eos false, or use a tokenizer that has one"
        )
    return [[*ids, tokenizer.eos_token_id] for ids in outputs]


WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / torch.compile wrappers around a policy


def checkpoint_name(name: str) -> str:
    """A parameter's name as transformers saves it: without DDP ``module.`` / torch.compile ``_orig_mod.``
    prefixes."""
    for prefix in WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer has neither a pad nor an eos token to pad with")
    return pad_id


def pack_prompt_and_output_ids(
    prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]], pad_id: int, pad_to_multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Concatenate token-id lists pairwise and right-pad: what :func:`tokenize_prompt_and_output` returns,
    from ids (e.g. the exact tokens an engine sampled). B pairs → input_ids, labels, response_mask (B, L−1),
    with L − 1 rounded up to a multiple of ``pad_to_multiple`` (padding: no label in the response mask)."""
    longest = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids, strict=True))
    length = -(-(longest - 1) // pad_to_multiple) * pad_to_multiple + 1
    ids = torch.full((len(prompt_ids), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), length), dtype=torch.bool)
    for row, (p, o) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        ids[row, : len(p) + len(o)] = torch.tensor([*p, *o], dtype=torch.long)
        mask[row, len(p) : len(p) + len(o)] = True
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": mask[:, 1:]}


def pad_positions(
    input_ids: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor, pad_id: int, multiple: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) input ids, labels and response mask right-padded to T rounded up to ``multiple`` (padding
    ids ``pad_id``, outside the response mask: no loss)."""
    extra = -(-input_ids.shape[1] // multiple) * multiple - input_ids.shape[1]
    if not extra:
        return input_ids, labels, response_mask
    pad = torch.nn.functional.pad
    ids, targets = pad(input_ids, (0, extra), value=pad_id), pad(labels, (0, extra), value=pad_id)
    return ids, targets, pad(response_mask, (0, extra))


def _chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] in fp32 for a chunk: (N, V), (N,) → (N,)."""
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = LOGPROB_CHUNK_TOKENS
) -> torch.Tensor:
    """Per-token log-probability of ``labels`` under ``logits``, without a full fp32 log-softmax.

    logits: (B, T, V) any float dtype; labels: (B, T) → (B, T) fp32. Works on chunks of positions,
    each recomputed in backward (activation checkpointing), so at most one fp32 (chunk, V) temporary
    lives at a time instead of several fp32 (B, T, V) copies.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    pieces = []
    for start in range(0, flat_labels.numel(), chunk_tokens):
        chunk = (flat_logits[start : start + chunk_tokens], flat_labels[start : start + chunk_tokens])
        if torch.is_grad_enabled() and logits.requires_grad:
            pieces.append(checkpoint(_chunk_log_probs, *chunk, use_reentrant=False))
        else:
            pieces.append(_chunk_log_probs(*chunk))
    return torch.cat(pieces).view(labels.shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_tokens: int = LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """Entropy of each position's next-token distribution, for logging (no graph).

    logits: (B, T, V) → (B, T) fp32, computed chunk by chunk in fp32.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])
    pieces = [compute_entropy(flat[s : s + chunk_tokens].float()) for s in range(0, flat.shape[0], chunk_tokens)]
    return torch.cat(pieces).view(logits.shape[:-1])


def get_response_log_probs(
    model: Any, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool = False
) -> dict[str, torch.Tensor]:
    """Per-token conditional log-probs log p(labels_t | input_ids_≤t) of a causal LM.

    input_ids, labels: (B, T) → {"log_probs": (B, T) fp32, "token_entropy": (B, T) fp32 if asked}.
    Entropy carries no gradient: it is for logging. For the model types in
    ``a5core.policy.lm_head_log_probs.FUSABLE_MODEL_TYPES`` the (B, T, V) logits are never materialised: the
    LM head is fused with the log-softmax (same values, a fraction of the memory).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    fusable = (
        getattr(model.config, "model_type", None) in FUSABLE_MODEL_TYPES
        and isinstance(head, torch.nn.Linear)
        and head.bias is None
    )
    if fusable:
        return _fused_response_log_probs(model, head, input_ids, labels, return_token_entropy)
    logits = model(input_ids, use_cache=False).logits
    result = {"log_probs": token_log_probs(logits, labels)}
    if return_token_entropy:
        result["token_entropy"] = token_entropy(logits)
    return result


def _fused_response_log_probs(
    model: Any, head: torch.nn.Linear, input_ids: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool
) -> dict[str, torch.Tensor]:
    """:func:`get_response_log_probs` with the head swapped, for one call, for the fused log-softmax.

    The swap happens inside the model's own forward, so wrappers that act around it (FSDP2 gathering the
    head's weight, autocast) act on the fused head too.
    """
    result: dict[str, torch.Tensor] = {}

    def fused_head(hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) → (B, T)
        log_probs, entropy = linear_log_probs(hidden, head.weight, labels, with_entropy=return_token_entropy)
        result["log_probs"] = log_probs
        if entropy is not None:
            result["token_entropy"] = entropy
        return log_probs

    head.forward = fused_head
    try:
        model(input_ids, use_cache=False)
    finally:
        del head.forward
    return result


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One SFT micro-batch: negative log-likelihood of the response tokens, then ``backward``.

    policy_log_probs, response_mask: (B, T). loss = −masked_normalize(log_probs, mask, constant,
    dim=−1).mean() / gradient_accumulation_steps. Returns (loss, metadata) with the loss already
    scaled for accumulation, as it was back-propagated.
    """
    per_sequence = masked_normalize(policy_log_probs, response_mask, normalize_constant, dim=-1)
    loss = -per_sequence.mean() / gradient_accumulation_steps
    loss.backward()
    return loss.detach(), {
        "response_tokens": response_mask.sum().detach(),
        "mean_log_prob": masked_mean(policy_log_probs.detach(), response_mask),
    }
