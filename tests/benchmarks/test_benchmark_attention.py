"""benchmarks/_attention.py: the engine's decode attention and the one it replaced, which the benchmarks put
beside it, both give the model's own logits, and the engine's comes back after the block."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._attention import matmul_attend, use_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["sdpa", "matmul"])
def test_each_attention_gives_the_full_forward_logits_with_left_padding(name):
    from decode_checks import check_left_padded_decode, tiny_decoder_model

    from a5core.engines.static_decode import StaticKVDecoder

    engine = StaticKVDecoder._attend_cached
    with use_attention(name):
        check_left_padded_decode(
            tiny_decoder_model("qwen2"), narrow_every_other=True
        )  # 4 query heads over 2 key/value heads
    assert StaticKVDecoder._attend_cached is engine


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_engine_attention_matches_the_four_kernel_one_over_masked_columns(dtype, tolerance):
    from a5core.engines.static_decode import StaticKVDecoder

    generator = torch.Generator().manual_seed(0)
    b, kv_heads, groups, width, dims = 3, 2, 3, 11, 8
    q = torch.randn(b, kv_heads, groups, dims, generator=generator).to(dtype)
    keys, values = (torch.randn(b, kv_heads, width, dims, generator=generator).to(dtype) for _ in range(2))
    attend = torch.rand(b, width, generator=generator) < 0.6
    attend[:, -1] = True  # each row attends at least its own column
    engine = StaticKVDecoder._attend_cached(q, keys, values, attend, dims**-0.5)
    assert engine.shape == (b, kv_heads, groups, dims)
    torch.testing.assert_close(engine, matmul_attend(q, keys, values, attend, dims**-0.5), atol=tolerance, rtol=0)
    # a masked column changes nothing: the engine reads only the attended ones
    values_elsewhere = values.masked_fill(~attend[:, None, :, None], 1e3)
    torch.testing.assert_close(
        StaticKVDecoder._attend_cached(q, keys, values_elsewhere, attend, dims**-0.5), engine, atol=tolerance, rtol=0
    )


def test_an_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention 'flash': expected one of"):
        with use_attention("flash"):
            pass
