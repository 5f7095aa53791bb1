"""Policy micro-batch step at 16×1024 tokens: log-probs (with entropy) + masked GRPO loss + backward + AdamW.

Compares, in one process on one model: the plain transformers path (full logits, fp32 cross-entropy:
the baseline), the fused LM-head log-softmax (``a5core.policy.causal_lm.get_response_log_probs``) and the fused head
with compiled decoder layers (``a5core.policy.causal_lm.compile_decoder_layers``), at several activation-memory
budgets (torch's partitioner recomputes the cheapest activations in backward) and, optionally, with full
activation checkpointing. Target: ≥ 55k tok/s and ≤ 40 GiB peak on one H200.
``--profile``: instead, the first compiled setting's step under torch.profiler: its GPU time by kind of kernel
(GEMMs, attention, Triton-fused element-wise, optimizer, the rest) and the top kernels.

    python benchmarks/policy_step.py [--model-dir DIR] [--batch 16 --seq 1024 --steps 5] [--tiny] [--profile]
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


def baseline_step(model, ids, labels, mask, advantages):
    logits = model(ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()


def a5_step(model, ids, labels, mask, advantages):
    from a5core.handout import grpo_microbatch_train_step
    from a5core.policy.causal_lm import get_response_log_probs

    out = get_response_log_probs(model, ids, labels, return_token_entropy=True)
    grpo_microbatch_train_step(out["log_probs"], mask, 1, "reinforce_with_baseline", advantages=advantages)
    out["token_entropy"][mask].mean().item()  # what the loop logs


def optimizer_step(model, step, batch):
    """A function making one whole step: ``step`` (forward + backward) on ``batch``, then AdamW's update."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=torch.cuda.is_available())

    def one() -> None:
        step(model, *batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one


def measure(name, model, step, batch, steps, warmup, tokens):
    """Median seconds per step (forward + backward + AdamW) and peak GiB."""
    one = optimizer_step(model, step, batch)
    _model.reset_peak()
    times = []
    for i in range(warmup + steps):
        _model.cuda_sync()
        start = time.perf_counter()
        one()
        _model.cuda_sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = _model.peak_gib()
    del one  # and its optimizer's moments
    seconds = statistics.median(times)
    print(f"{name}: {seconds * 1000:.0f} ms/step, {tokens / seconds:,.0f} tok/s, peak {peak:.1f} GiB", flush=True)
    return seconds, peak


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer (AdamW)", ("multi_tensor", "adam")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "splitkreduce")),
    ("Triton-fused element-wise and reductions", ("triton",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel, from its name (``KERNEL_KINDS``; "other" when none matches)."""
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def profile(model, step, batch, warmup: int, steps: int, flops: float) -> None:
    """Print a step's GPU time by kernel kind and its top kernels (``steps`` profiled steps after ``warmup``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    one = optimizer_step(model, step, batch)
    for _ in range(warmup):
        one()
    _model.cuda_sync()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one()
        _model.cuda_sync()
    wall = (time.perf_counter() - start) / steps
    kernels = [  # kernels only: a user annotation's GPU span (AdamW.step, a compiled graph's call) covers kernels
        e
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    if not kernels:
        print(f"profiled step: {wall * 1e3:.0f} ms wall; no CUDA kernels (not on a GPU)")
        return
    by_kind: dict[str, float] = {}
    for event in kernels:
        kind = kernel_kind(event.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + event.self_device_time_total
    gpu = sum(by_kind.values()) / steps / 1e3  # ms a step
    print(f"profiled step: {wall * 1e3:.0f} ms wall, {gpu:.0f} ms of GPU kernels; {flops / wall / 1e12:.0f} TFLOP/s")
    for kind, total in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind}: {total / steps / 1e3:.1f} ms a step ({total / steps / 1e3 / gpu:.0%})")
    for event in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"  {event.self_device_time_total / steps / 1e3:7.2f} ms  ×{event.count // steps:<4} {event.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[1.0, 0.8, 0.6],
        help="activation memory budgets of the compiled variants",
    )
    parser.add_argument("--checkpointing", action="store_true", help="also measure full activation checkpointing")
    parser.add_argument("--profile", action="store_true", help="profile the first compiled setting instead")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    model.train()
    vocab = model.config.vocab_size
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    labels = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    mask = torch.zeros(args.batch, args.seq, dtype=torch.bool, device=device)
    mask[:, args.seq // 5 :] = True  # prompt ~20%, response the rest
    advantages = torch.randn(args.batch, 1, device=device)
    batch, tokens = (ids, labels, mask, advantages), args.batch * args.seq
    flops = _model.train_flops_per_token(model, args.seq) * tokens

    from a5core.policy.causal_lm import get_response_log_probs

    with torch.no_grad():  # the fused path's values against the plain log-softmax on this device
        fused = get_response_log_probs(model, ids[:2], labels[:2])["log_probs"]
        plain = torch.log_softmax(model(ids[:2]).logits.float(), -1).gather(-1, labels[:2, :, None]).squeeze(-1)
    max_diff = (fused - plain).abs().max().item()
    print(f"fused vs plain log-probs, max |diff|: {max_diff:.2e}", flush=True)
    if args.profile:
        from a5core.policy.causal_lm import compile_decoder_layers

        compile_decoder_layers(model, activation_memory_budget=args.budgets[0])
        print(f"a5: fused head + compiled decoder layers, activation budget {args.budgets[0]:g}")
        return profile(model, a5_step, batch, args.warmup, args.steps, flops)
    results = []
    for name, step in [
        ("plain transformers: full logits + fp32 cross-entropy (baseline)", baseline_step),
        ("a5: fused LM-head log-softmax", a5_step),
    ]:
        results.append((name, *measure(name, model, step, batch, args.steps, args.warmup, tokens)))
    from a5core.policy.causal_lm import compile_decoder_layers

    for budget in args.budgets:
        torch._dynamo.reset()
        compile_decoder_layers(model, activation_memory_budget=budget)
        name = "a5: fused head + compiled decoder layers" + ("" if budget == 1 else f", activation budget {budget:g}")
        results.append((name, *measure(name, model, a5_step, batch, args.steps, args.warmup, tokens)))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        name = "a5: fused head + compiled layers + activation checkpointing"
        results.append((name, *measure(name, model, a5_step, batch, args.steps, args.warmup, tokens)))

    base = results[0][1]
    rows = []
    for name, seconds, peak in results:
        tok_s = tokens / seconds
        mfu = flops / seconds / _model.PEAK_BF16_FLOPS if device == "cuda" else float("nan")
        meets = tok_s >= 55_000 and peak <= 40
        rows.append(
            [
                name,
                f"{seconds * 1000:.0f}",
                f"{tok_s:,.0f}",
                f"{mfu:.0%}",
                f"{peak:.1f}",
                f"{base / seconds:.2f}×",
                "yes" if meets else "no",
            ]
        )
    report(
        "Policy micro-batch step (log-probs + entropy + GRPO loss + backward + AdamW)",
        f"{description} · {args.batch}×{args.seq} tokens per step · torch {torch.__version__} · median of "
        f"{args.steps} after {args.warmup} warm-up · MFU at {_model.PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s · "
        f"fused vs plain log-probs max diff {max_diff:.1e} · target ≥ 55k tok/s and ≤ 40 GiB",
        ["path", "ms/step", "tok/s", "MFU", "peak GiB", "vs baseline", "target met"],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
