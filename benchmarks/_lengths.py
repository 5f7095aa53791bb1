"""Realistic response lengths for the benchmarks: each rollout ends at a length drawn from a seeded
distribution (log-uniform between ``low`` and ``high`` tokens: many short responses, a long tail), instead
of every row running to ``max_tokens``.

Random weights never write EOS or a stop string on their own, so the lengths are forced: the engine's
sampler is wrapped to emit EOS in each row at its drawn length (the benchmarks set ``min_tokens`` =
``max_tokens``, so no row ends earlier by chance). The decode loop then runs as it does on real
responses: until its longest row ends, finished rows fed padding.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator

import torch


def drawn_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths, log-uniform in [low, high], seeded."""
    rng = random.Random(seed)
    return [min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high)))))) for _ in range(count)]


@contextlib.contextmanager
def forced_lengths(engine, low: int, high: int, seed: int = 0) -> Iterator[list[int]]:
    """While open, every chunk ``engine`` (an :class:`a5core.rollout.hf.HFEngine`) decodes ends each row at
    a drawn length (a new draw per chunk: seed, seed + 1, …). Yields the list of every length drawn."""
    drawn: list[int] = []
    state = {"lengths": None}
    decode, sample = engine._decode_static, engine._sample

    def decode_static(input_ids, attention_mask, s):
        lengths = drawn_lengths(input_ids.shape[0], low, min(high, s.max_tokens), seed + len(drawn))
        drawn.extend(lengths)
        state["lengths"] = torch.tensor(lengths, device=input_ids.device)
        return decode(input_ids, attention_mask, s)

    def sample_then_end(logits, s, step, eos):
        token = sample(logits, s, step, eos)
        lengths = state["lengths"]
        ends = torch.zeros_like(token, dtype=torch.bool)
        ends[: lengths.shape[0]] = lengths == step + 1  # rows past the chunk (padding) are finished anyway
        return torch.where(ends, eos[0], token)

    engine._decode_static, engine._sample = decode_static, sample_then_end
    try:
        yield drawn
    finally:
        engine._decode_static, engine._sample = decode, sample
