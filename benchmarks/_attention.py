"""The static decode step's attention over the cache, the engine's beside the one it replaced, for the benchmarks:
``sdpa`` (:meth:`a5core.engines.static_decode.StaticKVDecoder._attend_cached`: one ``scaled_dot_product_attention``
call a layer, each key/value head's G query heads as the query rows) and ``matmul`` (the engine's until the sixth
measurement of ``benchmarks/RESULTS.md``: scores, mask, fp32 softmax, weighted sum — four kernels a layer over fp32
scores), so that earlier tables can be made again. The same attention to float rounding."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

ATTENTIONS = ("sdpa", "matmul")


def matmul_attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attend_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """:meth:`StaticKVDecoder._attend_cached` as four kernels: q (b, K, G, D), keys and values (b, K, W, D),
    attend_mask (b, W) bool → (b, K, G, D). Scores and softmax in fp32."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # (b, K, G, W)
    scores = scores.masked_fill(~attend_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values)


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[None]:
    """Within the block, every static decode step attends with ``name`` (decoders and compiled graphs made in it:
    reset torch.compile's caches between settings, as the benchmarks do)."""
    from a5core.engines.static_decode import StaticKVDecoder

    if name not in ATTENTIONS:
        raise ValueError(f"attention {name!r}: expected one of {ATTENTIONS}")
    engine = StaticKVDecoder.__dict__["_attend_cached"]
    if name == "matmul":
        StaticKVDecoder._attend_cached = staticmethod(matmul_attend)
    try:
        yield
    finally:
        StaticKVDecoder._attend_cached = engine


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--attentions``: the settings' decode attentions, the engine's by default."""
    parser.add_argument(
        "--attentions",
        nargs="+",
        choices=ATTENTIONS,
        default=["sdpa"],
        help="the decode step's cache attention: the engine's (sdpa) or the four-kernel one it replaced (matmul)",
    )
