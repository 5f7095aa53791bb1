"""The static decode step's attention over the cache, today's beside a candidate, for the benchmarks: ``matmul``
(:meth:`a5core.rollout.static_decode.StaticKVDecoder._attend_cached`: scores, mask, softmax, weighted sum — four
kernels a layer over fp32 scores) and ``sdpa`` (one ``scaled_dot_product_attention`` call a layer: each key/value
head's G query heads as G query rows of one attention, so no grouped-query support is needed, and a fused
kernel reads each cached key and value once). The same attention to float rounding."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

ATTENTIONS = ("matmul", "sdpa")


def sdpa_attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:meth:`StaticKVDecoder._attend_cached` as one fused attention: q (b, K, G, D), keys and values (b, K, W, D),
    attend_mask (b, W) bool → (b, K, G, D)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=attend_mask[:, None, None, :], scale=scaling)


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[None]:
    """Within the block, every static decode step attends with ``name`` (decoders and compiled graphs made in it:
    reset torch.compile's caches between settings, as the benchmarks do)."""
    from a5core.rollout.static_decode import StaticKVDecoder

    if name not in ATTENTIONS:
        raise ValueError(f"attention {name!r}: expected one of {ATTENTIONS}")
    today = StaticKVDecoder.__dict__["_attend_cached"]
    if name == "sdpa":
        StaticKVDecoder._attend_cached = staticmethod(sdpa_attend)
    try:
        yield
    finally:
        StaticKVDecoder._attend_cached = today


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--attentions``: the settings' decode attentions, today's by default."""
    parser.add_argument(
        "--attentions", nargs="+", choices=ATTENTIONS, default=["matmul"], help="the decode step's cache attention"
    )
