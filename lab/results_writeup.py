"""Generate ``docs/results.md`` from the runs' own records, never by hand.

    python lab/results_writeup.py [--runs lab/records] [--out docs/results.md] \\
        [--figures docs/results] [--context lab/how_to_repeat.md]

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
repeat the runs) is copied verbatim after the results. The
page is written atomically.
"""

from __future__ import annotations

import argparse
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

from a5core.sample_metrics import paired_difference, problem_scores
from flows.reproduce import verdict as reproduction_verdict

COMMAND = "python lab/results_writeup.py"
# Where results went, how a sweep's children were scheduled and its grid (the parent's): not what a child ran with.
HIDDEN = {"output_dir", "metrics_path", "tracking_uri", "experiment", "sizes", "filtered_data", "ablation", "runner"}
HIDDEN |= {"gpu_memory_fraction"}  # in what share of the GPU it ran, not what
# The registered model's folder and its files' digests (logged with it as params): what a run made, not what it ran.
HIDDEN |= {"model_dir"}
HIDDEN_PREFIXES = ("sweep_", "clip_", "ray_", "file_sha256/")
TRENDS = ("reward_mean", "token_entropy", "response_tokens_mean", "advantage_std", "grad_norm")
TRENDS += ("frac_groups_all_equal", "kept_fraction", "token_nll", "difficulty_learnable")
UNIT_METRICS = ("val_accuracy", "val_format_rate", "reward_mean")
SMALL = 0.2  # a unit metric whose values all lie under this is plotted on an axis scaled to them
LINESTYLES, MARKERS = ("-", "--", ":", "-."), ("o", "s", "^", "D")
DR_GRPO = "Dr. GRPO (Liu et al. 2025) argues"
# Experiment → (the setting expected to do better, the one expected to do worse, why).
PAIRS = {
    "grpo_baseline_ablation": ("reinforce_with_baseline", "no_baseline", "the handout expects a baseline to help"),
    "grpo_length_norm_ablation": (
        "masked_normalize",
        "masked_mean",
        f"{DR_GRPO} a constant normaliser avoids the length bias of masked_mean",
    ),
    "grpo_std_norm_ablation": (
        "no_std_normalization",
        "std_normalization",
        f"{DR_GRPO} dropping the std normalisation removes a question-difficulty bias (effect expected small)",
    ),
    "grpo_clip_ablation": ("grpo_clip", "grpo_no_clip", "many epochs per rollout batch without clipping are unstable"),
    "grpo_prompt_ablation": (
        "question_only",
        "r1_zero",
        f"{DR_GRPO} the R1 template hurts Qwen2.5-Math, which does best with the question alone",
    ),
    "grpo_dapo_ablation": (
        "dapo",
        "grpo",
        "DAPO (Yu et al. 2025) reports dynamic sampling, token-level loss and overlong shaping together beat GRPO",
    ),
    "grpo_gspo_ablation": (
        "gspo",
        "grpo_clip",
        "GSPO (Zheng et al. 2025) reports the sequence-level ratio trains more stably off-policy than token ratios",
    ),
    "grpo_kl_ablation": (
        "kl_0",
        "kl_0.01",
        "DAPO and Dr. GRPO drop the KL term: with a verifiable reward it mostly holds the policy back",
    ),
    "grpo_question_sampling_ablation": (
        "learnable",
        "uniform",
        "prime-rl and ROLL filter questions by difficulty: a group every sample solves, or none does, gives no "
        "gradient, so drawing only questions with 0 < pass rate < 1 should learn more per step",
    ),
    "grpo_async_ablation": (
        "synchronous",
        "one_step_off",
        "one step of staleness, corrected by truncated importance sampling, should cost at most a little "
        "accuracy per step (its gain is wall-clock: compare the curves by wall-clock)",
    ),
}
# Runs made by code with a bug fixed since (id prefix → why): listed apart, in no experiment, mean or comparison.
SUPERSEDED = {
    "60cb54e8": "learnable question sampling filled a step short of learnable questions in problem order (the same "
    "few every step), fixed in f3e269c; re-run after the fix (the other learnable run)",
}
# Final metrics by name: the training runs' final evaluation, or the leaderboard run's score.
MIN_RUNS = 3  # a verdict word needs this many finished runs of each setting, and as many pairs
# Runs of one setting name that differ in one of these settings: a setting each, named by it.
VARIANT_PARAMS = ("backend", "budget_hours")
PARITY = {
    ("backend=vllm", "backend=hf"): "the rollout engine does not change what GRPO learns (vLLM and the hf engine "
    "sample one distribution)",
}
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
        return shown | ({"model_path": self.tags["model_path"]} if "model_path" in self.tags else {})


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


def load_records(runs_dir: Path, tmp: Path) -> tuple[dict[str, Run], list[list]]:
    """Unpack every archive; the runs (one copy per id, with what their ``provenance.json`` says they were made
    from) and a row per archive: name, kB, runs, walls."""
    runs: dict[str, Run] = {}
    archives = []
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
    return runs, archives


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


def spread_se(values: list[float], binomial: float) -> float:
    """The s.e. of a mean of ``values`` (one a run): their standard deviation / sqrt(k), the spread between runs,
    or ``binomial`` (the runs' noise over problems) where that is larger or there is one value only."""
    k = len(values)
    if k < 2:
        return binomial
    mean = sum(values) / k
    return max(math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1) / k), binomial)


def mean_of(runs: list[Run], metric: str = "accuracy") -> tuple[float, float] | None:
    """The mean final ``metric`` over ``runs`` and its s.e.: the spread between runs (:func:`spread_se`), at least
    the runs' binomial s.e.s combined (sqrt(Σ se²) / k)."""
    values = [(p, se or 0.0) for p, se, _ in (estimate(r, metric) for r in runs) if p is not None]
    if not values:
        return None
    k = len(values)
    binomial = math.sqrt(sum(se**2 for _, se in values)) / k
    return sum(p for p, _ in values) / k, spread_se([p for p, _ in values], binomial)


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
    """``a`` − ``b`` in final ``metric``: the difference, its s.e., how many pairs gave it (0: unpaired means), the
    finished runs of each, and the verdict's word."""

    a: str
    b: str
    metric: str
    diff: float
    se: float
    pairs: int
    runs: tuple[int, int]
    by_problem: int = 0  # of the pairs, those whose runs' final evaluations were compared problem by problem

    @property
    def word(self) -> str:
        """agrees / disagrees only with MIN_RUNS runs of each setting and as many pairs, the paired difference
        clearing two standard errors; else within noise, or too few runs."""
        if min(*self.runs, self.pairs) < MIN_RUNS:
            return "too few runs"
        if abs(self.diff) < 2 * self.se or self.diff == 0:
            return "within noise"
        return "agrees" if self.diff > 0 else "disagrees"

    @property
    def difference(self) -> str:
        return f"{self.diff:+.3f} ± {self.se:.3f}"

    def sentence(self) -> str:
        word = "**disagrees**" if self.word == "disagrees" else self.word
        how = (
            f"paired over the {self.pairs} parent run{'s' * (self.pairs > 1)} and seed{'s' * (self.pairs > 1)} "
            "that ran both: the same starting model and problems"
            if self.pairs
            else "unpaired means: no parent run and seed ran both"
        )
        if self.by_problem:
            how += f"; {self.by_problem} of them also problem by problem"
        z = f"{self.diff / self.se:+.1f} s.e.; " if self.se else ""
        text = f"{word}: {self.a} − {self.b} = {self.difference} in final {self.metric.replace('_', ' ')} ({z}{how}; "
        text += f"{self.runs[0]} and {self.runs[1]} finished runs)"
        if self.word == "too few runs":
            return text + f"; a verdict needs {MIN_RUNS} runs of each setting, paired"
        if self.word == "disagrees":
            return text + f"; {self.b} ends above {self.a}, the opposite of the expectation"
        return text + (", under two standard errors" if self.word == "within noise" else "")


def compare(a: str, b: str, runs: dict[str, list[Run]], metric: str = "accuracy") -> Comparison | None:
    """``a`` − ``b``: paired by (parent run, seed), the runs that started from the same model on the same problems
    (mean of the pairs' differences, s.e. from their spread, at least their own s.e.s combined); with no such
    pair, the difference of the plain means (each s.e. from :func:`mean_of`). A pair's own s.e. is, for accuracy
    where both runs kept their final evaluation by problem, that of the per-problem differences (the same problems
    solved by both cancel), else the two runs' binomial s.e.s combined. None when either has no final figure."""
    done = {s: finished(runs.get(s, [])) for s in (a, b)}
    if not done[a] or not done[b]:
        return None
    keyed = [{(parent_of(r), r.params.get("seed")): r for r in done[s]} for s in (a, b)]
    shared = sorted(set(keyed[0]) & set(keyed[1]), key=str)
    counts = (len(done[a]), len(done[b]))
    if not shared:
        (ma, sa), (mb, sb) = mean_of(done[a], metric), mean_of(done[b], metric)
        return Comparison(a, b, metric, ma - mb, math.hypot(sa, sb), 0, counts)
    diffs, ses, by_problem = [], [], 0
    for key in shared:
        ra, rb = keyed[0][key], keyed[1][key]
        if metric == "accuracy" and ra.problems and rb.problems and ra.problems.keys() == rb.problems.keys():
            paired = paired_difference(ra.problems, rb.problems)
            diffs.append(paired["difference"])
            ses.append(paired["difference_se"])
            by_problem += 1
            continue
        (pa, sa, _), (pb, sb, _) = estimate(ra, metric), estimate(rb, metric)
        diffs.append(pa - pb)
        ses.append(math.hypot(sa or 0.0, sb or 0.0))
    k = len(diffs)
    se = spread_se(diffs, math.sqrt(sum(s**2 for s in ses)) / k)
    return Comparison(a, b, metric, sum(diffs) / k, se, k, counts, by_problem)


def verdict(a: str, b: str, runs: dict[str, list[Run]], metric: str = "accuracy") -> str:
    """The measured ``a`` − ``b`` and its verdict (:class:`Comparison`), as a sentence."""
    found = compare(a, b, runs, metric)
    return found.sentence() if found else f"not measured ({a} or {b} has no final {metric})"


# An expectation: its short form (the headline table), the comparison, the sentence of the section.
Expectation = tuple[str, "Comparison | None", str]


def sft_expectations(runs: dict[str, list[Run]]) -> list[Expectation]:
    """SFT: accuracy and format rate rise with the data size; filtered ≥ unfiltered at (nearly) equal size."""
    size = {
        s: int(rs[0].params["n_examples"]) for s, rs in runs.items() if rs[0].params.get("n_examples", "").isdigit()
    }
    sized = sorted((n, s) for s, n in size.items() if "filtered" not in s)
    found: list[Expectation] = []
    if len(sized) > 1:
        (n0, small), (n1, big) = sized[0], sized[-1]
        acc, fmt = compare(big, small, runs), compare(big, small, runs, "format_rate")
        found.append(
            (
                f"more SFT data, higher accuracy and format rate ({big} vs {small})",
                acc,
                f"Expectation (handout): accuracy and format rate rise with the SFT data size. Measured, {big} ({n1} "
                f"examples) against {small} ({n0}): accuracy {verdict(big, small, runs)}; format rate "
                f"{verdict(big, small, runs, 'format_rate')}.",
            )
        )
        if fmt:
            found.append((f"format rate, {big} vs {small}", fmt, ""))
    for filtered in [s for s in size if "filtered" in s][:1] if sized else []:
        n, near = min(sized, key=lambda x: abs(x[0] - size[filtered]))
        found.append(
            (
                f"filtered traces ≥ unfiltered at equal size ({filtered} vs {near})",
                compare(filtered, near, runs),
                f"Expectation: filtered (correct-only) traces ≥ unfiltered ones at equal size; the nearest unfiltered "
                f"size is {near} ({n} examples, against {size[filtered]}): accuracy {verdict(filtered, near, runs)}; "
                f"format rate {verdict(filtered, near, runs, 'format_rate')}.",
            )
        )
    return found


CHOSEN = " (the best setting, chosen on the scored problems)"
BIASED = (
    "chosen as the best on the same problems that score it (these records hold no held-out split), so the "
    "difference is biased upward"
)


def expectations(exp: Experiment) -> list[Expectation]:
    """The measured direction against each expectation, computed from the numbers."""
    runs = exp.by_setting()
    if exp.key in PAIRS:
        better, worse, why = PAIRS[exp.key]
        found = compare(better, worse, runs)
        return [(why, found, f"Expectation: {why}, so {better} ≥ {worse}. Measured: {verdict(better, worse, runs)}.")]
    if exp.kind == "sft_experiment":
        return sft_expectations(runs)
    for (a, b), why in PARITY.items():
        if set(runs) == {a, b}:
            found = compare(a, b, runs)
            return [
                (
                    f"{why}: {a} within two s.e. of {b}",
                    found,
                    f"Expectation: {why}, so {a} and {b} end within two standard errors of each other. "
                    f"Measured: {verdict(a, b, runs)}.",
                )
            ]
    finals = {s: m[0] for s, rs in runs.items() if (m := mean_of(rs)) is not None}
    if not finals:
        return []
    best = max(finals, key=finals.get)
    if exp.key == "grpo_lr_sweep":
        top = max(runs, key=lambda s: float(runs[s][0].params.get("learning_rate", "nan")))
        why = "too high a learning rate diverges"
        if top == best:
            return [(why, None, f"Expectation: {why}. Measured: the highest, {top}, ends best: no diverging rate.")]
        return [
            (
                f"{why}: best ≥ highest ({top}){CHOSEN}",
                compare(best, top, runs),
                f"Expectation: {why}, so the best ({best}, {BIASED}) ≥ the highest ({top}). "
                f"Measured: {verdict(best, top, runs)}.",
            )
        ]
    if exp.key == "grpo_off_policy_sweep" and "on_policy" in finals and len(finals) > 1:
        off = max((s for s in finals if s != "on_policy"), key=finals.get)
        why = "several epochs per rollout batch (grpo_clip) get more out of each batch than one on-policy step"
        return [
            (
                f"{why} ({off} vs on_policy){CHOSEN}",
                compare(off, "on_policy", runs),
                f"Expectation: {why}, so the best off-policy setting ({off}, {BIASED}) ≥ on_policy. Measured: "
                f"{verdict(off, 'on_policy', runs)}.",
            )
        ]
    return other_expectations(exp, runs, best, min(finals, key=finals.get))


def other_expectations(exp: Experiment, runs: dict[str, list[Run]], best: str, worst: str) -> list[Expectation]:
    """Expert Iteration against its start; a single run's score; best against worst elsewhere."""
    run = runs[best][0]
    p0, n0 = run.metrics.get("val_accuracy", {}).get(0), run.metrics.get("val_n_problems", {}).get(0)
    if exp.kind == "expert_iteration" and p0 is not None and n0:
        (p1, se1), se0 = mean_of(runs[best]), math.sqrt(p0 * (1 - p0) / n0)
        found = Comparison(
            f"{best} final", "step 0", "accuracy", p1 - p0, math.hypot(se1, se0), 0, (len(runs[best]), 1)
        )
        why = "Expert Iteration improves on its starting model"
        return [(why, found, f"Expectation (handout): {why}. Measured, best setting ({BIASED}): {found.sentence()}.")]
    if exp.kind == "leaderboard":
        return [("", None, leaderboard_sentence(exp, r)) for r in exp.children if estimate(r)[0] is not None]
    if len(exp.children) == 1:
        budget = run.final("budget_seconds")
        spent = f" in {run.final('wall_seconds'):.0f} s of a {budget:.0f} s budget" if budget else ""
        return [("", None, f"Final score {pm(*estimate(run))}{spent}; no expectation to compare it with.")]
    return [
        (
            "",
            None,
            f"No recorded expectation for this experiment; best against worst setting ({BIASED}): "
            f"{verdict(best, worst, runs)}.",
        )
    ]


def directions(exp: Experiment) -> list[str]:
    """The sentences of :func:`expectations`."""
    return [sentence for *_, sentence in expectations(exp) if sentence]


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


def ended(status: str) -> str:
    """How a run ended, from its status: an archive is a run's last record, so one still RUNNING there was
    stopped (with its machine) without ending."""
    return "stopped" if status == "RUNNING" else status


def settings_lines(exp: Experiment) -> tuple[list[str], list[str]]:
    """The parent runs and the settings every run shares; the names of the settings that differ."""
    lines = []
    for p in exp.parents:
        when = datetime.fromtimestamp(p.start / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        tags = [f"{k} `{v}`" for k, v in p.tags.items() if k in ("best_setting",)]
        took = f"{p.seconds:.0f} s" if p.seconds else "no end recorded"
        lines.append(f"- parent run `{p.id}` ({p.archive}): started {when}, {took}; {ended(p.status)}")
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


def section(exp: Experiment, figure_dir: Path, link_base: Path, spreads: dict[str, float]) -> list[str]:
    """An experiment's section: parents, settings, finals, runs of one setting, curves, trends, verdict, plots;
    ``spreads``: run id → the spread of the runs with its parameters elsewhere in the records."""
    lines, differ = settings_lines(exp)
    lines = [f"## `{exp.key}` (MLflow experiment `{exp.kind}`)", "", *lines]
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
        done = finished(rs)
        if len(done) > 1:
            accs = [estimate(r)[0] for r in done]
            seeds = ", ".join(r.params.get("seed", "?") for r in done)
            spread, formats = f"{max(accs) - min(accs):.4f}", pm(*mean_of(done, "format_rate") or [None])
            rows.append([s, len(done), seeds, pm(*mean_of(done)), spread, formats])
    if rows:
        lines += [
            "Runs of one setting (seeds, re-runs) that reached their final evaluation: the mean over runs, its s.e. "
            "from the spread between runs (standard deviation / sqrt(runs), at least the runs' binomial s.e.s "
            "combined), and the spread (max − min).",
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
    lines += [f"- {d}" for d in directions(exp)]
    if spread := max((spreads[c.id] for c in exp.children if c.id in spreads), default=None):
        lines += [
            f"- Runs with the parameters of runs here, made by other invocations, spread by up to {spread:.3f} in "
            "final accuracy (Repeated configurations, below): compare the differences above with that."
        ]
    lines += [""]
    return lines + [f"![{p.stem}]({os.path.relpath(p.resolve(), link_base)})\n" for p in figures(exp, figure_dir)]


def trend(points: dict[int, float] | None) -> str:
    """``first → last (mean)`` of a per-step metric."""
    values = [points[s] for s in sorted(points)] if points else []
    return f"{values[0]:.3g} → {values[-1]:.3g} ({sum(values) / len(values):.3g})" if values else ""


def repeats(experiments: list[Experiment]) -> tuple[list[str], dict[str, float]]:
    """Runs of different parents (invocations) with identical parameters, seed included: a table of their final
    accuracies, and each such run's id → the spread (max − min) of its group."""
    groups: dict[tuple, list[tuple[str, Run]]] = defaultdict(list)
    for exp in experiments:
        for run in exp.children:
            same = tuple(sorted((k, v) for k, v in run.settings().items() if k not in ("setting", "model_path")))
            groups[same].append((exp.key, run))
    rows, spreads = [], {}
    for group in groups.values():
        # runs that ended with an evaluation, each with its estimate
        scored = [(k, r, est) for k, r in group if (est := estimate(r))[0] is not None]
        if len({parent_of(r) for _, r, _ in scored}) > 1:
            spread = max(est[0] for *_, est in scored) - min(est[0] for *_, est in scored)
            runs = "; ".join(f"{k}/{r.setting} `{r.id[:8]}`: {pm(*est)}" for k, r, est in scored)
            rows.append([runs, f"{spread:.4f}"])
            spreads |= {r.id: spread for _, r, _ in scored}
    if not rows:
        return [], {}
    intro = (
        "Runs of different invocations with identical effective settings (params, and the settings some runs logged "
        "as tags instead, seed included); the same settings may still "
        "start from different weights (tag `model_path`, where logged):"
    )
    header = "runs: final accuracy ± s.e.|spread (max − min)"
    return ["## Repeated configurations", "", intro, "", *table(header, rows)], spreads


def clears(row: list[str]) -> bool:
    """Whether a headline row's difference ``… = d ± se`` is at least two standard errors."""
    d, se = (float(x) for x in row[2].rsplit("= ", 1)[1].split(" ± "))
    return abs(d) >= 2 * se


def headline(experiments: list[Experiment], spreads: dict[str, float], runs: dict[str, Run]) -> list[str]:
    """The page's opening: one row per expectation measured (experiment, expectation, difference ± s.e., runs,
    verdict) and a paragraph of what they say, computed from the same numbers."""
    rows, words, by_problem = [], [], 0
    for exp in experiments:
        for why, found, _ in expectations(exp):
            if found is None or not why:
                continue
            metric = "" if found.metric == "accuracy" else f" ({found.metric.replace('_', ' ')})"
            paired = f"; {found.pairs} paired" if found.pairs else "; unpaired"
            paired += f" ({found.by_problem} by problem)" if found.by_problem else ""
            by_problem += bool(found.by_problem)
            rows.append(
                [
                    f"`{exp.key}`",
                    why,
                    f"{found.a} − {found.b}{metric} = {found.difference}",
                    f"{found.runs[0]} + {found.runs[1]}{paired}",
                    f"**{found.word}**" if found.word in ("agrees", "disagrees") else found.word,
                ]
            )
            words.append(found.word)
    lines = ["## Findings", ""]
    lines += table("experiment|the handout's expectation|measured difference ± s.e.|runs|verdict", rows)
    counts = ", ".join(f"{words.count(w)} {w}" for w in ("agrees", "disagrees", "within noise", "too few runs"))
    lines += [
        f"What we learned: of {len(words)} measured expectations: {counts}. A verdict word (agrees, disagrees) needs "
        f"at least {MIN_RUNS} finished runs of each setting and {MIN_RUNS} pairs of runs made from the same starting "
        "model (same parent run and seed), their mean difference clearing two standard errors; every ± includes the "
        "spread between runs, not only each run's noise over problems."
    ]
    if spreads:
        ses = sorted(se for rid, se in ((r, estimate(runs[r])[1]) for r in spreads) if se)
        lines[-1] += (
            f" Runs of identical effective settings made by different invocations spread by up to "
            f"{max(spreads.values()):.3f} in final accuracy (Repeated configurations), where one run's s.e. over "
            f"problems is about {ses[len(ses) // 2]:.3f}: the starting model, retrained by each invocation, moves the "
            "score as much as most settings do, so most differences here are within what re-running alone gives."
        )
    if large := [r for r, w in zip(rows, words, strict=True) if w == "too few runs" and clears(r)]:
        lines[-1] += (
            " Differences that clear two standard errors all the same, measurements rather than verdicts with "
            f"fewer than {MIN_RUNS} runs a setting: " + "; ".join(f"{r[0]} {r[2]}" for r in large) + "."
        )
    older = (
        "the older runs keep per-problem results only for the 16 problems sampled into each evaluation's generations "
        "table, so their pairs are runs only"
    )
    if by_problem:
        lines[-1] += (
            f" {by_problem} of the {len(rows)} comparisons are also paired problem by problem: where both runs of a "
            "pair kept their final evaluation by problem, the pair's difference and s.e. come from the per-problem "
            f"differences (problems both solve, or both miss, cancel); {older}."
        )
    else:
        lines[-1] += f" No comparison is paired problem by problem: {older}."
    return lines + [""]


def render(runs_dir: Path, figure_dir: Path, context: Path, out: Path) -> str:
    """The whole page, from the archives under ``runs_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        runs, archives = load_records(runs_dir, Path(tmp))
    superseded = [
        (run, why) for run in runs.values() for prefix, why in SUPERSEDED.items() if run.id.startswith(prefix)
    ]
    left_out = {run.id for run, _ in superseded} | set(reproductions(runs))
    experiments = find_experiments({rid: run for rid, run in runs.items() if rid not in left_out})
    repeated, spreads = repeats(experiments)
    lines = [
        f"> Generated by `{COMMAND}` from the records in `{runs_dir.as_posix()}/`: do not edit by hand (edit "
        f"the script, or the hand-kept part on repeating the runs, `{context.as_posix()}`).",
        "",
        "# Results",
        "",
        *headline(experiments, spreads, runs),
    ]
    rows = [[f"`{exp.key}`", exp.kind, len(exp.parents), len(exp.children)] for exp in experiments]
    lines += ["## Experiments in the records", "", *table("experiment|MLflow experiment|parent runs|runs", rows)]
    for exp in experiments:
        lines += section(exp, figure_dir, out.resolve().parent, spreads)
    lines += repeated
    lines += reproduction_section(runs)
    if superseded:
        rows = [
            [f"`{r.id[:8]}`", r.tags.get("ablation", r.experiment), r.setting, pm(*estimate(r)), r.archive, why]
            for r, why in superseded
        ]
        lines += ["## Superseded runs", "", "Made by code with a bug fixed since; in no table or comparison above:", ""]
        lines += table("run|experiment|setting|final accuracy ± s.e.|archive|why", rows)
    lines += [context.read_text().rstrip(), ""] if context.is_file() else []
    lines += [
        "## Records",
        "",
        f"The archives under `{runs_dir.as_posix()}/`, the MLflow runs each store holds and "
        "its flows' process walls (`walls.txt`):",
        "",
        *table("archive|kB|MLflow runs|process walls", archives),
    ]
    logs = sorted(p.name for p in runs_dir.glob("*.log"))
    lines += [f"Logs beside them: {', '.join(f'`{name}`' for name in logs)}.", ""] if logs else []
    return "\n".join(lines).rstrip() + "\n"


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
                f"`{original.id[:8]}` ({original.archive})",
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
    args = parser.parse_args(argv)
    if not any(args.runs.glob("*.tar.gz")):
        parser.error(f"no *.tar.gz record archives under {args.runs}")
    write_atomic(args.out, render(args.runs, args.figures, args.context, args.out))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
