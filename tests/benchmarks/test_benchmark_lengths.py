"""benchmarks/_lengths.py: the benchmarks' varied response lengths end each row where drawn."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._lengths import drawn_lengths, forced_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lengths_are_seeded_and_within_bounds():
    lengths = drawn_lengths(500, 30, 1024, seed=3)
    assert lengths == drawn_lengths(500, 30, 1024, seed=3) and lengths != drawn_lengths(500, 30, 1024, seed=4)
    assert min(lengths) >= 30 and max(lengths) <= 1024
    assert sum(n < 177 for n in lengths) > 200  # log-uniform: the geometric middle, sqrt(30·1024) ≈ 175, halves it


def test_every_row_ends_at_its_drawn_length(tiny_tokenizer):
    from tiny_loops import make_model

    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine

    engine = HFEngine(make_model(tiny_tokenizer), tiny_tokenizer, batch_size=6)
    sampling = SamplingSettings(temperature=1.0, min_tokens=24, max_tokens=24, n=3, seed=0, stop=())
    with forced_lengths(engine, 4, 24, seed=0) as drawn:
        groups = engine.generate(["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?", "Name a prime."], sampling)
    completions = [c for group in groups for c in group]
    assert [len(c.token_ids) for c in completions] == drawn and len(drawn) == 12  # two chunks of 6
    assert all(c.finish_reason == ("length" if n == 24 else "stop") for c, n in zip(completions, drawn, strict=True))
    plain = engine.generate(["What is 1 + 1?"], sampling)  # closed: the engine is itself again
    assert all(len(c.token_ids) == 24 for c in plain[0])
