"""The static-KV-cache decoder: the model's own logits, step by step, with left padding; the engine's
loop on it gives what ``model.generate`` gives; compiled and eager agree."""

import pytest
import torch
from decode_checks import check_left_padded_decode, tiny_decoder_model

from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.engines.static_decode import StaticKVDecoder, supports

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "mistral"])
def test_prefill_and_decode_give_the_full_forward_logits(model_type):
    model = tiny_decoder_model(model_type)
    assert supports(model)
    check_left_padded_decode(model)


def test_fewer_rows_and_a_narrower_window_give_the_same_logits():
    """After two steps the cache's rows 3 and 1 move to the front (``compact``) and decode on as a batch of
    2 attending only the filled columns: each row's logits are still its own full forward's."""
    model = tiny_decoder_model("qwen2")
    torch.manual_seed(1)
    lengths = [5, 2, 4, 3]
    prompt = torch.randint(0, 61, (4, 5))
    valid = torch.arange(5)[None, :] >= (5 - torch.tensor(lengths))[:, None]
    continuation = torch.randint(0, 61, (4, 4))
    decoder = StaticKVDecoder(model, batch_size=4, capacity=16)
    attend = torch.zeros(4, 16, dtype=torch.bool)
    attend[:, :5] = valid
    steps = {row: [logits] for row, logits in enumerate(decoder.prefill(prompt, valid))}
    rows = torch.arange(4)
    for t in range(4):
        if t == 2:
            rows = torch.tensor([3, 1])
            decoder.compact(rows)
            attend = attend[rows]
        attend[:, 5 + t] = True
        window = 5 + t + 1  # the filled columns only
        out = decoder.decode(continuation[rows, t], valid[rows].sum(-1) + t, 5 + t, attend[:, :window])
        assert out.shape == (len(rows), 61)
        for row, logits in zip(rows.tolist(), out, strict=True):
            steps[row].append(logits)
    for row, n in enumerate(lengths):
        ids = torch.cat([prompt[row, 5 - n :], continuation[row, : len(steps[row]) - 1]])[None]
        with torch.no_grad():
            want = model(ids).logits[0, n - 1 :].float()
        torch.testing.assert_close(torch.stack(steps[row]), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit a 4×16 cache"):
        decoder.decode(continuation[:, 0], valid.sum(-1), 5, torch.ones(4, 17, dtype=torch.bool))


def test_unsupported_models_are_refused_by_name():
    model = tiny_decoder_model("mistral")
    model.config.sliding_window = 16
    assert not supports(model)
    with pytest.raises(ValueError, match="mistral"):
        StaticKVDecoder(model, 1, 8)
    with pytest.raises(ValueError, match="static_cache"):
        HFEngine(model, None, static_cache=True)


@pytest.fixture(scope="module")
def tiny_policy(tiny_lm_dir):
    from a5core.policy.causal_lm import load_policy

    return load_policy(tiny_lm_dir)


@pytest.fixture(scope="module")
def prompts(shared_data):
    import json

    with open(shared_data / "math" / "train.jsonl") as f:
        return [json.loads(line)["problem"] for _, line in zip(range(3), f, strict=False)] + ["What is 2+2?"]


CASES = [
    SamplingSettings(temperature=0, max_tokens=40),
    SamplingSettings(temperature=0, max_tokens=40, min_tokens=12),
    SamplingSettings(temperature=0, max_tokens=23, stop=("is </", "ans")),
    SamplingSettings(temperature=0, max_tokens=9, stop=()),
]


def test_static_loop_equals_transformers_generate(tiny_policy, prompts, monkeypatch):
    model, tokenizer = tiny_policy
    static = HFEngine(model, tokenizer, batch_size=3)
    plain = HFEngine(model, tokenizer, batch_size=3, static_cache=False)
    assert static.static_cache and not plain.static_cache and not static.compile
    calls = []
    monkeypatch.setattr(
        StaticKVDecoder, "prefill", lambda self, *a, _f=StaticKVDecoder.prefill: calls.append(1) or _f(self, *a)
    )
    for settings in CASES:
        assert static.generate(prompts, settings) == plain.generate(prompts, settings)
    assert calls  # the static loop really ran


def test_top_p_keeps_the_smallest_set_reaching_it(tiny_policy):
    engine = HFEngine(*tiny_policy)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, -1)
    no_eos = torch.tensor([], dtype=torch.long)
    torch.manual_seed(0)
    for top_p, support in [(0.5, {0}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        drawn = engine._sample(logits, SamplingSettings(top_p=top_p), 0, no_eos)
        assert set(drawn.tolist()) == support, top_p
    # min_tokens: EOS never drawn while blocked
    eos = torch.tensor([0])
    assert 0 not in engine._sample(logits, SamplingSettings(min_tokens=2), 1, eos).tolist()


@pytest.mark.parametrize("compiled", [False, True])
def test_gumbel_max_draws_from_the_tempered_softmax(compiled):
    """Temperature sampling's draws follow softmax(logits / T), eager and compiled (inductor's own random
    numbers), a masked (−inf) token is never drawn, and a seed repeats the draws."""
    from a5core.engines.hf import gumbel_max_sample

    draw = torch.compile(gumbel_max_sample, dynamic=True) if compiled else gumbel_max_sample
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])).expand(20000, -1).contiguous()
    for temperature in (1.0, 0.6):
        torch.manual_seed(0)
        drawn = draw(logits, temperature)
        expected = torch.softmax(logits[0] / temperature, dim=-1)
        frequency = torch.bincount(drawn, minlength=5).double() / len(drawn)
        assert (frequency - expected.double()).abs().max() < 0.015, (temperature, frequency, expected)
        assert frequency[4] == 0  # probability 0: never drawn
        torch.manual_seed(0)
        assert torch.equal(draw(logits, temperature), drawn)
    rows = draw(logits[:7], 1.0)  # another row count: the same compiled function
    assert rows.shape == (7,) and int(rows.max()) < 4


def test_compiled_loop_pads_the_chunk_and_agrees_with_eager(tiny_policy, prompts):
    """The compiled path (on CPU: inductor, no CUDA graph) pads 4 prompts to 8 rows and rounds the
    cache up; it reuses one decoder across calls whose lengths fit."""
    model, tokenizer = tiny_policy
    compiled = HFEngine(model, tokenizer, batch_size=8, compile=True, shrink=False)  # full size: the whole chunk
    eager = HFEngine(model, tokenizer, batch_size=8)
    assert eager.shrink and HFEngine(model, tokenizer, compile=True).shrink  # shrinking by default, compiled too
    for settings in CASES[:2]:
        assert compiled.generate(prompts, settings) == eager.generate(prompts, settings)
    decoder = compiled._decoder
    assert decoder.batch_size == 8 and decoder.capacity % 256 == 0
    compiled.generate(prompts[:1], CASES[3])
    assert compiled._decoder is decoder


def test_release_memory_frees_the_kept_decoder_and_the_next_call_builds_it_again(tiny_policy, prompts, monkeypatch):
    """The compiled engine keeps its decoder (its KV cache) between calls; ``release_memory`` frees it at once,
    its memory even where a reference to the cache outlives the decoder (True; False with none kept), and the
    next call builds a new one, which generates the same greedy rows; released during a generation, the cache
    that generation uses is left to it.
    torch.compile is the identity here (inductor takes ~30 s on the CPU; the tests around this one compile)."""
    import weakref

    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    model, tokenizer = tiny_policy
    engine = HFEngine(model, tokenizer, batch_size=8, compile=True)
    assert not engine.release_memory()  # nothing kept yet
    before = engine.generate(prompts, CASES[0])
    cache = weakref.ref(engine._decoder.keys[0])
    held = engine._decoder.values[0]  # as a compiled step's CUDA graphs may hold their inputs
    assert held.untyped_storage().nbytes() > 0
    assert engine.release_memory() and engine._decoder is None
    assert cache() is None  # freed now, not at some later garbage collection
    assert held.untyped_storage().nbytes() == 0  # its memory too, though a reference outlives the decoder
    assert not engine.release_memory()
    assert engine.generate(prompts, CASES[0]) == before
    assert engine._decoder is not None  # built again, and kept

    # released while a generation is in progress (as from another thread): that generation ends unharmed
    prefill = StaticKVDecoder.prefill

    def prefill_then_release(decoder, *args):
        logits = prefill(decoder, *args)
        assert engine.release_memory()
        return logits

    monkeypatch.setattr(StaticKVDecoder, "prefill", prefill_then_release)
    assert engine.generate(prompts, CASES[0]) == before


def test_the_compiled_shrinking_loop_compiles_once(tiny_tokenizer):
    """Rows, then widths, change as rows end at drawn lengths: the decode step is compiled once for all
    shapes, and the compiled loop generates what the eager one does."""
    import sys
    from pathlib import Path

    from tiny_loops import make_model
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from benchmarks._lengths import forced_lengths

    model = make_model(tiny_tokenizer, hidden=64, layers=2)
    prompts = [f"What is {a} + {b}?" for a, b in [(1, 1), (2, 2), (3, 9), (4, 7), (12, 5), (6, 6), (8, 1), (9, 30)]]
    greedy = SamplingSettings(temperature=0, min_tokens=300, max_tokens=300, stop=())
    torch._dynamo.reset()
    counters.clear()
    outputs, graphs = [], []
    for compile, shrink in [(True, True), (False, True), (True, False)]:  # the last: today's full-size decode
        engine = HFEngine(model, tiny_tokenizer, batch_size=8, compile=compile, shrink=shrink)
        with forced_lengths(engine, 4, 300, seed=2):
            outputs.append(engine.generate(prompts, greedy))
        graphs.append(counters["stats"]["unique_graphs"])
    assert outputs[0] == outputs[1] == outputs[2]
    assert graphs == [1, 1, 2]  # one compilation each


def test_shrinking_rows_and_window_changes_no_row(tiny_tokenizer, monkeypatch):
    """Rows ending at drawn lengths (4 to 300 tokens, 8 a chunk): the shrinking loop runs 8, 4, then 2 rows and
    attends 256 then all 313 columns, and every row generates what it generates in the full-size loop."""
    import sys
    from pathlib import Path

    from tiny_loops import make_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from benchmarks._lengths import forced_lengths

    model = make_model(tiny_tokenizer, hidden=64, layers=2)
    prompts = [f"What is {a} + {b}?" for a, b in [(1, 1), (2, 2), (3, 9), (4, 7), (12, 5), (6, 6), (8, 1), (9, 30)]]
    greedy = SamplingSettings(temperature=0, min_tokens=300, max_tokens=300, stop=())
    shapes = []
    decode = StaticKVDecoder.decode
    monkeypatch.setattr(
        StaticKVDecoder,
        "decode",
        lambda self, t, p, slot, attend: shapes.append(attend.shape) or decode(self, t, p, slot, attend),
    )
    outputs = {}
    for shrink in (True, False):
        engine = HFEngine(model, tiny_tokenizer, batch_size=8, shrink=shrink)
        shapes.clear()
        with forced_lengths(engine, 4, 300, seed=2) as drawn:
            outputs[shrink] = engine.generate(prompts, greedy)
        outputs[shrink, "shapes"] = sorted(set(shapes))
    assert outputs[True] == outputs[False]
    assert [len(c.token_ids) for g in outputs[True] for c in g] == drawn
    capacity = outputs[False, "shapes"][0][1]
    assert outputs[False, "shapes"] == [(8, capacity)] and capacity > 256
    rows = {b for b, _ in outputs[True, "shapes"]}
    widths = {w for _, w in outputs[True, "shapes"]}
    assert rows == {8, 4, 2} and widths == {256, capacity}


def test_sampled_rows_ending_on_stop_strings_shrink_the_loop(tiny_policy, prompts, monkeypatch):
    """Sampled rows that end on a stop string at different steps (found at the read-backs): the loop drops
    them and runs fewer rows; every row still ends at its first stop string or at max_tokens, and the same
    seed gives the same completions."""
    model, tokenizer = tiny_policy
    compactions = []
    compact = StaticKVDecoder.compact
    monkeypatch.setattr(
        StaticKVDecoder, "compact", lambda self, keep: compactions.append(len(keep)) or compact(self, keep)
    )
    engine = HFEngine(model, tokenizer, batch_size=16)
    first_compactions = []
    for seed in range(4):  # whether half the rows end by a read-back depends on the draws: several seeds
        compactions.clear()
        settings = SamplingSettings(temperature=1.0, max_tokens=64, seed=seed, n=4, stop=("</answer>",))
        groups = engine.generate(prompts, settings)
        first_compactions.append(compactions[:1])
        assert groups == engine.generate(prompts, settings)
        completions = [c for group in groups for c in group]
        for c in completions:
            if c.finish_reason == "stop":
                assert c.text.endswith("</answer>") and c.text.count("</answer>") == 1, c.text
            else:
                assert len(c.token_ids) == 64 and "</answer>" not in c.text, c.text
        assert len({len(c.token_ids) for c in completions}) > 4  # they did end at different steps
    assert [8] in first_compactions, first_compactions  # 16 rows, then 8


def test_the_loop_hands_the_decoder_its_cache_column_as_a_device_tensor(tiny_policy, prompts, monkeypatch):
    """Each step's cache column reaches ``decode`` as a tensor already on the model's device, counting up
    from the prompt length: made from a Python int it was a host-to-device copy at every step, and such a
    copy waits for the GPU (on the H200 half of each decode step was spent waiting there)."""
    model, tokenizer = tiny_policy
    slots = []
    decode = StaticKVDecoder.decode
    monkeypatch.setattr(
        StaticKVDecoder,
        "decode",
        lambda self, tokens, positions, slot, mask: slots.append(slot) or decode(self, tokens, positions, slot, mask),
    )
    engine = HFEngine(model, tokenizer, batch_size=4)
    prompt_len = max(len(tokenizer(p)["input_ids"]) for p in prompts[:4])
    engine.generate(prompts[:4], SamplingSettings(temperature=0, max_tokens=6, min_tokens=6, stop=()))
    assert all(isinstance(s, torch.Tensor) and s.device == model.device for s in slots)
    assert [int(s) for s in slots] == [prompt_len + step for step in range(5)]  # 6 tokens: 5 decode steps
