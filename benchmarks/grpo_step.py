"""One GRPO step at the A5 defaults on one GPU with the hf backend, phase by phase.

256 rollouts (32 questions × group 8), responses fixed at 400 tokens (``min_tokens`` = ``max_tokens``:
random weights never write ``</answer>``), train batch 256 in 128 micro-batches of 2, one epoch,
reinforce_with_baseline, graded by the project's r1_zero reward. The engine decodes with the policy's
own weights (colocated: no copy, the weight sync is a no-op). The first step compiles (CUDA graph of
the decode step; compiled decoder layers when asked) and is reported apart. Target (issue 7): ≤ 10 s.

    python benchmarks/grpo_step.py [--model-dir DIR] [--steps 3] [--tiny]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model  # noqa: E402
from benchmarks._report import report  # noqa: E402

PHASES = ("weight_sync", "generate", "grade", "old_log_probs", "train")
VARIANTS = {
    "eager": "eager decoder layers",
    "layers": "compiled decoder layers (activation budget 0.8)",
    "decoder": "decoder compiled as one graph",
}


def problems_of(count: int):
    from a5core.data import Problem

    return [
        Problem(f"bench/{i}", f"What is {i} + {2 * i}? Show your work step by step before answering.", str(3 * i))
        for i in range(count)
    ]


def run(model, tokenizer, args) -> list[dict]:
    from a5core.grading import r1_zero_reward_fn
    from a5core.grpo import GRPOConfig, grpo
    from a5core.prompts import load_prompt
    from a5core.rollout.hf import HFEngine

    sampling = dict(temperature=1.0, min_tokens=args.response, max_tokens=args.response)
    config = GRPOConfig(n_grpo_steps=args.steps, **sampling)
    if args.tiny:
        config = GRPOConfig(
            n_grpo_steps=args.steps,
            rollout_batch_size=16,
            train_batch_size=16,
            gradient_accumulation_steps=8,
            **sampling,
        )
    engine = HFEngine(model, tokenizer, batch_size=config.rollout_batch_size)
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
        log=lambda metrics, step: history.append(dict(metrics, step=step, peak_gib=_model.peak_gib())),
    )
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--response", type=int, default=400)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="how the training forward runs: eager, compiled layer by layer, or as one graph",
    )
    args = parser.parse_args()
    from a5core.policy import compile_decoder_layers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    rows = []
    for variant in args.variants:
        if variant != "eager":  # a fresh model: earlier variants' compiled modules are not reused
            model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
            torch._dynamo.reset()
            if variant == "decoder":  # micro-batches of 2 need no memory budget (the partitioner's search is slow)
                compile_decoder_layers(model, one_graph=True)
            else:
                compile_decoder_layers(model, activation_memory_budget=0.8)
        label = VARIANTS[variant]
        for metrics in run(model, tokenizer, args):
            which = "first (compiles)" if metrics["step"] == 1 else "warm"
            phases = [f"{metrics.get(f'time_{p}', 0.0):.2f}" for p in PHASES]
            total = metrics["time_step"]
            rows.append(
                [
                    label,
                    which,
                    *phases,
                    f"{total:.2f}",
                    f"{metrics['generate_tokens_per_s']:,.0f}",
                    f"{metrics['train_tokens_per_s']:,.0f}",
                    f"{metrics['peak_gib']:.1f}",
                    "yes" if total <= 10 and which == "warm" else "—",
                ]
            )
            print(rows[-1], flush=True)
    report(
        "One GRPO step at A5 defaults, hf backend, one GPU",
        f"{description} · 256 rollouts (32 × 8), responses 400 tokens, train batch 256 = 128 micro-batches × 2, "
        f"reinforce_with_baseline, masked_mean, AdamW · engine colocated (shares the policy's weights) · "
        f"torch {torch.__version__} · target ≤ 10 s",
        [
            "training layers",
            "step",
            *[f"{p} s" for p in PHASES],
            "step s",
            "generate tok/s",
            "train tok/s",
            "peak GiB",
            "≤ 10 s",
        ],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
