"""The report's sections, one a stage (the baseline, SFT, Expert Iteration, GRPO, the difficulty table, the
leaderboard run), each written from the stage's files ("not run" where it has none), and the headline table that
sums them up (each stage's accuracy before it trained and after)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.report_inputs import first_json, read_json, stage_plots, stage_rows, stage_run
from tasks.report_page import Page, as_text

NOT_RUN = "not run"
CATEGORY_MEANING = {
    "format1_answer1": "formatted, correct",
    "format1_answer0": "formatted, wrong answer",
    "format0_answer0": "format not followed",
}


def run_links(record: dict[str, Any] | None) -> str:
    """``MLflow run [id](address) …; Prefect flow run …; registered model …`` for a stage's record."""
    if record is None:
        return ""
    parts = []
    if record.get("mlflow_run_url"):
        parts.append(
            f"MLflow run [`{record['mlflow_run_id'][:12]}`]({record['mlflow_run_url']}) "
            f"(experiment `{record['experiment']}`)"
        )
    if record.get("prefect_flow_run_url"):
        parts.append(f"Prefect flow run [{record['prefect_flow_run_id'][:8]}]({record['prefect_flow_run_url']})")
    for model in record.get("models") or []:
        parts.append(f"registered model `{model['name']}` version {model['version']} ({model['setting']})")
    return ("; ".join(parts) + ".") if parts else ""


def _add_plots(page: Page, stage: str, folder: Path) -> None:
    for plot in stage_plots(folder):
        page.figure(plot, f"{stage}_{plot.name}", f"{stage}: {plot.stem.replace('_', ' ')}")


def _settings(settings: dict[str, Any], *keys: str) -> str:
    """``Settings: model `x`, n_grpo_steps `2`. `` for the keys the settings hold (nothing if none): those the
    stage's MLflow run recorded (``_recorded``), else params.yaml's."""
    parts = [f"{k} `{settings[k]}`" for k in keys if settings.get(k) is not None]
    source = " (as the run recorded them)" if settings.get("_recorded") else ""
    return f"Settings{source}: {', '.join(parts)}. " if parts else ""


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best row: by its accuracy on the selection split (``selection_accuracy``) where the stage kept one
    apart from the problems that score it; else by its final accuracy (then :func:`_chosen_on` says so)."""
    key = "selection_accuracy" if any(isinstance(r.get("selection_accuracy"), (int, float)) for r in rows) else None
    scored = [r for r in rows if isinstance(r.get(key or "final_accuracy"), (int, float))]
    return max(scored, key=lambda r: r[key or "final_accuracy"]) if scored else None


def _chosen_on(best: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Which problems chose ``best`` and which scored it, as a sentence's end."""
    if len(rows) < 2:
        return ""
    if isinstance(best.get("selection_accuracy"), (int, float)):
        return (
            f" (chosen on the selection split, accuracy {best['selection_accuracy']:.3f} there; scored on the "
            "validation problems apart from it)"
        )
    return " (chosen on the same problems that score it: no selection split, so biased upward)"


def _before_after(prefix: str, best: dict[str, Any] | None) -> dict[str, float]:
    """The headline metrics of a stage's best row: accuracy and format rate at its start (``initial_*``,
    where the stage evaluated its starting model) and at its end."""
    if best is None:
        return {}
    names = {
        "accuracy": "final_accuracy",
        "accuracy_se": "final_accuracy_se",
        "format_rate": "final_format_rate",
        "initial_accuracy": "initial_accuracy",
        "initial_accuracy_se": "initial_accuracy_se",
        "initial_format_rate": "initial_format_rate",
        "change": "accuracy_change",
        "change_se": "accuracy_change_se",
        "selection_accuracy": "selection_accuracy",
    }
    return {f"{prefix}_{name}": best[key] for name, key in names.items() if isinstance(best.get(key), (int, float))}


def baseline_section(page: Page, root: Path, settings: dict[str, Any], out_files: dict[str, str]) -> dict[str, float]:
    page.h(1, "Zero-shot baseline")
    summary = first_json(root / "outputs/baseline_eval/summary.json", root / "metrics/baseline_eval.json")
    if summary is None:
        page.p(f"Baseline evaluation: {NOT_RUN}.")
        return {}
    page.p(
        _settings(settings, "model", "prompt", "max_tokens", "temperature")
        + f"{summary['n_records']} responses to {summary['n_problems']} problems, "
        + f"**accuracy {summary['accuracy']:.3f}**, "
        f"format rate {summary['format_rate']:.3f}, mean length {summary['mean_response_tokens']:.1f} tokens."
    )
    n = summary["n_records"] or 1
    page.table(
        [
            {
                "category": c,
                "meaning": meaning,
                "count": summary.get(f"count_{c}", 0),
                "share": summary.get(f"count_{c}", 0) / n,
            }
            for c, meaning in CATEGORY_MEANING.items()
        ]
    )
    finishes = {k.removeprefix("finish_"): v for k, v in summary.items() if k.startswith("finish_")}
    if finishes:
        page.p(
            "Finish reasons: "
            + ", ".join(f"{k} {v}" for k, v in finishes.items())
            + ("; `length` responses hit `max_tokens`." if "length" in finishes else ".")
        )
    cases = root / "outputs/baseline_eval/report.md"
    if cases.is_file():
        text = cases.read_text()
        verdict = next((line for line in text.splitlines() if line.startswith("Of the ")), None)
        if verdict:
            page.p(verdict)
        out_files["baseline_cases.md"] = text
        page.document("baseline_cases.md", "Examples of each category", text)
    _link_run(page, root, "baseline_eval")
    return {
        f"baseline_{key}": summary[key]
        for key in ("accuracy", "accuracy_se", "format_rate")
        if isinstance(summary.get(key), (int, float))
    }


def _link_run(page: Page, root: Path, stage: str) -> None:
    links = run_links(stage_run(root, stage))
    if links:
        page.p(links)


def sft_section(page: Page, root: Path, settings: dict[str, Any]) -> dict[str, float]:
    page.h(1, "SFT")
    data = first_json(root / "data/sft/sizes.json", root / "metrics/sft_data.json")
    if data and all(isinstance(values, dict) for values in data.values()):
        page.p("SFT data sets after filtering to the traces the grader accepts (`data/sft/sizes.json`):")
        page.table([{"set": name, **values} for name, values in data.items()])
    rows = stage_rows(root, "sft_experiment")
    if not rows:
        page.p(f"SFT sweep: {NOT_RUN}.")
        return {}
    best = _best(rows)
    steps = ", ".join(f"{r['setting']} {r['steps']}" for r in rows if r.get("steps") is not None)
    page.p(
        _settings(settings, "model", "train_data", "filtered_data", "validation_data", "sizes", "learning_rate")
        + (f"Optimizer steps run: {steps}. " if steps else "")
        + "One run per training-set size (and the filtered set); final validation accuracy and format rate."
        + (f" Best: **{best['setting']}** at {best['final_accuracy']:.3f}{_chosen_on(best, rows)}." if best else "")
    )
    page.table(rows)
    _add_plots(page, "sft_experiment", root / "outputs/sft_experiment")
    _link_run(page, root, "sft_experiment")
    return _before_after("sft_best", best)


def ei_section(page: Page, root: Path, settings: dict[str, Any]) -> dict[str, float]:
    page.h(1, "Expert Iteration")
    rows = stage_rows(root, "expert_iteration")
    if not rows:
        page.p(f"Expert Iteration: {NOT_RUN}.")
        return {}
    best = _best(rows)
    kind = (
        "One run"
        if [r.get("setting") for r in rows] == ["single"]
        else f"A sweep of {len(rows)} settings (G × E × D_b)"
    )
    page.p(
        _settings(settings, "model", "n_ei_steps", "train_data", "validation_data")
        + f"{kind}."
        + (f" Best: **{best['setting']}** at {best['final_accuracy']:.3f}{_chosen_on(best, rows)}." if best else "")
    )
    page.table(rows)
    _add_plots(page, "expert_iteration", root / "outputs/expert_iteration")
    _link_run(page, root, "expert_iteration")
    return _before_after("ei_best", best)


def grpo_section(page: Page, root: Path, settings: dict[str, Any]) -> dict[str, float]:
    page.h(1, "GRPO")
    rows = stage_rows(root, "grpo")
    if not rows:
        page.p(f"GRPO: {NOT_RUN}.")
        return {}
    best = _best(rows)
    single = [r.get("setting") for r in rows] == ["single"]
    what = "One run" if single else f"Ablation `{settings.get('ablation') or '?'}` ({len(rows)} settings)"
    page.p(
        _settings(settings, "model", "n_grpo_steps", "loss_type", "learning_rate", "train_data", "validation_data")
        + f"{what}."
        + (
            f" Final validation accuracy: **{best['final_accuracy']:.3f}**"
            + ("" if single else f" ({best['setting']}){_chosen_on(best, rows)}")
            + "."
            if best
            else ""
        )
    )
    if best:
        page.p(_change_sentence(best) + _signal_sentence(root / "outputs/grpo/train_curves.csv", best["setting"]))
    page.table(rows)
    _add_plots(page, "grpo", root / "outputs/grpo")
    _link_run(page, root, "grpo")
    return _before_after("grpo_best", best)


def _change_sentence(row: dict[str, Any]) -> str:
    """``Accuracy 0.344 ± 0.084 → 0.594 ± 0.088; paired on the 32 problems both scored: +0.250 ± 0.080. ``"""
    if not isinstance(row.get("initial_accuracy"), (int, float)):
        return ""
    text = f"Accuracy {_plus_minus(row, 'initial_accuracy')} → {_plus_minus(row, 'final_accuracy')}"
    if isinstance(row.get("accuracy_change"), (int, float)):
        text += (
            f"; paired on the {row.get('paired_problems', '')} problems both scored: "
            f"**{row['accuracy_change']:+.3f} ± {row.get('accuracy_change_se') or 0:.3f}**"
        )
    return text + ". "


def _plus_minus(row: dict[str, Any], key: str) -> str:
    se = row.get(f"{key}_se")
    return f"{row[key]:.3f}" + (f" ± {se:.3f}" if isinstance(se, (int, float)) else "")


def _signal_sentence(curves: Path, setting: str) -> str:
    """How many of a GRPO run's steps had no learning signal (every group's rewards equal), from its
    ``train_curves.csv``; "" where the file holds no such column."""
    import csv

    if not curves.is_file():
        return ""
    with open(curves, newline="") as f:
        steps = [r for r in csv.DictReader(f) if r.get("setting") == setting and r.get("frac_groups_all_equal")]
    if not steps:
        return ""
    shares = [float(r["frac_groups_all_equal"]) for r in steps]
    none = [r["step"] for r, share in zip(steps, shares, strict=True) if share == 1.0]
    listed = f" (step {', '.join(none)})" if none else ""
    return (
        f"Steps with no learning signal (every group's rewards equal, so every advantage 0): {len(none)} of "
        f"{len(steps)}{listed}; share of groups with equal rewards, mean over steps: {sum(shares) / len(shares):.2f}."
    )


def difficulty_section(page: Page, root: Path, settings: dict[str, Any]) -> bool:
    """The difficulty table's shares and histogram; nothing (False) where the stage has not run."""
    summary = first_json(root / "outputs/difficulty/summary.json", root / "metrics/difficulty.json")
    if not isinstance(summary, dict) or "mean_pass_rate" not in summary:
        return False
    page.h(1, "Questions by difficulty")
    page.p(
        _settings(settings, "model", "train_data", "limit", "n")
        + f"{summary['questions']} training questions, {summary['samples_per_question']} samples each: "
        + f"mean pass rate **{summary['mean_pass_rate']:.3f}**. A question solved never or always teaches GRPO "
        "and EI nothing; the learnable ones are those in between."
    )
    page.table(
        [
            {"questions": label, "share": summary.get(f"difficulty_{key}")}
            for key, label in (("unsolved", "never solved"), ("learnable", "sometimes solved"), ("solved", "always"))
        ]
    )
    histogram = root / "outputs/difficulty/pass_rate_histogram.png"
    if histogram.is_file():
        page.figure(histogram, "difficulty_pass_rate_histogram.png", "difficulty: pass rates of the questions")
    _link_run(page, root, "difficulty")
    return True


def leaderboard_section(page: Page, root: Path) -> dict[str, float]:
    summary = read_json(root / "metrics/leaderboard.json")
    if not isinstance(summary, dict):
        return {}
    page.h(1, "Leaderboard run")
    page.table([{k: v for k, v in summary.items() if k != "mlflow_run_id"}])
    _add_plots(page, "leaderboard", root / "outputs/leaderboard")
    _link_run(page, root, "leaderboard")
    score = summary.get("final_score")
    return {"leaderboard_score": score} if isinstance(score, (int, float)) else {}


HEADLINE_STAGES = (
    ("Zero-shot baseline", "baseline", "baseline_eval"),
    ("SFT (best setting)", "sft_best", "sft_experiment"),
    ("Expert Iteration (best)", "ei_best", "expert_iteration"),
    ("GRPO (best)", "grpo_best", "grpo"),
)


def headline(metrics: dict[str, float], settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per stage: the problems it is scored on, its accuracy (± its standard error) before it trained
    (its starting model) and after, the change paired problem by problem (± its standard error), and its
    format rate ("not run" for a stage with no output)."""
    rows = []
    for stage, prefix, section in HEADLINE_STAGES:
        if f"{prefix}_accuracy" not in metrics:
            rows.append({"stage": stage, "scored on": "", "accuracy": NOT_RUN})
            continue
        before = {k: metrics.get(f"{prefix}_initial_{k}") for k in ("accuracy", "accuracy_se", "format_rate")}
        change = metrics.get(f"{prefix}_change")
        rows.append(
            {
                "stage": stage,
                "scored on": scored_on(settings.get(section, {}), f"{prefix}_selection_accuracy" in metrics),
                "accuracy": _arrow(
                    _with_se(before["accuracy"], before["accuracy_se"]),
                    _with_se(metrics[f"{prefix}_accuracy"], metrics.get(f"{prefix}_accuracy_se")),
                ),
                "change": "" if change is None else f"{change:+.3f} ± {metrics.get(f'{prefix}_change_se') or 0:.3f}",
                "format rate": _arrow(as_text(before["format_rate"]), as_text(metrics.get(f"{prefix}_format_rate"))),
            }
        )
    if "leaderboard_score" in metrics:
        rows.append({"stage": "Leaderboard run", "scored on": "", "accuracy": as_text(metrics["leaderboard_score"])})
    return rows


def scored_on(settings: dict[str, Any], score_split: bool) -> str:
    """The problems a stage's final evaluation scores, from its settings: ``arithmetic:32:1 (first 32)``;
    ``score_split``: a sweep's, the first of those apart from its selection split."""
    data = settings.get("validation_data") or settings.get("data") or ""
    limit = settings.get("val_limit") or settings.get("limit")
    first = f"first {limit}" if limit else ""
    where = ", ".join(part for part in (first, "score split" if score_split else "") if part)
    return Path(str(data)).name + (f" ({where})" if where else "")


def _with_se(value: float | None, se: float | None) -> str | None:
    """``0.312 ± 0.082`` (the value alone without its standard error; None without a value)."""
    if value is None:
        return None
    return as_text(value) + (f" ± {as_text(se)}" if se is not None else "")


def _arrow(before: str | None, after: str | None) -> str:
    """``0.000 → 0.312`` when both are known, else the one that is."""
    if not after:
        return ""
    return f"{before} → {after}" if before else after


def scored_sets_note(rows: list[dict[str, Any]]) -> str:
    """What the headline's rows are scored on: the same problems (then rows compare), or not (then say so)."""
    scored = {row["scored on"] for row in rows if row.get("scored on")}
    if len(scored) == 1:
        return (
            f"Every row is scored on the same problems, {scored.pop()}: the rows compare with one another, and each "
            "change is paired problem by problem (± its standard error)."
        )
    if not scored:
        return ""
    return (
        "The rows are scored on different problems (see *scored on*): compare a row's before and after, not one "
        "row with another."
    )
