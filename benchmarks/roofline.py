"""The hf engine's decode step against its roofline, on whatever card runs it.

First the card's own limits, measured here: a device-to-device copy (bytes read and written per second) and a
bf16 8192³ matmul (FLOP/s). Then, for each batch size: what a decode step must move and compute
(``benchmarks/_roofline.py``), the time that allows, the compiled decode step's measured time (the engine's
``StaticKVDecoder``, one CUDA graph, median of ``--steps``), the engine's whole loop per new token (sampling, the
host's bookkeeping and the prefill included) with the prefill's share of it and, from a profile of it, what a token
spends beyond the step (kernels the step does not run, and time with no kernel running: the GPU waiting on the
host; the longest such kernels are printed), and the step's kernels by kind from torch.profiler (matmuls,
attention, elementwise and norms, copies, the rest), each against its share of the floor.

    python benchmarks/roofline.py [--model-dir DIR] [--batches 64 256] [--prompt 200] [--new 256] [--tiny]

The table goes to benchmarks/RESULTS.md (not with ``--tiny``, a CPU check).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks._roofline import decode_step_cost  # noqa: E402

KINDS = (  # a kernel's kind by the words in its name, first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul", "mm_")),  # nvjet: cuBLAS's Hopper GEMMs
    ("elementwise", ("triton_",)),  # inductor's fused kernels, named after their ops (often "_to_copy")
    ("copy", ("memcpy", "memset", "copy")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "triton", "fused")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, words in KINDS if any(w in lowered for w in words)), "other")


def timed(fn, repeats: int) -> list[float]:
    """Each of ``repeats`` calls' time in ms, after three warm-up calls."""
    for _ in range(3):
        fn()
    _model.cuda_sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _model.cuda_sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def card_limits(device: str) -> tuple[float, float]:
    """(bytes/s read + written by a device-to-device copy, bf16 matmul FLOP/s), measured on ``device``."""
    if not device.startswith("cuda"):
        size, n = 1 << 24, 512
    else:
        size, n = 1 << 30, 8192
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_ms = statistics.median(timed(lambda: target.copy_(source), 10))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    matmul_ms = statistics.median(timed(lambda: a @ b, 10))
    return 2 * size / copy_ms * 1e3, 2 * n**3 / matmul_ms * 1e3


def step_inputs(batch: int, prompt: int, capacity: int, device: str):
    ids = torch.randint(0, 1000, (batch, prompt), device=device)
    valid = torch.ones(batch, prompt, dtype=torch.bool, device=device)
    attend = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
    return ids, valid, attend


def decode_step_ms(model, batch: int, prompt: int, new: int, device: str, steps: int):
    """(median ms of the compiled decode step at ``prompt + new/2`` filled columns, its kernels' CUDA time by kind
    per step, in ms); the five longest kernels are printed with their kind, so a misnamed kind shows."""
    from a5core.engines.static_decode import StaticKVDecoder

    capacity, filled = prompt + new, prompt + new // 2
    ids, valid, attend = step_inputs(batch, prompt, capacity, device)
    attend[:, :filled] = True
    decoder = StaticKVDecoder(model, batch, capacity, compile=device.startswith("cuda"))
    decoder.prefill(ids, valid)
    tokens = torch.randint(0, 1000, (batch,), device=device)
    positions = torch.full((batch,), filled, device=device)
    slot = torch.full((1,), filled, device=device)
    median = statistics.median(timed(lambda: decoder.decode(tokens, positions, slot, attend), steps))
    per_kernel = kernel_ms(lambda: decoder.decode(tokens, positions, slot, attend), 5, device)
    kinds: dict[str, float] = {}
    for name, ms in per_kernel.items():
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + ms
    for name, ms in sorted(per_kernel.items(), key=lambda item: -item[1])[:5]:
        print(f"batch {batch}: {ms:.3f} ms a step, {kind_of(name)}: {name[:120]}")
    return median, kinds, per_kernel


def kernel_ms(fn, units: int, device: str) -> dict[str, float]:
    """Each CUDA kernel's (and copy's) device time per unit, in ms, over one profiled ``fn()`` that does ``units``
    units of work (steps, tokens); empty off CUDA."""
    if not device.startswith("cuda"):
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _model.cuda_sync()
    found = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if us:
            found[event.key] = us / units / 1e3
    return found


def loop_outside_step(
    loop_ms: float, loop_kernels: dict[str, float], step_kernels: dict[str, float]
) -> tuple[float, float, list[tuple[str, float]]]:
    """Where a token of the engine's loop goes beyond its decode step: (ms of kernels whose names the step does not
    run: sampling, bookkeeping, the prefill; ms with no kernel running: the GPU waiting on the host, ``loop_ms`` less
    every kernel's time; those kernels, longest first)."""
    outside = sorted(((k, ms) for k, ms in loop_kernels.items() if k not in step_kernels), key=lambda kv: -kv[1])
    return sum(ms for _, ms in outside), loop_ms - sum(loop_kernels.values()), outside


def engine_ms_per_token(
    model, tokenizer, batch: int, prompt: int, new: int, device: str
) -> tuple[float, float, dict[str, float]]:
    """The engine's whole ``generate`` per new token (fixed length: every row ``new`` tokens), prefill included; the
    prefill's part of it: a ``generate`` of one token (the prefill and one sampled token), spread over ``new``; and
    a profiled ``generate``'s kernels, ms per new token (:func:`kernel_ms`)."""
    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from benchmarks.rollout import prompts_of

    engine = HFEngine(model, tokenizer, batch_size=batch)
    prompts = prompts_of(tokenizer, batch, prompt, model.config.vocab_size)

    def settings(tokens: int) -> SamplingSettings:
        return SamplingSettings(temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=0)

    def generate(tokens: int) -> float:
        return statistics.median(timed(lambda: engine.generate(prompts, settings(tokens)), 2))

    loop = generate(new) / new  # warms the engine up first: the profile below sees no compiling or autotuning
    kernels = kernel_ms(lambda: engine.generate(prompts, settings(new)), new, device)
    return loop, generate(1) / new, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    _model.add_arguments(parser)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=256, help="tokens generated a row; the step is timed halfway")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    model.eval()
    bandwidth, peak = card_limits(device)
    element = 2 if device == "cuda" else 4
    rows = []
    for batch in args.batches:
        cost = decode_step_cost(model.config, batch, args.prompt + args.new // 2, dtype_bytes=element)
        floor = cost.floor_ms(bandwidth, peak)
        step, kinds, step_kernels = decode_step_ms(model, batch, args.prompt, args.new, device, args.steps)
        loop, prefill, loop_kernels = engine_ms_per_token(model, tokenizer, batch, args.prompt, args.new, device)
        outside, idle, longest = loop_outside_step(loop, loop_kernels, step_kernels)
        for name, ms in longest[:5]:
            print(f"batch {batch}: {ms:.3f} ms a token outside the step, {kind_of(name)}: {name[:120]}")
        floors = cost.floors_by_kind(bandwidth, peak)
        by_kind = ", ".join(
            f"{k} {ms:.2f}" + (f" (floor {floors[k]:.2f})" if k in floors else "")
            for k, ms in sorted(kinds.items(), key=lambda item: -item[1])
        )
        rows.append(
            [
                batch,
                f"{cost.weights / 1e9:.2f} + {cost.cache / 1e9:.2f} + {cost.logits / 1e9:.2f}",
                f"{cost.flops / 1e9:.0f}",
                f"{floor:.2f}",
                f"{step:.2f} ({floor / step:.2f})",
                f"{loop:.2f} ({floor / loop:.2f})",
                f"{prefill:.2f}",
                f"{outside:.2f}, {idle:.2f}" if loop_kernels else "n/a (no CUDA)",
                f"{batch / loop * 1e3:,.0f}",
                by_kind,
            ]
        )
    settings = (
        f"{description}; the card measured here: {bandwidth / 1e9:,.0f} GB/s copy (read + written), "
        f"{peak / 1e12:.1f} TFLOP/s matmul; prompt {args.prompt}, {args.new} new tokens, the step timed at "
        f"{args.prompt + args.new // 2} filled columns"
    )
    header = [
        "batch",
        "GB a step (weights + KV cache + logits)",
        "GFLOP a step",
        "floor (ms)",
        "decode step, ms (of floor)",
        "engine per token, ms (of floor)",
        "of which the prefill, ms",
        "a token's kernels outside the step, GPU idle (ms)",
        "tok/s",
        "step's kernels by kind (ms)",
    ]
    report("Decode step against its roofline, hf engine", settings, header, rows, record=not args.tiny)


if __name__ == "__main__":
    main()
