"""One GRPO step with the engine in a process of its own: synchronous against one-step-off.

The policy (Qwen2.5-Math-1.5B's architecture at random weights, compiled decoder layers, micro-batches by
``--token-budget``) trains on cuda:0; the engine is a RemoteEngine (hf backend) on ``--engine-device``, started
from the policy's weights saved once and sent them every step: over NCCL to a GPU of its own (cuda:1), through
host memory (gloo) to the policy's own GPU (cuda:0, one-step-off on one GPU). ``pipeline_depth`` 0 pushes the
weights, generates, then trains; 1 generates step k+1's rollouts while step k trains (:mod:`a5core.loops.grpo`).
Both use truncated importance sampling (``tis_cap`` 2.0, the engine returning its log-probs), as the flow's
``grpo_async_ablation`` runs them. 256 rollouts (32 × 8) a step, train batch 256, responses fixed at
``--response`` tokens (``min_tokens`` = ``max_tokens``: random weights never stop, and the engine's process
cannot take ``benchmarks/_lengths.py``'s forced lengths). Each depth runs ``--steps`` steps in this one process,
one after the other, on the same engine.

Reported per depth: the first step (it compiles) apart, then the warm steps' median and maximum, each phase's
median (``generate`` is the engine's time, in the background at depth 1; ``wait_rollouts`` is how long the
trainer waited for them), the fraction of generation hidden behind training (1 − wait_rollouts / generate)
and the warm median against depth 0's. Target: depth 1 at ≤ 0.6× the time of depth 0.

    python benchmarks/async_step.py [--model-dir DIR] [--steps 11] [--depths 0 1] [--token-budget 32768]
    python benchmarks/async_step.py --engine-device cuda:0     # one GPU: the engine beside the policy
    python benchmarks/async_step.py --tiny --steps 3      # CPU check: both ends on the CPU (gloo), not recorded
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (the engine server sets it too)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks.grpo_step import steps_of  # noqa: E402

PHASES = ("weight_sync", "generate", "wait_rollouts", "grade", "old_log_probs", "train")


def run(model, tokenizer, engine, args, depth: int) -> list[dict]:
    """``args.steps`` GRPO steps of ``model`` at ``pipeline_depth`` ``depth``, rollouts from ``engine``;
    each step's logged metrics with the trainer GPU's peak memory."""
    from a5core.loops.grpo import GRPOConfig

    batch = dict(rollout_batch_size=16, train_batch_size=16) if args.tiny else {}
    config = GRPOConfig(
        n_grpo_steps=args.steps,
        temperature=1.0,
        min_tokens=args.response,
        max_tokens=args.response,
        gradient_accumulation_steps=batch.get("train_batch_size", 256) // 2,
        max_tokens_per_microbatch=args.token_budget or None,
        pipeline_depth=depth,
        tis_cap=2.0,
        **batch,
    )
    return steps_of(model, tokenizer, engine, config)


def median(steps: list[dict], key: str) -> float:
    return statistics.median(m.get(key, 0.0) for m in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--steps", type=int, default=11, help="GRPO steps per depth (the first compiles)")
    parser.add_argument("--depths", type=int, nargs="+", choices=(0, 1), default=[0, 1], help="pipeline_depth")
    parser.add_argument("--response", type=int, default=400, help="tokens per response")
    parser.add_argument(
        "--token-budget", type=int, default=32768, help="max_tokens_per_microbatch (0: micro-batches of 2 rollouts)"
    )
    parser.add_argument(
        "--engine-device", default="cuda:1", help="the engine's GPU: cuda:1 (its own) or cuda:0 (the policy's)"
    )
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step compiles and is reported apart")
    from a5core.engines.remote import RemoteEngine, weight_transport
    from a5core.policy.causal_lm import compile_decoder_layers

    on_gpu = not args.tiny
    policy_device, engine_device = ("cuda:0", args.engine_device) if on_gpu else ("cpu", "cpu")
    needed = (torch.device(engine_device).index or 0) + 1
    if on_gpu and torch.cuda.device_count() < needed:
        parser.error(f"--engine-device {engine_device}: found {torch.cuda.device_count()} GPUs (use --tiny on a CPU)")
    transport = "NCCL" if weight_transport(engine_device, policy_device) == "cuda" else "gloo, through host memory"
    if on_gpu:
        torch.cuda.set_device(policy_device)  # the trainer's end of the weight transport
    else:
        torch.set_num_threads(1)
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, policy_device)
    rows, baseline = [], None
    with tempfile.TemporaryDirectory(prefix="async_step_") as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if on_gpu:
            compile_decoder_layers(model, activation_memory_budget=0.8)
        batch_size = 16 if args.tiny else 256
        with RemoteEngine(
            folder, "hf", device=engine_device, dtype=model.dtype, threads=None if on_gpu else 1, batch_size=batch_size
        ) as engine:
            for depth in args.depths:
                history = run(model, tokenizer, engine, args, depth)
                warm = history[1:]
                step_median = median(warm, "time_step")
                baseline = step_median if depth == 0 else baseline
                generate, waited = median(warm, "time_generate"), median(warm, "time_wait_rollouts")
                rows.append(
                    [
                        f"{depth} ({'one-step-off' if depth else 'synchronous'})",
                        f"{len(warm)}",
                        f"{history[0]['time_step']:.2f}",
                        f"{step_median:.2f}",
                        f"{max(m['time_step'] for m in warm):.2f}",
                        *[f"{median(warm, f'time_{p}'):.2f}" for p in PHASES],
                        f"{1 - waited / generate:.0%}" if depth and generate else "—",
                        f"{step_median / baseline:.2f}×" if baseline else "—",
                        f"{median(warm, 'policy_lag'):.0f}",
                        f"{max(m['peak_gib'] for m in history):.1f}",
                    ]
                )
                print(rows[-1], flush=True)
    budget = f"budget {args.token_budget:,}" if args.token_budget else "micro-batches of 2 rollouts"
    report(
        "One GRPO step, engine in a process of its own: synchronous against one-step-off (pipeline_depth)",
        f"{description}, policy on {policy_device} ({'compiled' if on_gpu else 'eager'} decoder layers, {budget}), "
        f"RemoteEngine(hf) on "
        f"{engine_device}, weights over {transport} every step · "
        f"{'16' if args.tiny else '256'} rollouts a step, train batch the same, reinforce_with_baseline, tis_cap 2.0 · "
        f"responses fixed at {args.response} tokens · the first step compiles; median and max of the warm steps "
        f"after it · torch {torch.__version__} · target: depth 1 ≤ 0.6× depth 0",
        [
            "pipeline_depth",
            "warm steps",
            "first step s",
            "warm median s",
            "warm max s",
            *[f"{p} s" for p in PHASES],
            "generation hidden",
            "vs depth 0",
            "policy lag",
            "trainer peak GiB",
        ],
        rows,
        record=on_gpu,
    )


if __name__ == "__main__":
    main()
