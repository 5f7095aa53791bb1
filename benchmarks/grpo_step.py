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

``--modes`` replaces that cross product by named configurations (``benchmarks/_modes.py``, shared with
``sft_step.py``): the ``a5`` profile as it shipped before the ``auto`` defaults (fp32 policy, eager layers,
micro-batches of 2 rollouts), the defaults now (fp32 policy; ``compile_layers`` and ``max_tokens_per_microbatch``
``auto``: compiled layers, a budget sized to the GPU), the best hand-set configuration measured (bf16 policy,
compiled layers, budget 32,768), and the defaults with the process capped to 80 and 40 GiB
(``torch.cuda.set_per_process_memory_fraction``; the cap is skipped on the CPU), each with the engine as the
flows run it (:data:`ENGINE_DEFAULTS`: shrinking decode, Gumbel-max, sdpa). The ``auto`` budget each run
settled on is in its micro-batches column.

    python benchmarks/grpo_step.py [--model-dir DIR] [--steps 11] [--lengths fixed varied]
        [--token-budgets 0 16384 32768] [--count-steps N] [--decodes full shrinking shrinking-static]
        [--samplers multinomial gumbel-max] [--policy-dtypes bfloat16 float32] [--attentions sdpa matmul]
        [--variants layers] [--modes shipped defaults best defaults-80g defaults-40g] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _attention, _buckets, _model, _modes, _sampler  # noqa: E402
from benchmarks._attention import use_attention  # noqa: E402
from benchmarks._buckets import decode_mode  # noqa: E402
from benchmarks._lengths import forced_lengths  # noqa: E402
from benchmarks._modes import MODES, budgets_seen, cut_of, memory_cap  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks._sampler import use_sampler  # noqa: E402

PHASES = ("weight_sync", "generate", "grade", "old_log_probs", "train")
VARIANTS = {
    "eager": "eager decoder layers",
    "layers": "compiled decoder layers (activation budget 0.8)",
    "decoder": "decoder compiled as one graph",
}
SHORTEST = 30  # the varied lengths' lower end, tokens


@dataclass(frozen=True)
class Setting:
    """One measured configuration: training layers (a VARIANTS key, or ``auto``: the loop's ``compile_layers``
    default), ``max_tokens_per_microbatch`` (None: micro-batches of ``--microbatch``), decode, sampler, policy
    dtype, attention, and a cap on the process's GPU memory in GiB (None: the whole GPU)."""

    variant: str
    budget: int | str | None
    decode: str
    sampler: str
    policy_dtype: str
    attention: str
    cap_gib: float | None = None
    name: str = ""


# What the flows' hf engine runs (HFEngine's defaults), which every named mode measures.
ENGINE_DEFAULTS = dict(decode="shrinking", sampler="gumbel-max", attention="sdpa")


def problems_of(count: int):
    from a5core.data.files import Problem

    return [
        Problem(f"bench/{i}", f"What is {i} + {2 * i}? Show your work step by step before answering.", str(3 * i))
        for i in range(count)
    ]


def steps_of(model, tokenizer, engine, config, extra: Callable[[], dict] = dict) -> list[dict]:
    """GRPO with ``config`` on the benchmark's problems (r1_zero prompt and reward), rollouts from ``engine``:
    each step's logged metrics with the peak memory and ``extra()``'s fields."""
    from a5core.data.prompts import load_prompt
    from a5core.grading.grader import r1_zero_reward_fn
    from a5core.loops.grpo import grpo

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
    model,
    engine_model,
    tokenizer,
    args,
    lengths: str,
    setting: Setting,
    shrink: bool,
    steps: int,
) -> list[dict]:
    """``steps`` GRPO steps of the policy ``model``, the engine decoding ``engine_model`` (the policy itself:
    colocated); each step's logged metrics with the peak memory and ``graphs``, the graphs torch.compile built in
    this setting by the end of that step (decode step and training layers). Layers compiled by the loop only
    under the ``auto`` variant (the others are compiled, or not, before)."""
    from a5core.engines.hf import HFEngine
    from a5core.loops.grpo import GRPOConfig
    from a5core.policy.causal_lm import compiled_graphs

    tokens = args.response if lengths == "fixed" else args.max_tokens
    batch = dict(rollout_batch_size=16, train_batch_size=16) if args.tiny else {}
    size = batch.get("train_batch_size", 256)
    config = GRPOConfig(
        n_grpo_steps=steps,
        temperature=1.0,
        min_tokens=tokens,
        max_tokens=tokens,
        gradient_accumulation_steps=size // args.microbatch,
        max_tokens_per_microbatch=setting.budget,
        compile_layers="auto" if setting.variant == "auto" else False,
        **batch,
    )
    engine = use_sampler(
        HFEngine(engine_model, tokenizer, batch_size=config.rollout_batch_size, shrink=shrink), setting.sampler
    )
    before = compiled_graphs()
    with forced_lengths(engine, SHORTEST, tokens) if lengths == "varied" else contextlib.nullcontext():
        return steps_of(model, tokenizer, engine, config, lambda: {"graphs": compiled_graphs() - before})


def settings_of(args) -> list[Setting]:
    """The configurations to measure: ``--modes`` by name, else the cross product of the options."""
    if args.modes:
        return [
            Setting(variant, budget, policy_dtype=dtype, cap_gib=cap, name=mode, **ENGINE_DEFAULTS)
            for mode, (variant, budget, dtype, cap) in ((m, MODES[m]) for m in args.modes)
        ]
    return [
        Setting(v, b or None, d, s, p, a)
        for v in args.variants
        for p in args.policy_dtypes
        for b in args.token_budgets
        for d in args.decodes
        for s in args.samplers
        for a in args.attentions
    ]


def microbatches_of(args, setting: Setting, settled: int | None) -> str:
    """The micro-batches column: by count, a fixed budget, or what auto settled on (and the mode's name)."""
    cut = cut_of(setting.budget, settled, f"{args.microbatch} rollouts")
    return f"{setting.name}: {cut}" if setting.name else cut


def measure(args, setting: Setting, lengths: str, device: str) -> tuple[list[str], str]:
    """One configuration's table row (a fresh model, compile cache and peak), and the model's description."""
    from a5core.loops import training
    from a5core.policy.causal_lm import compile_decoder_layers

    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    engine_model = model
    if setting.policy_dtype == "float32" and model.dtype != torch.float32:
        model = copy.deepcopy(engine_model).float()
    torch._dynamo.reset()  # a fresh model and compile cache per setting
    if setting.variant == "decoder":
        compile_decoder_layers(model, one_graph=True)
    elif setting.variant == "layers":
        compile_decoder_layers(model, activation_memory_budget=0.8)
    steps = args.steps if setting.budget is not None else (args.count_steps or args.steps)
    with use_attention(setting.attention), decode_mode(setting.decode) as shrink, memory_cap(setting.cap_gib):
        with budgets_seen(training) as budgets:
            history = run(model, engine_model, tokenizer, args, lengths, setting, shrink, steps)
    warm_steps = history[1:] or history
    warm = [m["time_step"] for m in warm_steps]
    last = history[-1]
    layers = "compile_layers auto" if setting.variant == "auto" else VARIANTS[setting.variant]
    row = [
        layers,
        str(model.dtype).removeprefix("torch."),
        lengths,
        microbatches_of(args, setting, budgets[-1].value if budgets else None),
        setting.decode,
        setting.sampler,
        setting.attention,
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
        "—" if setting.cap_gib is None else f"{setting.cap_gib:.0f}",
    ]
    return row, description


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
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        help="named configurations instead of the cross product of --variants, --token-budgets and "
        "--policy-dtypes (the first decode, sampler and attention): shipped, defaults, best, defaults capped",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, description = [], ""
    for lengths in args.lengths:
        for setting in settings_of(args):
            row, description = measure(args, setting, lengths, device)
            rows.append(row)
            print(row, flush=True)
    report(
        "One GRPO step at A5 defaults, hf backend, one GPU: micro-batches by count and by token budget, "
        "full-size and shrinking decode, samplers, policy dtype, decode attention, memory cap",
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
            *_modes.TIMING_COLUMNS,
            *[f"{p} s" for p in PHASES],
            "mean response tokens",
            "generate tok/s",
            "train tok/s",
            "passes/step",
            "shapes",
            *_modes.MEMORY_COLUMNS,
        ],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
