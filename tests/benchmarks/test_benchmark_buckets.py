"""benchmarks/_buckets.py: the shrinking decode with each (rows, width) bucket compiled as a static shape, the
candidate the benchmarks put beside today's, generates what the eager loop does, one graph per bucket."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._buckets import StaticBucketDecoder, decode_mode  # noqa: E402
from benchmarks._lengths import forced_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_each_bucket_compiles_once_and_the_loop_generates_what_eager_does(tiny_tokenizer):
    from tiny_loops import make_model
    from torch._dynamo.utils import counters

    import a5core.engines.hf as hf
    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from a5core.engines.static_decode import StaticKVDecoder

    model = make_model(tiny_tokenizer, hidden=64, layers=2)
    prompts = [f"What is {a} + {b}?" for a, b in [(1, 1), (2, 2), (3, 9), (4, 7), (12, 5), (6, 6), (8, 1), (9, 30)]]
    greedy = SamplingSettings(temperature=0, min_tokens=300, max_tokens=300, stop=())
    eager = HFEngine(model, tiny_tokenizer, batch_size=8)
    with forced_lengths(eager, 4, 300, seed=2):  # rows 8, 4, then 2; widths 256, then the whole cache
        want = eager.generate(prompts, greedy)
    torch._dynamo.reset()
    counters.clear()
    with decode_mode("shrinking-static") as shrink:
        engine = HFEngine(model, tiny_tokenizer, batch_size=8, compile=True, shrink=shrink)
        with forced_lengths(engine, 4, 300, seed=2):
            got = engine.generate(prompts, greedy)
    assert shrink and isinstance(engine._decoder, StaticBucketDecoder) and hf.StaticKVDecoder is StaticKVDecoder
    assert got == want
    assert counters["stats"]["unique_graphs"] == 4  # (8, 256), (8, all), (4, all), (2, all): one each


def test_the_other_modes_leave_the_engine_as_it_is():
    with decode_mode("full") as shrink:
        assert shrink is False
    with decode_mode("shrinking") as shrink:
        assert shrink is True
    with pytest.raises(ValueError, match="decode 'paged': expected one of"):
        with decode_mode("paged"):
            pass
