"""benchmarks/policy_step.py --profile: kernels sorted into kinds by name, with names the H200 printed."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.policy_step import kernel_kind  # noqa: E402


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMM"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128", "attention"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedOpti",
            "optimizer (AdamW)",
        ),
        ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", "Triton-fused element-wise and reductions"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernels_are_sorted_by_kind(name, kind):
    assert kernel_kind(name) == kind
