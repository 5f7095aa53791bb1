"""The verdict flow's page (Markdown) and records (JSON-able rows) of a :class:`a5core.verdicts.decide.Decision`:
the findings, how they were decided (every number computed here), the pairs behind each, the runs made more than
once, the runs left out, and the runs of each experiment."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from a5core.verdicts.decide import DECIDED, GENERAL, PAIRS, START_MODELS, Decision, Test, Verdict
from a5core.verdicts.expectations import Expectation
from a5core.verdicts.pairing import Cell, Pair, RunRecord, short
from a5core.verdicts.statistics import MOST_PAIRS
from tasks.tables import markdown_table, markdown_text

CORRECTIONS = {
    "bonferroni": "Bonferroni's level over the page's tests",
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


def width(half: float) -> str:
    return "∞" if math.isinf(half) else f"{half:.3f}"


def label_of(e: Expectation) -> str:
    return f"{e.a} − {e.b}" + ("" if e.metric == "final_val_accuracy" else f" ({e.metric})")


def difference_text(v: Verdict) -> str:
    """``a − b = +0.045 ± 0.025`` (the pairs' raw interval), or without ± under ``min_pairs`` pairs."""
    label = label_of(v.expectation)
    sample = v.sample
    if sample is None:
        return label
    test = v.tests.get(PAIRS)
    if test is None:
        return f"{label} = {signed(sample.mean)}"
    return f"{label} = {signed(sample.mean)} ± {width(test.half)}"


def verdict_text(v: Verdict) -> str:
    if v.word in ("agrees", "disagrees"):
        text = f"**{v.word}**"
    elif v.word == "inconclusive":
        text = f"inconclusive (±{width(v.tests[PAIRS].decidable)})"
    elif v.word == "not judged":
        return f"not judged: {v.arms.not_judged}"
    elif v.word == "not measured":
        return f"not measured: {v.arms.missing}"
    else:
        text = v.word
    return text + (f", {v.scope}" if v.word in DECIDED and v.scope != GENERAL else "")


def start_models_text(v: Verdict) -> str:
    """``3 (within 0.021, between 0.034)``: the start models of the pairs and the spread within and between."""
    if not v.arms.pairs:
        return ""
    within, between = v.spread()
    parts = [f"within {within:.3f}" if within is not None else "", f"between {between:.3f}" if between else ""]
    parts = [p for p in parts if p]
    return f"{len(v.start_models)}" + (f" ({', '.join(parts)})" if parts else "")


def compute_text(v: Verdict) -> str:
    """``rollouts 3.40×, tokens 3.12×, seconds 2.95×``: each of arm a's means over arm b's, where both logged them."""
    found = v.compute()
    a, b = found.get(v.expectation.a), found.get(v.expectation.b)
    if not a or not b:
        return ""
    ratios = [f"{what} {a[what] / b[what]:.2f}×" for what in ("rollouts", "tokens", "seconds") if b[what] > 0]
    rollouts = f"{a['rollouts']:,.0f} vs {b['rollouts']:,.0f} rollouts"
    return f"{rollouts}: " + ", ".join(ratios)


def more_text(v: Verdict) -> str:
    if v.word not in ("inconclusive", "too few runs") or v.sample is None:
        return ""
    pairs = f"over {MOST_PAIRS} pairs" if v.more_pairs is None else f"{v.more_pairs} more pairs"
    models = v.tests.get(START_MODELS)
    if models is None or models.word in DECIDED:
        return pairs
    more = f"over {MOST_PAIRS}" if models.more is None else f"{models.more} more"
    return f"{pairs}; {more} start models for a general verdict"


def findings_rows(decision: Decision) -> list[dict[str, Any]]:
    rule = decision.rule
    correction = rule.corrected_by
    after = f"verdict ({CORRECTIONS[correction]})" if correction != "none" else "verdict"
    interval = "confidence sequence" if rule.method == "anytime" else "interval"
    rows = []
    for v in decision.verdicts:
        e = v.expectation
        test = v.tests.get(PAIRS)
        rows.append(
            {
                "experiment": f"`{e.experiment}`" if e.experiment else "",
                "expectation": f"`{e.text}`" + (f": {e.why}" if e.why else ""),
                "endpoint": e.endpoint,
                f"difference ± {rule.confidence:.0%} {interval}": difference_text(v),
                "pairs": v.k,
                "start models (SD within, between)": start_models_text(v),
                "p (difference)": p_text(*_ps(test, "difference"), correction),
                "p (within ±margin)": p_text(*_ps(test, "within"), correction),
                "before correction": v.raw if correction != "none" else None,
                after: verdict_text(v),
                "compute (a over b)": compute_text(v),
                "would likely decide it": more_text(v),
            }
        )
    return [{k: val for k, val in row.items() if val is not None} for row in rows]


def _ps(test: Test | None, question: str) -> tuple[float | None, float | None]:
    if test is None:
        return None, None
    return getattr(test, f"p_{question}"), getattr(test, f"adjusted_{question}")


def summary_rows(decision: Decision) -> list[dict[str, Any]]:
    """One short row an expectation: for the Prefect artifact and the flow's log."""
    return [
        {
            "expectation": v.expectation.text,
            "difference": difference_text(v),
            "pairs": v.k,
            "verdict": v.word + (f" ({v.scope})" if v.word in DECIDED and v.scope != GENERAL else ""),
        }
        for v in decision.verdicts
    ]


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {w}" for w, n in counts.items())


def rule_text(decision: Decision, cells_made_again: int, largest_spread: float | None) -> str:
    """How the verdicts were made, with this page's own numbers."""
    rule = decision.rule
    general, specific = decision.general_counts()
    text = [
        f"Of {len(decision.verdicts)} expectations: {counts_text(decision.counts())}"
        + (
            f" ({counts_text(decision.counts(raw=True))} before the correction)."
            if rule.corrected_by != "none"
            else "."
        ),
        f"Of the {general + specific} decided, {general} general and {specific} for their start models only."
        if rule.method == "anytime" and rule.start_model_level
        else "",
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
        "Each row's endpoint, declared before its runs, is in its column: final (the final evaluation) or "
        "mean_last_K (the mean of the last K points of the validation curve); a row asked at equal rollouts reads "
        "each pair's runs where both had generated as many rollouts."
    )
    text += [*_method_text(decision), correction_text(decision)]
    shared = sum(bool(v.shares_with) for v in decision.verdicts if v.k)
    if shared:
        text.append(
            f"{shared} comparison{'s' * (shared != 1)} share runs with another (a reference setting's runs serve "
            "several): their errors are correlated, which the correction allows for."
        )
    text.append(
        "**agrees** / **disagrees**: a difference, on the expected side or the other (for an expectation of parity, "
        f"`~`, any difference disagrees); within noise: a difference within ±{rule.margin:g}; inconclusive: neither, "
        "with the half-width at the level verdicts are read, beyond which a difference would have been decided; too "
        f"few runs: under {rule.min_pairs} pairs, no verdict; not judged: no pair whose arms differ in the setting "
        "under test alone, or every run of both arms scored alike (a pair whose start model was trained with one "
        "arm's prompt favours that arm, one whose start model has no recorded hash may, and the pairs of a start "
        "model whose every run scored 0 or 1 tell nothing of the difference while another's can: they are set "
        "apart, shown under The pairs). Would likely decide it: how many more pairs (and start models) would decide "
        f"it with probability {rule.power:.0%} at the difference seen, at the level verdicts are read, with the "
        "spread of its own units"
        + (
            f" (under {rule.min_pairs} pairs: the spread pooled over the page's pairs, SD {decision.pooled_sd:.3f})."
            if decision.pooled_sd is not None
            else "."
        )
        + " Compute: each arm's rollouts generated, response tokens and seconds of its steps, a run's mean over the"
        " pairs' runs, arm a's over arm b's: a verdict at equal steps says nothing of equal generation."
    )
    if decision.left_out:
        text.append(f"{len(decision.left_out)} runs are left out and listed apart (Runs left out).")
    return " ".join(t for t in text if t)


def _method_text(decision: Decision) -> list[str]:
    rule, alpha = decision.rule, decision.rule.alpha
    if rule.method == "fixed":
        text = [
            f"With k ≥ {rule.min_pairs} pairs, the ± is the half-width of the {rule.confidence:.0%} Student's t "
            "interval on the mean of their k differences, and each expectation asks two questions of them: is there "
            f"a difference (two-sided t test), and is it within ±{rule.margin:g} (the two one-sided t tests, each at "
            f"the level, which pass when the {1 - 2 * alpha:.0%} interval lies within ±{rule.margin:g}). These tests "
            "are valid only for a number of pairs fixed before the runs were looked at: pairs added until a row is "
            "decided make a false verdict likelier than stated (use the anytime rule for that)."
        ]
        return text
    levels = " and its start models" if START_MODELS in rule.levels else ""
    text = [
        f"Each expectation is tested on its pairs{levels} by a confidence sequence (a t confidence sequence: the "
        f"normal-mixture e-value of the safe t-test, g = {rule.mixture_g:g}), which covers the true mean "
        "difference at every number of pairs at once: pairs may be added and the page made again after each, and "
        "a row stopped once decided, without making a false verdict likelier than stated. The ± is its "
        f"{rule.confidence:.0%} half-width (∞ while too few units bound it); a p-value is 1/e, the e-value's, "
        "against no difference, or against a difference beyond the margin (within noise: the sequence inside "
        f"±{rule.margin:g})."
    ]
    if START_MODELS in rule.levels:
        text.append(
            "A start model is a random draw too, and its effect on a comparison may differ from another's: the "
            "pairs' test says what holds for the start models they come from, the start models' test (each start "
            "model's mean difference a unit) what holds in general. A verdict is general where the start models' "
            "test decides it, else it is said for its start models only."
        )
    return text


# How the correction bounds the page's errors, by method and correction: {m} tests (each of two questions), α.
CORRECTION_TEXT = {
    ("fixed", "holm"): "The {q} p-values of the {m} expectations judged together are corrected by Holm's step-down, an "
    "expectation's two questions counted once (they cannot both be true), so that the chance of any false verdict on "
    "the page is at most {a}, however the comparisons are correlated.",
    ("fixed", "bh"): "The {q} p-values of the {m} expectations judged together are corrected by Benjamini–Hochberg's "
    "step-up: of the verdicts decided, at most {a} are expected to be false.",
    ("anytime", "bonferroni"): "Every test the page asks ({m}: each expectation's, on every level, fixed before any "
    "run) is read at {a}/{m}, an e-value reaching {m}/α, so that the chance of any false verdict on the page, at any "
    "time it is made, is at most {a}.",
    ("anytime", "bh"): "The e-values of the {q} questions are combined by e-BH (Benjamini–Hochberg on 1/e): of the "
    "verdicts decided, at most {a} are expected to be false, whatever the dependence.",
}


def correction_text(decision: Decision) -> str:
    rule, m = decision.rule, decision.family
    template = CORRECTION_TEXT.get(
        (rule.method, rule.corrected_by), "Each test is read at {a} on its own, with no correction for the {m} asked."
    )
    return template.format(q=2 * m, m=m, a=f"{rule.alpha:.0%}")


def rules_section(changes: Sequence[tuple[str, str, list[str]]]) -> list[str]:
    """The page's rules with the day each was adopted, and the verdicts each changes here."""
    if not changes:
        return []
    rows = [
        {"rule": text, "adopted": adopted, "verdicts it changes here (without → with)": "; ".join(changed) or "none"}
        for text, adopted, changed in changes
    ]
    return ["## The rules and what each changed", "", markdown_table(rows), ""]


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
    row = {
        "start model": short(p.a.origin),
        "seed": p.a.seed,
        e.a: cell_text(p.a),
        e.b: cell_text(p.b),
        "difference": signed(p.difference),
    }
    if p.rollouts is not None:
        row["at rollouts"] = f"{p.rollouts:,.0f}"
    return row


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
        "at_rollouts": p.rollouts,
    }


def test_record(t: Test) -> dict[str, Any]:
    return {
        "units": t.units,
        "n": t.sample.k,
        "mean": t.sample.mean,
        "sd": t.sample.sd if t.sample.k > 1 else None,
        "half_width": None if math.isinf(t.half) else t.half,
        "decided_beyond": None if math.isinf(t.decidable) else t.decidable,
        "p_difference": t.p_difference,
        "p_within_margin": t.p_within,
        "adjusted_p_difference": t.adjusted_difference,
        "adjusted_p_within_margin": t.adjusted_within,
        "verdict_before_correction": t.raw,
        "verdict": t.word,
        "more": t.more,
    }


def records(decision: Decision) -> dict[str, Any]:
    """The decision as JSON-able data: the rule, each verdict with its tests and pairs, and the runs left out."""
    rule = decision.rule
    verdicts = []
    for v in decision.verdicts:
        e = v.expectation
        within, between = v.spread()
        sample = v.sample
        verdicts.append(
            {
                "expectation": e.text,
                "a": e.a,
                "relation": e.relation,
                "b": e.b,
                "metric": e.metric,
                "endpoint": e.endpoint,
                "equal_rollouts": e.equal_rollouts,
                "experiment": e.experiment,
                "why": e.why,
                "pairs": v.k,
                "start_models": len(v.start_models),
                "sd_within_start_models": within,
                "sd_between_start_models": between,
                "mean": sample.mean if sample else None,
                "verdict_before_correction": v.raw,
                "verdict": v.word,
                "scope": v.scope or None,
                "more_pairs": v.more_pairs,
                "tests": {name: test_record(t) for name, t in v.tests.items()},
                "compute": v.compute(),
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
            "method": rule.method,
            "confidence": rule.confidence,
            "margin": rule.margin,
            "correction": rule.corrected_by,
            "min_pairs": rule.min_pairs,
            "power": rule.power,
            "mixture_g": rule.mixture_g if rule.method == "anytime" else None,
            "levels": list(rule.levels),
            "family": decision.family,
            "pooled_sd": decision.pooled_sd,
        },
        "verdicts": verdicts,
        "left_out": [
            {"run_id": r.id, "experiment": r.group, "setting": r.setting, "why": w} for r, w in decision.left_out
        ],
    }
