"""Weight push from the trainer to an engine in its own process on another GPU (RemoteEngine, hf backend).

The policy is the Qwen2.5-Math-1.5B architecture (``--config``) at random bf16 weights on cuda:0; it is
saved once (with the tokenizer) for the engine to start from, then changed (noise on every weight),
so the engine on cuda:1 differs from it until a push. Measured:

- ``load_weights``: median seconds of ``--pushes`` pushes (after one warm-up push) and GB/s, tensor
  by tensor and in flat buckets of each ``--bucket-mb`` size (weights over NCCL);
- ``generate``: one call (after a warm-up call), ``--prompts`` prompts × ``--max-tokens`` sampled
  tokens (min_tokens = max_tokens);
- the engine's log-probs of its greedy tokens against the policy's own (``get_response_log_probs``),
  max |difference| before the first push and after the last: the push must close the gap.

    python benchmarks/weight_push.py --config DIR/config.json [--tokenizer DIR]   # 2 GPUs
    python benchmarks/weight_push.py --tiny                                       # CPU check

``--tiny`` shrinks the model (2 layers, hidden 64, same vocabulary), runs both ends on the CPU (gloo,
float32) and only prints its table. Otherwise the table is appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast (the engine server sets it too)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from a5core.engines import SamplingSettings  # noqa: E402
from a5core.engines.remote import RemoteEngine  # noqa: E402
from a5core.engines.weight_sync import plan_buckets, policy_weights, specs_of  # noqa: E402
from a5core.policy.causal_lm import get_response_log_probs  # noqa: E402
from benchmarks._model import TINY, random_model  # noqa: E402
from benchmarks._report import report  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "shared/data/qwen2.5-math-1.5b/config.json"
QUESTIONS = [
    "Find the remainder when $2^{100}$ is divided by 7.",
    "What is the sum of the interior angles of a hexagon, in degrees?",
    "Solve for $x$: $3x + 7 = 22$.",
    "How many positive divisors does 360 have?",
]
CHECK = SamplingSettings(temperature=0, max_tokens=32, stop=(), logprobs=True)


@torch.no_grad()
def change(model) -> None:
    """Noise of the initial weights' scale on every parameter: the engine's copy is now stale."""
    generator = torch.Generator(device=model.device).manual_seed(1)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype) * 0.02)


@torch.no_grad()
def log_prob_gap(engine: RemoteEngine, model, tokenizer) -> float:
    """Max |engine log-prob − policy log-prob| over the engine's greedy tokens for ``QUESTIONS``."""
    gap = 0.0
    for question, (completion,) in zip(QUESTIONS, engine.generate(QUESTIONS, CHECK), strict=True):
        prompt_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + list(completion.token_ids)], device=model.device)
        policy = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"][0, len(prompt_ids) - 1 :]
        gap = max(gap, (policy.float().cpu() - torch.tensor(completion.log_probs)).abs().max().item())
    return gap


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_pushes(engine: RemoteEngine, model, pushes: int, device: str) -> float:
    """Median seconds of ``pushes`` pushes, after one warm-up push."""
    engine.load_weights(model)
    seconds = []
    for _ in range(pushes):
        sync(device)
        start = time.perf_counter()
        engine.load_weights(model)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the model's config.json")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer folder (default: the config's folder)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script only")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--bucket-mb", default="0,256,1024", help="bucket sizes to time, MiB (0: tensor by tensor)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    buckets_mib = [int(size) for size in args.bucket_mb.split(",") if size.strip().isdigit()]
    if len(buckets_mib) != len(args.bucket_mb.split(",")) or min(args.pushes, args.prompts, args.max_tokens) < 1:
        parser.error("--bucket-mb takes integers >= 0 separated by commas; --pushes, --prompts, --max-tokens >= 1")
    from transformers import AutoTokenizer

    on_gpu = not args.tiny
    if on_gpu and torch.cuda.device_count() < 2:
        parser.error(f"needs 2 GPUs, found {torch.cuda.device_count()} (use --tiny on a CPU)")
    policy_device, engine_device = ("cuda:0", "cuda:1") if on_gpu else ("cpu", "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu:
        torch.cuda.set_device(policy_device)  # the trainer's end of the NCCL group
    else:
        torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.config.parent)
    model = random_model(args.config, dtype, policy_device, TINY if args.tiny else None).eval()
    specs = specs_of(policy_weights(model))
    gigabytes = sum(spec.nbytes for spec in specs) / 1e9
    rows = []
    with tempfile.TemporaryDirectory(prefix="weight_push_") as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        change(model)
        with RemoteEngine(
            folder, "hf", device=engine_device, dtype=dtype, threads=None if on_gpu else 1, batch_size=args.prompts
        ) as engine:
            gap_before = log_prob_gap(engine, model, tokenizer)
            for mib in buckets_mib:
                engine.bucket_bytes = mib << 20
                seconds = time_pushes(engine, model, args.pushes, policy_device)
                broadcasts = len(plan_buckets(specs, engine.bucket_bytes))
                setting = f"{mib} MiB buckets" if mib else "tensor by tensor"
                plural = "s" if broadcasts > 1 else ""
                rows.append(
                    [
                        "load_weights",
                        f"{setting} ({broadcasts} broadcast{plural}, {gigabytes:.2f} GB)",
                        f"{seconds:.3f}",
                        f"{gigabytes / seconds:.1f} GB/s",
                    ]
                )
            gap_after = log_prob_gap(engine, model, tokenizer)
            sampling = SamplingSettings(
                temperature=1.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens, stop=(), seed=0
            )
            prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
            engine.generate(prompts, sampling)  # warm-up: the engine may compile for these shapes
            start = time.perf_counter()
            groups = engine.generate(prompts, sampling)
            seconds = time.perf_counter() - start
    tokens = sum(len(group[0].token_ids) for group in groups)
    rows.append(
        [
            "generate",
            f"{args.prompts} prompts × {args.max_tokens} tokens, T=1",
            f"{seconds:.2f}",
            f"{tokens / seconds:.0f} tok/s",
        ]
    )
    rows.append(
        [
            "log-probs vs policy",
            f"greedy {CHECK.max_tokens} tokens × {len(QUESTIONS)} prompts",
            "",
            f"max abs diff {gap_before:.3g} before the first push, {gap_after:.3g} after",
        ]
    )
    model_name = "tiny Qwen2 (2 layers, hidden 64)" if args.tiny else f"{args.config.parent.name} architecture"
    settings = (
        f"{model_name}, random {str(dtype).removeprefix('torch.')} weights, policy on {policy_device}, "
        f"RemoteEngine(hf) on {engine_device}, {'NCCL' if on_gpu else 'gloo'}; torch {torch.__version__}; "
        f"median of {args.pushes} pushes after a warm-up"
    )
    report(
        "Weight push: trainer → engine process (RemoteEngine)",
        settings,
        ["measure", "setting", "seconds", "rate / check"],
        rows,
        record=on_gpu,
    )


if __name__ == "__main__":
    main()
