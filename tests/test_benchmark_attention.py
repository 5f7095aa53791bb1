"""benchmarks/_attention.py: the candidate decode attention the benchmarks put beside today's gives the model's
own logits too, and today's comes back after the block."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._attention import use_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["matmul", "sdpa"])
def test_each_attention_gives_the_full_forward_logits_with_left_padding(name):
    from test_static_decode import _tiny

    from a5core.rollout.static_decode import StaticKVDecoder

    model = _tiny("qwen2")  # 4 query heads over 2 key/value heads
    torch.manual_seed(1)
    lengths = [5, 3, 1]  # left-padded to 5
    prompt = torch.randint(0, 61, (3, 5))
    valid = torch.arange(5)[None, :] >= (5 - torch.tensor(lengths))[:, None]
    continuation = torch.randint(0, 61, (3, 4))
    today = StaticKVDecoder._attend_cached
    with use_attention(name):
        decoder = StaticKVDecoder(model, batch_size=3, capacity=12)
        attend = torch.zeros(3, 12, dtype=torch.bool)
        attend[:, :5] = valid
        steps = [decoder.prefill(prompt, valid)]
        for t in range(4):
            attend[:, 5 + t] = True
            window = 5 + t + 1 if t % 2 else 12  # the filled columns, or the whole cache
            steps.append(decoder.decode(continuation[:, t], valid.sum(-1) + t, 5 + t, attend[:, :window]))
    assert StaticKVDecoder._attend_cached is today
    for row, n in enumerate(lengths):
        ids = torch.cat([prompt[row, 5 - n :], continuation[row]])[None]
        with torch.no_grad():
            want = model(ids).logits[0, n - 1 :].float()
        torch.testing.assert_close(torch.stack([step[row] for step in steps]), want, rtol=1e-4, atol=1e-4)


def test_an_unknown_attention_is_refused():
    with pytest.raises(ValueError, match="attention 'flash': expected one of"):
        with use_attention("flash"):
            pass
