"""Generate ``docs/results.md`` from the runs' own records, never by hand.

    python lab/results_writeup.py [--runs lab/records] [--out docs/results.md] \\
        [--figures docs/results] [--context lab/how_to_repeat.md] [--index RUNS/INDEX.md]

Every ``*.tar.gz`` under ``--runs`` is unpacked into a temporary folder and each ``mlflow.db`` in it read
through sqlite3, read-only (no migration; the runs/params/tags/metrics tables every MLflow store has). A run
found in several archives is kept once: the copy with more metric points, then the later end time. An
experiment is a parent run with children (tag ``mlflow.parentRunId``), named by its tag ``ablation`` or its
run name (``sft_experiment``, ``ei_sweep``); parents of one name (a second seed, a re-run) form one
experiment, unless their runs were scored on another validation set (``validation_data``): those form
``NAME on SET``. Runs that ``SUPERSEDED`` names (made by code with a bug fixed since) are left out of every
experiment and listed apart with the reason. A run with neither parent nor children but a final score
(``leaderboard``) is an experiment of its own.

The page opens with the findings: one row per expectation of the handout (or the literature) measured, the
difference ± s.e., the runs and a verdict, then a paragraph of what they say. A difference is paired over runs of
one parent run and seed (the same starting model and problems) where there are such pairs; every mean's ± counts
the spread between runs (at least the runs' binomial s.e.s). "agrees"/"disagrees" only with ``MIN_RUNS`` runs of
each setting and as many pairs, the mean paired difference clearing two standard errors; "within noise" or "too
few runs" otherwise. Then, for each experiment: the settings its runs share and those that differ (effective
settings: params, and the settings some runs logged as tags, ``EFFECTIVE_TAGS``); final validation accuracy and
format rate ± sqrt(p(1−p)/n); the mean and spread over runs of one setting; curves, training trends and plots
(``--figures``). Repeated configurations group runs by effective settings. ``--context`` (hand-kept: how to
repeat the runs) is copied verbatim after the results. The page is keyed by experiment and the dates its runs
started, and says how to re-run each with the flows' own commands; it names no archive. Which archive holds which
run, and what each archive holds, goes to ``--index`` (beside the archives). Both are written atomically.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sqlite3
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from a5core.grading.sample_metrics import mean_and_se, paired_difference, problem_scores, t_interval
from flows.reproduce import verdict as reproduction_verdict

COMMAND = "python lab/results_writeup.py"
# Where results went, how a sweep's children were scheduled and its grid (the parent's): not what a child ran with.
HIDDEN = {"output_dir", "metrics_path", "tracking_uri", "experiment", "sizes", "filtered_data", "ablation", "runner"}
HIDDEN |= {"gpu_memory_fraction", "ablation_only"}  # in what share of the GPU it ran, which of a grid: not what
# The registered model's folder and its files' digests (logged with it as params): what a run made, not what it ran.
HIDDEN |= {"model_dir"}
HIDDEN_PREFIXES = ("sweep_", "clip_", "ray_", "file_sha256/")
TRENDS = ("reward_mean", "token_entropy", "response_tokens_mean", "advantage_std", "grad_norm")
TRENDS += ("frac_groups_all_equal", "kept_fraction", "token_nll", "difficulty_learnable")
UNIT_METRICS = ("val_accuracy", "val_format_rate", "reward_mean")
SMALL = 0.2  # a unit metric whose values all lie under this is plotted on an axis scaled to them
LINESTYLES, MARKERS = ("-", "--", ":", "-."), ("o", "s", "^", "D")
DR_GRPO = "Dr. GRPO (Liu et al. 2025) argues"
DAPO = (
    "DAPO (Yu et al. 2025) reports dynamic sampling, token-level loss and overlong shaping each help, and together "
    "beat GRPO"
)
KL = "DAPO and Dr. GRPO drop the KL term: with a verifiable reward it mostly holds the policy back"
# Each experiment's expectations from the handout or the literature: (a, b, parity, why). Directional (parity False):
# a ends at or above b; parity: a and b end within ±DELTA of each other. A comparison is made wherever the records hold
# runs labelled a and b in that experiment (they say which settings a and b are; see ``defining_keys``).
EXPECTED: dict[str, list[tuple[str, str, bool, str]]] = {
    "grpo_baseline_ablation": [
        ("reinforce_with_baseline", "no_baseline", False, "the handout expects a baseline to help")
    ],
    "grpo_length_norm_ablation": [
        (
            "masked_normalize",
            "masked_mean",
            False,
            f"{DR_GRPO} a constant normaliser avoids the length bias of masked_mean",
        )
    ],
    "grpo_std_norm_ablation": [
        (
            "no_std_normalization",
            "std_normalization",
            False,
            f"{DR_GRPO} dropping the std normalisation removes a question-difficulty bias (effect expected small)",
        )
    ],
    "grpo_clip_ablation": [
        ("grpo_clip", "grpo_no_clip", False, "many epochs per rollout batch without clipping are unstable")
    ],
    "grpo_prompt_ablation": [
        (
            "question_only",
            "r1_zero",
            False,
            f"{DR_GRPO} the R1 template hurts Qwen2.5-Math, which does best with the question alone",
        )
    ],
    "grpo_dapo_ablation": [(s, "grpo", False, DAPO) for s in ("dapo", "dynamic_sampling", "token_mean", "overlong")],
    "grpo_gspo_ablation": [
        (
            "gspo",
            "grpo_clip",
            False,
            "GSPO (Zheng et al. 2025) reports the sequence-level ratio trains more stably off-policy than token ratios",
        )
    ],
    "grpo_kl_ablation": [("kl_0", "kl_0.01", False, KL), ("kl_0", "kl_0.001", False, KL)],
    "grpo_question_sampling_ablation": [
        (
            "learnable",
            "uniform",
            False,
            "prime-rl and ROLL filter questions by difficulty: a group every sample solves, or none does, gives no "
            "gradient, so drawing only questions with 0 < pass rate < 1 should learn more per step",
        )
    ],
    "grpo_async_ablation": [
        (
            "one_step_off",
            "synchronous",
            True,
            "one step of staleness, corrected by truncated importance sampling, costs little or no accuracy per step "
            "(its gain is wall-clock: compare the curves by wall-clock)",
        )
    ],
    "grpo": [
        (
            "backend=vllm",
            "backend=hf",
            True,
            "the rollout engine does not change what GRPO learns (vLLM and the hf engine sample one distribution)",
        )
    ],
}
# The flow that makes an MLflow experiment's runs, and the flags a sweep's parent run name stands for: an
# experiment's re-run command (``rerun``).
FLOWS = {
    "sft_experiment": "sft_experiment",
    "expert_iteration": "expert_iteration",
    "grpo": "grpo",
    "leaderboard": "leaderboard",
}
SWEEP_FLAGS = {"ei_sweep": "--sweep true"}
PROFILE = "--config params.yaml --profile gpu-small"  # the profile every recorded run was made with
OFF_POLICY = "several epochs per rollout batch (grpo_clip) get more out of each batch than one on-policy step"
# Runs made by code with a bug fixed since (id prefix → why): listed apart, in no experiment, mean or comparison.
SUPERSEDED = {
    "60cb54e8": "learnable question sampling filled a step short of learnable questions in problem order (the same "
    "few every step, and the questions its table called unsolved never measured again: its groups ended 97% "
    "all-equal), fixed in f3e269c; re-run after the fix (the other learnable run)",
}
MIN_PAIRS = 3  # a verdict needs this many independent pairs (other start models or seeds)
CONFIDENCE = 0.95  # of the t interval on the pairs' mean difference
DELTA = 0.05  # within noise: the whole interval inside ±DELTA of accuracy
# Not what a run ran with, when runs are matched: its label, where its start model's folder was, its seed (the start
# model is matched by its weights' content hash, the seed on its own).
UNMATCHED = ("setting", "model", "model_path", "seed")
# Runs of one setting name that differ in one of these settings: a setting each, named by it.
VARIANT_PARAMS = ("backend", "budget_hours")
# Settings some runs logged as tags rather than params: part of what a run ran with.
EFFECTIVE_TAGS = ("compile_layers", "fsdp_reshard_after_forward", "max_tokens_per_microbatch", "engine_device")
FINALS = {
    "accuracy": ("final_val_accuracy", "final_score"),
    "format_rate": ("final_val_format_rate", "final_format_rate"),
}


@dataclass
class Run:
    """One MLflow run as an archive's store holds it (metrics: key → step → the value logged last)."""

    id: str
    name: str
    experiment: str
    start: int
    end: int | None
    status: str
    archive: str
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    variant: str | None = None  # the setting a standalone run stands for among its experiment's (``backend=vllm``)
    provenance: dict[str, str] = field(default_factory=dict)  # what it was made from (see ``made_from``)
    problems: dict[str, float] | None = None  # its final evaluation's accuracy by problem id (``final_problems``)

    def final(self, *keys: str) -> float | None:
        """The value at the last step of the first of ``keys`` the run logged."""
        for key in keys:
            if self.metrics.get(key):
                return self.metrics[key][max(self.metrics[key])]
        return None

    @property
    def setting(self) -> str:
        """The child's setting (its :attr:`variant`, else param ``setting``), else its run name."""
        return self.variant or self.params.get("setting", self.name)

    @property
    def seconds(self) -> float | None:
        """Start to end, in seconds (None while running)."""
        return (self.end - self.start) / 1000 if self.end else None

    @property
    def points(self) -> int:
        """How many metric points it holds: the newer copy of a run holds more."""
        return sum(map(len, self.metrics.values()))

    def settings(self) -> dict[str, str]:
        """The settings that say what ran, its effective ones: the parameters, the settings some runs logged as
        tags instead (``EFFECTIVE_TAGS``), and the starting model's real folder (tag ``model_path``)."""
        shown = {k: v for k, v in self.params.items() if k not in HIDDEN and not k.startswith(HIDDEN_PREFIXES)}
        shown |= {k: self.tags[k] for k in EFFECTIVE_TAGS if k in self.tags and k not in shown}
        return shown | ({"model_path": project_relative(self.tags["model_path"])} if "model_path" in self.tags else {})

    @property
    def origin(self) -> str:
        """The model it started from: its weights' content hash (its provenance record's), else, for a run
        without that record, its parent run (the invocation, which started its children from one model)."""
        return self.provenance.get("data model") or f"parent run {parent_of(self)}"

    def core(self) -> dict[str, str]:
        """What it ran with, as runs are matched: :meth:`settings` less :data:`UNMATCHED`."""
        return {k: v for k, v in self.settings().items() if k not in UNMATCHED}

    @property
    def identity(self) -> tuple:
        """(start model, settings, seed): runs alike in all three are one run made twice, and count once."""
        return self.origin, tuple(sorted(self.core().items())), self.params.get("seed")


@dataclass
class Experiment:
    key: str
    parents: list[Run]
    children: list[Run]

    @property
    def kind(self) -> str:
        """The MLflow experiment its runs are in (``grpo``, ``sft_experiment``, ...)."""
        return (self.parents or self.children)[0].experiment

    def by_setting(self) -> dict[str, list[Run]]:
        """Setting name → its runs (seeds, re-runs), in start order."""
        groups: dict[str, list[Run]] = defaultdict(list)
        for run in self.children:
            groups[run.setting].append(run)
        return groups

    @property
    def slug(self) -> str:
        """The key as a file-name stem (figures)."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.key)

    def label(self, run: Run) -> str:
        """The run's setting, with its seed and id when the experiment holds more than one run of it."""
        if len(self.by_setting()[run.setting]) < 2:
            return run.setting
        return f"{run.setting} (seed {run.params.get('seed', '?')}, {run.id[:6]})"


def read_store(db: Path, archive: str) -> list[Run]:
    """The active runs of one MLflow SQLite store, with their params, tags and non-system metrics."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        names = dict(con.execute("select experiment_id, name from experiments"))
        rows = con.execute("select run_uuid, name, experiment_id, start_time, end_time, status from runs")
        runs = {r[0]: Run(r[0], r[1] or r[0][:8], names.get(r[2], str(r[2])), r[3] or 0, *r[4:], archive) for r in rows}
        for rid, stage in con.execute("select run_uuid, lifecycle_stage from runs"):
            if stage != "active":
                del runs[rid]
        for table in ("params", "tags"):
            for rid, key, value in con.execute(f"select run_uuid, key, value from {table}"):
                if rid in runs:
                    getattr(runs[rid], table)[key] = value
        query = (
            "select run_uuid, key, step, value, is_nan from metrics where key not like 'system/%' order by timestamp"
        )
        for rid, key, step, value, is_nan in con.execute(query):
            if rid in runs:
                runs[rid].metrics[key][step] = math.nan if is_nan else value
    finally:
        con.close()
    return list(runs.values())


def made_from(record: dict) -> dict[str, str]:
    """A run's ``provenance.json`` flattened to what says where it came from: ``code`` (the commit, ``+dirty``),
    ``data <name>`` (the content hash of each data file and model folder it read), ``version <package>``,
    ``device``."""
    code = record.get("code") or {}
    made = {"code": f"{code.get('commit', '?')[:12]}{' +dirty' if code.get('dirty') else ''}"}
    made |= {f"data {name}": str(item.get("hash")) for name, item in (record.get("inputs") or {}).items()}
    made |= {f"version {name}": str(v) for name, v in (record.get("versions") or {}).items()}
    return made | {"device": str(record.get("device"))}


PER_PROBLEM = re.compile(r"(full|subset(\d+))_step_(\d+)\.json")


def final_problems(artifacts: Path) -> dict[str, float] | None:
    """A run's final evaluation by problem (id → accuracy, its samples' mean) from its ``per_problem/`` tables
    under ``artifacts``: the last step's, the full set's before a subset's; None where it logged none."""
    found = []
    for path in (artifacts / "per_problem").glob("*.json"):
        if match := PER_PROBLEM.fullmatch(path.name):
            found.append((int(match[3]), math.inf if match[1] == "full" else int(match[2]), path))
    if not found:
        return None
    table = json.loads(max(found)[2].read_text())
    return problem_scores([dict(zip(table["columns"], row, strict=True)) for row in table["data"]])


def read_pool(path: Path) -> list[tuple[str, int, int, str]]:
    """A pool's runs (``lab/device_run.sh pool``'s ``pool.txt``: ``NAME start T`` and ``NAME end T rc=R`` lines):
    (name, start, end, exit status) of each that ended."""
    starts, ended = {}, []
    for words in (line.split() for line in path.read_text().splitlines()):
        if len(words) >= 3 and words[1] == "start":
            starts[words[0]] = int(words[2])
        elif len(words) >= 4 and words[1] == "end" and words[0] in starts:
            ended.append((words[0], starts[words[0]], int(words[2]), words[3].removeprefix("rc=")))
    return ended


@dataclass
class Pool:
    """Runs made side by side on one GPU: an archive's ``pool.txt`` (:func:`read_pool`), the kind of GPU its runs'
    records name (:func:`pool_gpu`; None where none does) and the walls of the SFT runs its archive started with."""

    gpu: str | None
    runs: list[tuple[str, int, int, str]]
    sft_seconds: list[float]

    @property
    def minutes(self) -> float:
        """The GPU's time it held: its first start to its last end, runs that exited non-zero and waits included."""
        return (max(e for _, _, e, _ in self.runs) - min(s for _, s, _, _ in self.runs)) / 60


GPU = re.compile(r"cuda: 1 × (?:NVIDIA )?(.+?)(?:[ -](?:\d+GB|HBM|PCIe|SXM|NVL).*)?")


def gpu_of(run: Run) -> str | None:
    """The kind of GPU a run's record names: its provenance's ``device``, else its tag ``device`` (``cuda: 1 ×
    NVIDIA H100 80GB HBM3`` → ``H100``); None where neither names one GPU."""
    for device in (run.provenance.get("device"), run.tags.get("device")):
        if device and (match := GPU.fullmatch(device)):
            return match[1]
    return None


def pool_gpu(found: list[Run], entries: list[tuple[str, int, int, str]]) -> str | None:
    """The GPU a pool ran on: the one kind named by the records of the archive's runs that started between its
    first start and its last end; None where they name none, or more than one."""
    first, last = min(s for _, s, _, _ in entries), max(e for _, _, e, _ in entries)
    kinds = {gpu_of(run) for run in found if first <= run.start / 1000 <= last} - {None}
    return kinds.pop() if len(kinds) == 1 else None


def load_records(runs_dir: Path, tmp: Path) -> tuple[dict[str, Run], list[list], list[Pool]]:
    """Unpack every archive; the runs (one copy per id, with what their ``provenance.json`` says they were made
    from), a row per archive (name, kB, runs, walls), and the pools of runs made side by side (:class:`Pool`), each
    with its GPU and the walls of the SFT runs its archive started with."""
    runs: dict[str, Run] = {}
    archives, pools = [], []
    for archive in sorted(runs_dir.glob("*.tar.gz")):
        dest = tmp / archive.name
        with tarfile.open(archive) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        found = [run for db in sorted(dest.rglob("mlflow.db")) for run in read_store(db, archive.name)]
        records = {path.parent.parent.name: path for path in dest.rglob("artifacts/provenance.json")}
        artifacts = {path.parent.name: path for path in dest.rglob("mlruns/*/*/artifacts")}
        for run in found:
            if run.id in records:
                run.provenance = made_from(json.loads(records[run.id].read_text()))
            if run.id in artifacts:
                run.problems = final_problems(artifacts[run.id])
            old = runs.get(run.id)
            if old is None or (run.points, run.end or 0) > (old.points, old.end or 0):
                runs[run.id] = run
        walls = []  # walls.txt: one "flow call=N rc=R wall_s=S" line per flow a device call ran
        for line in (
            line.split() for path in sorted(dest.rglob("walls.txt")) for line in path.read_text().splitlines()
        ):
            kv = dict(item.split("=", 1) for item in line[1:] if "=" in item)
            walls += [f"{line[0]} (call {kv.get('call', '?')}, rc {kv.get('rc', '?')}): {kv.get('wall_s', '?')} s"]
        archives.append([f"`{archive.name}`", archive.stat().st_size // 1024, len(found), "; ".join(walls)])
        if pool := [entry for path in sorted(dest.rglob("pool.txt")) for entry in read_pool(path)]:
            sft = [float(m[1]) for w in walls if (m := re.fullmatch(r"sft\S* \(.*\): (\d+) s", w))]
            pools.append(Pool(pool_gpu(found, pool), pool, sft))
    return runs, archives, pools


def validation_set(parent: Run, children: list[Run]) -> str:
    """What the parent's runs were scored on (param ``validation_data``; "" where none logged it)."""
    return parent.params.get("validation_data") or next(
        (c.params["validation_data"] for c in children if "validation_data" in c.params), ""
    )


def find_experiments(runs: dict[str, Run]) -> list[Experiment]:
    """Parents with children, grouped by name (tag ``ablation`` or run name), MLflow experiment (a name's first
    experiment keeps the name; runs of that name in another experiment, a study of its own such as
    ``--experiment grpo_recipe``, take the experiment's name) and validation set (the first set keeps the bare
    name, another one is ``NAME on SET``); standalone runs with a score."""
    children: dict[str, list[Run]] = defaultdict(list)
    for run in sorted(runs.values(), key=lambda r: r.start):
        if run.tags.get("mlflow.parentRunId") in runs:
            children[run.tags["mlflow.parentRunId"]].append(run)
    found: dict[str, Experiment] = {}
    first_set: dict[str, str] = {}
    first_experiment: dict[str, str] = {}
    for run in sorted(runs.values(), key=lambda r: r.start):
        if run.id in children:
            name, scored_on = run.tags.get("ablation", run.name), validation_set(run, children[run.id])
            if first_experiment.setdefault(name, run.experiment) != run.experiment:
                name = run.experiment
            key = name if first_set.setdefault(name, scored_on) == scored_on else f"{name} on {scored_on}"
            exp = found.setdefault(key, Experiment(key, [], []))
            exp.parents.append(run)
            exp.children += children[run.id]
        elif run.tags.get("mlflow.parentRunId") not in runs and estimate(run)[0] is not None:
            found.setdefault(run.name, Experiment(run.name, [], [])).children.append(run)
    for exp in found.values():
        name_variants(exp)
    return list(found.values())


def name_variants(exp: Experiment) -> None:
    """Runs of one setting name that differ in a ``VARIANT_PARAMS`` setting: each becomes a setting of its own,
    named by it (``backend=vllm``; ``1024, backend=vllm`` where the name is not the flow's ``single``)."""
    for name, group in exp.by_setting().items():
        for key in VARIANT_PARAMS:
            if len({run.params.get(key) for run in group}) > 1:
                for run in group:
                    value = f"{key}={run.params.get(key)}"
                    run.variant = value if name == "single" else f"{name}, {value}"
                break


def estimate(run: Run, metric: str = "accuracy") -> tuple[float | None, float | None, float | None]:
    """(p, its standard error sqrt(p(1−p)/n), n) of the run's final validation accuracy or format_rate."""
    p, n = run.final(*FINALS[metric]), run.final("final_val_n_problems", "n_final_problems")
    return (p, math.sqrt(p * (1 - p) / n), n) if p is not None and n else (p, None, n)


def finished(runs: list[Run]) -> list[Run]:
    """The runs that reached their final evaluation (a run stopped before it has no final figure)."""
    return [r for r in runs if estimate(r)[0] is not None]


def distinct(runs: list[Run]) -> list[Run]:
    """The finished runs, one per :attr:`Run.identity` (the first made): a run made twice counts once."""
    found: dict[tuple, Run] = {}
    for run in sorted(finished(runs), key=lambda r: r.start):
        found.setdefault(run.identity, run)
    return list(found.values())


def mean_of(runs: list[Run], metric: str = "accuracy") -> tuple[float, float] | None:
    """The mean final ``metric`` over ``runs`` (each run once: :func:`distinct`) and its s.e.: the spread between
    them (standard deviation / sqrt(runs)), or for one run its own s.e. over problems."""
    values = [estimate(r, metric)[:2] for r in distinct(runs)]
    if not values:
        return None
    if len(values) == 1:
        return values[0][0], values[0][1] or 0.0
    return mean_and_se([p for p, _ in values])


def pm(p: float | None, se: float | None = None, n: float | None = None) -> str:
    """``p ± se (k / n)``, with the decimals that show the s.e.'s first two digits (at least three)."""
    if p is None:
        return ""
    digits = max(3, 1 - math.floor(math.log10(se))) if se else 3
    text = f"{p:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")
    return text + (f" ({round(p * n)} / {int(n)})" if n else "")


def num(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or empty when there is none."""
    return "" if value is None else format(value, spec)


def table(header: str, rows: list[list]) -> list[str]:
    """A markdown table; ``header`` is the column names joined by ``|``."""
    cells = [["" if v is None else str(v).replace("|", "\\|") for v in row] for row in rows]
    lines = [f"| {header.replace('|', ' | ')} |", "|" + "---|" * (header.count("|") + 1)]
    return lines + [f"| {' | '.join(row)} |" for row in cells] + [""]


def parent_of(run: Run) -> str:
    """The parent run's id (the invocation that ran it: its starting model, its call), else its own."""
    return run.tags.get("mlflow.parentRunId", run.id)


@dataclass
class Comparison:
    """``a`` − ``b`` in final ``metric`` over independent pairs of runs (each pair: the two settings from one start
    model with one seed): the pairs' differences, the runs of each setting (each once), and the verdict. With fewer
    than two pairs, ``within``: one pair's s.e. over problems, or (no pair) the unpaired means' ``unpaired``
    difference and their s.e.s combined: within-run noise only."""

    a: str
    b: str
    metric: str
    diffs: list[float]
    runs: tuple[int, int]
    within: float | None = None
    unpaired: float | None = None
    by_problem: int = 0  # of the pairs, those whose runs' final evaluations were compared problem by problem
    parity: bool = False

    @property
    def k(self) -> int:
        return len(self.diffs)

    @property
    def mean(self) -> float:
        return sum(self.diffs) / self.k if self.diffs else self.unpaired

    @property
    def half(self) -> float | None:
        """The half-width of the t interval (:data:`CONFIDENCE`, k − 1 degrees of freedom); None under 2 pairs."""
        return t_interval(self.diffs, CONFIDENCE)[1] if self.k >= 2 else None

    @property
    def word(self) -> str:
        """Under MIN_PAIRS pairs: too few runs. Else, with the interval: agrees / disagrees when it excludes 0 (on
        the expected side, or the other; for a parity expectation any side disagrees), within noise when it lies
        inside ±DELTA, inconclusive otherwise."""
        if self.k < MIN_PAIRS:
            return "too few runs"
        low, high = self.mean - self.half, self.mean + self.half
        inside = -DELTA <= low and high <= DELTA
        if self.parity:
            return "within noise" if inside else "disagrees" if low > 0 or high < 0 else "inconclusive"
        if low > 0 or high < 0:
            return "agrees" if low > 0 else "disagrees"
        return "within noise" if inside else "inconclusive"

    @property
    def difference(self) -> str:
        if self.half is not None:
            return f"{self.mean:+.3f} ± {self.half:.3f} ({CONFIDENCE:.0%} t, {self.k - 1} df)"
        what = "one pair's s.e. over problems" if self.k else "unpaired means"
        return f"{self.mean:+.3f} ± {self.within:.3f} (within-run only: {what})"

    @property
    def verdict(self) -> str:
        """The word, bold when it decides, and for inconclusive the half-width (what these runs could decide)."""
        if self.word in ("agrees", "disagrees"):
            return f"**{self.word}**"
        return f"inconclusive (±{self.half:.3f})" if self.word == "inconclusive" else self.word

    @property
    def counted(self) -> str:
        """The pairs behind the figure (and how many of them were compared problem by problem)."""
        return f"{self.k or 'no'} pair{'s' * (self.k != 1)}" + (
            f" ({self.by_problem} by problem)" if self.by_problem else ""
        )

    def sentence(self) -> str:
        text = f"{self.verdict}: {self.a} − {self.b} = {self.difference} in final {self.metric.replace('_', ' ')} "
        text += (
            f"({self.counted}, each a run of both settings from one start model with one seed; the records hold "
            f"{self.runs[0]} run{'s' * (self.runs[0] != 1)} of {self.a} and {self.runs[1]} of {self.b}, each once)"
        )
        if self.word == "too few runs":
            return text + f"; a verdict needs {MIN_PAIRS} pairs"
        if self.word == "inconclusive":
            return text + f"; differences beyond ±{self.half:.3f} would have been decided"
        if self.word == "disagrees":
            side = "they end apart" if self.parity else f"{self.b} ends above {self.a}"
            return text + f"; {side}, against the expectation"
        return text


def defining_keys(a_runs: list[Run], b_runs: list[Run]) -> set[str]:
    """The settings that make a run one of setting ``a`` or ``b`` (their labels say which runs are which): those
    in which every run of the one differs from every run of the other (a setting only some pairs of runs differ in,
    another invocation's, is not one of them)."""
    differ = [
        {k for k in ra.core().keys() | rb.core().keys() if ra.core().get(k) != rb.core().get(k)}
        for ra in a_runs
        for rb in b_runs
    ]
    return set.intersection(*differ) if differ else set()


def pair_difference(ra: Run, rb: Run, metric: str) -> tuple[float, float, bool]:
    """(``ra`` − ``rb`` in final ``metric``, its s.e. over problems, whether problem by problem): for accuracy where
    both runs kept their final evaluation by problem, the per-problem differences' (problems both solve, or both
    miss, cancel), else the two runs' binomial s.e.s combined."""
    if metric == "accuracy" and ra.problems and rb.problems and ra.problems.keys() == rb.problems.keys():
        paired = paired_difference(ra.problems, rb.problems)
        return paired["difference"], paired["difference_se"], True
    (pa, sa, _), (pb, sb, _) = estimate(ra, metric), estimate(rb, metric)
    return pa - pb, math.hypot(sa or 0.0, sb or 0.0), False


def compare(
    exp: Experiment, a: str, b: str, pool: list[Run], metric: str = "accuracy", parity: bool = False
) -> Comparison | None:
    """``a`` − ``b``, settings of ``exp``: every run of ``pool`` (the records' finished runs, each once) whose
    defining settings (:func:`defining_keys`, learnt from the runs ``exp`` labels ``a`` and ``b``) are ``a``'s is a
    run of ``a``, wherever it was made, and likewise for ``b``; a pair is a run of each from the same start model
    with the same seed and every other setting alike. None when ``exp`` has no finished run of ``a`` or ``b``."""
    labelled = exp.by_setting()
    a_runs, b_runs = finished(labelled.get(a, [])), finished(labelled.get(b, []))
    if not a_runs or not b_runs:
        return None
    keys = defining_keys(a_runs, b_runs)
    if keys:
        values = [{k: runs[0].core().get(k) for k in keys} for runs in (a_runs, b_runs)]
        a_units, b_units = ([u for u in pool if all(u.core().get(k) == v for k, v in vs.items())] for vs in values)
    else:  # alike but for their labels: the labelled runs alone
        a_units, b_units = distinct(a_runs), distinct(b_runs)

    def key(run: Run) -> tuple:
        return run.origin, run.params.get("seed"), tuple(sorted((k, v) for k, v in run.core().items() if k not in keys))

    partners = {key(u): u for u in b_units}
    pairs = [(u, partners[key(u)]) for u in a_units if key(u) in partners]
    counts = (len(a_units), len(b_units))
    if not pairs:
        (ma, sa), (mb, sb) = mean_of(a_units, metric), mean_of(b_units, metric)
        return Comparison(a, b, metric, [], counts, math.hypot(sa, sb), ma - mb, parity=parity)
    found = [pair_difference(ra, rb, metric) for ra, rb in pairs]
    return Comparison(
        a,
        b,
        metric,
        [d for d, _, _ in found],
        counts,
        within=found[0][1],
        by_problem=sum(p for *_, p in found),
        parity=parity,
    )


def measured(found: Comparison | None, a: str, b: str, metric: str = "accuracy") -> str:
    """``found`` as a sentence, or that it was not measured."""
    return found.sentence() if found else f"not measured ({a} or {b} has no final {metric})"


# An expectation: its short form (the headline table), the comparison, the sentence of the section.
Expectation = tuple[str, "Comparison | None", str]


def sft_expectations(exp: Experiment, pool: list[Run]) -> list[Expectation]:
    """SFT: accuracy and format rate rise with the data size; filtered ≥ unfiltered at (nearly) equal size."""
    runs = exp.by_setting()
    size = {
        s: int(rs[0].params["n_examples"]) for s, rs in runs.items() if rs[0].params.get("n_examples", "").isdigit()
    }
    sized = sorted((n, s) for s, n in size.items() if "filtered" not in s)
    found: list[Expectation] = []
    if len(sized) > 1:
        (n0, small), (n1, big) = sized[0], sized[-1]
        acc, fmt = compare(exp, big, small, pool), compare(exp, big, small, pool, "format_rate")
        found.append(
            (
                f"more SFT data, higher accuracy and format rate ({big} vs {small})",
                acc,
                f"Expectation (handout): accuracy and format rate rise with the SFT data size. Measured, {big} ({n1} "
                f"examples) against {small} ({n0}): accuracy {measured(acc, big, small)}; format rate "
                f"{measured(fmt, big, small, 'format_rate')}.",
            )
        )
        if fmt:
            found.append((f"format rate, {big} vs {small}", fmt, ""))
    for filtered in [s for s in size if "filtered" in s][:1] if sized else []:
        n, near = min(sized, key=lambda x: abs(x[0] - size[filtered]))
        acc, fmt = compare(exp, filtered, near, pool), compare(exp, filtered, near, pool, "format_rate")
        found.append(
            (
                f"filtered traces ≥ unfiltered at equal size ({filtered} vs {near})",
                acc,
                f"Expectation: filtered (correct-only) traces ≥ unfiltered ones at equal size; the nearest unfiltered "
                f"size is {near} ({n} examples, against {size[filtered]}): accuracy {measured(acc, filtered, near)}; "
                f"format rate {measured(fmt, filtered, near, 'format_rate')}.",
            )
        )
    return found


CHOSEN = " (the best setting, chosen on the scored problems)"
BIASED = (
    "chosen as the best on the same problems that score it (these records hold no held-out split), so the "
    "difference is biased upward"
)


def expectations(exp: Experiment, pool: list[Run]) -> list[Expectation]:
    """The measured direction against each expectation, computed from the numbers."""
    runs = exp.by_setting()
    specs = [spec for spec in EXPECTED.get(exp.key, []) if spec[0] in runs and spec[1] in runs]
    if exp.key == "grpo_off_policy_sweep" and "on_policy" in runs:
        specs = [(s, "on_policy", False, f"{OFF_POLICY} ({s} vs on_policy)") for s in runs if s != "on_policy"]
    if specs:
        found = []
        for a, b, parity, why in specs:
            comparison = compare(exp, a, b, pool, parity=parity)
            expected = f"{a} and {b} end within ±{DELTA}" if parity else f"{a} ≥ {b}"
            found.append(
                (why, comparison, f"Expectation: {why}, so {expected}. Measured: {measured(comparison, a, b)}.")
            )
        return found
    if exp.kind == "sft_experiment":
        return sft_expectations(exp, pool)
    finals = {s: m[0] for s, rs in runs.items() if (m := mean_of(rs)) is not None}
    if not finals:
        return []
    best = max(finals, key=finals.get)
    if exp.key == "grpo_lr_sweep":
        top = max(runs, key=lambda s: float(runs[s][0].params.get("learning_rate", "nan")))
        why = "too high a learning rate diverges"
        if top == best:
            return [(why, None, f"Expectation: {why}. Measured: the highest, {top}, ends best: no diverging rate.")]
        found = compare(exp, best, top, pool)
        return [
            (
                f"{why}: best ≥ highest ({top}){CHOSEN}",
                found,
                f"Expectation: {why}, so the best ({best}, {BIASED}) ≥ the highest ({top}). "
                f"Measured: {measured(found, best, top)}.",
            )
        ]
    return other_expectations(exp, pool, best, min(finals, key=finals.get))


def other_expectations(exp: Experiment, pool: list[Run], best: str, worst: str) -> list[Expectation]:
    """Expert Iteration against its start; a single run's score; best against worst elsewhere."""
    runs = exp.by_setting()
    run = runs[best][0]
    if exp.kind == "expert_iteration" and all(r.metrics.get("val_accuracy", {}).get(0) is not None for r in runs[best]):
        units = distinct(runs[best])
        start = [r.metrics["val_accuracy"][0] for r in units]
        gains = [estimate(r)[0] - p0 for r, p0 in zip(units, start, strict=True)]
        first = units[0]
        n0 = first.metrics.get("val_n_problems", {}).get(0) or estimate(first)[2]
        within = math.hypot(estimate(first)[1] or 0.0, math.sqrt(start[0] * (1 - start[0]) / n0))
        found = Comparison(f"{best} final", "step 0", "accuracy", gains, (len(units), len(units)), within)
        why = "Expert Iteration improves on its starting model"
        return [
            (
                f"{why}{CHOSEN}",
                found,
                f"Expectation (handout): {why}. Measured, best setting ({BIASED}): {found.sentence()}.",
            )
        ]
    if exp.kind == "leaderboard":
        return [("", None, leaderboard_sentence(exp, r)) for r in exp.children if estimate(r)[0] is not None]
    if len(exp.children) == 1:
        budget = run.final("budget_seconds")
        spent = f" in {run.final('wall_seconds'):.0f} s of a {budget:.0f} s budget" if budget else ""
        return [("", None, f"Final score {pm(*estimate(run))}{spent}; no expectation to compare it with.")]
    found = compare(exp, best, worst, pool)
    return [
        (
            "",
            None,
            f"No recorded expectation for this experiment; best against worst setting ({BIASED}): "
            f"{measured(found, best, worst)}.",
        )
    ]


def directions(exp: Experiment, pool: list[Run]) -> list[str]:
    """The sentences of :func:`expectations`."""
    return [sentence for *_, sentence in expectations(exp, pool) if sentence]


def plot(path: Path, series: dict[str, list[tuple[float, float]]], x: str, y: str, title: str) -> Path:
    """One line per series, saved at 80 dpi; the axes of :func:`tasks.plots.plot_curves` (which saves at 120):
    0–1 for accuracies, rates and rewards (scaled to the data where every value is under ``SMALL``), integer
    ticks for steps; past ten series the colours repeat with another line style and marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(6.4, 3.8))
    for i, (name, points) in enumerate(series.items()):
        # ten colours, then each colour again with another line style and marker
        style = {"linestyle": LINESTYLES[i // 10 % len(LINESTYLES)], "marker": MARKERS[i // 10 % len(MARKERS)]}
        axes.plot(*zip(*sorted(points), strict=True), markersize=3, label=name, color=f"C{i % 10}", **style)
    values = [v for points in series.values() for _, v in points]
    if y in UNIT_METRICS and values and all(0 <= v <= 1 for v in values):
        top = max(values)  # all small (an SFT sweep's accuracies): scaled to the data, not to 0–1
        axes.set_ylim(-0.02, 1.02) if top > SMALL else axes.set_ylim(0, max(top * 1.15, 1e-3))
    if x == "step":
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel=x, ylabel=y, title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def figures(exp: Experiment, out_dir: Path) -> list[Path]:
    """Accuracy, format rate and train reward by step, accuracy by wall-clock: what the runs logged."""
    made = []
    for y in UNIT_METRICS:
        series = {exp.label(r): list(r.metrics[y].items()) for r in exp.children if r.metrics.get(y)}
        if series:
            made.append(plot(out_dir / f"{exp.slug}_{y}_vs_step.png", series, "step", y, f"{exp.key}: {y}"))
    walls = {}
    # The run's accuracy by wall seconds as it logged it (the leaderboard's clock starts with its flow, its SFT phase
    # included, where its GRPO steps' wall_seconds start after it), else wall_seconds at the evaluation steps.
    for r in exp.children:
        acc, wall = r.metrics.get("val_accuracy", {}), r.metrics.get("wall_seconds", {})
        points = list(r.metrics.get("val_accuracy_by_wall_seconds", {}).items())
        if points := points or [(wall[s], v) for s, v in acc.items() if s in wall]:
            walls[exp.label(r)] = points
    if walls:
        path = out_dir / f"{exp.slug}_val_accuracy_vs_wall_seconds.png"
        made.append(plot(path, walls, "wall_seconds", "val_accuracy", f"{exp.key}: by wall-clock"))
    return made


def project_relative(path: str) -> str:
    """A starting model's folder as the project names it (``outputs/...``), not the machine's absolute path."""
    head, sep, tail = path.partition("/outputs/")
    return f"outputs/{tail}" if sep and head.startswith("/") else path


def ended(status: str) -> str:
    """How a run ended, from its status: an archive is a run's last record, so one still RUNNING there was
    stopped (with its machine) without ending."""
    return "stopped" if status == "RUNNING" else status


def settings_lines(exp: Experiment) -> tuple[list[str], list[str]]:
    """The parent runs and the settings every run shares; the names of the settings that differ."""
    lines = []
    for p in exp.parents:
        when = started(p)
        tags = [f"{k} `{v}`" for k, v in p.tags.items() if k in ("best_setting",)]
        took = f"{p.seconds:.0f} s" if p.seconds else "no end recorded"
        lines.append(f"- parent run `{p.id}`: started {when}, {took}; {ended(p.status)}")
        lines[-1] += "".join(f"; {t}" for t in tags)
    settings = [c.settings() for c in exp.children]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    # one value among the runs that log it: a field added since older runs were made is no difference
    values = {k: {s[k] for s in settings if k in s} for k in keys}
    shared = [k for k in keys if len(values[k]) == 1]
    lines += ["", "Settings every run shares: " + ", ".join(f"`{k}={next(iter(values[k]))}`" for k in shared) + "."]
    if newer := [k for k in shared if any(k not in s for s in settings)]:
        lines += [
            f"(In neither the params nor the tags of the older runs, fields added since: "
            f"{', '.join(f'`{k}`' for k in newer)}.)"
        ]
    lines += [""]
    return lines, [k for k in keys if k not in shared and k != "setting"]


def leaderboard_sentence(exp: Experiment, run: Run) -> str:
    """A leaderboard run's score, its budget, and which problems chose its checkpoint and which scored it."""
    p, se, n = estimate(run)
    said = f"`{run.id[:8]}` ({exp.label(run)}): final score {pm(p, se, n)}"
    if (budget := run.final("budget_seconds")) and (wall := run.final("wall_seconds")) is not None:
        said += f" in {wall:.0f} s of a {budget:.0f} s budget"
    step, chosen = run.final("best_step"), run.final("best_subset_accuracy")
    picked = f"its checkpoint (step {step:.0f}, {chosen:.3f} there)" if step is not None else "its checkpoint"
    scored = f"the first {n:.0f} problems of `{run.params.get('validation_data')}`"
    if (held := run.final("n_selection_problems")) is not None:
        return (
            f"{said}; {picked} chosen on {held:.0f} problems held out of `{run.params.get('train_data')}`'s "
            f"training set (its curve above), scored on {scored}, which took no part in the choice."
        )
    return f"{said}; {picked} chosen on {scored}, the problems that score it (its curve above): biased upward."


def dates(exp: Experiment) -> str:
    """The days its runs started (its parent runs', or its own runs' where it has no parent): ``first – last``."""
    days = sorted({datetime.fromtimestamp(r.start / 1000, timezone.utc).date() for r in exp.parents or exp.children})
    return f"{days[0]} – {days[-1]}" if len(days) > 1 else str(days[0])


def rerun(exp: Experiment) -> str:
    """The flows' own command that makes the experiment again with the profile its runs were made with (the flags
    some runs added are in the hand-kept part, how to repeat the runs); "" for runs of a flow this page does not
    know. A study in an MLflow experiment of its own (``--experiment``) is named by it; a set scored apart,
    ``NAME on SET``, by its ``--validation-data``."""
    first = (exp.parents or exp.children)[0]
    ablation = ablation_of(exp)
    flow = FLOWS.get(exp.kind) or FLOWS.get(first.name) or ("grpo" if ablation else None)  # ablations: flows.grpo's
    if flow is None:
        return ""
    words = [f"python -m flows.{flow} {PROFILE}"]
    if ablation:
        words.append(f"--ablation {ablation}")
    if flags := SWEEP_FLAGS.get(first.name):
        words.append(flags)
    if exp.kind != flow:
        words.append(f"--experiment {exp.kind}")
    if " on " in exp.key:
        words.append(f"--validation-data {exp.key.split(' on ', 1)[1]}")
    return " ".join(words)


def ablation_of(exp: Experiment) -> str | None:
    """The ablation or sweep its parent runs ran (their tag ``ablation``; older parents carry it as their run name
    alone), else None (a flow's plain run, or a sweep of its own flag, ``SWEEP_FLAGS``)."""
    named = [p.tags.get("ablation", p.name) for p in exp.parents]
    return next((n for n in named if n.endswith(("_ablation", "_sweep")) and n not in SWEEP_FLAGS), None)


def section(
    exp: Experiment, pool: list[Run], figure_dir: Path, link_base: Path, spreads: dict[str, float]
) -> list[str]:
    """An experiment's section: parents, settings, finals, runs of one setting, curves, trends, verdict, plots;
    ``pool``: the records' runs, each once (comparisons); ``spreads``: run id → the spread of the runs with its
    settings and seed from other start models elsewhere in the records."""
    lines, differ = settings_lines(exp)
    made = f"Runs started {dates(exp)}; re-run: `{rerun(exp)}`" if rerun(exp) else f"Runs started {dates(exp)}"
    lines = [f"## `{exp.key}` (MLflow experiment `{exp.kind}`)", "", made + ".", "", *lines]
    walls = any(c.metrics.get("wall_seconds") for c in exp.children)
    rows = []
    for c in exp.children:
        # a run's own steps: not a phase's (the leaderboard's sft/*) nor the system monitor's (system/*)
        own = (m for k, m in c.metrics.items() if m and not k.endswith("_by_wall_seconds") and "/" not in k)
        steps = max((max(m) for m in own), default=None)
        status = "" if c.status == "FINISHED" else f" {ended(c.status)}"
        row = [exp.label(c), *(c.settings().get(k, "—") for k in differ), f"`{c.id[:8]}`{status}", steps]
        tokens = num(c.final("final_val_mean_response_tokens"), ".1f")
        row += [pm(*estimate(c)), pm(*estimate(c, "format_rate")), tokens]
        rows.append(row + ([num(c.final("wall_seconds"), ".1f")] if walls else []) + [num(c.seconds, ".0f")])
    header = "|".join(["setting", *differ, "run", "steps", "accuracy ± s.e. (correct / n)"])
    header += "|format rate ± s.e. (formatted)|mean response tokens" + ("|wall_seconds (loop)" if walls else "")
    lines += ["Final evaluation; s.e. over problems, sqrt(p(1−p)/n); run (s): the MLflow run's start to end.", ""]
    lines += table(header + "|run (s)", rows)
    rows = []
    for s, rs in exp.by_setting().items():
        done = distinct(rs)
        if len(done) > 1:
            accs = [estimate(r)[0] for r in done]
            seeds = ", ".join(r.params.get("seed", "?") for r in done)
            spread, formats = f"{max(accs) - min(accs):.4f}", pm(*mean_of(done, "format_rate") or [None])
            rows.append([s, len(done), seeds, pm(*mean_of(done)), spread, formats])
    if rows:
        lines += [
            "Runs of one setting (seeds, start models) that reached their final evaluation, a run made twice counted "
            "once: the mean over runs, its s.e. from the spread between them (standard deviation / sqrt(runs)), and "
            "the spread (max − min).",
            "",
        ]
        lines += table("setting|runs|seeds|mean accuracy ± s.e.|accuracy spread|mean format rate ± s.e.", rows)
    steps = sorted({s for c in exp.children for s in c.metrics.get("val_accuracy", {})})
    if steps:
        rows = []
        for c in exp.children:
            acc, fmt = c.metrics.get("val_accuracy", {}), c.metrics.get("val_format_rate", {})
            rows.append(
                [exp.label(c)]
                + [f"{acc[s]:.3f}" + (f" / {fmt[s]:.2f}" if s in fmt else "") if s in acc else "" for s in steps]
            )
        lines += ["Validation accuracy / format rate by step (the subset evaluations):", ""]
        lines += table("|".join(["setting", *map(str, steps)]), rows)
    trends = [t for t in TRENDS if any(c.metrics.get(t) for c in exp.children)]
    if trends:
        lines += ["Training trends, first step → last step (mean over steps):", ""]
        lines += table(
            "|".join(["setting", *trends]),
            [[exp.label(c)] + [trend(c.metrics.get(t)) for t in trends] for c in exp.children],
        )
    lines += [f"- {d}" for d in directions(exp, pool)]
    if spread := max((spreads[c.id] for c in exp.children if c.id in spreads), default=None):
        lines += [
            f"- Runs with the settings and seed of runs here, from other start models, spread by up to {spread:.3f} "
            "in final accuracy (Repeated configurations, below)."
        ]
    lines += [""]
    return lines + [f"![{p.stem}]({os.path.relpath(p.resolve(), link_base)})\n" for p in figures(exp, figure_dir)]


def trend(points: dict[int, float] | None) -> str:
    """``first → last (mean)`` of a per-step metric."""
    values = [points[s] for s in sorted(points)] if points else []
    return f"{values[0]:.3g} → {values[-1]:.3g} ({sum(values) / len(values):.3g})" if values else ""


def repeats(experiments: list[Experiment]) -> tuple[list[str], dict[str, float]]:
    """Finished runs with identical settings and seed made by more than one invocation: a table of their start models
    and final accuracies, and each such run's id → the spread (max − min) among those of other start models (what a
    retrained start model moves; runs of one start model are one run made again, counted once)."""
    groups: dict[tuple, list[tuple[str, Run]]] = defaultdict(list)
    for exp in experiments:
        for run in finished(exp.children):
            groups[(tuple(sorted(run.core().items())), run.params.get("seed"))].append((exp.key, run))
    rows, spreads = [], {}
    for group in groups.values():
        if len({parent_of(r) for _, r in group}) < 2:
            continue
        accs = {r.id: estimate(r)[0] for _, r in group}
        origins = {r.origin for _, r in group}
        runs = "; ".join(f"{k}/{r.setting} `{r.id[:8]}` ({short(r.origin)}): {pm(*estimate(r))}" for k, r in group)
        same = [
            "identical" if len({accs[r.id] for _, r in group if r.origin == o}) == 1 else "differ"
            for o in sorted(origins)
            if sum(r.origin == o for _, r in group) > 1
        ]
        spread = max(accs.values()) - min(accs.values())
        rows.append([runs, len(origins), ", ".join(same) or "—", f"{spread:.4f}"])
        if len(origins) > 1:
            spreads |= {r.id: spread for _, r in group}
    if not rows:
        return [], {}
    intro = (
        "Runs with identical effective settings (params, and the settings some runs logged as tags instead, seed "
        "included) made by different invocations, with the model each started from (its weights' content hash, or "
        "its parent run where no record says): runs of one start model are one run made again (counted once, and "
        "they should end identical); runs of other start models show what a retrained start model moves."
    )
    header = "runs (start model): final accuracy ± s.e.|start models|same start model: finals|spread (max − min)"
    return ["## Repeated configurations", "", intro, "", *table(header, rows)], spreads


def short(origin: str) -> str:
    """A start model as the tables name it: its hash's first hex digits, or its parent run's id's."""
    return origin.split(":")[-1][:8] if not origin.startswith("parent run") else f"parent {origin.split()[-1][:8]}"


def cost(pools: list[Pool]) -> str:
    """What the runs cost, GPU by GPU (a pool whose GPU no record names stands alone, as "one GPU"): for each, from
    its pools (:class:`Pool`): runs, how many at once, the GPU-minutes (those of runs that failed too), the median run's
    wall time, runs a GPU-minute, and the GPU-minutes a verdict (three pairs: six runs, three where the reference
    runs serve several comparisons) takes."""
    by_gpu: dict[str | int, list[Pool]] = defaultdict(list)
    for i, pool in enumerate(pools):
        by_gpu[pool.gpu or i].append(pool)
    said = [text for group in by_gpu.values() if (text := cost_on(group))]
    if not said:
        return ""
    return (
        f" Cost: {'; '.join(said)}. A verdict's three pairs are six runs, three where the reference setting's runs "
        "serve several comparisons."
    )


def cost_on(group: list[Pool]) -> str:
    """The cost clause of pools made on one GPU (:func:`cost`); "" where none of their runs ended well."""
    done = [(s, e) for pool in group for _, s, e, rc in pool.runs if rc == "0"]
    if not done:
        return ""
    events = sorted([(s, 1) for s, _ in done] + [(e, -1) for _, e in done])
    at_once = max(itertools.accumulate(change for _, change in events))
    minutes = sum(pool.minutes for pool in group)
    failed = sum(rc != "0" for pool in group for *_, rc in pool.runs)
    failed_text = f" (with the time of {failed} attempt{'s' * (failed != 1)} that exited non-zero)" if failed else ""
    walls = sorted((e - s) / 60 for s, e in done)
    rate = len(done) / minutes
    sft_seconds = [s for pool in group for s in pool.sft_seconds]
    sft = f", plus the start model's SFT ({max(sft_seconds) / 60:.1f} min) once per batch" if sft_seconds else ""
    return (
        f"one {group[0].gpu or 'GPU'} ran {len(done)} GRPO runs (40 steps of SmolLM2-135M) as processes side by side, "
        f"at most {at_once} at once, in {minutes:.1f} GPU-minutes{failed_text}: a run took a median "
        f"{walls[len(walls) // 2]:.1f} min of wall clock, {rate:.1f} runs a GPU-minute, so a verdict's three pairs "
        f"take {6 / rate:.1f} GPU-minutes ({3 / rate:.1f} with a shared reference){sft}"
    )


def headline(
    experiments: list[Experiment], pool: list[Run], spreads: dict[str, float], costs: str, runs: dict[str, Run]
) -> list[str]:
    """The page's opening: one row per expectation measured (experiment, expectation, difference ± its interval,
    runs, verdict) and a paragraph of what they say and how they were decided, computed from the same numbers."""
    rows, words = [], []
    for exp in experiments:
        for why, found, _ in expectations(exp, pool):
            if found is None or not why:
                continue
            metric = "" if found.metric == "accuracy" else f" ({found.metric.replace('_', ' ')})"
            difference = f"{found.a} − {found.b}{metric} = {found.difference}"
            rows.append([f"`{exp.key}`", why, difference, found.counted, found.verdict])
            words.append(found.word)
    lines = ["## Findings", ""]
    lines += table("experiment|the expectation|measured difference ± interval|pairs|verdict", rows)
    kinds = ("agrees", "disagrees", "within noise", "inconclusive", "too few runs")
    counts = ", ".join(f"{words.count(w)} {w}" for w in kinds)
    lines += [
        f"What we learned: of {len(words)} measured expectations: {counts}. How a verdict is made: a comparison pairs "
        "a run of each setting started from the same model (the content hash of its weights; for older runs that "
        "recorded none, the same parent run) with the same seed, scored on the same problems; runs alike in start "
        "model, settings and seed are one run made again and count once, wherever they were made (one run of today's "
        "GRPO serves every comparison against it). With k pairs (k ≥ 2) the ± is the half-width of the "
        f"{CONFIDENCE:.0%} Student's t interval on the mean of their k differences (k − 1 degrees of freedom). "
        "**agrees** / **disagrees**: the interval excludes 0, on the expected side or the other (for an expectation "
        f"of parity, either side disagrees); within noise: it lies inside ±{DELTA}; inconclusive: neither, with "
        "its half-width, beyond which a difference would have been decided; too few runs: under "
        f"{MIN_PAIRS} pairs, where one pair's ± is its s.e. over problems (within-run only, smaller than the spread "
        "between runs) and no verdict is drawn."
    ]
    made_twice = [group for group in identical_groups(runs) if len(group) > 1]
    if made_twice:
        differ = [group for group in made_twice if len({estimate(r)[0] for r in group}) > 1]
        lines[-1] += (
            f" Of {len(made_twice)} run{'s' * (len(made_twice) != 1)} made more than once from one start model "
            f"with the same settings and seed, {len(made_twice) - len(differ)} ended with identical final accuracy "
            "each time (Repeated configurations)"
        )
        if differ and all(r.core().get("max_tokens_per_microbatch") == "auto" for g in differ for r in g):
            lines[-1] += (
                f"; the {len(differ)} that differ ran with max_tokens_per_microbatch auto, which cuts micro-batches "
                "by the memory free when a run starts (other runs on the GPU): the experiment profile pins it"
            )
        lines[-1] += "."
    if spreads:
        lines[-1] += (
            f" Runs of identical settings and seed from other start models (an SFT model retrained) spread by up to "
            f"{max(spreads.values()):.3f}: comparisons pair runs of one start model for that reason."
        )
    return lines + [costs.strip(), ""] if costs else lines + [""]


def identical_groups(runs: dict[str, Run]) -> list[list[Run]]:
    """The finished runs grouped by :attr:`Run.identity` (a parent run has no final evaluation of its own)."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for run in finished(list(runs.values())):
        groups[run.identity].append(run)
    return list(groups.values())


def render(runs_dir: Path, figure_dir: Path, context: Path, out: Path) -> tuple[str, str]:
    """The whole page, from the archives under ``runs_dir``, and the lab's index of those archives (which
    experiment's runs each holds, its size, its flows' walls, the logs beside them)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs, archives, pools = load_records(runs_dir, Path(tmp))
    superseded = [
        (run, why) for run in runs.values() for prefix, why in SUPERSEDED.items() if run.id.startswith(prefix)
    ]
    left_out = {run.id for run, _ in superseded} | set(reproductions(runs))
    experiments = find_experiments({rid: run for rid, run in runs.items() if rid not in left_out})
    repeated, spreads = repeats(experiments)
    pool = distinct([run for exp in experiments for run in exp.children])
    counted = {rid: run for rid, run in runs.items() if rid not in left_out}
    lines = [
        f"> Generated by `{COMMAND}` from the runs' MLflow records: do not edit by hand (edit the script, or the "
        f"hand-kept part on repeating the runs, `{context.as_posix()}`).",
        "",
        "# Results",
        "",
        *headline(experiments, pool, spreads, cost(pools), counted),
    ]
    rows = [
        [
            dates(exp),
            f"`{exp.key}`",
            exp.kind,
            len(exp.parents),
            len(exp.children),
            f"`{rerun(exp)}`" * bool(rerun(exp)),
        ]
        for exp in experiments
    ]
    lines += [
        "## Experiments by date",
        "",
        "Each experiment, the days its runs started and the command that makes it again (`--seed 1` for another "
        "seed; the flags some runs added are under How to repeat the runs); one recorded run again, as it was: "
        "`python -m flows.reproduce --run-id RUN_ID`.",
        "",
        *table("started|experiment|MLflow experiment|parent runs|runs|re-run", rows),
    ]
    for exp in experiments:
        lines += section(exp, pool, figure_dir, out.resolve().parent, spreads)
    lines += repeated
    lines += reproduction_section(runs)
    if superseded:
        rows = [
            [f"`{r.id[:8]}`", r.tags.get("ablation", r.experiment), r.setting, pm(*estimate(r)), why]
            for r, why in superseded
        ]
        lines += ["## Superseded runs", "", "Made by code with a bug fixed since; in no table or comparison above:", ""]
        lines += table("run|experiment|setting|final accuracy ± s.e.|why", rows)
    lines += [context.read_text().rstrip(), ""] if context.is_file() else []
    index = archive_index(runs_dir, out, experiments, archives, superseded, reproductions(runs))
    return "\n".join(lines).rstrip() + "\n", index


def archive_index(
    runs_dir: Path,
    out: Path,
    experiments: list[Experiment],
    archives: list[list],
    superseded: list[tuple[Run, str]],
    made_again: dict[str, Run],
) -> str:
    """The lab's map from the page to the archives: each experiment's parent runs (or runs, where it has no parent),
    the superseded runs and the reproductions, with the archive holding each; then each archive's size, MLflow runs
    and its flows' process walls (``walls.txt``), and the logs beside them."""
    rows = []
    for exp in experiments:
        for run in exp.parents or exp.children:
            rows.append([f"`{exp.key}`", f"`{run.id}`", started(run), f"`{run.archive}`"])
    rows += [
        [f"superseded: `{r.tags.get('ablation', r.experiment)}`", f"`{r.id}`", started(r), f"`{r.archive}`"]
        for r, _ in superseded
    ]
    rows += [
        [f"reproduction of `{r.tags['reproduces'][:8]}`", f"`{r.id}`", started(r), f"`{r.archive}`"]
        for r in sorted(made_again.values(), key=lambda r: r.start)
        if "reproduces" in r.tags
    ]
    lines = [
        f"# The record archives behind `{out.as_posix()}`",
        "",
        f"> Generated by `{COMMAND}` beside the page: do not edit by hand.",
        "",
        "## Which archive holds which run",
        "",
        *table("experiment|run|started|archive", rows),
        "## The archives",
        "",
        f"The archives under `{runs_dir.as_posix()}/`, the MLflow runs each store holds and "
        "its flows' process walls (`walls.txt`):",
        "",
        *table("archive|kB|MLflow runs|process walls", archives),
    ]
    logs = sorted(p.name for p in runs_dir.glob("*.log"))
    lines += [f"Logs beside them: {', '.join(f'`{name}`' for name in logs)}.", ""] if logs else []
    return "\n".join(lines).rstrip() + "\n"


def started(run: Run) -> str:
    """When the run started, to the minute (UTC)."""
    return datetime.fromtimestamp(run.start / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def reproductions(runs: dict[str, Run]) -> dict[str, Run]:
    """The runs ``flows.reproduce`` made (tag ``reproduces``: its top run and each matched child), and the child
    runs of those tops: id → run. They repeat a run already counted, so they are in no experiment or mean."""
    made = {rid: run for rid, run in runs.items() if "reproduces" in run.tags}
    return made | {rid: run for rid, run in runs.items() if run.tags.get("mlflow.parentRunId") in made}


def reproduction_rows(runs: dict[str, Run], made: dict[str, Run]) -> list[list]:
    """One row per reproduced run (of ``made``, :func:`reproductions`) with a final evaluation: the original's and
    the reproduction's final accuracy, their difference, the largest difference along the validation curve, and
    ``flows.reproduce``'s verdict on them: ``exact``, ``within noise`` (the final and every point of the curve
    within two of the original's s.e.) or ``differs``."""
    rows = []
    for run in sorted(made.values(), key=lambda r: r.start):
        original = runs.get(run.tags.get("reproduces", ""))
        then, se, _ = estimate(original) if original else (None, None, None)
        now = estimate(run)[0]
        if then is None or now is None:
            continue
        old, new = original.metrics.get("val_accuracy", {}), run.metrics.get("val_accuracy", {})
        both = old.keys() & new.keys()
        curve = max((abs(new[s] - old[s]) for s in both), default=0.0)
        rows.append(
            [
                f"`{original.id[:8]}`",
                original.tags.get("ablation", original.experiment),
                original.setting,
                f"`{run.id[:8]}`",
                pm(then, se),
                pm(now),
                f"{now - then:+.3f}",
                f"{curve:.3f} ({len(both)} evaluations)",
                reproduction_verdict("final_val_accuracy", now - then, curve, se),
            ]
        )
    return rows


def reproduction_section(runs: dict[str, Run]) -> list[str]:
    """The runs remade by ``flows.reproduce`` from their records: the metrics side by side, and what the
    reproduction's record says differed from the original's (code, data, versions, device)."""
    made = reproductions(runs)
    rows = reproduction_rows(runs, made)
    if not rows:
        return []
    lines = [
        "## Reproductions",
        "",
        "Runs made again from their MLflow record with `python -m flows.reproduce --run-id ID` (the same flow and "
        "settings; in no table above): final validation accuracy ± the original's s.e. over problems; within noise: "
        "the final and every evaluation along the curve within two of that s.e. (`flows.reproduce`'s rule).",
        "",
        *table(
            "original run|experiment|setting|reproduction|original|reproduced|difference|"
            "largest difference along the curve|verdict",
            rows,
        ),
    ]
    for run in sorted(made.values(), key=lambda r: r.start):
        original = runs.get(run.tags.get("reproduces", ""))
        if not original or "mlflow.parentRunId" in run.tags or not (run.provenance and original.provenance):
            continue
        keys = sorted(run.provenance.keys() | original.provenance.keys())
        changed = [
            f"{key}: {original.provenance.get(key, 'none')} → {run.provenance.get(key, 'none')}"
            for key in keys
            if original.provenance.get(key) != run.provenance.get(key)
        ]
        said = "; ".join(f"`{item}`" for item in changed) if changed else "nothing (same code, data, versions, device)"
        lines.append(f"- `{run.id[:8]}` reproduces `{original.id[:8]}`; what differed in their records: {said}.")
    return [*lines, ""]


def write_atomic(path: Path, text: str) -> None:
    """Write beside ``path`` and rename into place: a reader never sees half a page."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> Path:
    """Parse the arguments, render the page and write it; returns its path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, default=Path("lab/records"), help="folder of record archives")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"), help="the page to write")
    parser.add_argument("--figures", type=Path, default=Path("docs/results"), help="folder for the PNG plots")
    parser.add_argument(
        "--context", type=Path, default=Path("lab/how_to_repeat.md"), help="hand-kept: how to repeat the runs"
    )
    parser.add_argument(
        "--index", type=Path, help="where each run's archive is listed (default: INDEX.md in the --runs folder)"
    )
    args = parser.parse_args(argv)
    if not any(args.runs.glob("*.tar.gz")):
        parser.error(f"no *.tar.gz record archives under {args.runs}")
    page, index = render(args.runs, args.figures, args.context, args.out)
    write_atomic(args.out, page)
    write_atomic(index_path := args.index or args.runs / "INDEX.md", index)
    print(f"wrote {args.out} and {index_path}")
    return args.out


if __name__ == "__main__":
    main()
