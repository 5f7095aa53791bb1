"""What one decode step of a Llama-family model must move and compute: the floor under its time on a card.

For a step at batch ``b`` with ``c`` filled cache columns per row (the prompt and the tokens so far):

- bytes: every matmul weight read once (the layers' projections and MLPs, and the output head, which a tied
  embedding reads a second time); the ``b`` embedding rows gathered; the KV cache's filled columns read
  (``b·c·L·2·K·D`` elements) and the new column written; the norms' weights; the logits written in fp32 and
  read back by the sampler;
- FLOPs: 2 per multiply-add of every matmul weight and row (``2·W·b``), and the attention's scores and weighted
  sum (``4·b·L·H·D·c``).

The card allows ``max(bytes / bandwidth, FLOPs / peak)``: at decode batch sizes the weights and the cache, not
the arithmetic, set the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCost:
    """A decode step's traffic by part (bytes) and its FLOPs."""

    weights: float
    cache: float
    logits: float
    flops: float
    attention_flops: float  # of ``flops``: the attention's scores and weighted sum

    @property
    def bytes(self) -> float:
        return self.weights + self.cache + self.logits

    def floor_ms(self, bandwidth: float, peak: float) -> float:
        """The time the card allows, in ms: ``bandwidth`` in bytes/s (read + written), ``peak`` in FLOP/s."""
        return max(self.bytes / bandwidth, self.flops / peak) * 1e3

    def floors_by_kind(self, bandwidth: float, peak: float) -> dict[str, float]:
        """The floor of the step's matmuls (the weights) and of its attention (the cache), in ms: what each kind
        of kernel in a profile is measured against."""
        return {
            "matmul": max(self.weights / bandwidth, (self.flops - self.attention_flops) / peak) * 1e3,
            "attention": max(self.cache / bandwidth, self.attention_flops / peak) * 1e3,
        }


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def decode_step_cost(config: Any, batch: int, context: int, dtype_bytes: int = 2, logits_bytes: int = 4) -> StepCost:
    """The bytes and FLOPs of one decode step of the model ``config`` describes (a transformers config or its
    dict) at ``batch`` rows with ``context`` filled cache columns, weights and cache in ``dtype_bytes``-byte
    elements (bf16: 2) and logits in ``logits_bytes``."""
    hidden, inter = _get(config, "hidden_size"), _get(config, "intermediate_size")
    layers, heads = _get(config, "num_hidden_layers"), _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads", heads)
    head_dim = _get(config, "head_dim") or hidden // heads
    vocab = _get(config, "vocab_size")
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter
    matmul_weights = layers * (attention + mlp) + vocab * hidden  # the output head read in full
    norms = (2 * layers + 1) * hidden
    weights = (matmul_weights + norms + batch * hidden) * dtype_bytes  # + the embedding rows gathered
    per_column = layers * 2 * kv_heads * head_dim * dtype_bytes  # keys and values of all layers, one row's column
    cache = batch * (context + 1) * per_column  # the filled columns read, the new one written
    logits = 2 * batch * vocab * logits_bytes  # written by the head, read by the sampler
    attention_flops = 4 * batch * layers * heads * head_dim * context
    return StepCost(weights, cache, logits, 2 * matmul_weights * batch + attention_flops, attention_flops)
