"""Where a decode step's time goes in the hf engine's static loop (the profile behind benchmarks/rollout.py).

Times, per step at batch 256 with a 768-position cache: the compiled (CUDA-graph) decode step, the eager
one, the sampling; prints torch.profiler's top CUDA kernels of a few compiled steps and how far the
compiled step's logits are from the eager step's on the same inputs; for each ``--attentions`` (the
engine's ``sdpa``, the ``matmul`` it replaced: ``benchmarks/_attention.py``). ``--loop N``: instead, the engine's
whole loop (``HFEngine.generate``, N new tokens, full-size and shrinking): ms per step, and torch.profiler's
top operators by CPU time and cProfile's top functions, where host-side waits and launch costs show.

    python benchmarks/decode_profile.py [--model-dir DIR] [--batch 256 --capacity 768] [--tiny]
        [--loop 128 [--decodes full shrinking shrinking-static]] [--attentions sdpa matmul]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _attention, _buckets, _model  # noqa: E402
from benchmarks._attention import use_attention  # noqa: E402
from benchmarks._buckets import decode_mode  # noqa: E402


def per_step_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn(0)
    _model.cuda_sync()
    start = time.perf_counter()
    for i in range(steps):
        fn(i)
    _model.cuda_sync()
    return (time.perf_counter() - start) / steps * 1000


def profile_loop(args) -> None:
    """The engine's loop at ``args.batch`` rows, ``args.loop`` new tokens: ms per step (after three warm calls),
    then the profilers' view of one more call, for each of ``args.decodes`` (full-size, shrinking)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from benchmarks.rollout import prompts_of

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    model.eval()
    prompts = prompts_of(tokenizer, args.batch, args.prompt, model.config.vocab_size)
    settings = SamplingSettings(temperature=1.0, max_tokens=args.loop, min_tokens=args.loop, seed=0)
    print(description, flush=True)
    for attention, decode in [(a, d) for a in args.attentions for d in args.decodes]:
        torch._dynamo.reset()  # each setting's step compiled anew
        print(f"== {attention} attention, {decode} decode", flush=True)
        with use_attention(attention), decode_mode(decode) as shrink:
            engine = HFEngine(model, tokenizer, batch_size=args.batch, shrink=shrink)
            ms = per_step_ms(lambda i, engine=engine: engine.generate(prompts, settings), 1) / args.loop
            print(f"shrink={shrink}: {ms:.2f} ms per new token, prefill included", flush=True)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=activities) as prof:
                engine.generate(prompts, settings)
                _model.cuda_sync()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
            profiler = cProfile.Profile()
            profiler.runcall(lambda engine=engine: (engine.generate(prompts, settings), _model.cuda_sync()))
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
            engine = None


def time_step(model, args, inputs, compiled: bool) -> torch.Tensor:
    """Print a decode step's first call and per-step time (and, compiled on CUDA, the profiler's top kernels);
    return the first step's logits (b, V). ``inputs``: prompt ids and mask, tokens, positions, slots, attend mask."""
    from a5core.engines.static_decode import StaticKVDecoder

    ids, valid, tokens, positions, slots, attend = inputs
    b = ids.shape[0]
    decoder = StaticKVDecoder(model, b, args.capacity, compile=compiled)
    decoder.prefill(ids, valid)
    start = time.perf_counter()
    logits = decoder.decode(tokens, positions, slots[0], attend).clone()
    _model.cuda_sync()
    print(f"compile={compiled}: first decode {time.perf_counter() - start:.1f} s", flush=True)
    ms = per_step_ms(lambda i: decoder.decode(tokens, positions + i, slots[i % 64], attend), args.steps)
    print(f"compile={compiled}: decode step {ms:.2f} ms ({b / ms * 1000:,.0f} tok/s at batch {b})", flush=True)
    if compiled and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                decoder.decode(tokens, positions + i, slots[i], attend)
            _model.cuda_sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    return logits


def compiled_against_eager(model, args, inputs) -> None:
    """The compiled decode step, then the eager one (each decoder freed before the next is built), and how far
    their first logits are apart on the same inputs."""
    compiled, eager = (time_step(model, args, inputs, flag) for flag in (True, False))
    difference = (compiled - eager).abs().max().item()
    print(f"compiled vs eager decode step, same inputs: max |Δlogit| {difference:.2e} (logits' std {eager.std():.2e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=768)
    _buckets.add_argument(parser)
    parser.add_argument("--steps", type=int, default=30)
    _attention.add_argument(parser)
    parser.add_argument("--loop", type=int, help="profile HFEngine.generate over this many new tokens instead")
    args = parser.parse_args()
    if args.loop:
        return profile_loop(args)
    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from a5core.engines.token_loop import Draw

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
    slots = [torch.full((1,), p + i, device=device) for i in range(64)]  # on the device, as the loop passes them
    print(description, flush=True)
    for attention in args.attentions:
        torch._dynamo.reset()  # each attention's step compiled anew
        print(f"== {attention} attention", flush=True)
        with use_attention(attention):
            compiled_against_eager(model, args, (ids, valid, tokens, positions, slots, attend))
    engine = HFEngine(model, tokenizer, batch_size=b, compile=False)
    logits = torch.randn(b, model.config.vocab_size, device=device)
    eos = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
    eos[0] = True
    for settings in (SamplingSettings(temperature=1.0), SamplingSettings(temperature=1.0, top_p=0.9)):
        draw = Draw.of(settings, eos)
        ms = per_step_ms(lambda i, draw=draw: engine._sample(logits, draw, 10), args.steps)
        print(f"sample (top_p {settings.top_p}): {ms:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
