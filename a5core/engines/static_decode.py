"""A batched decoder with a preallocated KV cache for Llama-family models, made for CUDA graphs.

``transformers``' ``generate`` is launch-bound on a GPU: each decode step launches hundreds of small
kernels, grows its cache by concatenation and, for grouped-query attention with a padding mask, copies
every cached key and value once per query head. This decoder runs the model's own modules (norms,
projections, MLPs, rotary embedding: the weights stay the model's) over a static cache of fixed shape,
so one decode step has fixed shapes and addresses and ``torch.compile(mode="reduce-overhead")`` can
capture it as one CUDA graph. Grouped-query attention reads each cached key/value head once, in one fused
attention call a layer.

A decode step need not cost the whole cache: it runs the first ``b`` rows of the cache and attends to its
first ``W`` columns, ``b`` and ``W`` read from its inputs' shapes. The caller keeps ``W`` to the filled
columns (rounded up to a few widths) and, as rows finish, moves the unfinished ones to the front
(:meth:`StaticKVDecoder.compact`) and runs fewer rows (halving: a few row counts). The step is compiled
once, ``b`` and ``W`` symbolic; each (``b``, ``W``) is one more CUDA graph of it, recorded when first met.

Shapes: ``B`` rows (sequences), ``P`` prompt positions (left-padded), ``C`` cache capacity
(prompt + new tokens), ``K`` key/value heads of ``D`` dims, ``G`` query heads per
key/value head, ``V`` vocabulary entries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def supports(model: Any) -> bool:
    """True when ``model`` is a Llama-family causal LM this decoder reproduces exactly (no sliding window)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False
    if model_type == "qwen2":  # Qwen2 configs carry a sliding_window size that only use_sliding_window enables
        return not getattr(config, "use_sliding_window", False)
    return getattr(config, "sliding_window", None) is None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (halves convention). x: (B, heads, T, D); cos, sin: (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticKVDecoder:
    """Prefill and one-token decode steps over a KV cache of ``batch_size`` × ``capacity`` positions.

    ``compile``: capture :meth:`decode` with ``torch.compile(mode="reduce-overhead")`` (CUDA graphs);
    ``varying``: the calls' rows and widths vary (compiled once with both symbolic, one CUDA graph per
    shape); False: every call has the whole cache's shape (compiled for exactly that shape).
    Not thread-safe; one generation at a time.
    """

    def __init__(self, model: Any, batch_size: int, capacity: int, *, compile: bool = False, varying: bool = False):
        if not supports(model):
            raise ValueError(
                f"StaticKVDecoder supports {', '.join(SUPPORTED_MODEL_TYPES)} models without sliding "
                f"windows, not {getattr(model.config, 'model_type', type(model).__name__)!r}"
            )
        self.model, self.inner = model, model.model
        self.batch_size, self.capacity = batch_size, capacity
        config = model.config
        attention = self.inner.layers[0].self_attn
        self.head_dim = attention.head_dim
        self.kv_heads = config.num_key_value_heads
        self.groups = config.num_attention_heads // config.num_key_value_heads
        weight = self.inner.embed_tokens.weight
        # One tensor per layer, not views of one stacked tensor: an in-place write into a view of a
        # graph input is compiled as a copy of the whole input (measured: 2 ms per layer per step).
        # One column more than the capacity, never attended: no window is then the whole cache, so every
        # window is a strided view of the same layout and the step compiles once, not once more for W = C.
        shape = (batch_size, self.kv_heads, capacity + 1, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in self.inner.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        if compile:
            for cache in (*self.keys, *self.values):
                torch._dynamo.mark_static_address(cache)
            self._decode = torch.compile(self._decode_step, mode="reduce-overhead", dynamic=None if varying else False)
        else:
            self._decode = self._decode_step
        self.compiled, self.varying = compile, varying

    # ------------------------------------------------------------------------------------ steps

    def _layer(
        self, index: int, layer: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend
    ) -> torch.Tensor:
        """Decoder layer ``index`` on hidden (B, T, H). ``attend(index, scaling, q, k, v)`` with q (B, heads, T, D)
        and k, v (B, K, T, D) after the rotary embedding stores k, v in the cache and returns (B, T, heads·D)."""
        attn = layer.self_attn
        b, t, _ = hidden.shape
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        hidden = hidden + attn.o_proj(attend(index, attn.scaling, q, k, v))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden state (B, H) → fp32 logits (B, V)."""
        return self.model.lm_head(self.inner.norm(hidden)).float()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Run left-padded prompts (B, P), ``valid`` (B, P) bool, into cache positions [0, P).

        Returns the fp32 logits (B, V) of each row's last position. Padding positions attend only to
        themselves (finite values, never attended by real tokens).
        """
        b, p = input_ids.shape
        if b != self.batch_size or p >= self.capacity:
            raise ValueError(f"prefill of {b}×{p} tokens does not fit a {self.batch_size}×{self.capacity} cache")
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(p, p, dtype=torch.bool, device=input_ids.device).tril()
        mask = (causal & valid[:, None, :]) | torch.eye(p, dtype=torch.bool, device=input_ids.device)
        mask = mask[:, None]  # (B, 1, P, P)

        def attend(index, scaling, q, k, v):
            self.keys[index][:, :, :p] = k
            self.values[index][:, :, :p] = v
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # (B, heads, P, D)
            return out.transpose(1, 2).reshape(b, p, -1)

        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        for index, layer in enumerate(self.inner.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, attend)
        return self._logits(hidden[:, -1])

    def _decode_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, attend_mask: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`decode`'s step, unchecked and uncompiled (``slot``: a (1,) long tensor): what :meth:`decode`
        compiles, and what :class:`a5core.engines.token_loop.TokenLoop` calls inside its own compiled token step."""
        b, window = attend_mask.shape
        rows = torch.arange(b, device=tokens.device)[:, None]
        heads = torch.arange(self.kv_heads, device=tokens.device)[None, :]

        def attend(index, scaling, q, k, v):
            # written through the whole cache tensor (a graph input), never through a view of it: an in-place
            # write into a view of a graph input is compiled as a copy of the whole input
            self.keys[index].index_put_((rows, heads, slot), k[:, :, 0])
            self.values[index].index_put_((rows, heads, slot), v[:, :, 0])
            keys, values = self.keys[index][:b, :, :window], self.values[index][:b, :, :window]
            q = q.reshape(b, self.kv_heads, self.groups, self.head_dim)  # one query position
            return self._attend_cached(q, keys, values, attend_mask, scaling).reshape(b, 1, -1)  # (b, 1, heads·D)

        hidden = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(hidden, positions[:, None])
        for index, layer in enumerate(self.inner.layers):
            hidden = self._layer(index, layer, hidden, cos, sin, attend)
        return self._logits(hidden[:, -1])

    @staticmethod
    def _attend_cached(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend_mask: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """One query position per row over W cached columns: q (b, K, G, D) — each key/value head's G query
        heads —, keys and values (b, K, W, D), attend_mask (b, W) bool → (b, K, G, D).

        One fused attention call a layer: each key/value head's G query heads are G query rows of one attention,
        so no grouped-query support is needed and each cached key and value is read once (fp32 accumulation).
        Faster than scores, mask, fp32 softmax and weighted sum as four kernels (``benchmarks/RESULTS.md``, "one
        fused attention call in the decode step")."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attend_mask[:, None, None, :], scale=scaling)

    @torch.no_grad()
    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot: int | torch.Tensor, attend_mask: torch.Tensor
    ) -> torch.Tensor:
        """One new token for each of the cache's first ``b`` rows: tokens (b,) at rotary ``positions`` (b,)
        written to cache column ``slot``; ``attend_mask`` (b, W) bool: which of the first ``W`` cache columns
        each row attends to (its own ``slot`` included, so ``slot`` < ``W``). Returns fp32 logits (b, V),
        valid until the next call. ``slot`` as a Python int is copied to the device, and on CUDA that copy
        waits for the work queued before it: a loop passes a (1,) long tensor already on the device."""
        b, window = attend_mask.shape
        slot = torch.as_tensor(slot, dtype=torch.long, device=tokens.device).reshape(1)
        if b > self.batch_size or window > self.capacity or tokens.shape != (b,):
            raise ValueError(
                f"decode of {tuple(tokens.shape)} tokens attending {b}×{window} does not fit a "
                f"{self.batch_size}×{self.capacity} cache"
            )
        if self.compiled and self.varying:
            for tensor in (tokens, positions, attend_mask):  # one compiled graph for every (b, W), not one each
                for dim, size in enumerate(tensor.shape):
                    if size > 1:  # sizes 0 and 1 are always specialised
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)
            torch.compiler.cudagraph_mark_step_begin()
        return self._decode(tokens, positions, slot, attend_mask)

    def free(self) -> None:
        """Free the cache's memory now, whoever still refers to its tensors (a compiled step's CUDA graphs may
        keep them, as graph inputs, after this decoder is dropped). The decoder cannot decode after."""
        for cache in (*self.keys, *self.values):
            cache.untyped_storage().resize_(0)
        self.keys, self.values = [], []

    @torch.no_grad()
    def compact(self, keep: torch.Tensor) -> None:
        """Move cache rows ``keep`` (n,) to rows [0, n), in that order (the rows after n keep stale values).
        The next :meth:`decode` calls then run n rows (or fewer)."""
        for cache in (*self.keys, *self.values):
            cache[: keep.shape[0]] = cache.index_select(0, keep)
