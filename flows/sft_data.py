"""Stages ``sft_data``, ``sft_distill``, ``sft_filter``: the SFT trace sets, raw and filtered.

    python -m flows.sft_data math     --config params.yaml   # data/sft/math_solutions.jsonl
    python -m flows.sft_data traces   --config params.yaml   # data/sft/teacher_raw.jsonl
    python -m flows.sft_data distill  --config params.yaml   # data/sft/distilled_raw.jsonl
    python -m flows.sft_data filter   --config params.yaml   # data/sft/<set>_filtered.jsonl + metrics/sft_data.json

Settings come from params.yaml's ``sft_data`` section, deep-merged with
``profiles.<profile>.sft_data`` (so a profile may override one key of ``distill``).

- ``math``: MATH train solutions as r1_zero traces (a5core.sft_data.math_solution_traces); the 2
  problems with an empty ``\\boxed{}`` are skipped and named.
- ``traces``: a prompt/response/ground_truth file (``sft_data.traces``, the teacher sample by
  default), its prompts re-rendered with ``sft_data.prompt`` when ``reprompt_traces`` is on.
- ``distill``: teacher samples for MATH problems. **Opt-in** (``sft_data.distill.enabled``), because
  real distillation needs a teacher worth learning from: a model served behind an OpenAI-compatible
  ``/v1/completions`` endpoint (``teacher: openai``, e.g. ``vllm serve <model> --port 8000`` and
  ``base_url: http://127.0.0.1:8000/v1``; an API key is read from the environment variable named by
  ``api_key_env``, never from params) or a local model through a rollout engine (``teacher:
  engine``). Disabled, it writes an empty ``distilled_raw.jsonl`` so the DVC stage has its output,
  and the ``a5`` profile uses the teacher traces file instead. The ``cpu`` profile enables it with
  the embedded SmolLM2-135M on a handful of problems, to exercise the route, not to get good traces.
- ``filter``: per set, drop exact duplicates (``sft_data.dedup``), keep traces the r1_zero grader
  gives reward 1, write ``<set>_filtered.jsonl``; metrics per set: ``raw``, ``duplicates``,
  ``filtered``, ``kept_fraction`` (filtered / raw) and ``format_rate`` (of the deduplicated traces).
  An empty raw file (distillation disabled) gives an empty filtered file and null rates.

Every output is written atomically (temporary file, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from a5core.data import DataError, load_math, load_sft_traces, write_jsonl_atomic, write_text_atomic
from a5core.models import ModelResolutionError, resolve_model
from a5core.prompts import PromptTemplateError, load_prompt
from a5core.rollout import make_engine
from a5core.sft_data import (
    OpenAICompletionsTeacher,
    TeacherError,
    dedup_traces,
    distill,
    filter_correct,
    import_traces,
    math_solution_traces,
)
from flows.cli import ConfigError, cli_main, profile_name, read_config, section_settings
from flows.params import DistillParams, Prompt

OUT_DIR = Path("data/sft")
DEFAULT_SETS = {
    "math_solutions": OUT_DIR / "math_solutions.jsonl",
    "teacher": OUT_DIR / "teacher_raw.jsonl",
    "distilled": OUT_DIR / "distilled_raw.jsonl",
}
DEFAULT_METRICS = Path("metrics/sft_data.json")


class SftDataParams(Prompt):
    """The trace sets' settings; every set's prompts are written with ``prompt``."""

    model_config = ConfigDict(extra="forbid")

    math: str = Field("../shared/data/math/train.jsonl", description="MATH train problems with solutions")
    traces: str = Field(
        "../shared/data/sft/teacher_traces_sample.jsonl", description="prompt/response/ground_truth file"
    )
    reprompt_traces: bool = Field(True, description="re-render the trace file's prompts with `prompt`")
    dedup: bool = Field(True, description="drop exact duplicate traces before filtering")
    distill: DistillParams = DistillParams()


def load_params(config: str | os.PathLike | None) -> SftDataParams:
    """``sft_data`` of a params file, with its selected profile's ``sft_data`` deep-merged on top."""
    if config is None:
        return SftDataParams()
    document = read_config(config)
    if "sft_data" not in document:
        raise ConfigError(f"--config {config}: no `sft_data` section")
    profile = profile_name(document, None, config)
    try:
        return SftDataParams(**section_settings(document, "sft_data", profile, config))
    except ValidationError as e:
        raise ConfigError(f"--config {config}: invalid `sft_data` (profile {profile!r}):\n{e}") from None


def _records(traces) -> list[dict[str, str]]:
    return [{"prompt": t.prompt, "response": t.response, "ground_truth": t.ground_truth} for t in traces]


# ------------------------------------------------------------------------------------ subcommands


def write_math(params: SftDataParams, out: str | os.PathLike) -> dict[str, Any]:
    traces, skipped = math_solution_traces(load_math(params.math), load_prompt(params.prompt))
    write_jsonl_atomic(out, _records(traces))
    return {"traces": len(traces), "skipped": skipped, "out": str(out)}


def write_traces(params: SftDataParams, out: str | os.PathLike) -> dict[str, Any]:
    traces = import_traces(params.traces, load_prompt(params.prompt) if params.reprompt_traces else None)
    write_jsonl_atomic(out, _records(traces))
    return {"traces": len(traces), "out": str(out)}


def make_teacher(d: DistillParams) -> Any:
    """The teacher ``distill`` samples from: a server client, or a rollout engine (loads the model)."""
    if d.teacher == "openai":
        api_key = None
        if d.api_key_env:
            api_key = os.environ.get(d.api_key_env)
            if not api_key:
                raise DataError(f"sft_data.distill.api_key_env: environment variable {d.api_key_env} is not set")
        return OpenAICompletionsTeacher.served(d, d.model, api_key)
    return make_engine(resolve_model(d.model), d.backend, dtype=d.dtype)


def write_distill(params: SftDataParams, out: str | os.PathLike, teacher: Any = None) -> dict[str, Any]:
    """Distil (or, disabled, write an empty file). ``teacher`` overrides the one params describe."""
    d = params.distill
    if not d.enabled:
        write_jsonl_atomic(out, [])
        return {"traces": 0, "enabled": False, "out": str(out)}
    problems = load_math(d.problems)[: d.limit]
    template = load_prompt(params.prompt)
    traces = distill(problems, template, teacher or make_teacher(d), d.n, d.sampling_for(template))
    write_jsonl_atomic(out, _records(traces))
    return {"traces": len(traces), "enabled": True, "problems": len(problems), "out": str(out)}


def read_set(path: str | os.PathLike) -> list:
    """The traces of a raw set file; a file with no records (distillation disabled) is an empty set."""
    path = Path(path)
    if path.is_file() and not path.read_text(encoding="utf-8").strip():
        return []
    return load_sft_traces(path)


def write_filtered(
    sets: dict[str, str | os.PathLike],
    out_dir: str | os.PathLike,
    metrics_path: str | os.PathLike | None,
    dedup: bool = True,
) -> dict[str, dict[str, Any]]:
    """For each ``name → raw file``: dedup (optional), keep correct traces, write ``<name>_filtered.jsonl``."""
    metrics = {}
    for name, raw_path in sets.items():
        raw = read_set(raw_path)
        unique, duplicates = dedup_traces(raw) if dedup else (list(raw), 0)
        kept, stats = filter_correct(unique)
        write_jsonl_atomic(Path(out_dir) / f"{name}_filtered.jsonl", _records(kept))
        metrics[name] = {
            "raw": len(raw),
            "duplicates": duplicates,
            "filtered": len(kept),
            "kept_fraction": len(kept) / len(raw) if raw else None,
            "format_rate": stats["format_rate"],
        }
    if metrics_path:
        write_text_atomic(metrics_path, json.dumps(metrics, indent=2) + "\n")
    return metrics


# ------------------------------------------------------------------------------------------- CLI


def _set_arg(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name.isidentifier() or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


@cli_main("flows.sft_data")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, out, what in (
        ("math", DEFAULT_SETS["math_solutions"], "MATH solutions as traces"),
        ("traces", DEFAULT_SETS["teacher"], "import a trace file"),
        ("distill", DEFAULT_SETS["distilled"], "sample traces from a teacher"),
    ):
        sub = commands.add_parser(name, help=what)
        sub.add_argument("--config", help="params file with an `sft_data` section (default: built-in defaults)")
        sub.add_argument("--out", default=str(out))
    sub = commands.add_parser("filter", help="dedup + keep correct traces; sizes to the metrics file")
    sub.add_argument("--config")
    sub.add_argument(
        "--set",
        dest="sets",
        action="append",
        type=_set_arg,
        metavar="NAME=PATH",
        help="raw set to filter (repeatable; default: " + ", ".join(f"{k}={v}" for k, v in DEFAULT_SETS.items()) + ")",
    )
    sub.add_argument("--out-dir", default=str(OUT_DIR))
    sub.add_argument("--metrics", default=str(DEFAULT_METRICS))
    args = parser.parse_args(argv)

    start = time.monotonic()
    try:
        params = load_params(args.config)
        if args.command == "math":
            result = write_math(params, args.out)
            print(
                f"math_solutions: {result['traces']} traces → {args.out}; skipped (no or empty box): "
                f"{len(result['skipped'])} {result['skipped']}"
            )
        elif args.command == "traces":
            result = write_traces(params, args.out)
            print(f"teacher: {result['traces']} traces from {params.traces} → {args.out}")
        elif args.command == "distill":
            result = write_distill(params, args.out)
            if result["enabled"]:
                print(f"distilled: {result['traces']} traces from {result['problems']} problems → {args.out}")
            else:
                print(f"distilled: disabled (sft_data.distill.enabled: false) → empty {args.out}")
        else:
            metrics = write_filtered(dict(args.sets or DEFAULT_SETS), args.out_dir, args.metrics, params.dedup)
            for name, m in metrics.items():
                rate = "-" if m["kept_fraction"] is None else f"{m['kept_fraction']:.3f}"
                print(
                    f"{name:16} raw {m['raw']:>6}  duplicates {m['duplicates']:>4}  "
                    f"filtered {m['filtered']:>6}  kept {rate}"
                )
    except (DataError, ConfigError, TeacherError, PromptTemplateError, ModelResolutionError, FileNotFoundError) as e:
        sys.exit(f"sft_data {args.command}: {e}")
    print(f"({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
