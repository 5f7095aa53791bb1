"""One GRPO step at the A5 defaults on one GPU with the hf backend, phase by phase.

256 rollouts (32 questions × group 8), train batch 256, one epoch, reinforce_with_baseline, graded by the
project's r1_zero reward. The engine decodes with the policy's own weights (colocated: no copy, the
weight sync is a no-op). Random weights never write ``</answer>``, so response lengths are set: ``fixed``
(every response ``--response`` tokens, ``min_tokens`` = ``max_tokens``) or ``varied`` (each rollout ends at
a length drawn log-uniformly between 30 and ``--max-tokens``, see ``benchmarks/_lengths.py``).

Micro-batching, side by side in one run: today's fixed count (``--microbatch`` rollouts, 2 by default:
gradient_accumulation_steps 128) and token budgets (``--token-budgets``: ``max_tokens_per_microbatch``);
the decode (``--decodes``): every step at full size, or shrinking (``HFEngine(shrink=...)``, the default); and
the temperature sampler (``--samplers``): softmax → multinomial as before, or today's Gumbel-max; and the
policy's weights (``--policy-dtypes``): bf16, colocated with the engine (no weight sync), or fp32 as the flows'
default ``policy_dtype`` (bf16 autocast; the engine decodes a bf16 copy, synced each step); and the decode step's
cache attention (``--attentions``, ``benchmarks/_attention.py``): the engine's ``sdpa``, or the ``matmul`` it replaced.
The first step compiles (CUDA graph of the decode step; compiled decoder layers) and is reported apart;
the warm steps' median and maximum are the figures. Targets: median ≤ 4.5 s, max ≤ 5.5 s.

    python benchmarks/grpo_step.py [--model-dir DIR] [--steps 11] [--lengths fixed varied]
        [--token-budgets 0 16384 32768] [--count-steps N] [--decodes full shrinking shrinking-static]
        [--samplers multinomial gumbel-max] [--policy-dtypes bfloat16 float32] [--attentions sdpa matmul]
        [--variants layers] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _attention, _buckets, _model, _sampler  # noqa: E402
from benchmarks._attention import use_attention  # noqa: E402
from benchmarks._buckets import decode_mode  # noqa: E402
from benchmarks._lengths import forced_lengths  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks._sampler import use_sampler  # noqa: E402

PHASES = ("weight_sync", "generate", "grade", "old_log_probs", "train")
VARIANTS = {
    "eager": "eager decoder layers",
    "layers": "compiled decoder layers (activation budget 0.8)",
    "decoder": "decoder compiled as one graph",
}
SHORTEST = 30  # the varied lengths' lower end, tokens


def problems_of(count: int):
    from a5core.data import Problem

    return [
        Problem(f"bench/{i}", f"What is {i} + {2 * i}? Show your work step by step before answering.", str(3 * i))
        for i in range(count)
    ]


def steps_of(model, tokenizer, engine, config, extra: Callable[[], dict] = dict) -> list[dict]:
    """GRPO with ``config`` on the benchmark's problems (r1_zero prompt and reward), rollouts from ``engine``:
    each step's logged metrics with the peak memory and ``extra()``'s fields."""
    from a5core.grading import r1_zero_reward_fn
    from a5core.grpo import grpo
    from a5core.prompts import load_prompt

    history: list[dict] = []
    _model.reset_peak()
    grpo(
        model,
        tokenizer,
        engine,
        problems_of(4 * config.prompts_per_step),
        load_prompt("r1_zero"),
        r1_zero_reward_fn,
        config,
        log=lambda metrics, step: history.append(dict(metrics, step=step, peak_gib=_model.peak_gib(), **extra())),
    )
    return history


def run(
    model, engine_model, tokenizer, args, lengths: str, budget: int | None, shrink: bool, sampler: str, steps: int
) -> list[dict]:
    """``steps`` GRPO steps of the policy ``model``, the engine decoding ``engine_model`` (the policy itself:
    colocated); each step's logged metrics with the peak memory and ``graphs``, the graphs torch.compile built in
    this setting by the end of that step (decode step and training layers)."""
    from a5core.grpo import GRPOConfig
    from a5core.policy import compiled_graphs
    from a5core.rollout.hf import HFEngine

    tokens = args.response if lengths == "fixed" else args.max_tokens
    batch = dict(rollout_batch_size=16, train_batch_size=16) if args.tiny else {}
    size = batch.get("train_batch_size", 256)
    config = GRPOConfig(
        n_grpo_steps=steps,
        temperature=1.0,
        min_tokens=tokens,
        max_tokens=tokens,
        gradient_accumulation_steps=size // args.microbatch,
        max_tokens_per_microbatch=budget,
        **batch,
    )
    engine = use_sampler(
        HFEngine(engine_model, tokenizer, batch_size=config.rollout_batch_size, shrink=shrink), sampler
    )
    before = compiled_graphs()
    with forced_lengths(engine, SHORTEST, tokens) if lengths == "varied" else contextlib.nullcontext():
        return steps_of(model, tokenizer, engine, config, lambda: {"graphs": compiled_graphs() - before})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=11, help="GRPO steps per setting (the first compiles)")
    parser.add_argument("--response", type=int, default=400, help="fixed lengths: tokens per response")
    parser.add_argument("--max-tokens", type=int, default=1024, help="varied lengths: the longest response")
    parser.add_argument("--lengths", nargs="+", choices=("fixed", "varied"), default=["fixed", "varied"])
    parser.add_argument("--microbatch", type=int, default=2, help="today's fixed-count micro-batches: rollouts each")
    parser.add_argument(
        "--token-budgets",
        type=int,
        nargs="+",
        default=[0, 16384, 32768],
        help="max_tokens_per_microbatch of each setting; 0: today's fixed-count micro-batches (--microbatch)",
    )
    parser.add_argument(
        "--count-steps",
        type=int,
        help="GRPO steps of the fixed-count settings (budget 0; default --steps): at ~12 s a step, the slow ones",
    )
    for options in (_buckets, _sampler, _attention):
        options.add_argument(parser)
    parser.add_argument(
        "--policy-dtypes",
        nargs="+",
        choices=("bfloat16", "float32"),
        default=["bfloat16"],
        help="the policy's weights: bf16 and colocated with the engine, or fp32 (the flows' policy_dtype default) "
        "with the engine on a bf16 copy",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=["layers"],
        help="how the training forward runs: eager, compiled layer by layer, or as one graph",
    )
    args = parser.parse_args()
    from a5core.policy import compile_decoder_layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for variant in args.variants:
        for lengths in args.lengths:
            settings = [
                (b or None, d, s, p, a)
                for p in args.policy_dtypes
                for b in args.token_budgets
                for d in args.decodes
                for s in args.samplers
                for a in args.attentions
            ]
            for budget, decode, sampler, policy_dtype, attention in settings:
                model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
                engine_model = model
                if policy_dtype == "float32" and model.dtype != torch.float32:
                    model = copy.deepcopy(engine_model).float()
                torch._dynamo.reset()  # a fresh model and compile cache per setting
                if variant == "decoder":
                    compile_decoder_layers(model, one_graph=True)
                elif variant == "layers":
                    compile_decoder_layers(model, activation_memory_budget=0.8)
                steps = args.steps if budget is not None else (args.count_steps or args.steps)
                with use_attention(attention), decode_mode(decode) as shrink:
                    history = run(model, engine_model, tokenizer, args, lengths, budget, shrink, sampler, steps)
                warm_steps = history[1:] or history
                warm = [m["time_step"] for m in warm_steps]
                last = history[-1]
                rows.append(
                    [
                        VARIANTS[variant],
                        str(model.dtype).removeprefix("torch."),
                        lengths,
                        f"{args.microbatch} rollouts" if budget is None else f"budget {budget:,}",
                        decode,
                        sampler,
                        attention,
                        f"{len(warm)}",
                        f"{history[0]['time_step']:.2f}",
                        f"{statistics.median(warm):.2f}",
                        f"{max(warm):.2f}",
                        *[f"{statistics.median(m.get(f'time_{p}', 0.0) for m in warm_steps):.2f}" for p in PHASES],
                        f"{last['response_tokens_mean']:.0f}",
                        f"{statistics.median(m['generate_tokens_per_s'] for m in history):,.0f}",
                        f"{statistics.median(m['train_tokens_per_s'] for m in history):,.0f}",
                        f"{last['microbatches']:.0f}",
                        f"{last['microbatch_shapes']:.0f}",
                        f"{history[0]['graphs']} → {last['graphs']}",
                        f"{max(m['peak_gib'] for m in history):.1f}",
                    ]
                )
                print(rows[-1], flush=True)
    report(
        "One GRPO step at A5 defaults, hf backend, one GPU: micro-batches by count and by token budget, "
        "full-size and shrinking decode, samplers, policy dtype, decode attention",
        f"{description} (the engine; the policy: its column) · 256 rollouts (32 × 8), train batch 256, "
        "reinforce_with_baseline, masked_mean, AdamW · "
        f"responses fixed at {args.response} tokens, or varied log-uniform {SHORTEST}–{args.max_tokens} · "
        "the first step compiles; median and max of the warm steps after it · a bf16 policy is the engine's "
        "model (colocated), an fp32 one is copied into the engine's bf16 model each step · "
        f"torch {torch.__version__} · targets: median ≤ 4.5 s, max ≤ 5.5 s",
        [
            "training layers",
            "policy",
            "lengths",
            "micro-batches",
            "decode",
            "sampler",
            "attention",
            "warm steps",
            "first step s",
            "warm median s",
            "warm max s",
            *[f"{p} s" for p in PHASES],
            "mean response tokens",
            "generate tok/s",
            "train tok/s",
            "passes/step",
            "shapes",
            "graphs compiled: first step → last",
            "peak GiB",
        ],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
