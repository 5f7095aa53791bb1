"""Per-token log-probs straight from the last hidden states: the LM head fused with the log-softmax.

A causal LM's logits are (B, T, V) with V ≈ 152k for Qwen: 5 GB in bf16 at 16×1024 tokens, and a plain
``log_softmax`` in fp32 holds several fp32 copies of that size (values, gradient). Here the head's matrix
product, the logsumexp and the gather run on chunks of ``chunk_tokens`` positions, and backward recomputes
each chunk's logits from the saved hidden states instead of keeping them, so at most one fp32
(chunk_tokens, V) block lives at a time:

    log p(y_t) = h_t·w_{y_t} − logsumexp_v(h_t·w_v)
    ∂/∂logits_t = g_t · (onehot(y_t) − softmax(logits_t))

Entropy (for logging) is computed from the same chunks in the forward pass, without a graph. On CUDA
the element-wise work of a chunk (upcast, logsumexp, gather, entropy; in backward softmax and the
one-hot difference) is compiled into fused kernels that read each (chunk, V) block once.
:func:`a5core.policy.causal_lm.get_response_log_probs` uses this for the model types in ``FUSABLE_MODEL_TYPES``.
"""

from __future__ import annotations

import torch

# Model types whose logits are exactly ``lm_head(final hidden state)`` (no bias, soft-capping or scaling).
FUSABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
CHUNK_TOKENS = 4096


def _chunk_forward(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    """logits (c, V) any float, labels (c,) → log-probs, logsumexp, entropy (c,) fp32 (entropy 0 unless asked)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels[:, None]).squeeze(-1) - lse
    if with_entropy:  # H = lse − Σ p·logits
        return log_probs, lse, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return log_probs, lse, torch.zeros_like(lse)


def _chunk_backward(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """∂loss/∂logits = g · (onehot(label) − softmax(logits)), in the logits' dtype:
    (c, V), (c,), (c,), (c,) → (c, V)."""
    probs = torch.exp(logits.float() - lse[:, None])
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == labels[:, None]
    return (grad[:, None] * (onehot.float() - probs)).to(logits.dtype)


_COMPILED: dict = {}


def _kernel(fn, tensor: torch.Tensor):
    """``fn`` compiled into fused kernels on CUDA (one pass over each (c, V) block), eager elsewhere."""
    if not tensor.is_cuda:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return _COMPILED[fn]


class _LinearLogProbs(torch.autograd.Function):
    """hidden (N, H), weight (V, H), labels (N,) → log-probs (N,) fp32, entropy (N,) fp32 (no gradient)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden, weight, labels, chunk_tokens, with_entropy):
        pieces = []
        forward_chunk = _kernel(_chunk_forward, hidden)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            pieces.append(forward_chunk(hidden[rows] @ weight.T, labels[rows], with_entropy))
        log_probs, logsumexp, entropy = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        ctx.save_for_backward(hidden, weight, labels, logsumexp)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")  # backward recomputes the logits under forward's autocast state
    def backward(ctx, grad_log_probs, _grad_entropy):
        hidden, weight, labels, logsumexp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        backward_chunk = _kernel(_chunk_backward, hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            logits = hidden[rows] @ weight.T  # recomputed: (c, V)
            grad_logits = backward_chunk(logits, logsumexp[rows], labels[rows], grad_log_probs[rows].float())
            del logits
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                grad_weight.add_(grad_logits.T @ hidden[rows])  # accumulated in fp32 over chunks
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    with_entropy: bool = False,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T)[labels] without materialising the logits.

    hidden: (..., H); weight: (V, H); labels: (...) → (log_probs (...) fp32 with gradient to hidden and
    weight, entropy (...) fp32 without gradient, or None unless ``with_entropy``).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens!r}")
    shape = labels.shape
    log_probs, entropy = _LinearLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_tokens, with_entropy
    )
    return log_probs.view(shape), entropy.view(shape) if with_entropy else None
