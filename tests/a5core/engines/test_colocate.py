"""Sharing one GPU between policy and vLLM (a5core.engines.colocate): the engine's share and its KV cache, on the CPU.

The sizes come from a model's config (counted on the meta device), so a tiny Qwen2 folder stands for the
1.5B model.
"""

from __future__ import annotations

import pytest
import torch

from a5core.engines.colocate import (
    GIB,
    MAX_SEQUENCES,
    PROMPT_TOKENS,
    colocated_memory_fraction,
    kv_bytes_per_token,
    policy_reserve_bytes,
    rollout_tokens,
)
from a5core.engines.engine import ENGINE_SAMPLING
from a5core.policy.model_specs import parameter_count


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 (4 layers, 2 key/value heads of 16) saved as config + random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    folder = tmp_path_factory.mktemp("colocate_model")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def test_parameter_count_is_the_models_own(model_dir):
    from transformers import AutoModelForCausalLM

    assert parameter_count(str(model_dir)) == AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer(model_dir):
    # 4 layers × (key + value) × 2 heads × head_dim 16 × 2 bytes
    assert kv_bytes_per_token(str(model_dir), torch.bfloat16) == 4 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token(str(model_dir), torch.float32) == 4 * 2 * 2 * 16 * 4


def test_policy_reserve_counts_weights_gradients_and_adam(model_dir):
    count = parameter_count(str(model_dir))
    assert policy_reserve_bytes(str(model_dir), "float32") == count * 16 + 2 * GIB  # 4 + 4 + 8 bytes a weight
    assert policy_reserve_bytes(str(model_dir), "bfloat16") == count * 12 + 2 * GIB
    assert policy_reserve_bytes(str(model_dir), "float32", reference=True) == count * 20 + 2 * GIB
    assert policy_reserve_bytes(str(model_dir), "float32", lora=True) == count * 4 + count // 50 * 12 + 2 * GIB


def test_engine_share_is_what_is_free_less_the_policy():
    assert colocated_memory_fraction(100 * GIB, 140 * GIB, 30 * GIB) == pytest.approx(70 / 140)
    with pytest.raises(ValueError, match=r"40\.0 GiB free of 140\.0 GiB, and the policy needs 39\.5 GiB"):
        colocated_memory_fraction(40 * GIB, 140 * GIB, int(39.5 * GIB))


def test_rollout_tokens_follow_the_runs_batch():
    assert rollout_tokens(256, 1024) == 256 * (1024 + PROMPT_TOKENS)
    assert rollout_tokens(512 * 8, 64) == MAX_SEQUENCES * (64 + PROMPT_TOKENS)  # 4,096 sequences wait their turn
    assert rollout_tokens(None, 256) == 256 * (256 + PROMPT_TOKENS)
    assert rollout_tokens(None, None) == 256 * (ENGINE_SAMPLING.max_tokens + PROMPT_TOKENS)


def test_vllm_on_the_cpu_refuses_to_sleep(tiny_lm_dir):
    pytest.importorskip("vllm")
    from a5core.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match="sleep_when_idle needs vLLM on CUDA"):
        VLLMEngine(str(tiny_lm_dir), sleep_when_idle=True)
