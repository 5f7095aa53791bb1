"""vLLM beside a5's hf engine on one GPU: rollouts, the weight push, and one GRPO step at the A5 settings.

The policy is Qwen2.5-Math-1.5B's architecture at seeded random bf16 weights, saved once (with the tokenizer)
to a temporary folder for vLLM to start from. Random weights never write EOS, so response lengths are forced:
``fixed`` (every response runs to its length: ``min_tokens`` = ``max_tokens``) or ``varied`` (lengths drawn
log-uniformly between 30 and the maximum, ``benchmarks/_lengths.py``; vLLM gets them as per-request
``min_tokens`` = ``max_tokens``, the hf engine as an EOS forced into its sampler).

- ``rollouts``: batch 256 × 200-token prompts, 512 new tokens at temperature 1 (vLLM at ``--memory-fraction``);
  tok/s fixed and varied, after one warm-up call each; each engine in ``--processes`` processes (default 3), one
  after another, each figure their median with their range.
- ``push``: ``VLLMEngine.load_weights`` of the 1.5B policy, median of ``--pushes`` (after one), awake and asleep
  (``sleep_when_idle``: the push first maps the weights back).
- ``grpo``: ``--steps`` GRPO steps, 256 rollouts (32 × 8) of 400 tokens (or 30–1,024), train batch 256, bf16
  policy with compiled decoder layers and ``max_tokens_per_microbatch`` ``--token-budget``: ``backend: hf`` (the
  engine decodes the policy itself), ``backend: vllm`` sleeping beside the policy with its memory share and KV
  cache sized by the flows' rule (``a5core.engines.colocate``), and vLLM awake throughout at a fixed
  ``gpu_memory_utilization`` (0.3, the old default); each
  setting in its own process; the GPU's used memory sampled every 10 ms (vLLM's memory included).

    python benchmarks/vllm_engine.py rollouts [--lengths fixed varied] [--engines vllm hf] [--processes 3]
    python benchmarks/vllm_engine.py push
    python benchmarks/vllm_engine.py grpo [--settings hf vllm vllm-awake] [--lengths fixed varied] [--steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # its sampler compiles kernels at first use

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _model  # noqa: E402
from benchmarks._lengths import drawn_lengths, forced_lengths  # noqa: E402
from benchmarks._report import report  # noqa: E402
from benchmarks.rollout import timed  # noqa: E402

SHORTEST = 30
PHASES = ("weight_sync", "generate", "grade", "old_log_probs", "train")


class DeviceMemory:
    """The GPU's used memory (total − free, every process and allocator) sampled every 10 ms: ``peak_gib``."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while torch.cuda.is_available() and not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.01)

    def __enter__(self) -> DeviceMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gib(self) -> float:
        return self.peak / 2**30


def saved_model(args, folder: Path):
    """The random bf16 policy on the GPU, saved with its tokenizer to ``folder`` for vLLM."""
    model, tokenizer, description = _model.build(
        args.model_dir, args.tiny, "cuda" if torch.cuda.is_available() else "cpu"
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return model, tokenizer, description


@contextlib.contextmanager
def vllm_lengths(engine, low: int, high: int, seed: int = 0):
    """While open, ``engine`` (a VLLMEngine) gives request i of each call its drawn length as ``min_tokens`` =
    ``max_tokens`` (all samples of one request share it)."""
    generate = engine.llm.generate

    def varied(prompts, params, **kwargs):
        lengths = drawn_lengths(len(prompts), low, min(high, params.max_tokens), seed)
        per_request = []
        for length in lengths:
            request = params.clone()
            request.max_tokens = request.min_tokens = length
            per_request.append(request)
        return generate(prompts, per_request, **kwargs)

    engine.llm.generate = varied
    try:
        yield
    finally:
        engine.llm.generate = generate


def rollout_one(args) -> dict:
    """One engine's (``--engine``) rollouts in this process: its first call's seconds, then fixed and (with
    ``varied`` in ``--lengths``) varied lengths, each after a warm-up call."""
    from a5core.engines import SamplingSettings
    from a5core.engines.hf import HFEngine
    from a5core.engines.vllm import VLLMEngine
    from benchmarks.rollout import prompts_of

    with tempfile.TemporaryDirectory() as folder:
        model, tokenizer, description = saved_model(args, Path(folder))
        prompts = prompts_of(tokenizer, args.batch, args.prompt, model.config.vocab_size)
        sampling = SamplingSettings(temperature=1.0, max_tokens=args.new, min_tokens=args.new, seed=0)
        if args.engine == "vllm":
            engine = VLLMEngine(folder, dtype="bfloat16", gpu_memory_utilization=args.memory_fraction)
            varied = vllm_lengths(engine, SHORTEST, args.new, seed=1)
            label = f"vLLM {engine._vllm.__version__}"
        else:
            engine = HFEngine(model, tokenizer, batch_size=args.batch)
            varied = forced_lengths(engine, SHORTEST, args.new, seed=1)
            label = "a5 hf engine"
        _, first = timed(lambda: engine.generate(prompts, sampling))
        groups, seconds = timed(lambda: engine.generate(prompts, sampling))
        assert all(len(group[0].token_ids) == args.new for group in groups)
        found = {"label": label, "description": description, "first": first, "seconds": seconds,
                 "fixed": len(prompts) * args.new / seconds}  # fmt: skip
        if "varied" in args.lengths:
            with varied:
                timed(lambda: engine.generate(prompts, sampling))  # the shapes they reach compile here
                groups, seconds = timed(lambda: engine.generate(prompts, sampling))
            generated = sum(len(group[0].token_ids) for group in groups)
            found |= {"varied_seconds": seconds, "varied": generated / seconds, "mean": generated / len(groups)}
    return found


def in_own_process(mode: str, *flags: str) -> dict | None:
    """This script's one-process ``mode`` (``rollout-one``, ``grpo-one``) with ``flags`` and this command's own
    arguments, in a fresh process: the JSON it prints last, or None (its output's tail printed) if it failed."""
    command = [sys.executable, __file__, mode, *flags, *sys.argv[2:]]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-6000:], flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float], form: str = "{:,.0f}") -> str:
    """``median (min–max, n processes)`` of one figure measured in several processes."""
    median = form.format(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({form.format(min(values))}–{form.format(max(values))}, {len(values)} processes)"


def rollouts(args) -> None:
    """Each engine in ``--processes`` processes of its own, one after another: a figure is their median, with
    their range (one process's tok/s can stray far from another's)."""
    rows, description = [], ""
    for name in args.engines:
        runs = []
        for _ in range(args.processes):
            if (found := in_own_process("rollout-one", "--engine", name)) is not None:
                runs.append(found)
        if not runs:
            rows.append([name, "failed", "", "", "", ""])
            continue
        description, label = runs[0]["description"], runs[0]["label"]
        fixed = [r["fixed"] for r in runs]
        rows.append([label, "fixed", spread([r["first"] for r in runs], "{:.1f}"),
                     spread([r["seconds"] for r in runs], "{:.2f}"), spread(fixed), "—"])  # fmt: skip
        print(rows[-1], flush=True)
        if "varied" in args.lengths:
            varied = [r["varied"] for r in runs]
            mean = statistics.median(r["mean"] for r in runs)
            rows.append([label, f"varied {SHORTEST}–{args.new} (mean {mean:.0f})", "—",
                         spread([r["varied_seconds"] for r in runs], "{:.2f}"), spread(varied),
                         f"{statistics.median(varied) / statistics.median(fixed):.0%}"])  # fmt: skip
            print(rows[-1], flush=True)
    report(
        "Rollouts: vLLM beside the hf engine",
        f"{description} · batch {args.batch} · {args.prompt}-token prompts · {args.new} new tokens · temperature 1 · "
        f"vLLM gpu_memory_utilization {args.memory_fraction}, CUDA graphs; hf: shrinking decode, Gumbel-max, sdpa · "
        f"each engine in {args.processes} processes: median (range) · torch {torch.__version__} · targets: vLLM "
        "≥ 50k tok/s, varied ≥ 80% of fixed",
        ["engine", "lengths", "first call s", "seconds", "new tok/s", "of fixed"],
        rows,
        record=not args.tiny,
    )


def push(args) -> None:
    from a5core.engines import SamplingSettings
    from a5core.engines.vllm import VLLMEngine

    check = SamplingSettings(temperature=0, max_tokens=16, stop=(), logprobs=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model, tokenizer, description = saved_model(args, Path(folder))
        engine = VLLMEngine(folder, dtype="bfloat16", gpu_memory_utilization=args.memory_fraction, sleep_when_idle=True)
        prompt = ["What is 2 + 3? Think step by step."]
        for asleep in (False, True):
            times = []
            for _ in range(args.pushes + 1):
                if asleep:
                    engine._sleep()
                else:
                    engine._wake(("weights", "kv_cache"))
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(1.0001)
                _, seconds = timed(lambda: engine.load_weights(model))
                times.append(seconds)
            median = statistics.median(times[1:])
            gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
            rows.append(["asleep (weights mapped back first)" if asleep else "awake", f"{median:.3f}",
                         f"{max(times[1:]):.3f}", f"{gb / median:.1f}"])  # fmt: skip
            print(rows[-1], flush=True)
        out = engine.generate(prompt, check)[0][0]
        ids = torch.tensor(
            [tokenizer(prompt[0], add_special_tokens=False)["input_ids"] + list(out.token_ids)], device="cuda"
        )
        from a5core.policy.causal_lm import get_response_log_probs

        with torch.no_grad():
            policy = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"][0, -len(out.token_ids) :]
        diff = (torch.tensor(out.log_probs, device="cuda") - policy.float()).abs().max().item()
    report(
        "Weight push into vLLM (in-process, reload_weights)",
        f"{description} · {args.pushes} pushes after one · engine vs policy log-prob max |diff| after the last push "
        f"{diff:.2e} · torch {torch.__version__} · target ≤ 0.5 s",
        ["engine state", "median s", "max s", "GB/s"],
        rows,
        record=not args.tiny,
    )


def grpo_setting(args) -> dict:
    """One GRPO setting (``args.setting``, ``args.length``) in this process: its warm steps and peak memory."""
    from a5core.engines.colocate import PROMPT_TOKENS, colocated_memory_fraction
    from a5core.engines.hf import HFEngine
    from a5core.engines.vllm import VLLMEngine
    from a5core.loops.grpo import GRPOConfig
    from a5core.policy.causal_lm import compile_decoder_layers
    from benchmarks.grpo_step import steps_of

    tokens = args.response if args.length == "fixed" else args.max_tokens
    batch = dict(rollout_batch_size=16, train_batch_size=16) if args.tiny else {}
    config = GRPOConfig(
        n_grpo_steps=args.steps,
        temperature=1.0,
        min_tokens=tokens,
        max_tokens=tokens,
        gradient_accumulation_steps=batch.get("train_batch_size", 256) // 2,
        max_tokens_per_microbatch=args.token_budget,
        **batch,
    )
    with tempfile.TemporaryDirectory() as folder, DeviceMemory() as memory:
        model, tokenizer, _ = saved_model(args, Path(folder))
        if args.setting == "hf":
            engine = HFEngine(model, tokenizer, batch_size=config.rollout_batch_size)
            lengths = forced_lengths(engine, SHORTEST, tokens)
        else:
            sleep = args.setting == "vllm"
            fraction = 0.3
            if sleep:  # the flows' rule: what is free less what the policy will hold (bf16, AdamW)
                free, total = torch.cuda.mem_get_info()
                count = model.num_parameters()  # bf16 weights already on the GPU; gradients and AdamW's moments to come
                fraction = colocated_memory_fraction(free, total, count * (2 + 8) + 2 * 2**30)
            kv_tokens = config.rollout_batch_size * (tokens + PROMPT_TOKENS) if sleep else None
            engine = VLLMEngine(
                folder,
                dtype="bfloat16",
                gpu_memory_utilization=fraction,
                sleep_when_idle=sleep,
                kv_cache_tokens=kv_tokens,
            )
            lengths = vllm_lengths(engine, SHORTEST, tokens)
        compile_decoder_layers(model, activation_memory_budget=0.8)
        with lengths if args.length == "varied" else contextlib.nullcontext():
            history = steps_of(model, tokenizer, engine, config)
    warm = history[1:] or history
    return {
        "first": history[0]["time_step"],
        "median": statistics.median(m["time_step"] for m in warm),
        "max": max(m["time_step"] for m in warm),
        "phases": {p: statistics.median(m.get(f"time_{p}", 0.0) for m in warm) for p in PHASES},
        "response_tokens": history[-1]["response_tokens_mean"],
        "generate_tok_s": statistics.median(m["generate_tokens_per_s"] for m in warm),
        "peak_gib": memory.peak_gib,
        "torch_peak_gib": max(m["peak_gib"] for m in history),
        "fraction": fraction if args.setting != "hf" else None,
    }


def grpo(args) -> None:
    labels = {
        "hf": "hf (decodes the policy itself)",
        "vllm": "vLLM, asleep while training (share and KV cache sized by the flows' rule)",
        "vllm-awake": "vLLM awake throughout (gpu_memory_utilization 0.3)",
    }
    rows = []
    for length in args.lengths:
        for setting in args.settings:
            r = in_own_process("grpo-one", "--setting", setting, "--length", length)
            if r is None:
                rows.append([labels[setting], length, "failed", *[""] * 10])
                continue
            fraction = "" if r["fraction"] is None else f" ({r['fraction']:.2f})"
            rows.append([labels[setting] + fraction, length, f"{r['first']:.1f}", f"{r['median']:.2f}",
                         f"{r['max']:.2f}", *[f"{r['phases'][p]:.2f}" for p in PHASES],
                         f"{r['response_tokens']:.0f}", f"{r['generate_tok_s']:,.0f}", f"{r['peak_gib']:.1f}",
                         f"{r['torch_peak_gib']:.1f}"])  # fmt: skip
            print(rows[-1], flush=True)
    report(
        "One GRPO step at the A5 settings: backend vllm beside backend hf",
        f"Qwen2.5-Math-1.5B architecture, random weights, bf16 policy, compiled decoder layers, "
        f"max_tokens_per_microbatch {args.token_budget:,} · 256 rollouts (32 × 8), train batch 256, one epoch, "
        f"reinforce_with_baseline · responses {args.response} tokens (fixed) or {SHORTEST}–{args.max_tokens} "
        f"(varied) · {args.steps} steps, the first reported apart · device peak: the GPU's used memory sampled "
        f"every 10 ms · torch {torch.__version__} · target (vLLM): median ≤ 4.5 s",
        [
            "engine",
            "lengths",
            "first step s",
            "warm median s",
            "warm max s",
            *[f"{p} s" for p in PHASES],
            "mean response tokens",
            "generate tok/s",
            "device peak GiB",
            "PyTorch peak GiB",
        ],  # fmt: skip
        rows,
        record=not args.tiny,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("rollouts", "rollout-one", "push", "grpo", "grpo-one"))
    _model.add_arguments(parser)
    parser.add_argument("--memory-fraction", type=float, default=0.4, help="vLLM's share (rollouts, push)")
    parser.add_argument("--engines", nargs="+", choices=("vllm", "hf"), default=["vllm", "hf"])
    parser.add_argument("--processes", type=int, default=3, help="processes an engine's rollouts run in, each anew")
    parser.add_argument("--lengths", nargs="+", choices=("fixed", "varied"), default=["fixed", "varied"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument(
        "--settings", nargs="+", choices=("hf", "vllm", "vllm-awake"), default=["hf", "vllm", "vllm-awake"]
    )
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps a setting (the first compiles)")
    parser.add_argument("--response", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--token-budget", type=int, default=32768)
    parser.add_argument("--setting", choices=("hf", "vllm", "vllm-awake"), help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=("vllm", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--length", choices=("fixed", "varied"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode in ("grpo-one", "rollout-one"):
        print(json.dumps(grpo_setting(args) if args.mode == "grpo-one" else rollout_one(args)))
        return
    {"rollouts": rollouts, "push": push, "grpo": grpo}[args.mode](args)


if __name__ == "__main__":
    main()
