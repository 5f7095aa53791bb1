"""The hf engine's temperature sampler, today's beside the one before, for the benchmarks: ``gumbel-max``
(:func:`a5core.engines.hf.gumbel_max_sample`, compiled with the decode step: what the engine does) and
``multinomial`` (softmax of logits / T, then ``torch.multinomial``: the engine's sampler until Gumbel-max).
Both draw from the same distribution; they draw other tokens for the same seed."""

from __future__ import annotations

import argparse

import torch

SAMPLERS = ("multinomial", "gumbel-max")


def softmax_multinomial(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """One draw per row from softmax(logits / temperature): (B, V) → (B,), the way the engine drew before."""
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1).squeeze(-1)


def use_sampler(engine, name: str):
    """``engine`` (an :class:`a5core.engines.hf.HFEngine`) drawing temperature samples with sampler ``name``."""
    if name not in SAMPLERS:
        raise ValueError(f"sampler {name!r}: expected one of {SAMPLERS}")
    if name == "multinomial":
        engine._temperature_draw = softmax_multinomial
    return engine


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--samplers``: the settings' temperature samplers, both by default."""
    parser.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS), help="temperature sampler")
