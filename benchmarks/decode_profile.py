"""Where a decode step's time goes in the hf engine's static loop (the profile behind benchmarks/rollout.py).

Times, per step at batch 256 with a 768-position cache: the compiled (CUDA-graph) decode step, the eager
one, the sampling; prints torch.profiler's top CUDA kernels of a few compiled steps and how far the
compiled step's logits are from the eager step's on the same inputs.

    python benchmarks/decode_profile.py [--model-dir DIR] [--batch 256 --capacity 768] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model  # noqa: E402


def per_step_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn(0)
    _model.cuda_sync()
    start = time.perf_counter()
    for i in range(steps):
        fn(i)
    _model.cuda_sync()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=768)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from a5core.rollout import SamplingSettings
    from a5core.rollout.hf import HFEngine
    from a5core.rollout.static_decode import StaticKVDecoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    model.eval()
    b, p = args.batch, args.prompt
    ids = torch.randint(0, 1000, (b, p), device=device)
    valid = torch.ones(b, p, dtype=torch.bool, device=device)
    attend = torch.zeros(b, args.capacity, dtype=torch.bool, device=device)
    attend[:, : p + 64] = True
    tokens = torch.randint(0, 1000, (b,), device=device)
    positions = torch.full((b,), p, device=device)
    print(description, flush=True)
    first_logits = {}
    for compiled in (True, False):
        decoder = StaticKVDecoder(model, b, args.capacity, compile=compiled)
        decoder.prefill(ids, valid)
        start = time.perf_counter()
        first_logits[compiled] = decoder.decode(tokens, positions, p, attend).clone()
        _model.cuda_sync()
        print(f"compile={compiled}: first decode {time.perf_counter() - start:.1f} s", flush=True)
        ms = per_step_ms(lambda i: decoder.decode(tokens, positions + i, p + (i % 64), attend), args.steps)
        print(f"compile={compiled}: decode step {ms:.2f} ms ({b / ms * 1000:,.0f} tok/s at batch {b})", flush=True)
        if compiled and device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(5):
                    decoder.decode(tokens, positions + i, p + i, attend)
                _model.cuda_sync()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        decoder = None  # free its cache before the next one is built
    difference = (first_logits[True] - first_logits[False]).abs().max().item()
    spread = first_logits[False].std().item()
    print(f"compiled vs eager decode step, same inputs: max |Δlogit| {difference:.2e} (logits' std {spread:.2e})")
    engine = HFEngine(model, tokenizer, batch_size=b, compile=False)
    logits = torch.randn(b, model.config.vocab_size, device=device)
    eos = torch.tensor([0], device=device)
    for settings in (SamplingSettings(temperature=1.0), SamplingSettings(temperature=1.0, top_p=0.9)):
        ms = per_step_ms(lambda i: engine._sample(logits, settings, 10, eos), args.steps)
        print(f"sample (top_p {settings.top_p}): {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
