"""Stages ``sft_data``, ``sft_distill``, ``sft_filter``: the SFT trace sets, raw and filtered.

    python -m flows.sft_data math     --config params.yaml   # data/sft/math_solutions.jsonl
    python -m flows.sft_data math     --config params.yaml --math-prompts [r1_zero,question_only] --out X.jsonl
    python -m flows.sft_data traces   --config params.yaml   # data/sft/teacher_raw.jsonl
    python -m flows.sft_data distill  --config params.yaml   # data/sft/distilled_raw.jsonl
    python -m flows.sft_data filter   --config params.yaml   # data/sft/<set>_filtered.jsonl, sizes.json + metrics

Settings come from params.yaml's ``sft_data`` section, deep-merged with
``profiles.<profile>.sft_data`` (so a profile may override one key of ``distill``).

- ``math``: MATH train solutions as traces (a5core.data.sft_data.math_solution_traces); the 2
  problems with an empty ``\\boxed{}`` are skipped and named. Written with ``prompt`` (r1_zero), or with each
  template of ``math_prompts`` in turn, each trace's response in its template's form: ``[r1_zero,
  question_only]`` makes a set for a start model trained for both prompts alike, so that neither arm of the
  prompt ablation is favoured. ``--math-prompts VALUE`` (read as YAML, ``null`` included) replaces the params
  file's. ``filter`` grades each trace by the grader of the prompt it was written with (``prompt`` and
  ``math_prompts``), so such a set keeps both prompts' correct traces.
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
  gives reward 1, write ``<set>_filtered.jsonl``; per set in ``sizes.json`` beside them: ``raw``,
  ``duplicates``, ``filtered``, ``kept_fraction`` (filtered / raw) and ``format_rate`` (of the deduplicated
  traces); the metrics file holds the traces kept in all (``traces``).
  An empty raw file (distillation disabled) gives an empty filtered file and null rates.

Every output is written atomically (temporary file, then rename). Each command is also the Prefect flow
``sft_data`` (``command`` one of the four; a deployment of ``python -m flows.serve``); the command line runs it
as a flow run when ``PREFECT_API_URL`` names a server, else plain (see :mod:`flows.prepare_data`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from a5core.data.files import DataError, load_math, load_sft_traces
from a5core.data.prompts import PromptTemplate, load_prompt
from a5core.data.sft_data import dedup_traces, filter_correct, import_traces, math_solution_traces
from a5core.engines import make_engine
from a5core.engines.teacher import OpenAICompletionsTeacher, TeacherError, distill
from a5core.policy.model_specs import ModelResolutionError, resolve_model
from a5core.runtime.settings import READS, describe
from a5core.runtime.writing import write_jsonl_atomic, write_text_atomic
from flows.arguments import argument_parser, yaml_value
from flows.cli import cli_main
from flows.config_file import settings_from_file
from flows.params import DistillParams, Prompt
from tasks.engines import closing_engine
from tasks.flow_summary import publish
from tasks.outputs import check_output_dir, check_output_file, note_written, write_output_file
from tasks.prefect_server import check_prefect_api

OUT_DIR = Path("data/sft")
DEFAULT_SETS = {
    "math_solutions": OUT_DIR / "math_solutions.jsonl",
    "teacher": OUT_DIR / "teacher_raw.jsonl",
    "distilled": OUT_DIR / "distilled_raw.jsonl",
}
DEFAULT_METRICS = Path("metrics/sft_data.json")
SIZES = "sizes.json"  # beside the filtered sets: each set's raw, duplicate and kept traces


class SftDataParams(Prompt):
    """The trace sets' settings; every set's prompts are written with ``prompt`` (the MATH set's with
    ``math_prompts`` when it is set)."""

    model_config = ConfigDict(extra="forbid")

    math: Annotated[str, READS] = Field(
        "../shared/data/math/train.jsonl", description="MATH train problems with solutions"
    )
    traces: Annotated[str, READS] = Field(
        "../shared/data/sft/teacher_traces_sample.jsonl", description="prompt/response/ground_truth file"
    )
    math_prompts: list[str] | None = Field(
        None,
        min_length=1,
        description="the MATH set's templates (names or files), problem i written with the (i mod n)-th, each "
        "response in its template's form (None: `prompt`); [r1_zero, question_only] trains a start model for "
        "both prompts alike",
    )
    reprompt_traces: bool = Field(True, description="re-render the trace file's prompts with `prompt`")
    dedup: bool = Field(True, description="drop exact duplicate traces before filtering")
    distill: DistillParams = DistillParams()


def load_params(config: str | os.PathLike | None, changes: dict[str, Any] | None = None) -> SftDataParams:
    """``sft_data`` of a params file, with its selected profile's ``sft_data`` deep-merged on top, and ``changes``
    (settings by name) replacing its values."""
    params = SftDataParams() if config is None else settings_from_file(SftDataParams, "sft_data", config)
    return params.replace(**changes) if changes else params


def _records(traces) -> list[dict[str, str]]:
    return [{"prompt": t.prompt, "response": t.response, "ground_truth": t.ground_truth} for t in traces]


# ------------------------------------------------------------------------------------ subcommands


def write_set(out: str | os.PathLike, traces: list) -> None:
    """A trace set, written atomically and noted as a5's (the next run may replace it)."""
    write_jsonl_atomic(out, _records(traces))
    note_written(out)


def write_math(params: SftDataParams, out: str | os.PathLike) -> dict[str, Any]:
    """The MATH set, written with ``math_prompts`` in turn (None: ``prompt``)."""
    prompts = params.math_prompts or [params.prompt]
    traces, skipped = math_solution_traces(load_math(params.math), *map(load_prompt, prompts))
    write_set(out, traces)
    return {"traces": len(traces), "skipped": skipped, "prompts": prompts, "out": str(out)}


def write_traces(params: SftDataParams, out: str | os.PathLike) -> dict[str, Any]:
    traces = import_traces(params.traces, load_prompt(params.prompt) if params.reprompt_traces else None)
    write_set(out, traces)
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
        write_set(out, [])
        return {"traces": 0, "enabled": False, "out": str(out)}
    problems = load_math(d.problems)[: d.limit]
    template = load_prompt(params.prompt)
    # A teacher made here is closed when done (a vLLM engine frees its GPU); one handed in stays open.
    with closing_engine(make_teacher(d)) if teacher is None else contextlib.nullcontext(teacher) as teacher:
        traces = distill(problems, template, teacher, d.n, d.sampling_for(template))
    write_set(out, traces)
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
    templates: Sequence[PromptTemplate] = (),
) -> dict[str, dict[str, Any]]:
    """For each ``name → raw file``: dedup (optional), keep correct traces (each graded by the grader of the
    template among ``templates`` its prompt was written with: :func:`a5core.data.sft_data.filter_correct`), write
    ``<name>_filtered.jsonl``; each set's sizes to ``sizes.json`` beside them, and the traces kept in all
    (``traces``) to the metrics file."""
    metrics = {}
    for name, raw_path in sets.items():
        raw = read_set(raw_path)
        unique, duplicates = dedup_traces(raw) if dedup else (list(raw), 0)
        kept, stats = filter_correct(unique, *templates)
        write_jsonl_atomic(Path(out_dir) / f"{name}_filtered.jsonl", _records(kept))
        metrics[name] = {
            "raw": len(raw),
            "duplicates": duplicates,
            "filtered": len(kept),
            "kept_fraction": len(kept) / len(raw) if raw else None,
            "format_rate": stats["format_rate"],
        }
    write_text_atomic(Path(out_dir) / SIZES, json.dumps(metrics, indent=2) + "\n")
    if metrics_path:
        traces = sum(m["filtered"] for m in metrics.values())
        write_output_file(metrics_path, json.dumps({"traces": traces}, indent=2) + "\n")
    return metrics


# ------------------------------------------------------------------------------------------- CLI


SETTING_FLAGS = ("math_prompts",)  # the `sft_data` settings a command line may give


def _set_arg(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


Command = Literal["math", "traces", "distill", "filter"]
DEFAULT_OUTS = {
    "math": DEFAULT_SETS["math_solutions"],
    "traces": DEFAULT_SETS["teacher"],
    "distill": DEFAULT_SETS["distilled"],
}


class SftDataRun(BaseModel):
    """One of the trace-set commands, as the Prefect flow ``sft_data`` (and its deployment's form) takes it. What
    it writes is checked here (:mod:`tasks.outputs`), so the command line and a deployment refuse the same."""

    model_config = ConfigDict(extra="forbid")

    command: Command = Field(..., description="math | traces | distill: write a raw set; filter: the filtered sets")
    config: str | None = Field("params.yaml", description="params file with an `sft_data` section (None: defaults)")
    settings: dict[str, Any] = Field(
        {},
        description="`sft_data` settings that replace the params file's, by name (e.g. "
        "{math_prompts: [r1_zero, question_only]})",
    )
    out: str | None = Field(None, description="math, traces, distill: the file written (default: data/sft/…)")
    sets: dict[str, str] | None = Field(
        None,
        description="filter: raw sets to filter, name → file (default: all); each writes out_dir/NAME_filtered.jsonl",
    )
    out_dir: str = Field(str(OUT_DIR), description="filter: where the filtered sets go")
    metrics: str | None = Field(str(DEFAULT_METRICS), description="filter: the sizes' metrics file")

    @field_validator("sets")
    @classmethod
    def _set_names(cls, sets: dict[str, str] | None) -> dict[str, str] | None:
        for name in sets or {}:
            if not name.isidentifier():  # it names a file in out_dir
                raise ValueError(f"set name {name!r}: letters, digits and '_' (it names out_dir/NAME_filtered.jsonl)")
        return sets

    @field_validator("settings")
    @classmethod
    def _known_settings(cls, settings: dict[str, Any]) -> dict[str, Any]:
        SftDataParams(**settings)  # a name no setting has, or a bad value, is refused before anything runs
        return settings

    @model_validator(mode="after")
    def _outputs_are_its_own(self) -> SftDataRun:
        if self.command != "filter":
            check_output_file(self.written(), "out")
            return self
        sets = {name: Path(path) for name, path in self.raw_sets().items()}
        inputs = {path.name for path in sets.values() if path.parent.resolve() == Path(self.out_dir).resolve()}
        written = {f"{name}_filtered.jsonl" for name in sets} | {SIZES} | {p.name for p in DEFAULT_SETS.values()}
        check_output_dir(self.out_dir, "SFTData", "out_dir", ours=(inputs | written).__contains__)
        if self.metrics:
            check_output_file(self.metrics, "metrics")
        return self

    def written(self) -> str:
        """The file a math, traces or distill command writes."""
        return self.out or str(DEFAULT_OUTS[self.command])

    def raw_sets(self) -> dict[str, str | os.PathLike]:
        """The raw sets a filter command filters, by name."""
        return dict(self.sets or DEFAULT_SETS)


@flow(name="sft_data")
def sft_data(params: SftDataRun) -> dict[str, Any]:
    """Run one trace-set command; returns its result and the lines that tell what it wrote."""
    settings = load_params(params.config, params.settings)
    out = "" if params.command == "filter" else params.written()
    if params.command == "math":
        result = write_math(settings, out)
        rows = [{"set": "math_solutions", "traces": result["traces"], "skipped": len(result["skipped"]), "out": out}]
        lines = [
            f"math_solutions: {result['traces']} traces ({', '.join(result['prompts'])}) → {out}; skipped (no or "
            f"empty box): {len(result['skipped'])} {result['skipped']}"
        ]
    elif params.command == "traces":
        result = write_traces(settings, out)
        rows = [{"set": "teacher", "traces": result["traces"], "out": out}]
        lines = [f"teacher: {result['traces']} traces from {settings.traces} → {out}"]
    elif params.command == "distill":
        result = write_distill(settings, out)
        rows = [{"set": "distilled", "traces": result["traces"], "enabled": result["enabled"], "out": out}]
        lines = [
            f"distilled: {result['traces']} traces from {result['problems']} problems → {out}"
            if result["enabled"]
            else f"distilled: disabled (sft_data.distill.enabled: false) → empty {out}"
        ]
    else:
        templates = [load_prompt(name) for name in dict.fromkeys([settings.prompt, *(settings.math_prompts or [])])]
        result = write_filtered(params.raw_sets(), params.out_dir, params.metrics, settings.dedup, templates)
        rows = [{"set": name, **m} for name, m in result.items()]
        lines = [
            f"{name:16} raw {m['raw']:>6}  duplicates {m['duplicates']:>4}  filtered {m['filtered']:>6}  kept "
            + ("-" if m["kept_fraction"] is None else f"{m['kept_fraction']:.3f}")
            for name, m in result.items()
        ]
    publish("sft_data", f"SFT data: {params.command}", rows)
    return {"result": result, "lines": lines}


@cli_main("flows.sft_data")
def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, what in (
        ("math", "MATH solutions as traces"),
        ("traces", "import a trace file"),
        ("distill", "sample traces from a teacher"),
    ):
        sub = commands.add_parser(name, help=what, allow_abbrev=False)
        sub.add_argument("--config", help="params file with an `sft_data` section (default: built-in defaults)")
        sub.add_argument("--out", default=str(DEFAULT_OUTS[name]))
        if name == "math":
            field = SftDataParams.model_fields["math_prompts"]
            sub.add_argument(
                "--math-prompts",
                type=yaml_value,
                default=argparse.SUPPRESS,  # absent: the params file's (a given null replaces it)
                metavar="VALUE",
                help=f"{field.description} (YAML; replaces the params file's)",
            )
    sub = commands.add_parser(
        "filter", help="dedup + keep correct traces; sizes to the metrics file", allow_abbrev=False
    )
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
    # A Prefect flow run where a server is running (PREFECT_API_URL), else plain: dvc repro runs these
    # commands four times, and each flow run would start a temporary Prefect server (20 s).
    try:
        run = SftDataRun(
            command=args.command,
            config=args.config,
            settings={name: getattr(args, name) for name in SETTING_FLAGS if hasattr(args, name)},
            out=getattr(args, "out", None),
            sets=dict(args.sets) if getattr(args, "sets", None) else None,
            out_dir=getattr(args, "out_dir", str(OUT_DIR)),
            metrics=getattr(args, "metrics", str(DEFAULT_METRICS)),
        )
        if os.environ.get("PREFECT_API_URL"):
            check_prefect_api()
        done = (sft_data if os.environ.get("PREFECT_API_URL") else sft_data.fn)(run)
    except ValidationError as e:
        sys.exit(f"sft_data {args.command}: {describe(e)}")
    except (ValueError, TeacherError, ModelResolutionError, FileNotFoundError) as e:  # DataError: a ValueError
        sys.exit(f"sft_data {args.command}: {e}")
    print("\n".join(done["lines"]))
    print(f"({time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
