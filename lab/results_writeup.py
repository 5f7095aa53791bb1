"""Generate ``docs/results.md`` from the runs' own records, never by hand.

    python lab/results_writeup.py [--runs lab/records] [--out docs/results.md] \\
        [--figures docs/results] [--context lab/context.md]

Every ``*.tar.gz`` under ``--runs`` is unpacked into a temporary folder and each ``mlflow.db`` in it read
through sqlite3, read-only (no migration; the runs/params/tags/metrics tables every MLflow store has). A run
found in several archives is kept once: the copy with more metric points, then the later end time. An
experiment is a parent run with children (tag ``mlflow.parentRunId``), named by its tag ``ablation`` or its
run name (``sft_experiment``, ``ei_sweep``); parents of one name (a second seed, a re-run) form one
experiment, unless their runs were scored on another validation set (``validation_data``): those form
``NAME on SET``. Runs that ``SUPERSEDED`` names (made by code with a bug fixed since) are left out of every
experiment and listed apart with the reason. A run with neither parent nor children but a final score
(``leaderboard``) is an experiment of its own. For each: the settings its runs share and those that differ; final validation accuracy and format
rate ± the standard error over problems sqrt(p(1−p)/n); the mean and spread over runs of one setting;
curves, training trends and plots (``--figures``); the measured direction against the handout's
expectation. ``--context`` (hand-kept prose on how the runs were made) is copied verbatim to the top. The
page is written atomically.
"""

from __future__ import annotations

import argparse
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

COMMAND = "python lab/results_writeup.py"
# Where results went, how a sweep's children were scheduled and its grid (the parent's): not what a child ran with.
HIDDEN = {"output_dir", "metrics_path", "tracking_uri", "experiment", "sizes", "filtered_data", "ablation", "runner"}
HIDDEN_PREFIXES = ("sweep_", "clip_", "ray_")
TRENDS = ("reward_mean", "token_entropy", "response_tokens_mean", "advantage_std", "grad_norm")
TRENDS += ("frac_groups_all_equal", "kept_fraction", "token_nll", "difficulty_learnable")
UNIT_METRICS = ("val_accuracy", "val_format_rate", "reward_mean")
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
    "few every step), fixed in f3e269c; re-run after the fix in the fifth session",
}
# Final metrics by name: the training runs' final evaluation, or the leaderboard run's score.
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

    def final(self, *keys: str) -> float | None:
        """The value at the last step of the first of ``keys`` the run logged."""
        for key in keys:
            if self.metrics.get(key):
                return self.metrics[key][max(self.metrics[key])]
        return None

    @property
    def setting(self) -> str:
        """The child's setting (param ``setting``), else its run name."""
        return self.params.get("setting", self.name)

    @property
    def seconds(self) -> float | None:
        """Start to end, in seconds (None while running)."""
        return (self.end - self.start) / 1000 if self.end else None

    @property
    def points(self) -> int:
        """How many metric points it holds: the newer copy of a run holds more."""
        return sum(map(len, self.metrics.values()))

    def settings(self) -> dict[str, str]:
        """The parameters that say what ran, with the starting model's real folder (tag ``model_path``)."""
        shown = {k: v for k, v in self.params.items() if k not in HIDDEN and not k.startswith(HIDDEN_PREFIXES)}
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


def load_records(runs_dir: Path, tmp: Path) -> tuple[dict[str, Run], list[list]]:
    """Unpack every archive; the runs (one copy per id) and a row per archive: name, kB, runs, walls."""
    runs: dict[str, Run] = {}
    archives = []
    for archive in sorted(runs_dir.glob("*.tar.gz")):
        dest = tmp / archive.name
        with tarfile.open(archive) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        found = [run for db in sorted(dest.rglob("mlflow.db")) for run in read_store(db, archive.name)]
        for run in found:
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
    """Parents with children, grouped by name (tag ``ablation`` or run name) and validation set (the name's
    first set keeps the bare name, another one is ``NAME on SET``); standalone runs with a score."""
    children: dict[str, list[Run]] = defaultdict(list)
    for run in sorted(runs.values(), key=lambda r: r.start):
        if run.tags.get("mlflow.parentRunId") in runs:
            children[run.tags["mlflow.parentRunId"]].append(run)
    found: dict[str, Experiment] = {}
    first_set: dict[str, str] = {}
    for run in sorted(runs.values(), key=lambda r: r.start):
        if run.id in children:
            name, scored_on = run.tags.get("ablation", run.name), validation_set(run, children[run.id])
            key = name if first_set.setdefault(name, scored_on) == scored_on else f"{name} on {scored_on}"
            exp = found.setdefault(key, Experiment(key, [], []))
            exp.parents.append(run)
            exp.children += children[run.id]
        elif run.tags.get("mlflow.parentRunId") not in runs and estimate(run)[0] is not None:
            found.setdefault(run.name, Experiment(run.name, [], [])).children.append(run)
    return list(found.values())


def estimate(run: Run, metric: str = "accuracy") -> tuple[float | None, float | None, float | None]:
    """(p, its standard error sqrt(p(1−p)/n), n) of the run's final validation accuracy or format_rate."""
    p, n = run.final(*FINALS[metric]), run.final("final_val_n_problems", "n_final_problems")
    return (p, math.sqrt(p * (1 - p) / n), n) if p is not None and n else (p, None, n)


def finished(runs: list[Run]) -> list[Run]:
    """The runs that reached their final evaluation (a run stopped before it has no final figure)."""
    return [r for r in runs if estimate(r)[0] is not None]


def mean_of(runs: list[Run], metric: str = "accuracy") -> tuple[float, float] | None:
    """The mean final ``metric`` over ``runs`` and its s.e. (the runs' binomial s.e.s: sqrt(Σ se²) / k)."""
    values = [(p, se or 0.0) for p, se, _ in (estimate(r, metric) for r in runs) if p is not None]
    if not values:
        return None
    return sum(p for p, _ in values) / len(values), math.sqrt(sum(se**2 for _, se in values)) / len(values)


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


def paired(a: str, b: str, runs: dict[str, list[Run]], metric: str) -> tuple[float, float, int] | None:
    """``a`` − ``b`` within the parent runs where both finished (each parent's children start from the same
    model, made in the same call; parents differ by more than their problems' noise): the mean over those
    parents of each one's difference of means, its s.e. (sqrt(Σ se²) / k) and k. None when no parent has
    both, or when every finished run of either is in such a parent (then the plain means say the same)."""
    done = {s: finished(runs.get(s, [])) for s in (a, b)}
    shared = {parent_of(r) for r in done[a]} & {parent_of(r) for r in done[b]}
    if not shared or all(parent_of(r) in shared for s in (a, b) for r in done[s]):
        return None
    diffs = []
    for parent in sorted(shared):
        ma, mb = (mean_of([r for r in done[s] if parent_of(r) == parent], metric) for s in (a, b))
        diffs.append((ma[0] - mb[0], math.hypot(ma[1], mb[1])))
    k = len(diffs)
    return sum(d for d, _ in diffs) / k, math.sqrt(sum(se**2 for _, se in diffs)) / k, k


def verdict(a: str, b: str, runs: dict[str, list[Run]], metric: str = "accuracy", ests: tuple = ()) -> str:
    """Whether ``a`` ≥ ``b`` in final ``metric`` (means over a setting's runs, or the estimates ``ests``):
    agrees, disagrees, or within noise (a difference under two combined standard errors). Where some runs
    of the two share a parent run and others do not, only the shared parents' runs are compared
    (:func:`paired`): runs from another starting model would compare the models, not the settings."""
    pair = None if ests else paired(a, b, runs, metric)
    if pair is not None:
        diff, se, k = pair
        notes = [f"{diff / se:+.1f} s.e."] if se else []
        notes.append(f"within the {k} parent run{'s' * (k > 1)} that ran both: the same starting model")
        return judged(a, b, diff, se, notes, metric)
    ma, mb = ests or (mean_of(runs.get(a, []), metric), mean_of(runs.get(b, []), metric))
    if ma is None or mb is None:
        return f"not measured ({a} or {b} has no final {metric})"
    diff, se = ma[0] - mb[0], math.hypot(ma[1], mb[1])
    means = [f"{s}: mean of {len(finished(runs[s]))} runs" for s in (a, b) if len(finished(runs.get(s, []))) > 1]
    return judged(a, b, diff, se, ([f"{diff / se:+.1f} s.e."] if se else []) + means, metric)


def judged(a: str, b: str, diff: float, se: float, notes: list[str], metric: str) -> str:
    """The verdict's sentence for ``a`` − ``b`` = ``diff`` ± ``se``."""
    measured = f"{a} − {b} = {diff:+.3f} ± {se:.3f} in final {metric.replace('_', ' ')}"
    measured += f" ({'; '.join(notes)})" if notes else ""
    if abs(diff) < 2 * se or diff == 0:
        return f"within noise: {measured}, under two combined standard errors"
    if diff > 0:
        return f"agrees: {measured}"
    return f"**disagrees**: {measured}; {b} ends above {a}, the opposite of the expectation"


def sft_directions(runs: dict[str, list[Run]]) -> list[str]:
    """SFT: accuracy and format rate rise with the data size; filtered ≥ unfiltered at (nearly) equal size."""
    size = {
        s: int(rs[0].params["n_examples"]) for s, rs in runs.items() if rs[0].params.get("n_examples", "").isdigit()
    }
    sized = sorted((n, s) for s, n in size.items() if "filtered" not in s)
    lines = []
    if len(sized) > 1:
        (n0, small), (n1, big) = sized[0], sized[-1]
        lines.append(
            f"Expectation (handout): accuracy and format rate rise with the SFT data size. Measured, {big} ({n1} "
            f"examples) against {small} ({n0}): accuracy {verdict(big, small, runs)}; format rate "
            f"{verdict(big, small, runs, 'format_rate')}."
        )
    for filtered in [s for s in size if "filtered" in s][:1] if sized else []:
        n, near = min(sized, key=lambda x: abs(x[0] - size[filtered]))
        lines.append(
            f"Expectation: filtered (correct-only) traces ≥ unfiltered ones at equal size; the nearest unfiltered size "
            f"is {near} ({n} examples, against {size[filtered]}): accuracy {verdict(filtered, near, runs)}; format "
            f"rate {verdict(filtered, near, runs, 'format_rate')}."
        )
    return lines


def directions(exp: Experiment) -> list[str]:
    """One or two sentences: the measured direction against the expectation, computed from the numbers."""
    runs = exp.by_setting()
    if exp.key in PAIRS:
        better, worse, why = PAIRS[exp.key]
        return [f"Expectation: {why}, so {better} ≥ {worse}. Measured: {verdict(better, worse, runs)}."]
    if exp.kind == "sft_experiment":
        return sft_directions(runs)
    finals = {s: m[0] for s, rs in runs.items() if (m := mean_of(rs)) is not None}
    if not finals:
        return []
    best, worst = max(finals, key=finals.get), min(finals, key=finals.get)
    if exp.key == "grpo_lr_sweep":
        top = max(runs, key=lambda s: float(runs[s][0].params.get("learning_rate", "nan")))
        why = "Expectation: too high a learning rate diverges"
        if top == best:
            return [f"{why}. Measured: the highest, {top}, ends best: the sweep reaches no diverging rate."]
        return [f"{why}, so the best ({best}) ≥ the highest ({top}). Measured: {verdict(best, top, runs)}."]
    if exp.key == "grpo_off_policy_sweep" and "on_policy" in finals and len(finals) > 1:
        off = max((s for s in finals if s != "on_policy"), key=finals.get)
        why = "several epochs per rollout batch (grpo_clip) get more out of each batch than one on-policy step"
        return [
            f"Expectation: {why}, so the best off-policy setting ({off}) ≥ on_policy. Measured: "
            f"{verdict(off, 'on_policy', runs)}."
        ]
    run = runs[best][0]
    p0, n0 = run.metrics.get("val_accuracy", {}).get(0), run.metrics.get("val_n_problems", {}).get(0)
    if exp.kind == "expert_iteration" and p0 is not None and n0:
        ests = (mean_of([run]), (p0, math.sqrt(p0 * (1 - p0) / n0)))
        return [
            f"Expectation (handout): Expert Iteration improves on its starting model. Measured, best setting: "
            f"{verdict(f'{best} final', 'step 0', runs, ests=ests)}."
        ]
    if len(exp.children) == 1:
        budget = run.final("budget_seconds")
        spent = f" in {run.final('wall_seconds'):.0f} s of a {budget:.0f} s budget" if budget else ""
        return [f"Final score {pm(*estimate(run))}{spent}; no expectation to compare it with."]
    return [f"No recorded expectation for this experiment; best against worst setting: {verdict(best, worst, runs)}."]


def plot(path: Path, series: dict[str, list[tuple[float, float]]], x: str, y: str, title: str) -> Path:
    """One line per series, saved at 80 dpi; the axes of :func:`tasks.plots.plot_curves` (which saves at 120):
    0–1 for accuracies, rates and rewards, integer ticks for steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(6.4, 3.8))
    for name, points in series.items():
        axes.plot(*zip(*sorted(points), strict=True), marker="o", markersize=3, label=name)
    if y in UNIT_METRICS and all(0 <= v <= 1 for points in series.values() for _, v in points):
        axes.set_ylim(-0.02, 1.02)
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


def settings_lines(exp: Experiment) -> tuple[list[str], list[str]]:
    """The parent runs and the settings every run shares; the names of the settings that differ."""
    lines = []
    for p in exp.parents:
        when = datetime.fromtimestamp(p.start / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        tags = [f"{k} `{v}`" for k, v in p.tags.items() if k in ("best_setting",)]
        lines.append(f"- parent run `{p.id}` ({p.archive}): started {when}, {num(p.seconds, '.0f')} s; {p.status}")
        lines[-1] += "".join(f"; {t}" for t in tags)
    settings = [c.settings() for c in exp.children]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    # one value among the runs that log it: a field added since older runs were made is no difference
    values = {k: {s[k] for s in settings if k in s} for k in keys}
    shared = [k for k in keys if len(values[k]) == 1]
    lines += ["", "Settings every run shares: " + ", ".join(f"`{k}={next(iter(values[k]))}`" for k in shared) + "."]
    if newer := [k for k in shared if any(k not in s for s in settings)]:
        lines += [f"(Not logged by the older runs, fields added since: {', '.join(f'`{k}`' for k in newer)}.)"]
    lines += [""]
    return lines, [k for k in keys if k not in shared and k != "setting"]


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
        status = "" if c.status == "FINISHED" else f" {c.status}"
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
            "Runs of one setting (seeds, re-runs) that reached their final evaluation: the mean over runs (s.e. "
            "from the runs' binomial s.e.s) and the spread (max − min).",
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
        "Runs of different invocations with identical parameters (seed included); the same parameters may still "
        "start from different weights (tag `model_path`, where logged):"
    )
    header = "runs: final accuracy ± s.e.|spread (max − min)"
    return ["## Repeated configurations", "", intro, "", *table(header, rows)], spreads


def render(runs_dir: Path, figure_dir: Path, context: Path, out: Path) -> str:
    """The whole page, from the archives under ``runs_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        runs, archives = load_records(runs_dir, Path(tmp))
    superseded = [
        (run, why) for run in runs.values() for prefix, why in SUPERSEDED.items() if run.id.startswith(prefix)
    ]
    left_out = {run.id for run, _ in superseded}
    experiments = find_experiments({rid: run for rid, run in runs.items() if rid not in left_out})
    lines = [
        f"> Generated by `{COMMAND}` from the records in `{runs_dir.as_posix()}/`: do not edit by hand (edit "
        f"the script, or the hand-kept prose on top, `{context.as_posix()}`).",
        "",
    ]
    lines += [context.read_text().rstrip(), ""] if context.is_file() else []
    rows = []
    for exp in experiments:
        finals = {s: m for s, rs in exp.by_setting().items() if (m := mean_of(rs))}
        best = max(finals, key=lambda s: finals[s][0]) if finals else None
        rows.append([f"`{exp.key}`", len(exp.parents), len(exp.children), best, pm(*finals[best]) if best else ""])
    lines += [
        "## Experiments in the records",
        "",
        *table("experiment|parent runs|runs|best setting|its final accuracy ± s.e.", rows),
    ]
    repeated, spreads = repeats(experiments)
    for exp in experiments:
        lines += section(exp, figure_dir, out.resolve().parent, spreads)
    lines += repeated
    if superseded:
        rows = [
            [f"`{r.id[:8]}`", r.tags.get("ablation", r.experiment), r.setting, pm(*estimate(r)), r.archive, why]
            for r, why in superseded
        ]
        lines += ["## Superseded runs", "", "Made by code with a bug fixed since; in no table or comparison above:", ""]
        lines += table("run|experiment|setting|final accuracy ± s.e.|archive|why", rows)
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
    parser.add_argument("--context", type=Path, default=Path("lab/context.md"), help="hand-kept prose on top")
    args = parser.parse_args(argv)
    if not any(args.runs.glob("*.tar.gz")):
        parser.error(f"no *.tar.gz record archives under {args.runs}")
    write_atomic(args.out, render(args.runs, args.figures, args.context, args.out))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
