"""The shrinking decode with each (rows, width) bucket compiled as a static shape, for the benchmarks: a candidate
beside today's, where the decode step is compiled once with rows and width symbolic (``varying``) and runs slower
a step than the full-size step's static graph although it attends fewer columns (``benchmarks/RESULTS.md``, fourth
measurement). Here each bucket the loop meets (at most 5 row counts ×
capacity / 256 widths) is compiled and captured on its own, specialised to its shape, at the price of one
compilation per bucket."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

from a5core.engines.static_decode import StaticKVDecoder

DECODES = ("full", "shrinking", "shrinking-static")  # the benchmarks' --decodes
RECOMPILE_LIMIT = 64  # ≥ the buckets a loop can meet: torch.compile falls back to eager past its limit (8)


class StaticBucketDecoder(StaticKVDecoder):
    """:class:`StaticKVDecoder` compiled for exact shapes even when its calls' rows and width vary: one graph per
    (rows, width) met, each a new CUDA graph in the same tree (a step begins before each call)."""

    def __init__(self, model, batch_size: int, capacity: int, *, compile: bool = False, varying: bool = False):
        # ``varying`` (the engine passes shrink) is overridden: every shape is compiled as a static one
        super().__init__(model, batch_size, capacity, compile=compile, varying=False)

    def decode(self, tokens, positions, slot, attend_mask):
        if self.compiled:
            torch.compiler.cudagraph_mark_step_begin()
        return super().decode(tokens, positions, slot, attend_mask)


@contextlib.contextmanager
def decode_mode(name: str) -> Iterator[bool]:
    """Within the block, the hf engines made there decode as ``name`` says; yields their ``shrink`` setting."""
    import a5core.engines.hf as hf

    if name not in DECODES:
        raise ValueError(f"decode {name!r}: expected one of {DECODES}")
    if name != "shrinking-static":
        yield name == "shrinking"
        return
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        hf.StaticKVDecoder = StaticBucketDecoder
        try:
            yield True
        finally:
            hf.StaticKVDecoder = StaticKVDecoder


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--decodes``: the settings' decodes, full size and today's shrinking by default."""
    parser.add_argument(
        "--decodes",
        nargs="+",
        choices=DECODES,
        default=["full", "shrinking"],
        help="every step at full size, shrinking as rows finish (the engine's default), or shrinking with each "
        "(rows, width) bucket compiled as a static shape",
    )
