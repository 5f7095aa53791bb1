"""Realistic response lengths for the benchmarks: each rollout ends at a length drawn from a seeded
distribution (log-uniform between ``low`` and ``high`` tokens: many short responses, a long tail), instead
of every row running to ``max_tokens``.

Random weights never write EOS or a stop string on their own, so the lengths are forced: the engine's
sampler is wrapped to emit EOS in each row at its drawn length (the benchmarks set ``min_tokens`` =
``max_tokens``, so no row ends earlier by chance). The decode loop then runs as it does on real
responses: until its longest row ends, finished rows fed padding or (``shrink``) dropped.
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
    """While open, every chunk ``engine`` (an :class:`a5core.engines.hf.HFEngine`) decodes ends each row at
    a drawn length (a new draw per chunk: seed, seed + 1, …), wherever the loop moves the row
    (``StaticKVDecoder.compact``). Yields the list of every length drawn."""
    drawn: list[int] = []
    state = {"lengths": None}
    decode, sample, make_decoder = engine._decode_static, engine._sample, engine._static_decoder
    decoders = []

    def decode_static(input_ids, attention_mask, s):
        lengths = drawn_lengths(input_ids.shape[0], low, min(high, s.max_tokens), seed + len(drawn))
        drawn.extend(lengths)
        state["lengths"] = torch.tensor(lengths, device=input_ids.device)
        return decode(input_ids, attention_mask, s)

    def static_decoder(rows, needed):
        decoder = make_decoder(rows, needed)
        padding = decoder.batch_size - state["lengths"].shape[0]  # rows past the chunk: finished anyway
        state["lengths"] = torch.nn.functional.pad(state["lengths"], (0, padding))

        def compact(keep):
            state["lengths"] = state["lengths"][keep]
            type(decoder).compact(decoder, keep)

        decoder.compact = compact
        decoders.append(decoder)
        return decoder

    def sample_then_end(logits, s, step, eos):
        token = sample(logits, s, step, eos)
        return torch.where(state["lengths"][: token.shape[0]] == step + 1, eos[0], token)

    engine._decode_static, engine._sample, engine._static_decoder = decode_static, sample_then_end, static_decoder
    try:
        yield drawn
    finally:
        engine._decode_static, engine._sample, engine._static_decoder = decode, sample, make_decoder
        for decoder in decoders:
            decoder.__dict__.pop("compact", None)
