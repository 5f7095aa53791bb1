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


def _wrapper_state(engine) -> dict:
    """The engine's one sampler wrapper (made on first need), and where it finds the current decoder's lengths:
    the engine's compiled token step traces the sampler, so it must stay the same objects from one block to the
    next (a new wrapper would be a new compilation each time a block opens)."""
    state = engine.__dict__.get("_forced_lengths_state")
    if state is None:
        state = engine._forced_lengths_state = {"buffer": None}

        def sample_then_end(logits, draw, count):
            token = type(engine)._sample(engine, logits, draw, count)
            return torch.where(state["buffer"][: token.shape[0]] == count + 1, engine.eos_ids[0], token)

        state["sample"] = sample_then_end
    return state


def _lengths_buffer(decoder) -> torch.Tensor:
    """``decoder``'s buffer of row lengths (one per decoder, at a fixed address: the compiled step reads it)."""
    buffer = decoder.__dict__.get("forced_lengths")
    if buffer is None:
        buffer = torch.zeros(decoder.batch_size, dtype=torch.long, device=decoder.keys[0].device)
        if decoder.compiled:
            torch._dynamo.mark_static_address(buffer)
        decoder.forced_lengths = buffer
    return buffer


@contextlib.contextmanager
def forced_lengths(engine, low: int, high: int, seed: int = 0) -> Iterator[list[int]]:
    """While open, every chunk ``engine`` (an :class:`a5core.engines.hf.HFEngine`) decodes ends each row at
    a drawn length (a new draw per chunk: seed, seed + 1, …), wherever the loop moves the row
    (``StaticKVDecoder.compact``). Yields the list of every length drawn. The lengths live in a buffer per decoder,
    refilled in place for each chunk and moved with the decoder's rows."""
    drawn: list[int] = []
    state = _wrapper_state(engine)
    decode, make_decoder = engine._decode_static, engine._static_decoder
    lengths: list[int] = []
    decoders = []

    def decode_static(input_ids, attention_mask, s):
        lengths[:] = drawn_lengths(input_ids.shape[0], low, min(high, s.max_tokens), seed + len(drawn))
        drawn.extend(lengths)
        return decode(input_ids, attention_mask, s)

    def static_decoder(rows, needed):
        decoder = make_decoder(rows, needed)
        buffer = state["buffer"] = _lengths_buffer(decoder)
        buffer.zero_()  # rows past the chunk: finished anyway
        buffer[: len(lengths)] = torch.tensor(lengths, device=buffer.device)

        def compact(keep):
            buffer[: keep.shape[0]] = buffer.index_select(0, keep)
            type(decoder).compact(decoder, keep)

        decoder.compact = compact
        decoders.append(decoder)
        return decoder

    saved = {name: engine.__dict__.get(name) for name in ("_decode_static", "_sample", "_static_decoder")}
    engine._decode_static, engine._sample, engine._static_decoder = decode_static, state["sample"], static_decoder
    try:
        yield drawn
    finally:
        for name, value in saved.items():  # the engine's own methods again (or what was set on it before)
            if value is None:
                engine.__dict__.pop(name, None)
            else:
                setattr(engine, name, value)
        for decoder in decoders:
            decoder.__dict__.pop("compact", None)
