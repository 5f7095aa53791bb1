"""vLLM on CUDA, for real: the engine a GPU install generates with, beside the policy it trains.

Run on a GPU machine with vLLM's CUDA build (``pytest -m gpu``); skipped elsewhere. The planted tiny model of
tests/tiny_lm.py with one attention head of 64 (FlashAttention 3's smallest head size) writes
" the answer is </answer> ..." greedily by wide margins, so bf16 greedy decoding must agree with the policy's
own token for token. The engine sleeps between calls (``sleep_when_idle``) as it does beside a training
policy, so every test also runs through sleep and wake-up. Log-probs agree to bf16 tolerance: the engine
computes its logits in bf16, the policy here too (same GPU, other kernels).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_lm import STOP, build_tiny_lm, pushed_variant

from a5core.engines import SamplingSettings, make_engine
from a5core.policy.causal_lm import get_response_log_probs, load_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
KV_TOKENS = 64 * 1024  # the KV cache the engine is sized for, as the flows size it for their rollouts
BF16_LOG_PROB_TOL = 0.1  # bf16 logits of ~8 are spaced 1/32 apart; two kernels' roundings add up


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, shared_data):
    return build_tiny_lm(tmp_path_factory.mktemp("tiny_lm_gpu"), shared_data / "math" / "train.jsonl", heads=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    pytest.importorskip("vllm")
    engine = make_engine(
        str(model_dir),
        "vllm",
        max_model_len=1024,
        gpu_memory_utilization=0.2,
        sleep_when_idle=True,
        kv_cache_tokens=KV_TOKENS,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def policy(model_dir):
    """The policy in bf16 on the GPU (fresh each module: tests that train copy it first)."""
    model, tokenizer = load_policy(model_dir)
    return model.to("cuda", torch.bfloat16).eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(shared_data) -> list[str]:
    with open(shared_data / "math" / "train.jsonl") as f:
        return [json.loads(line)["problem"] for _, line in zip(range(6), f, strict=False)] + ["What is 2+2?"]


def greedy_ids(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[int, ...]:
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tuple(out[0, ids.shape[1] :].tolist())


def policy_log_probs(model, tokenizer, prompt: str, token_ids) -> torch.Tensor:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + list(token_ids)], device=model.device)
    with torch.no_grad():
        values = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"][0]
    return values[len(prompt_ids) - 1 :].float().cpu()


def test_greedy_rows_equal_the_policys_greedy_decode(engine, policy, prompts):
    model, tokenizer = policy
    settings = SamplingSettings(temperature=0, max_tokens=40, stop=(), logprobs=True)
    for prompt, (completion,) in zip(prompts, engine.generate(prompts, settings), strict=True):
        assert completion.token_ids == greedy_ids(model, tokenizer, prompt, 40)
        assert completion.finish_reason == "length"
        expected = policy_log_probs(model, tokenizer, prompt, completion.token_ids)
        assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=BF16_LOG_PROB_TOL)


def test_stop_string_cuts_the_text_and_n_samples_differ(engine, prompts):
    groups = engine.generate(prompts, SamplingSettings(n=4, temperature=1.0, max_tokens=120, seed=3))
    assert [len(group) for group in groups] == [4] * len(prompts)
    stopped = [c for group in groups for c in group if c.finish_reason == "stop"]
    assert stopped and all(c.text.endswith(STOP) and c.text.count(STOP) == 1 for c in stopped)
    assert all(len({c.token_ids for c in group}) > 1 for group in groups)  # p ≈ 0.75 a step: samples differ


def test_seeded_sampling_is_reproducible_and_batch_independent(engine, prompts):
    settings = SamplingSettings(n=2, temperature=1.0, max_tokens=48, seed=11)
    first = engine.generate(prompts, settings)
    assert engine.generate(prompts, settings) == first
    assert engine.generate(prompts[-2:], settings) == first[-2:]
    assert engine.generate(prompts, SamplingSettings(n=2, temperature=1.0, max_tokens=48, seed=12)) != first


def test_push_makes_the_engine_follow_the_policy(engine, policy, prompts):
    """Noise on every weight of a copy and EOS planted after </answer>: after the push the engine decodes what
    the pushed copy decodes, with its log-probs; pushing the original back restores the original output."""
    model, tokenizer = policy
    pushed = pushed_variant(model, tokenizer)
    settings = SamplingSettings(temperature=0, max_tokens=30, stop=(), logprobs=True)
    before = engine.generate(prompts, settings)
    engine.load_weights(pushed)
    try:
        after = engine.generate(prompts, settings)
        assert after != before
        for prompt, (completion,) in zip(prompts, after, strict=True):
            assert completion.token_ids == greedy_ids(pushed, tokenizer, prompt, 30)
            assert completion.token_ids[-1] == tokenizer.eos_token_id and completion.finish_reason == "stop"
            expected = policy_log_probs(pushed, tokenizer, prompt, completion.token_ids)
            assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=BF16_LOG_PROB_TOL)
    finally:
        engine.load_weights(model)
    assert [g[0].token_ids for g in engine.generate(prompts, settings)] == [g[0].token_ids for g in before]


def test_push_after_an_optimizer_step_changes_the_output(engine, policy, prompts):
    """A few AdamW steps teach an fp32 copy to end with EOS after </answer>; pushed, the engine does too."""
    model, tokenizer = policy
    trained = copy.deepcopy(model).float().train()
    target = " the answer is </answer>"
    ids = tokenizer([p + target for p in prompts], add_special_tokens=False)["input_ids"]
    optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-2)
    for _ in range(30):
        loss = 0.0
        for row in ids:
            row = torch.tensor([row + [tokenizer.eos_token_id]], device="cuda")
            loss = loss - get_response_log_probs(trained, row[:, :-1], row[:, 1:])["log_probs"][0, -1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    settings = SamplingSettings(temperature=0, max_tokens=30, stop=())
    before = engine.generate(prompts, settings)
    engine.load_weights(trained)
    try:
        after = engine.generate(prompts, settings)
        assert after != before
        bf16 = copy.deepcopy(trained).to(torch.bfloat16).eval()
        for prompt, (completion,) in zip(prompts, after, strict=True):
            assert completion.token_ids == greedy_ids(bf16, tokenizer, prompt, 30)
    finally:
        engine.load_weights(model)


def test_the_engine_releases_its_kv_cache_between_calls(engine, prompts):
    """The KV cache holds the tokens it was sized for, not all of the engine's share; asleep between calls (what a
    training pass sees), the engine holds neither KV cache nor weights."""
    config = engine.llm.llm_engine.vllm_config
    kv_tokens = config.cache_config.num_gpu_blocks * config.cache_config.block_size
    assert KV_TOKENS * 0.9 <= kv_tokens <= KV_TOKENS * 1.1
    kv_bytes = kv_tokens * 2 * 2 * 1 * 64 * 2  # 2 layers × (key + value) × 1 head × 64 × bf16
    engine.generate(prompts[:1], SamplingSettings(temperature=0, max_tokens=4))
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    engine._wake(("weights", "kv_cache"))
    free_awake = torch.cuda.mem_get_info()[0]
    engine._sleep()
    assert free_asleep - free_awake >= 0.9 * kv_bytes
