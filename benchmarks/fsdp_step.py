"""SFT optimizer-step time on 1 and 2 GPUs with FSDP2: the loop itself (a5core.loops.sft.train_sft), timed.

The Qwen2.5-Math-1.5B architecture (``--config``, a config.json) at random weights (bf16 by default)
trains on a fixed global batch (default 32 sequences × 1024 tokens, micro-batches of 4 per rank):
a few warm-up steps, then the median of the next ``--steps``. Each row: step time, tokens/s per GPU
(all positions of the batch), speed-up over the first row, peak memory of each rank. Sequences are
random token ids (a stand-in tokenizer reads ids written as text), so every one has exactly the
requested length.

    python benchmarks/fsdp_step.py                        # torchrun for 1, then 2 ranks: one table
    python benchmarks/fsdp_step.py --tiny                 # the same on CPU: tiny model, gloo
    torchrun --nproc-per-node 2 benchmarks/fsdp_step.py   # one world size, its own table

The table is printed and appended to benchmarks/RESULTS.md by rank 0 (or by the launcher).
Processes started here get ``NCCL_NVLS_ENABLE=0`` (no NVLink multicast).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # a5core and _report, however the script is started

import torch  # noqa: E402
from _model import TINY, random_model  # noqa: E402
from _report import report  # noqa: E402

DEFAULT_CONFIG = REPO.parent / "shared/data/qwen2.5-math-1.5b/config.json"
PROMPT_FRACTION = 8  # the first 1/8 of each sequence is prompt; the rest is response (the part trained on)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


class IdTokenizer:
    """A stand-in tokenizer: text is token ids separated by spaces ("17 4 9"); pad and eos are id 0."""

    pad_token_id = 0
    eos_token_id = 0

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [[int(t) for t in text.split()] for text in texts]}


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The architecture of ``--config`` (shrunk, with a 1,024-token vocabulary, with ``--tiny``) at seeded
    random weights."""
    overrides = {**TINY, "vocab_size": 1024} if args.tiny else None
    return random_model(args.config, getattr(torch, args.dtype), str(device), overrides)


def examples(args: argparse.Namespace, vocab_size: int) -> list:
    """``--batch`` sequences of ``--seq-len`` + 1 random ids (``--seq-len`` input positions each)."""
    from a5core.data.files import Trace

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab_size, (args.batch, args.seq_len + 1), generator=generator).tolist()
    prompt = args.seq_len // PROMPT_FRACTION
    return [Trace(" ".join(map(str, row[:prompt])), " ".join(map(str, row[prompt:])), "") for row in ids]


def worker(args: argparse.Namespace) -> dict:
    """One rank of a torchrun world: train ``--warmup + --steps`` SFT steps, time them on rank 0."""
    os.environ.update(NCCL_ENV)
    from a5core.loops.sft import SFTConfig, train_sft
    from a5core.runtime.distributed import gather_lists, init_from_env, shard

    rank, world = init_from_env()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core per rank, whatever their number: a fair comparison
    model = build_model(args, device)
    if world > 1 and args.keep_gathered:
        shard(model, reshard_after_forward=False)  # train_sft's setup_model keeps a sharded model as it is
    config = SFTConfig(
        learning_rate=1e-6,
        lr_schedule="constant",
        batch_size=args.batch,
        microbatch_size=args.micro,
        epochs=args.warmup + args.steps,
        max_seq_len=args.seq_len + 1,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    ends: list[float] = []  # rank 0's log call after each step (the loop reads its metrics: the step is done)
    train_sft(
        model,
        IdTokenizer(),
        examples(args, model.config.vocab_size),
        config,
        log=lambda metrics, step: ends.append(time.perf_counter()),
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks = gather_lists([peak])
    step_s = (
        statistics.median([b - a for a, b in zip(ends, ends[1:], strict=False)][-args.steps :])
        if rank == 0
        else float("nan")
    )
    return {"ranks": world, "step_s": step_s, "peak_gib": peaks, "backend": "nccl" if device.type == "cuda" else "gloo"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(args: argparse.Namespace, ranks: int) -> dict:
    """This script on ``ranks`` processes through torchrun, with the same settings; rank 0's result."""
    settings = [
        f"--config={args.config}",
        f"--batch={args.batch}",
        f"--seq-len={args.seq_len}",
        f"--micro={args.micro}",
        f"--warmup={args.warmup}",
        f"--steps={args.steps}",
        f"--dtype={args.dtype}",
    ]
    settings += ["--tiny"] * args.tiny + ["--gradient-checkpointing"] * args.gradient_checkpointing
    settings += ["--keep-gathered"] * args.keep_gathered
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            __file__,
            *settings,
            f"--result={result}",
        ]
        subprocess.run(command, env={**os.environ, **NCCL_ENV}, check=True)
        return json.loads(result.read_text())


def table(args: argparse.Namespace, results: list[dict]) -> None:
    """Print the rows and append them to RESULTS.md."""
    tokens = args.batch * args.seq_len  # per step, whatever the number of ranks
    base = results[0]
    rows = []
    for r in results:
        speedup = base["step_s"] / r["step_s"]
        efficiency = speedup * base["ranks"] / r["ranks"]
        rows.append(
            [
                r["ranks"],
                f"{r['step_s']:.3f}",
                f"{tokens / r['step_s'] / r['ranks']:,.0f}",
                f"{tokens / r['step_s']:,.0f}",
                f"{speedup:.2f}× ({efficiency:.0%})",
                " / ".join("-" if p is None else f"{p:.1f}" for p in r["peak_gib"]),
            ]
        )
    model = (
        f"{Path(args.config).parent.name}, shrunk to 2 layers, hidden 64"
        if args.tiny
        else Path(args.config).parent.name
    )
    checkpointing = ", gradient checkpointing" if args.gradient_checkpointing else ""
    sharding = "reshard_after_forward=False" if args.keep_gathered else "reshard_after_forward=True"
    settings = (
        f"{model}, random {args.dtype} weights; global batch {args.batch} × {args.seq_len} tokens, "
        f"micro-batch {args.micro} per rank; train_sft step (AdamW, clip 1.0{checkpointing}); median of "
        f"{args.steps} steps after {args.warmup} warm-up; one rank trains unsharded, several FSDP2-sharded "
        f"({base['backend']}, {sharding}); torch {torch.__version__}"
    )
    header = [
        "ranks",
        "step (s)",
        "tokens/s per GPU",
        "tokens/s",
        "speed-up (efficiency) vs first row",
        "peak memory per rank (GiB)",
    ]
    report(
        "FSDP2: SFT optimizer step on 1 vs N GPUs (a5core.loops.sft.train_sft)",
        settings,
        header,
        rows,
        record=not args.tiny,
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a model's config.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2 on CPU (gloo), a small batch: a check")
    parser.add_argument("--ranks", default="1,2", help="world sizes to launch, comma-separated (launcher mode)")
    parser.add_argument("--batch", type=int, help="sequences per optimizer step (default 32; 8 with --tiny)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 1024; 64 with --tiny)")
    parser.add_argument("--micro", type=int, help="micro-batch per rank (default 4; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (>= 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="weights (default bfloat16; tiny: float32)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="FSDP2 reshard_after_forward=False: weights stay gathered from forward to backward",
    )
    parser.add_argument("--result", help=argparse.SUPPRESS)  # a worker's JSON output (set by the launcher)
    args = parser.parse_args()
    defaults = (
        dict(batch=8, seq_len=64, micro=2, dtype="float32")
        if args.tiny
        else dict(batch=32, seq_len=1024, micro=4, dtype="bfloat16")
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the first step's time includes start-up)")
    if args.micro < 1 or args.batch % args.micro:
        parser.error(f"--batch ({args.batch}) must be a multiple of --micro ({args.micro})")
    if args.seq_len < PROMPT_FRACTION:
        parser.error(
            f"--seq-len must be >= {PROMPT_FRACTION} (the first 1/{PROMPT_FRACTION} of each sequence is prompt)"
        )
    if not all(n.strip().isdigit() and int(n) >= 1 for n in args.ranks.split(",")):
        parser.error(f"--ranks must be world sizes separated by commas, e.g. 1,2; got {args.ranks!r}")
    if not Path(args.config).is_file():  # --tiny shrinks this architecture
        parser.error(f"--config {args.config}: no such file")
    return args


def main() -> None:
    args = parse()
    if "RANK" in os.environ:  # a torchrun worker
        result = worker(args)
        if int(os.environ["RANK"]) == 0:
            if args.result:
                Path(args.result).write_text(json.dumps(result))
            else:
                table(args, [result])
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return
    table(args, [launch(args, int(n)) for n in args.ranks.split(",")])


if __name__ == "__main__":
    main()
