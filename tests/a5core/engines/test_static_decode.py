"""The static-KV-cache decoder: the model's own logits, step by step, with left padding; the engine's
loop on it gives what ``model.generate`` gives; compiled and eager agree."""

import pytest
import torch
from decode_checks import check_left_padded_decode, tiny_decoder_model

from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.engines.static_decode import StaticKVDecoder, supports
from a5core.engines.token_loop import Draw, TokenLoop

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
    no_eos = torch.zeros(4, dtype=torch.bool)
    torch.manual_seed(0)
    for top_p, support in [(0.5, {0}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        drawn = engine._sample(logits, Draw.of(SamplingSettings(top_p=top_p), no_eos), 0)
        assert set(drawn.tolist()) == support, top_p
    # min_tokens: EOS never drawn while blocked (token 1 of at least 2), drawn after (token 2, as a device count)
    eos = torch.tensor([True, False, False, False])
    blocked = Draw.of(SamplingSettings(min_tokens=2, top_p=0.5), eos)
    assert set(engine._sample(logits, blocked, 1).tolist()) == {1}
    assert set(engine._sample(logits, blocked, torch.tensor([2])).tolist()) == {0}
    for greedy in (Draw.of(SamplingSettings(temperature=0, min_tokens=2), eos), blocked):  # greedy, and top-p
        greedy.greedy = True
        assert set(engine._sample(logits, greedy, torch.tensor([1])).tolist()) == {1}


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
    step = TokenLoop.step
    monkeypatch.setattr(TokenLoop, "step", lambda self, b, w: shapes.append((b, w)) or step(self, b, w))
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


def old_draw(logits: torch.Tensor, s: SamplingSettings, step: int, eos: torch.Tensor) -> torch.Tensor:
    """The old loop's sampler (``HFEngine._sample`` before the token step)."""
    from a5core.engines.hf import gumbel_max_sample

    if step < s.min_tokens and eos.numel():
        logits = logits.index_fill(-1, eos, float("-inf"))
    if s.greedy:
        return logits.argmax(-1)
    if s.top_p >= 1.0:
        return gumbel_max_sample(logits, s.temperature)
    probs = torch.softmax(logits / s.temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= s.top_p
    probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1).squeeze(-1)


def old_static_loop(engine: HFEngine, input_ids, attention_mask, s: SamplingSettings):
    """The hf engine's static loop as it was before its token step (commit 608655a, eager): each token's draw and
    bookkeeping as separate operations around ``StaticKVDecoder.decode``, three read-backs a stop check. The
    reference that the token step must reproduce draw for draw on the uncompiled path."""
    from a5core.engines.hf import CAPACITY_STEP, ROW_HALVINGS, STOP_CHECK_EVERY

    real, prompt_len = input_ids.shape
    decoder = StaticKVDecoder(engine.model, real, prompt_len + s.max_tokens)
    valid = attention_mask.bool()
    attend = torch.zeros(real, decoder.capacity, dtype=torch.bool)
    attend[:, :prompt_len] = valid
    positions = valid.sum(-1)
    generated = torch.full((real, s.max_tokens), engine.pad_id, dtype=torch.long)
    sampled = torch.zeros((real, s.max_tokens), dtype=torch.float32)
    live = torch.arange(real)
    finished = torch.zeros(real, dtype=torch.bool)
    flagged = torch.zeros(real, dtype=torch.bool)
    eos = torch.tensor(engine.eos_ids, dtype=torch.long)
    candidates = engine._stop_candidates(tuple(s.stop)) if s.stop else None
    logits = decoder.prefill(input_ids, valid)
    steps = 0
    for step in range(s.max_tokens):
        token = torch.where(finished, engine.pad_id, old_draw(logits, s, step, eos))
        generated[live, step] = token
        sampled[live, step] = logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        finished |= torch.isin(token, eos)
        if s.stop:
            size = len(candidates) if candidates is not None else 0
            flagged |= True if candidates is None else candidates[token.clamp(max=size - 1)] | (token >= size)
        steps = step + 1
        if steps == s.max_tokens:
            break
        if steps % STOP_CHECK_EVERY == 0:
            for row in (flagged & ~finished).nonzero().flatten().tolist():
                ids = generated[live[row], :steps].tolist()
                if engine._stop_cut(ids, engine._decode(ids), s) is not None:
                    finished[row] = True
            flagged.zero_()
            if bool(finished.all()):
                break
            half, unfinished = len(live) // 2, (~finished).nonzero().flatten()
            if half >= max(2, real >> ROW_HALVINGS) and len(unfinished) <= half:
                keep = torch.cat([unfinished, finished.nonzero().flatten()])[:half]
                decoder.compact(keep)
                token, positions, attend, live, finished, flagged = (
                    x[keep] for x in (token, positions, attend, live, finished, flagged)
                )
        attend[:, prompt_len + step] = True
        width = min(decoder.capacity, -(-(prompt_len + step + 1) // CAPACITY_STEP) * CAPACITY_STEP)
        logits = decoder.decode(token, positions + step, prompt_len + step, attend[:, :width].contiguous())
    return generated[:, :steps].tolist(), sampled[:, :steps].tolist() if s.logprobs else None


@pytest.mark.parametrize("batch_size", [16, 6])
def test_the_token_step_draws_what_the_old_loop_drew(tiny_policy, prompts, monkeypatch, batch_size):
    """Seeded sampling (temperature, top-p, EOS held back by min_tokens, stop strings — one ending in whitespace, so
    every row is checked —, log-probs, rows dropped as they end, several chunks): uncompiled, the token step and
    its one read-back a check give exactly the completions and log-probs of the loop it replaced, token for token."""
    model, tokenizer = tiny_policy
    engine = HFEngine(model, tokenizer, batch_size=batch_size)
    cases = [
        SamplingSettings(n=4, temperature=1.0, max_tokens=64, seed=seed, logprobs=True, stop=("</answer>",))
        for seed in range(3)
    ] + [
        SamplingSettings(n=4, temperature=0.7, top_p=0.8, max_tokens=48, min_tokens=9, seed=5, logprobs=True),
        SamplingSettings(n=4, temperature=1.2, top_p=0.95, max_tokens=40, seed=1, stop=("is ", "ans")),
        SamplingSettings(temperature=0, max_tokens=40, min_tokens=12, logprobs=True),
        SamplingSettings(n=2, temperature=1.0, max_tokens=33, min_tokens=33, seed=4, stop=()),
    ]
    compactions = []
    compact = StaticKVDecoder.compact
    monkeypatch.setattr(StaticKVDecoder, "compact", lambda self, k: compactions.append(len(k)) or compact(self, k))
    new = [engine.generate(prompts, s) for s in cases]
    assert compactions  # rows were dropped on the way
    monkeypatch.setattr(engine, "_decode_static", lambda ids, mask, s: old_static_loop(engine, ids, mask, s))
    assert [engine.generate(prompts, s) for s in cases] == new


def test_a_token_is_one_call_that_reads_nothing_back(tiny_policy, prompts, monkeypatch):
    """Between two tokens the loop only calls the token step, and the token step reads nothing back from the
    device and copies nothing to it (no ``item``, ``tolist``, ``bool(tensor)``, ``nonzero``, no tensor made from
    Python values: on CUDA each of those waits for the queued steps); a stop check every ``STOP_CHECK_EVERY``
    tokens reads back once, and copies in only the rows a stop string ended or the rows kept."""
    from a5core.engines.hf import STOP_CHECK_EVERY

    model, tokenizer = tiny_policy
    events: list[str] = []

    def spy(name, function):
        def spied(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)

        return spied

    reads = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
    step, read_back = TokenLoop.step, TokenLoop.read_back
    engine = HFEngine(model, tokenizer, batch_size=16)
    cases = [
        SamplingSettings(n=4, temperature=1.0, max_tokens=64, seed=seed, logprobs=True, stop=("</answer>",))
        for seed in range(3)
    ] + [SamplingSettings(temperature=0, max_tokens=40, min_tokens=33, stop=("</answer>",))]
    compactions = 0
    for s in cases:
        with monkeypatch.context() as patch:
            for name in reads:
                patch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
            for name in ("tensor", "as_tensor", "from_numpy"):
                patch.setattr(torch, name, spy(f"torch.{name}", getattr(torch, name)))
            patch.setattr(TokenLoop, "step", lambda self, b, w: events.append("step") or step(self, b, w))
            patch.setattr(TokenLoop, "read_back", lambda self, *a: events.append("read") or read_back(self, *a))
            events.clear()
            engine.generate(prompts, s)
        steps = [i for i, e in enumerate(events) if e == "step"]
        assert len(steps) > STOP_CHECK_EVERY
        for number, (before, after) in enumerate(zip(steps, steps[1:], strict=False), start=2):
            between = events[before + 1 : after]  # after token `number - 1` was drawn, before token `number` is
            if number % STOP_CHECK_EVERY:
                assert between == [], (number, between)
            else:  # a stop check: one read-back (its one tolist), then copies in of ended or kept rows
                assert between[:2] == ["read", "tolist"], (number, between)
                assert set(between[2:]) <= {"torch.tensor"}, (number, between)
                compactions += len(between[2:])
    assert compactions  # the checks did end rows or drop them (and that copied them in)


def test_the_compiled_token_step_compiles_once_for_every_value_of_its_settings(tiny_policy, prompts):
    """Compiled (on CPU: inductor, no CUDA graph), the token step draws with its own random numbers, so it is checked
    in distribution, not against eager draws: a seed repeats its completions, the log-probs recorded are the
    policy's own for the tokens drawn, EOS is held back by min_tokens inside the step and ends the row after, greedy
    rows are the eager loop's; and temperature (greedy too), min_tokens, stop strings and log-probs on or off are
    values the step reads, one compilation for them all (top-p would be one more)."""
    import copy

    from tiny_lm import plant_eos_after_stop
    from torch._dynamo.utils import counters

    from a5core.policy.causal_lm import get_response_log_probs

    model, tokenizer = tiny_policy
    eos_model = copy.deepcopy(model)
    plant_eos_after_stop(eos_model, tokenizer)
    torch._dynamo.reset()
    counters.clear()
    engine = HFEngine(eos_model, tokenizer, batch_size=8, compile=True)
    sampled = SamplingSettings(n=2, temperature=1.0, max_tokens=40, seed=3, logprobs=True)
    first = engine.generate(prompts, sampled)
    assert engine.generate(prompts, sampled) == first
    for prompt, group in zip(prompts, first, strict=True):
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for completion in group:
            ids = torch.tensor([prompt_ids + list(completion.token_ids)])
            with torch.no_grad():
                want = get_response_log_probs(eos_model, ids[:, :-1], ids[:, 1:])["log_probs"][0, len(prompt_ids) - 1 :]
            assert torch.allclose(torch.tensor(completion.log_probs), want, atol=1e-4)
    # nearly greedy (the planted model: the loop, then EOS after its last token, the tenth): EOS waits for min_tokens
    for min_tokens in (0, 12):
        cold = SamplingSettings(n=2, temperature=0.05, max_tokens=40, min_tokens=min_tokens, seed=1, stop=())
        for group in engine.generate(prompts, cold):
            for completion in group:
                ids = completion.token_ids
                assert completion.finish_reason == "stop" and ids[-1] == tokenizer.eos_token_id
                assert len(ids) == 10 if min_tokens == 0 else len(ids) > 12 and tokenizer.eos_token_id not in ids[:-1]
    greedy = SamplingSettings(temperature=0, max_tokens=30, min_tokens=12, stop=("ans",), logprobs=True)
    compiled, eager = engine.generate(prompts, greedy), HFEngine(eos_model, tokenizer).generate(prompts, greedy)
    for (a,), (b,) in zip(compiled, eager, strict=True):  # the same tokens; log-probs to float rounding
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
