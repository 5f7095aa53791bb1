"""benchmarks/_roofline.py: a decode step's bytes and FLOPs, counted by hand for a small config and checked
against the parameter count transformers builds for Qwen2.5-Math-1.5B's config."""

import json

import pytest

from benchmarks._roofline import StepCost, decode_step_cost


def test_a_small_config_counted_by_hand():
    config = dict(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    cost = decode_step_cost(config, batch=3, context=5, dtype_bytes=2, logits_bytes=4)
    head_dim = 2
    attention = 8 * 4 * head_dim + 2 * 8 * 2 * head_dim + 4 * head_dim * 8  # q, k and v, o
    matmuls = 2 * (attention + 3 * 8 * 16) + 100 * 8
    assert cost.weights == (matmuls + (2 * 2 + 1) * 8 + 3 * 8) * 2
    assert cost.cache == 3 * 6 * 2 * 2 * 2 * head_dim * 2
    assert cost.logits == 2 * 3 * 100 * 4
    assert cost.flops == 2 * matmuls * 3 + 4 * 3 * 2 * 4 * head_dim * 5
    assert cost.attention_flops == 4 * 3 * 2 * 4 * head_dim * 5
    assert cost.bytes == cost.weights + cost.cache + cost.logits


def test_the_weights_are_those_of_the_real_architecture(shared_data):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((shared_data / "qwen2.5-math-1.5b" / "config.json").read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    parameters = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    cost = decode_step_cost(config, batch=1, context=0)
    # every parameter but the biases (a few thousand), 2 bytes each: the tied embedding read in full as the output
    # head, and as the embedding only the batch's one row
    assert cost.weights == pytest.approx((parameters - biases + config.hidden_size) * 2, rel=1e-9)


def test_the_floor_is_the_larger_of_traffic_and_arithmetic():
    cost = StepCost(weights=2e9, cache=1e9, logits=0.0, flops=4e11, attention_flops=8e10)
    assert cost.floor_ms(bandwidth=3e12, peak=8e14) == pytest.approx(1.0)  # 3 GB at 3 TB/s beats 0.5 ms of FLOPs
    assert cost.floor_ms(bandwidth=3e13, peak=8e14) == pytest.approx(0.5)
    kinds = cost.floors_by_kind(bandwidth=3e12, peak=8e14)
    assert kinds == pytest.approx({"matmul": 2e9 / 3e12 * 1e3, "attention": 1e9 / 3e12 * 1e3})


@pytest.mark.parametrize(
    "kernel, kind",
    [
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "matmul"),  # cuBLAS's GEMMs on an H100 (CUDA 12.8+)
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, float, 128, 16, 4, 4, false>", "matmul"),
        ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "elementwise"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "other"),
    ],
)
def test_a_kernel_is_counted_under_its_kind(kernel, kind):
    from benchmarks.roofline import kind_of

    assert kind_of(kernel) == kind


def test_a_loop_token_beyond_its_step_is_split_into_other_kernels_and_idle_time():
    from benchmarks.roofline import loop_outside_step

    step = {"nvjet_gemm": 2.0, "triton_red_fused_rmsnorm_0": 0.5}
    loop = {"nvjet_gemm": 2.1, "triton_red_fused_rmsnorm_0": 0.5, "gumbel_max": 0.3, "index_put": 0.1}
    outside, idle, longest = loop_outside_step(4.0, loop, step)
    assert outside == pytest.approx(0.4) and idle == pytest.approx(4.0 - 3.0)
    assert [name for name, _ in longest] == ["gumbel_max", "index_put"]
    assert loop_outside_step(4.0, {}, step) == (0, 4.0, [])  # off CUDA: no profile, every ms unexplained
