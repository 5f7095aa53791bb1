"""SFT optimizer steps through the project's loop under named configurations: time, memory, micro-batches.

``--batch`` sequences (32: the ``a5`` profile's ``batch_size``) a step through :func:`a5core.loops.sft.train_sft`,
the profile's other settings as ``SFTConfig`` defaults them (``microbatch_size`` 2, ``max_seq_len`` 1,024,
AdamW), on Qwen2.5-Math-1.5B's architecture at random weights (``benchmarks/_model.py``). Each sequence is
a short prompt and a response of one repeated token: ``fixed`` (every sequence ``--tokens`` tokens) or
``varied`` (each sequence's length drawn log-uniformly between 30 and ``--tokens``, as
``benchmarks/_lengths.py`` draws responses).

``--modes`` (``benchmarks/_modes.py``, shared with ``grpo_step.py``): ``shipped``, the profile as it was
before ``auto`` (fp32 policy under bf16 autocast on CUDA, eager layers, micro-batches of 2 sequences);
``defaults``, the defaults now (fp32 policy; ``compile_layers`` and ``max_tokens_per_microbatch`` ``auto``); ``best``,
the best hand-set configuration (bf16 policy, compiled layers, budget 32,768); ``defaults-80g`` and
``defaults-40g``, the defaults with the process capped to 80 and 40 GiB
(``torch.cuda.set_per_process_memory_fraction``; the cap is skipped on the CPU). Each mode runs on a fresh
model and compile cache. The budget ``auto`` settled on is in the micro-batches column; a run that runs out of
memory keeps its row, with the steps it finished. The first step compiles and is reported apart; the warm
steps' median and maximum are the figures.

    python benchmarks/sft_step.py [--model-dir DIR] [--modes shipped defaults best defaults-80g defaults-40g]
        [--lengths fixed varied] [--steps 6] [--batch 32] [--tokens 1024] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model, _modes  # noqa: E402
from benchmarks._lengths import drawn_lengths  # noqa: E402
from benchmarks._modes import MODES, budgets_seen, cut_of, memory_cap  # noqa: E402
from benchmarks._report import report  # noqa: E402

SHORTEST = 30  # the varied lengths' lower end, tokens
PROMPT = "Question:"
COMPILE_LAYERS = {"eager": False, "layers": True, "auto": "auto"}  # a mode's layers → SFTConfig.compile_layers


def examples_of(tokenizer, lengths: str, count: int, tokens: int) -> list:
    """``count`` traces (a5core.data.files.Trace) of ``tokens`` tokens each, prompt and response (``fixed``), or of
    lengths drawn log-uniformly between SHORTEST and ``tokens`` (``varied``, seeded)."""
    from a5core.data.files import Trace

    prompt_tokens = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    sizes = [tokens] * count if lengths == "fixed" else drawn_lengths(count, SHORTEST, tokens, seed=0)
    return [Trace(PROMPT, " step" * (size - prompt_tokens), "") for size in sizes]


@contextlib.contextmanager
def timed_steps() -> Iterator[list[dict]]:
    """The optimizer steps :func:`a5core.loops.sft.train_sft` takes inside: each one's metrics with ``seconds`` (its
    wall time, the GPU synchronised), ``peak_gib`` (the peak memory so far) and ``graphs`` (the graphs
    torch.compile built since the context opened)."""
    from a5core.loops import sft
    from a5core.policy.causal_lm import compiled_graphs

    history: list[dict] = []
    real, before = sft.sft_step, compiled_graphs()

    def timed(*args, **kwargs) -> dict[str, float]:
        _model.cuda_sync()
        start = time.perf_counter()
        metrics = real(*args, **kwargs)
        _model.cuda_sync()
        seconds = time.perf_counter() - start
        history.append(dict(metrics, seconds=seconds, peak_gib=_model.peak_gib(), graphs=compiled_graphs() - before))
        return metrics

    sft.sft_step = timed
    try:
        yield history
    finally:
        sft.sft_step = real


def layers_of(config, device: str) -> str:
    """The training layers column: what ran, and whether ``auto`` chose it."""
    layers = "compiled decoder layers" if config.speed.compiles(torch.device(device)) else "eager decoder layers"
    return f"compile_layers auto: {layers}" if config.compile_layers == "auto" else layers


def figures(history: list[dict]) -> list[str]:
    """First step s, warm median s, warm max s, tokens/s (response tokens trained, median of the warm steps),
    graphs compiled by the first step → the last, peak GiB; dashes where no step finished."""
    if not history:
        return ["—"] * 6
    warm = history[1:] or history
    seconds = [m["seconds"] for m in warm]
    return [
        f"{history[0]['seconds']:.2f}",
        f"{statistics.median(seconds):.2f}",
        f"{max(seconds):.2f}",
        f"{statistics.median(m['tokens'] / m['seconds'] for m in warm):,.0f}",
        f"{history[0]['graphs']} → {history[-1]['graphs']}",
        f"{max(m['peak_gib'] for m in history):.1f}",
    ]


def measure(args, name: str, lengths: str, device: str) -> tuple[list[str], str]:
    """One mode's table row (a fresh model, compile cache and peak), and the model's description."""
    from a5core.loops import training
    from a5core.loops.sft import SFTConfig, train_sft

    mode = MODES[name]
    model, tokenizer, description = _model.build(args.model_dir, args.tiny, device)
    if mode.policy_dtype == "float32":
        model.float()  # the flows' default; a bf16 policy is the model as built (bf16 on CUDA, fp32 on the CPU)
    torch._dynamo.reset()
    config = SFTConfig(
        batch_size=args.batch,
        epochs=1,
        max_tokens_per_microbatch=mode.budget,
        compile_layers=COMPILE_LAYERS[mode.layers],
    )
    examples = examples_of(tokenizer, lengths, args.batch * args.steps, args.tokens)
    outcome = ""
    _model.reset_peak()
    with memory_cap(mode.cap_gib), budgets_seen(training) as budgets, timed_steps() as history:
        try:
            train_sft(model, tokenizer, examples, config)
        except torch.OutOfMemoryError as error:
            print(f"{name}: {error}", file=sys.stderr, flush=True)
            outcome = ", out of memory"
    settled = budgets[-1].value if budgets else None
    first, median, most, speed, graphs, peak = figures(history)
    row = [
        name,
        layers_of(config, device),
        str(model.dtype).removeprefix("torch."),
        lengths,
        cut_of(mode.budget, settled, f"{config.microbatch_size} sequences"),
        f"{len(history)} of {args.steps}{outcome}",
        first,
        median,
        most,
        speed,
        graphs,
        peak,
        "—" if mode.cap_gib is None else f"{mode.cap_gib:.0f}",
    ]
    return row, description


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _model.add_arguments(parser)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="named configurations")
    parser.add_argument("--lengths", nargs="+", choices=("fixed", "varied"), default=["fixed"])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per mode (the first compiles)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per optimizer step (batch_size)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (varied: the longest)")
    args = parser.parse_args(argv)
    from a5core.loops.sft import SFTConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, description = [], ""
    for lengths in args.lengths:
        for name in args.modes:
            row, description = measure(args, name, lengths, device)
            rows.append(row)
            print(row, flush=True)
    report(
        "SFT optimizer steps through the loop, one GPU: the a5 profile as shipped, the auto defaults, the best "
        "hand-set, the defaults with memory capped",
        f"{description} (the policy: its column) · {args.batch} sequences a step of {args.tokens} tokens, or "
        f"varied log-uniform {SHORTEST}–{args.tokens} · max_seq_len {SFTConfig().max_seq_len}, AdamW, bf16 "
        "autocast on CUDA · the first step compiles; median and max of the warm steps after it · tokens/s: "
        f"response tokens trained · torch {torch.__version__}",
        [
            "mode",
            "training layers",
            "policy",
            "lengths",
            "micro-batches",
            "steps",
            *_modes.TIMING_COLUMNS,
            "tokens/s",
            *_modes.MEMORY_COLUMNS,
        ],
        rows,
        record=not args.tiny,
    )


if __name__ == "__main__":
    main()
