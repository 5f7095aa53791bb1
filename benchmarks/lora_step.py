"""SFT optimizer steps with full fine-tuning beside LoRA adapters, on the 1.5B architecture: time and memory.

Random bf16 weights (speed and memory do not depend on their values), ``--batch`` sequences of ``--tokens``
tokens a step in micro-batches of ``--micro``, AdamW; full fine-tuning first (today's path), then each
``--ranks`` LoRA rank on every linear layer of the decoder, each on a fresh model in the same run. The first
``--warmup`` steps are left out; the median of the rest is reported, with the peak memory and the
trainable parameters.

    python benchmarks/lora_step.py [--model-dir DIR] [--ranks 16 64] [--steps 6] [--tiny]
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


def run(args, rank: int) -> tuple[list, str]:
    """One row (setting, median step seconds, tokens/s, peak GiB, trainable parameters) and the model's
    description."""
    from a5core.data.files import Trace
    from a5core.loops.sft import SFTConfig, train_sft

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    words = " ".join(["step"] * args.tokens)
    examples = [Trace(f"Question {i}:", words, "") for i in range(args.batch * args.steps)]
    times: list[float] = []
    last = [time.perf_counter()]

    def log(metrics, step):
        _model.cuda_sync()
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    config = SFTConfig(
        learning_rate=1e-5,
        batch_size=args.batch,
        microbatch_size=args.micro,
        epochs=1,
        max_seq_len=args.tokens,
        lora_rank=rank,
        lora_alpha=2.0 * max(rank, 1),
    )
    _model.reset_peak()
    train_sft(model, tokenizer, examples, config, log=log)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    warm = times[args.warmup :] or times
    seconds = statistics.median(warm)
    label = "full fine-tuning" if not rank else f"LoRA r={rank}, all linear layers"
    speed = f"{args.batch * args.tokens / seconds:,.0f}"
    return [label, f"{seconds:.3f}", speed, f"{_model.peak_gib():.1f}", f"{trainable / 1e6:,.2f}M"], description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rows, description = [], ""
    for rank in [0, *args.ranks]:
        row, description = run(args, rank)
        rows.append(row)
        print(row, flush=True)
    report(
        "SFT step: full fine-tuning and LoRA",
        f"{description} · {args.batch} sequences × {args.tokens} tokens a step, micro-batches of {args.micro}, "
        f"AdamW · median of {args.steps - args.warmup} steps after {args.warmup} · torch {torch.__version__}",
        ["setting", "step s", "tokens/s", "peak GiB", "trainable"],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
