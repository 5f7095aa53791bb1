"""Rollouts with the hf backend: batch 256, 200-token prompts, 512 new tokens, sampling at temperature 1.

Compares, in one process on one model: transformers' ``generate`` (the baseline) and a5's hf engine
(static KV cache; its decode step captured as a CUDA graph), its decode at full size (every step runs the
whole chunk over the whole cache) and shrinking (the filled columns only, fewer rows as rows finish), each with
the temperature sampler before (softmax → multinomial) and today's (Gumbel-max; ``benchmarks/_sampler.py``),
and with the decode step's cache attention of today (``sdpa``) or the one it replaced (``matmul``,
``benchmarks/_attention.py``); ``--decodes shrinking-static``: shrinking with each bucket compiled as a static
shape (``benchmarks/_buckets.py``). Each setting compiles its decode step anew (``torch._dynamo.reset``).
Every sequence runs the full 512 tokens (``min_tokens`` = ``max_tokens``: random weights would otherwise
stop at random), and the stop-string machinery stays on (stop ``</answer>``). Then (``--lengths varied``)
each row ends at a length drawn log-uniformly between 30 and 512 tokens (``benchmarks/_lengths.py``):
tokens/s counts the tokens generated. Also checks the compiled loop against the eager one (greedy tokens)
and the engine's log-probs against the policy's. Targets: ≥ 50k tok/s; varied lengths within
80% of that.

    python benchmarks/rollout.py [--model-dir DIR] [--batch 256 --prompt 200 --new 512] [--tiny]
        [--decodes full shrinking shrinking-static] [--samplers multinomial gumbel-max] [--attentions sdpa matmul]
        [--skip-baseline]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _attention, _buckets, _model, _sampler  # noqa: E402
from benchmarks._attention import use_attention  # noqa: E402
from benchmarks._buckets import decode_mode  # noqa: E402
from benchmarks._lengths import forced_lengths  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks._sampler import use_sampler  # noqa: E402

SHORTEST = 30  # the varied lengths' lower end, tokens


def prompts_of(tokenizer, count: int, length: int, vocab: int) -> list[str]:
    """``count`` texts of about ``length`` tokens each (random ids, decoded and cut back to length)."""
    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(count):
        ids = torch.randint(0, min(vocab, len(tokenizer)) - 300, (length,), generator=generator).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        texts.append(tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:length]))
    return texts


def timed(fn):
    _model.cuda_sync()
    start = time.perf_counter()
    out = fn()
    _model.cuda_sync()
    return out, time.perf_counter() - start


def transformers_generate(model, tokenizer, prompts, new_tokens):
    from transformers import GenerationConfig

    enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt").to(
        model.device
    )
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    with torch.no_grad():
        return model.generate(**enc, generation_config=config)


def setting_rows(engine, name: str, prompts: list[str], sampling, args, baseline: float | None) -> list[list[str]]:
    """One setting's rows: its first call (it compiles), two timed calls at fixed lengths, then (``--lengths
    varied``) a first call with drawn lengths and the timed one; each row printed as it is measured."""
    rows: list[list[str]] = []

    def add(label: str, seconds: float, speed: float | None) -> None:
        versus = f"{speed / baseline:.2f}×" if baseline and speed else "—"
        rows.append([label, f"{seconds:.1f}", f"{speed:,.0f}" if speed else "", versus])
        print(rows[-1], flush=True)

    tokens = len(prompts) * args.new
    _, first = timed(lambda: engine.generate(prompts, sampling))
    print(f"{name}, first call (compiles): {first:.1f} s", flush=True)
    for label in (name, "same, second timed call"):
        groups, seconds = timed(lambda: engine.generate(prompts, sampling))
        assert all(len(g[0].token_ids) == args.new for g in groups)
        add(label, seconds, tokens / seconds)
    fixed_speed = tokens / seconds
    rows.append([f"{name}, first call (incl. compilation)", f"{first:.1f}", f"{tokens / first:,.0f}", "—"])
    if "varied" not in args.lengths:
        return rows
    # As rows finish, a shrinking decode meets (rows, width) shapes the fixed lengths never did: a first call with
    # the same drawn lengths compiles them, so the timed one measures decoding only.
    with forced_lengths(engine, SHORTEST, args.new, seed=1):
        _, first = timed(lambda: engine.generate(prompts, sampling))
    add(f"{name}, varied lengths, first call (compiles the shapes they reach)", first, None)
    with forced_lengths(engine, SHORTEST, args.new, seed=1):
        groups, seconds = timed(lambda: engine.generate(prompts, sampling))
    generated = sum(len(g[0].token_ids) for g in groups)
    speed = generated / seconds
    mean = generated / len(groups)
    add(
        f"{name}, varied lengths {SHORTEST}–{args.new} (mean {mean:.0f}), {speed / fixed_speed:.0%} of fixed",
        seconds,
        speed,
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--skip-baseline", action="store_true")
    for options in (_buckets, _sampler, _attention):
        options.add_argument(parser)
    parser.add_argument(
        "--lengths",
        nargs="+",
        choices=("fixed", "varied"),
        default=["fixed", "varied"],
        help="varied: also each row ending at a length drawn log-uniformly between 30 and --new",
    )
    args = parser.parse_args()
    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from a5core.policy.causal_lm import get_response_log_probs, pack_prompt_and_output_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    model.eval()
    prompts = prompts_of(tokenizer, args.batch, args.prompt, model.config.vocab_size)
    tokens = args.batch * args.new
    sampling = SamplingSettings(temperature=1.0, max_tokens=args.new, min_tokens=args.new, seed=0)
    rows = []

    baseline = None
    if not args.skip_baseline:
        transformers_generate(model, tokenizer, prompts[:8], 8)  # warm-up
        out, seconds = timed(lambda: transformers_generate(model, tokenizer, prompts, args.new))
        assert out.shape[1] - args.new > 0
        baseline = tokens / seconds
        rows.append(["transformers generate (baseline)", f"{seconds:.1f}", f"{baseline:,.0f}", "1.00×"])
        print(rows[-1], flush=True)

    for attention, decode, sampler in [(a, d, s) for a in args.attentions for d in args.decodes for s in args.samplers]:
        name = f"a5 hf engine, {'full-size' if decode == 'full' else decode} decode, {sampler}, {attention} attention"
        torch._dynamo.reset()  # each setting compiles its own decode step
        with use_attention(attention), decode_mode(decode) as shrink:
            engine = use_sampler(HFEngine(model, tokenizer, batch_size=args.batch, shrink=shrink), sampler)
            rows += setting_rows(engine, name, prompts, sampling, args, baseline)

    # correctness on the device: compiled vs eager greedy tokens, engine vs policy log-probs (the last setting's)
    check = prompts[:8]
    greedy = SamplingSettings(temperature=0, max_tokens=32, stop=())
    with use_attention(args.attentions[-1]), decode_mode(args.decodes[-1]):
        compiled_out = engine.generate(check, greedy)
        eager_out = HFEngine(model, tokenizer, batch_size=8, compile=False).generate(check, greedy)
        scored = engine.generate(check, SamplingSettings(temperature=1.0, max_tokens=64, seed=1, logprobs=True))
    same = sum(a[0].token_ids == b[0].token_ids for a, b in zip(compiled_out, eager_out, strict=True))
    prompt_ids = tokenizer(check, add_special_tokens=False)["input_ids"]
    packed = pack_prompt_and_output_ids(prompt_ids, [g[0].token_ids for g in scored], tokenizer.pad_token_id or 0)
    with torch.no_grad():
        policy = get_response_log_probs(model, packed["input_ids"].to(device), packed["labels"].to(device))["log_probs"]
    mask = packed["response_mask"].to(device)
    engine_lp = torch.zeros_like(policy)
    engine_lp[mask] = torch.tensor([x for g in scored for x in g[0].log_probs], device=device)
    diff = (engine_lp - policy)[mask].abs().max().item()
    print(f"greedy rows equal compiled vs eager: {same}/{len(check)}; engine vs policy log-prob max |diff| {diff:.2e}")

    report(
        "Rollouts, hf backend",
        f"{description} · batch {args.batch} · {args.prompt}-token prompts · {args.new} new tokens (min = max) · "
        f"temperature 1 · stop ['</answer>'] on · torch {torch.__version__} · greedy rows equal compiled vs eager "
        f"{same}/{len(check)} · engine vs policy log-prob max diff {diff:.1e} · "
        "targets ≥ 50k tok/s, varied lengths ≥ 80% of fixed",
        ["path", "seconds", "new tok/s", "vs baseline"],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
