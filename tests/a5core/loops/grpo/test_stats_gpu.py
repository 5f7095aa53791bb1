"""The train/inference mismatch on a GPU at learning rate 0, for each engine (hf; vLLM when installed): over
several GRPO steps the engine mismatch every step logs (``mismatch_*``, :class:`a5core.loops.grpo.stats.EngineMismatch`)
stays within bf16's bounds, the policy in fp32 master weights under bf16 autocast (the flows' default) and the
engine in bf16 beside it on the same GPU, as the flows place them. Prints each step's numbers.

    pytest -m gpu tests/a5core/loops/grpo/test_stats_gpu.py

Self-contained: the planted tiny model of tests/tiny_lm.py (one attention head of 64, FlashAttention 3's smallest
head size) with a tokenizer trained on arithmetic text written here, so no data folder is needed. Skipped without
CUDA; the vLLM case without vLLM.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_lm import build_tiny_lm

from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.engines import make_engine
from a5core.loops.grpo import GRPOConfig, grpo
from a5core.policy.causal_lm import load_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 4
# The bounds, each step. Per token, bf16 logits near the planted logit ~8 are spaced 1/32 apart: the engine's
# rounding and the trainer's bf16 products add up to ~0.06, so |d| ≤ 0.1 (d = log π_train − log π_engine; the
# per-token tolerance of test_vllm_gpu). Over a step's ~2.5k response tokens the roundings mostly cancel:
# |mean d| ≤ 0.01, and k3 ≤ 1e-3 (an rms d of 0.045). No token's ratio reaches 2 (d ≥ ln 2). For scale: an hf
# engine in bf16 on the CPU, this model, fp32 policy: max d 8e-4, k3 8e-8; one on weights off by noise of 0.05:
# max d > 1, k3 ~0.7; the same engine in fp32 on the CPU: max d 1e-6.
MAX_ABS_LOG_RATIO = 0.1
MAX_ABS_MEAN_LOG_RATIO = 0.01
MAX_K3 = 1e-3
PROBLEMS = [Problem(f"p{i}", f"What is {i} + {i % 7}?", str(i + i % 7)) for i in range(64)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The planted tiny model and a BPE tokenizer trained on arithmetic text written here."""
    directory = tmp_path_factory.mktemp("mismatch_gpu")
    rng = random.Random(0)
    words = "the answer is of a and to we find that sum product number value let then so which equals total".split()
    with (directory / "corpus.jsonl").open("w") as corpus:
        for _ in range(400):
            a, b, filler = rng.randrange(100), rng.randrange(100), " ".join(rng.choices(words, k=12))
            problem = f"What is {a} + {b}? {filler}"
            solution = f"We add {a} and {b}: {filler}. <think> {a} + {b} = {a + b} </think> <answer> {a + b} </answer>"
            corpus.write(json.dumps({"problem": problem, "solution": solution}) + "\n")
    return build_tiny_lm(directory / "model", directory / "corpus.jsonl", heads=1)


def length_reward(response: str, ground_truth: str) -> dict[str, float]:
    """Rewards that differ within a group, so every step has advantages and a gradient (which lr 0 discards)."""
    reward = float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


def engine_for(backend: str, model_dir):
    if backend == "hf":
        return make_engine(str(model_dir), "hf")  # bf16 on CUDA, compiled static-cache decode
    pytest.importorskip("vllm")
    return make_engine(
        str(model_dir),
        "vllm",
        max_model_len=1024,
        gpu_memory_utilization=0.2,
        sleep_when_idle=True,
        kv_cache_tokens=64 * 1024,
    )


@pytest.mark.usefixtures("learning_rate_0")
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_at_learning_rate_0_the_mismatch_stays_within_bf16s_bounds(backend, model_dir, capsys):
    policy, tokenizer = load_policy(model_dir, dtype=torch.float32, device="cuda")
    engine = engine_for(backend, model_dir)
    config = GRPOConfig(
        n_grpo_steps=STEPS,
        rollout_batch_size=256,
        group_size=8,
        train_batch_size=256,
        gradient_accumulation_steps=4,
        min_tokens=4,
        max_tokens=128,
        eval_every=0,
        checkpoint_every=0,
    )
    try:
        history = grpo(policy, tokenizer, engine, PROBLEMS, load_prompt("r1_zero"), length_reward, config)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    with capsys.disabled():
        for step in history:
            print(
                f"\n{backend} step {step['step']}: mean d {step['mismatch_log_ratio_mean']:+.3e}, max d "
                f"{step['mismatch_log_ratio_max']:+.3e}, k3 {step['mismatch_kl_k3']:.3e}, over cap "
                f"{step['mismatch_over_cap']:.3g}, responses of {step['response_tokens_mean']:.1f} tokens",
                end="",
            )
        print()
    assert len(history) == STEPS
    for step in history:
        assert abs(step["mismatch_log_ratio_mean"]) <= MAX_ABS_MEAN_LOG_RATIO, step
        assert abs(step["mismatch_log_ratio_max"]) <= MAX_ABS_LOG_RATIO, step
        assert 0 <= step["mismatch_kl_k3"] <= MAX_K3, step
        assert step["mismatch_over_cap"] == 0, step
