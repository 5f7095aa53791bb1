"""benchmarks/_attention.py: the candidate decode attention the benchmarks put beside today's gives the model's
own logits too, and today's comes back after the block."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._attention import use_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
def test_each_attention_gives_the_full_forward_logits_with_left_padding(name):
    from test_static_decode import _tiny, check_left_padded_decode

    from a5core.rollout.static_decode import StaticKVDecoder

    today = StaticKVDecoder._attend_cached
    with use_attention(name):
        check_left_padded_decode(_tiny("qwen2"), narrow_every_other=True)  # 4 query heads over 2 key/value heads
    assert StaticKVDecoder._attend_cached is today


def test_an_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention 'flash': expected one of"):
        with use_attention("flash"):
            pass
