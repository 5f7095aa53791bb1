"""The verdict flow's page (Markdown) and records (JSON-able rows) of a :class:`a5core.verdicts.decide.Decision`:
the findings, how they were decided (every number computed here), the pairs behind each, the runs made more than
once, the runs left out, and the runs of each experiment."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from a5core.verdicts.decide import Decision, Verdict
from a5core.verdicts.expectations import Expectation
from a5core.verdicts.pairing import Cell, Pair, RunRecord, short
from a5core.verdicts.statistics import MOST_PAIRS
from tasks.tables import markdown_table, markdown_text

CORRECTIONS = {
    "holm": "Holm's step-down",
    "bh": "Benjamini–Hochberg's step-up",
    "none": "no correction",
}


def signed(value: float) -> str:
    return f"{value:+.3f}"


def p_text(raw: float | None, adjusted: float | None, correction: str) -> str:
    if raw is None:
        return ""
    return f"{raw:.2g}" if correction == "none" else f"{raw:.2g} → {adjusted:.2g}"


def difference_text(v: Verdict) -> str:
    """``a − b = +0.045 ± 0.025`` (the raw interval), or without ± under ``min_pairs`` pairs."""
    e = v.expectation
    label = f"{e.a} − {e.b}" + ("" if e.metric == "final_val_accuracy" else f" ({e.metric})")
    if v.sample is None:
        return label
    if v.half is None:
        return f"{label} = {signed(v.sample.mean)}"
    return f"{label} = {signed(v.sample.mean)} ± {v.half:.3f}"


def verdict_text(v: Verdict) -> str:
    if v.word in ("agrees", "disagrees"):
        return f"**{v.word}**"
    if v.word == "inconclusive":
        return f"inconclusive (±{v.decidable:.3f})"
    if v.word == "not judged":
        return f"not judged: {v.arms.not_judged}"
    if v.word == "not measured":
        return f"not measured: {v.arms.missing}"
    return v.word


def more_text(v: Verdict) -> str:
    if v.word not in ("inconclusive", "too few runs") or v.sample is None:
        return ""
    return f"over {MOST_PAIRS}" if v.more_pairs is None else f"{v.more_pairs} more"


def findings_rows(decision: Decision) -> list[dict[str, Any]]:
    correction = decision.rule.correction
    after = f"verdict ({CORRECTIONS[correction]})" if correction != "none" else "verdict"
    rows = []
    for v in decision.verdicts:
        e = v.expectation
        rows.append(
            {
                "experiment": f"`{e.experiment}`" if e.experiment else "",
                "expectation": f"`{e.text}`" + (f": {e.why}" if e.why else ""),
                f"difference ± {decision.rule.confidence:.0%} interval": difference_text(v),
                "pairs": v.k,
                "p (difference)": p_text(v.p_difference, v.adjusted_difference, correction),
                "p (within ±margin)": p_text(v.p_equivalence, v.adjusted_equivalence, correction),
                "before correction": v.raw if correction != "none" else None,
                after: verdict_text(v),
                "pairs that would likely decide it": more_text(v),
            }
        )
    return [{k: val for k, val in row.items() if val is not None} for row in rows]


def summary_rows(decision: Decision) -> list[dict[str, Any]]:
    """One short row an expectation: for the Prefect artifact and the flow's log."""
    return [
        {"expectation": v.expectation.text, "difference": difference_text(v), "pairs": v.k, "verdict": v.word}
        for v in decision.verdicts
    ]


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {w}" for w, n in counts.items())


def rule_text(decision: Decision, cells_made_again: int, largest_spread: float | None) -> str:
    """How the verdicts were made, with this page's own numbers."""
    rule, m = decision.rule, decision.family
    alpha = rule.alpha
    shared = sum(bool(v.shares_with) for v in decision.verdicts if v.k)
    text = [
        f"Of {len(decision.verdicts)} expectations: {counts_text(decision.counts())}"
        + (f" ({counts_text(decision.counts(raw=True))} before the correction)." if rule.correction != "none" else "."),
        "How a verdict is made: a comparison pairs a run of each arm started from the same model (the content hash "
        "of its weights; for runs that recorded none, the same parent run) with the same seed and every other "
        "setting alike, so scored on the same problems. Runs alike in start model, settings and seed are one run "
        "made again: they count once, as the mean of their results",
    ]
    if cells_made_again:
        text[-1] += (
            f" ({cells_made_again} such run{'s' * (cells_made_again != 1)} here, "
            f"spread up to {largest_spread:.3f}: Runs made more than once)"
        )
    text[-1] += "."
    text.append(
        f"With k ≥ {rule.min_pairs} pairs, the ± is the half-width of the {rule.confidence:.0%} Student's t interval "
        f"on the mean of their k differences (k − 1 degrees of freedom), and each expectation asks two questions of "
        f"them: is there a difference (two-sided t test), and is it within ±{rule.margin:g} (two one-sided t tests, "
        f"which pass when that interval lies within ±{rule.margin:g})."
    )
    if rule.correction == "holm":
        text.append(
            f"The {2 * m} p-values of the {m} expectations judged together are corrected by Holm's step-down, an "
            "expectation's two questions counted once (they cannot both be true), so that the chance of any false "
            f"verdict on the page is at most {alpha:.0%}, however the comparisons are correlated."
        )
    elif rule.correction == "bh":
        text.append(
            f"The {2 * m} p-values of the {m} expectations judged together are corrected by Benjamini–Hochberg's "
            f"step-up: of the verdicts decided, at most {alpha:.0%} are expected to be false (a false-discovery "
            "rate; it holds for tests that are independent or positively correlated)."
        )
    else:
        text.append(f"Each test is read at {alpha:.0%} on its own, with no correction for the {m} asked together.")
    if shared:
        text.append(
            f"{shared} comparison{'s' * (shared != 1)} share runs with another (a reference setting's runs serve "
            "several): their errors are correlated."
        )
    level = "α" if rule.correction == "none" else "α over the expectations asked"
    text.append(
        "**agrees** / **disagrees**: a difference, on the expected side or the other (for an expectation of parity, "
        f"`~`, any difference disagrees); within noise: a difference within ±{rule.margin:g}; inconclusive: neither, "
        f"with the half-width at the correction's strictest level ({level}), beyond which a difference would have "
        f"been decided; too few runs: under {rule.min_pairs} pairs, no verdict; not judged: no pair whose arms differ "
        "in the setting under test alone, or every run of both arms scored alike (a pair whose start model was "
        "trained with one arm's prompt favours that arm, one whose start model has no recorded hash may, and the "
        "pairs of a start model whose every run scored 0 or 1 tell nothing of the difference while another's can: "
        "they are set apart, shown under The pairs). The pairs that "
        "would likely decide it: how many in all, beyond these, would decide it with probability "
        f"{rule.power:.0%} at the difference seen, at that strictest level, with the spread of its own pairs"
        + (
            f" (under {rule.min_pairs} pairs: the spread pooled over the page's pairs, SD {decision.pooled_sd:.3f})."
            if decision.pooled_sd is not None
            else "."
        )
    )
    if decision.left_out:
        text.append(f"{len(decision.left_out)} runs are left out and listed apart (Runs left out).")
    return " ".join(text)


def cell_text(cell: Cell) -> str:
    values = ", ".join(f"{x:.3f}" for x in cell.values)
    ids = ", ".join(f"`{r.id[:8]}`" for r in cell.runs)
    if len(cell.runs) == 1:
        return f"{values} ({ids})"
    return f"{cell.value:.3f}: mean of {values} ({ids})"


def pairs_sections(decision: Decision) -> list[str]:
    lines = []
    for v in decision.verdicts:
        if not v.arms.pairs and not v.arms.set_apart:
            continue
        e = v.expectation
        lines += [markdown_text(f"### `{e.text}`" + (f" in `{e.experiment}`" if e.experiment else "")), ""]
        said = []
        if v.arms.keys:
            said.append(f"The arms differ in {', '.join(f'`{k}`' for k in v.arms.keys)}.")
        if v.shares_with:
            others = ", ".join(f"`{decision.verdicts[j].expectation.text}`" for j in v.shares_with)
            said.append(f"Runs shared with {others}.")
        if said:
            lines += [markdown_text(" ".join(said)), ""]
        if v.arms.pairs:
            lines += [markdown_table([pair_row(e, p) for p in v.arms.pairs]), ""]
        if v.arms.set_apart:
            lines += [f"Set apart ({len(v.arms.set_apart)} pairs, not judged):", ""]
            lines += [markdown_table([pair_row(e, p) | {"why": why} for p, why in v.arms.set_apart]), ""]
    return lines


def pair_row(e: Expectation, p: Pair) -> dict[str, str | None]:
    return {
        "start model": short(p.a.origin),
        "seed": p.a.seed,
        e.a: cell_text(p.a),
        e.b: cell_text(p.b),
        "difference": signed(p.difference),
    }


def made_again(decision: Decision) -> list[Cell]:
    """The cells of the verdicts' pairs that hold more than one run, each once."""
    seen: dict[tuple[str, ...], Cell] = {}
    for v in decision.verdicts:
        if v.expectation.against_start:
            continue
        for pair in v.arms.pairs:
            for cell in (pair.a, pair.b):
                if len(cell.runs) > 1:
                    seen.setdefault(tuple(r.id for r in cell.runs), cell)
    return list(seen.values())


def reruns_section(cells: Sequence[Cell]) -> list[str]:
    if not cells:
        return []
    rows = [
        {
            "setting": cell.runs[0].setting,
            "start model": short(cell.origin),
            "seed": cell.seed,
            "runs": ", ".join(f"`{r.id[:8]}` ({r.group})" for r in cell.runs),
            "results": ", ".join(f"{x:.3f}" for x in cell.values),
            "mean": f"{cell.value:.3f}",
            "spread": f"{cell.spread:.3f}",
        }
        for cell in sorted(cells, key=lambda c: -c.spread)
    ]
    identical = sum(c.spread == 0 for c in cells)
    return [
        "## Runs made more than once",
        "",
        f"Runs alike in start model, settings and seed, made more than once: each counts once, as their mean. "
        f"{identical} of {len(cells)} ended identical each time.",
        "",
        markdown_table(rows),
        "",
    ]


def left_out_section(decision: Decision) -> list[str]:
    if not decision.left_out:
        return []
    rows = [
        {"run": f"`{r.id[:8]}`", "experiment": r.group, "setting": r.setting, "seed": r.seed, "why": why}
        for r, why in decision.left_out
    ]
    return ["## Runs left out", "", "In no pair or mean above:", "", markdown_table(rows), ""]


def run_value(run: RunRecord, metric: str) -> str:
    """``0.407 ± 0.028 (122 / 300)``: a final metric with its s.e. over problems, where the run logged them."""
    value = run.finals.get(metric)
    if value is None:
        return ""
    n = run.finals.get(metric.replace("accuracy", "n_problems").replace("format_rate", "n_problems"))
    if n and 0 <= value <= 1:
        return f"{value:.3f} ± {math.sqrt(value * (1 - value) / n):.3f} ({round(value * n)} / {int(n)})"
    return f"{value:.3f}"


def experiments_section(
    runs: Sequence[RunRecord], figures: dict[str, list[Path]], link_base: Path, metrics: Sequence[str]
) -> list[str]:
    """Each experiment (an ablation, a sweep, a flow's runs), the runs it holds and their curves."""
    by_group: dict[str, list[RunRecord]] = defaultdict(list)
    for run in runs:
        by_group[run.group].append(run)
    lines = [
        "## Experiments",
        "",
        "The runs read, by the ablation, sweep or flow that made them (first started first); a run again, as it "
        "was: `python -m flows.reproduce --run-id RUN_ID`.",
        "",
    ]
    for group, members in sorted(by_group.items(), key=lambda item: item[1][0].start_time):
        rows = [
            {
                "setting": r.setting,
                "seed": r.seed,
                "start model": short(r.origin),
                "run": f"`{r.id[:8]}`" + ("" if r.status == "FINISHED" else f" {r.status}"),
                **{m: run_value(r, m) for m in metrics},
            }
            for r in members
        ]
        lines += [markdown_text(f"### `{group}`"), "", markdown_table(rows), ""]
        for path in figures.get(group, []):
            lines += [f"![{path.stem}]({path.relative_to(link_base).as_posix()})", ""]
    return lines


def pair_record(p: Pair) -> dict[str, Any]:
    return {
        "start_model": p.a.origin,
        "seed": p.a.seed,
        "a_runs": [r.id for r in p.a.runs],
        "a_values": list(p.a.values),
        "b_runs": [r.id for r in p.b.runs],
        "b_values": list(p.b.values),
        "difference": p.difference,
    }


def records(decision: Decision) -> dict[str, Any]:
    """The decision as JSON-able data: the rule, each verdict with its pairs, and the runs left out."""
    rule = decision.rule
    verdicts = []
    for v in decision.verdicts:
        e = v.expectation
        verdicts.append(
            {
                "expectation": e.text,
                "a": e.a,
                "relation": e.relation,
                "b": e.b,
                "metric": e.metric,
                "experiment": e.experiment,
                "why": e.why,
                "pairs": v.k,
                "mean": v.sample.mean if v.sample else None,
                "sd": v.sample.sd if v.sample and v.k > 1 else None,
                "half_width": v.half,
                "p_difference": v.p_difference,
                "p_within_margin": v.p_equivalence,
                "adjusted_p_difference": v.adjusted_difference,
                "adjusted_p_within_margin": v.adjusted_equivalence,
                "verdict_before_correction": v.raw,
                "verdict": v.word,
                "decided_beyond": v.decidable,
                "more_pairs": v.more_pairs,
                "not_judged": v.arms.not_judged or None,
                "not_measured": v.arms.missing or None,
                "defining_settings": list(v.arms.keys),
                "shares_runs_with": [decision.verdicts[j].expectation.text for j in v.shares_with],
                "pair_list": [pair_record(p) for p in v.arms.pairs],
                "set_apart": [pair_record(p) | {"why": why} for p, why in v.arms.set_apart],
            }
        )
    return {
        "rule": {
            "confidence": rule.confidence,
            "margin": rule.margin,
            "correction": rule.correction,
            "min_pairs": rule.min_pairs,
            "power": rule.power,
            "expectations_judged": decision.family,
            "pooled_sd": decision.pooled_sd,
        },
        "verdicts": verdicts,
        "left_out": [
            {"run_id": r.id, "experiment": r.group, "setting": r.setting, "why": w} for r, w in decision.left_out
        ],
    }
