"""Flow ``report``: one page summarising what the pipeline produced, from the files the stages wrote.

Reads what exists of: ``outputs/baseline_eval/summary.json`` and the case report
``outputs/baseline_eval/report.md``; ``data/sft/sizes.json``; each training stage's rows,
``outputs/<stage>/summary.json`` (sft_experiment, expert_iteration, grpo; the metrics file of a run made
before metrics files were flat mappings), and its ``*.png``; GRPO's ``train_curves.csv`` (the steps with no
learning signal); ``outputs/difficulty/summary.json``; ``metrics/leaderboard.json``; the settings in
``params.yaml`` (with its profile's overrides); and, from MLflow, the newest parent run of each GRPO
ablation (experiment ``grpo``, tag ``ablation``) with its children's final metrics and a validation
accuracy plot. A stage with nothing on disk is reported as "not run".

Each stage's section links its MLflow run (``outputs/<stage>/run.json``, written by the stage's flow) and
states the settings the run recorded (its MLflow parameters; ``params.yaml``'s where the store is not at hand)
and what it did (steps run, the sets it trained and validated on). The difficulty table has a section of its own
(``outputs/difficulty/summary.json``, its histogram).

Writes ``outputs/report/``: ``report.md`` (plots linked from ``figures/``), ``report.html`` (the same page,
plots and the baseline's case report embedded: one self-contained file; text from settings and files is
escaped, and only http(s) and relative links become links), ``figures/*.png``, ``baseline_cases.md`` (the
baseline's case report) and the marker ``.a5-report``. The folder is built beside the old one and swapped in,
so a reader never sees half a report. Only a report folder is ever replaced: one holding the marker; any
other non-empty ``--output-dir`` (``outputs/baseline_eval``, a user's own report.md and figures) is refused and
left untouched. A ``--root`` that does not exist or holds no pipeline outputs (no ``metrics/`` and no
``outputs/<stage>/``) is an error, not a page of "not run". The report is logged as a run in MLflow experiment
``report`` (headline accuracies as metrics, the folder but its marker as artifacts; the run spans the report's
making). DVC stage ``report`` runs it after ``grpo``.

    python -m flows.report --config params.yaml
    python -m flows.report --root /path/to/another/checkout --output-dir /tmp/report --log-to-mlflow false
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import Field, field_validator

from a5core.runtime.settings import Settings
from a5core.runtime.writing import write_text_atomic
from flows.cli import flow_main, print_paths
from flows.config_file import profile_name, read_config, section_settings
from flows.params import ExperimentName, LogToMLflow, OutputFolder, TrackingUri, output_folder_of_its_flow
from tasks.outputs import REPORT_MARKER  # written into every report folder: the mark of a folder this flow made
from tasks.tables import markdown_table
from tasks.tracking import DEFAULT_TRACKING_URI

NOT_RUN = "not run"
_UMASK = os.umask(0)
os.umask(_UMASK)
CATEGORY_MEANING = {
    "format1_answer1": "formatted, correct",
    "format1_answer0": "formatted, wrong answer",
    "format0_answer0": "format not followed",
}
# Plots in this order first (those a stage wrote), then any other PNG of the stage's folder by name.
PLOT_ORDER = (
    "accuracy_vs_step.png",
    "accuracy_vs_wall_clock.png",
    "reward_mean_vs_step.png",
    "token_entropy_vs_step.png",
    "response_tokens_mean_vs_step.png",
)
STAGE_SECTIONS = {
    "baseline_eval": "baseline_eval",
    "sft_experiment": "sft_experiment",
    "expert_iteration": "expert_iteration",
    "grpo": "grpo",
    "leaderboard": "leaderboard",
}
# The stage folders under outputs/ the report reads (with metrics/, what a root that ran the pipeline holds).
STAGE_OUTPUTS = ("baseline_eval", "sft_experiment", "expert_iteration", "grpo", "leaderboard")


class ReportParams(Settings):
    output_dir: OutputFolder = "outputs/report"
    experiment: ExperimentName = "report"
    tracking_uri: TrackingUri = DEFAULT_TRACKING_URI
    log_to_mlflow: LogToMLflow = True
    root: str = Field(".", description="project folder whose metrics/ and outputs/ are read")
    params_file: str | None = Field("params.yaml", description="settings shown in the report (under root); None: none")
    ablations_from_mlflow: bool = Field(True, description="add the GRPO ablations found in the MLflow store")
    grpo_experiment: str = Field("grpo", description="MLflow experiment searched for ablation parent runs")
    title: str = Field("a5 pipeline report")

    _output_folder = field_validator("output_dir")(output_folder_of_its_flow)


# ------------------------------------------------------------------------------ the page's blocks
#
# A report is a list of blocks, rendered twice: ("h", level, text), ("p", text), ("table", rows),
# ("img", file name under figures/, caption). Text may hold `code`, **bold** and [label](link).


class Page:
    def __init__(self) -> None:
        self.blocks: list[tuple] = []
        self.figures: dict[str, Path] = {}  # name under figures/ → source file

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", level, text))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def table(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.blocks.append(("table", rows))

    def figure(self, source: Path, name: str, caption: str) -> None:
        self.figures[name] = source
        self.blocks.append(("img", name, caption))

    def document(self, file: str, summary: str, markdown: str) -> None:
        """A Markdown document beside the report (``file``): linked from report.md, embedded in report.html
        (folded under ``summary``), so the HTML page needs nothing beside it."""
        self.blocks.append(("doc", file, summary, markdown))


def _number(value: float) -> str:
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"


def _value(value: Any) -> str:
    if value is None:
        return ""
    return _number(value) if isinstance(value, float) else str(value)


def to_markdown(title: str, page: Page) -> str:
    lines = [f"# {title}", ""]
    for block in page.blocks:
        if block[0] == "h":
            lines += ["#" * (block[1] + 1) + " " + block[2], ""]
        elif block[0] == "p":
            lines += [block[1], ""]
        elif block[0] == "table":
            lines += [*markdown_table(block[1], number=_number).splitlines(), ""]
        elif block[0] == "img":
            lines += [f"![{block[2]}](figures/{block[1]})", ""]
        elif block[0] == "doc":
            lines += [f"{block[2]}: [{block[1]}]({block[1]}).", ""]
    return "\n".join(lines)


# One inline markup span, the first to start wins: `code`, **bold** or [label](link).
_INLINE = re.compile(r"`([^`]+)`|\*\*([^*]+)\*\*|\[([^\]]+)\]\(([^)\s]+)\)")
_HTTP_LINK = re.compile(r"https?://[^\s\"'<>`\\\x00-\x1f\x7f]+", re.IGNORECASE)
_RELATIVE_LINK = re.compile(r"[\w.~/#?&=%+-]+", re.ASCII)  # no scheme: no colon, no control characters


def _link_allowed(link: str) -> bool:
    """http(s) links and relative links (``baseline_cases.md``); never ``javascript:``, ``data:`` and the like."""
    return bool(_HTTP_LINK.fullmatch(link) or _RELATIVE_LINK.fullmatch(link))


def _inline_html(text: str) -> str:
    """``text`` as HTML: everything escaped; `code` (its content literal), **bold** and [label](link) marked
    up, a link only when :func:`_link_allowed` (else the markdown shows as plain text)."""
    parts, at = [], 0
    for m in _INLINE.finditer(text):
        parts.append(html.escape(text[at : m.start()], quote=False))
        at = m.end()
        if m[1] is not None:
            parts.append(f"<code>{html.escape(m[1], quote=False)}</code>")
        elif m[2] is not None:
            parts.append(f"<strong>{_inline_html(m[2])}</strong>")
        elif _link_allowed(m[4]):
            parts.append(f'<a href="{html.escape(m[4])}">{_inline_html(m[3])}</a>')
        else:
            parts.append(html.escape(m[0], quote=False))
    return "".join(parts) + html.escape(text[at:], quote=False)


_FENCE = re.compile(r"^(`{3,}|~{3,})")


def markdown_html(text: str) -> str:
    """The Markdown the project writes (a case report: headings, tables, paragraphs, fenced code of any
    fence length) as HTML, every text escaped; inline `code`, **bold** and links as :func:`_inline_html`."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            marker, body = fence[1], []
            i += 1
            while i < len(lines) and not (
                lines[i].startswith(marker[0] * len(marker)) and set(lines[i].strip()) == {marker[0]}
            ):
                body.append(lines[i])
                i += 1
            out.append("<pre><code>" + html.escape("\n".join(body), quote=False) + "</code></pre>")
        elif line.startswith("#"):
            level = min(len(line) - len(line.lstrip("#")), 6)
            out.append(f"<h{level}>{_inline_html(line[level:].strip())}</h{level}>")
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip().strip("|"))])
                i += 1
            i -= 1
            body_rows = [r for r in rows[1:] if not all(set(c) <= {"-", ":"} for c in r)]
            head = "".join(f"<th>{_inline_html(c)}</th>" for c in rows[0])
            cells = "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in r) + "</tr>" for r in body_rows)
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
        elif line.strip():
            paragraph = [line]
            while i + 1 < len(lines) and lines[i + 1].strip() and not re.match(r"^(#|\||`{3,}|~{3,})", lines[i + 1]):
                i += 1
                paragraph.append(lines[i])
            out.append(f"<p>{_inline_html(' '.join(paragraph))}</p>")
        i += 1
    return "\n".join(out)


def to_html(title: str, page: Page, figures_dir: Path) -> str:
    """The page as one HTML file, plots embedded as data URIs (it reads the same anywhere it is copied)."""
    body = [f"<h1>{html.escape(title)}</h1>"]
    for block in page.blocks:
        if block[0] == "h":
            body.append(f"<h{block[1] + 1}>{_inline_html(block[2])}</h{block[1] + 1}>")
        elif block[0] == "p":
            body.append(f"<p>{_inline_html(block[1])}</p>")
        elif block[0] == "table":
            header = list(dict.fromkeys(k for row in block[1] for k in row))
            cells = "".join(f"<th>{html.escape(k)}</th>" for k in header)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(_value(row.get(k)))}</td>" for k in header) + "</tr>"
                for row in block[1]
            )
            body.append(f"<table><thead><tr>{cells}</tr></thead><tbody>{rows}</tbody></table>")
        elif block[0] == "img":
            data = base64.b64encode((figures_dir / block[1]).read_bytes()).decode()
            body.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(block[2])}">'
                f"<figcaption>{html.escape(block[2])} "
                f"(<code>figures/{html.escape(block[1])}</code>)</figcaption></figure>"
            )
        elif block[0] == "doc":
            anchor = html.escape(block[1].rsplit(".", 1)[0].replace("_", "-"))
            body.append(
                f'<details id="{anchor}"><summary>{_inline_html(block[2])} '
                f'(<code>{html.escape(block[1])}</code>)</summary>\n<div class="doc">'
                + markdown_html(block[3])
                + "</div></details>"
            )
    style = (
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;line-height:1.45}"
        "table{border-collapse:collapse;margin:.5rem 0}td,th{border:1px solid #ccc;padding:.2rem .6rem;text-align:left}"
        "th{background:#f3f3f3}img{max-width:100%}figure{margin:1rem 0}figcaption{color:#555;font-size:.9rem}"
        "code{background:#f3f3f3;padding:0 .2rem}"
        "details{margin:1rem 0;border:1px solid #ddd;padding:.4rem .8rem}summary{cursor:pointer;font-weight:600}"
        "pre{background:#f6f6f6;padding:.5rem;overflow-x:auto;white-space:pre-wrap}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# ------------------------------------------------------------------------------------ reading


def _read_json(path: Path) -> Any:
    """The file's JSON, or None when it is absent or empty; ValueError naming a file that is not JSON (or nests
    too deeply to read: no stage writes such a file)."""
    if not path.is_file() or not path.read_text().strip():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, RecursionError) as error:
        detail = "nested too deeply" if isinstance(error, RecursionError) else error
        raise ValueError(f"{path}: not the JSON a stage writes ({detail}); run that stage again") from None


def _first_json(*paths: Path) -> Any:
    """The JSON of the first of ``paths`` that holds some (a stage's full summary before its metrics file, which
    a run made before metrics files were flat mappings filled with the same), None if none does."""
    return next((value for value in map(_read_json, paths) if value is not None), None)


def stage_settings(params_file: Path | None) -> dict[str, dict[str, Any]]:
    """Each stage's section of params.yaml with its profile's overrides applied (as the flows see them)."""
    if params_file is None or not params_file.is_file():
        return {}
    document = read_config(params_file)
    profile = profile_name(document, None, params_file)
    settings = {
        stage: section_settings(document, section, profile, params_file) for stage, section in STAGE_SECTIONS.items()
    }
    settings["_profile"] = {"profile": profile}
    return settings


def stage_run(root: Path, stage: str) -> dict[str, Any] | None:
    """What ``outputs/<stage>/run.json`` says (the stage's MLflow run, its Prefect flow run, the models it
    registered: :func:`tasks.flow_summary.publish`), None when the stage wrote none."""
    record = _read_json(root / "outputs" / stage / "run.json")
    return record if isinstance(record, dict) and record.get("mlflow_run_id") else None


def recorded_settings(root: Path, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The settings the stage's MLflow run recorded (its parameters, "None" read as None), or None when its
    store is not at hand (a relative SQLite store is looked for under ``root``; none is created)."""
    if record is None:
        return None
    from tasks.tracking import run_params, sqlite_database

    uri = record["tracking_uri"]
    database = sqlite_database(uri)
    if database is not None:
        database = database if database.is_absolute() else root / database
        if not database.is_file():
            return None
        uri = f"sqlite:///{database.resolve()}"
    params = run_params(uri, record["mlflow_run_id"])
    return None if params is None else {k: None if v == "None" else v for k, v in params.items()}


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


def _section(params_file: Path | None, section: str) -> dict[str, Any]:
    """One section of params.yaml with its profile's overrides ({} without the file)."""
    if params_file is None or not params_file.is_file():
        return {}
    document = read_config(params_file)
    return section_settings(document, section, profile_name(document, None, params_file), params_file)


def stage_plots(folder: Path) -> list[Path]:
    """The PNGs a stage wrote at the top of its output folder, the usual ones first."""
    found = {p.name: p for p in sorted(folder.glob("*.png"))} if folder.is_dir() else {}
    return [found[n] for n in PLOT_ORDER if n in found] + [p for n, p in found.items() if n not in PLOT_ORDER]


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


def _rows(root: Path, stage: str) -> list[dict[str, Any]] | None:
    """A training stage's per-setting rows: ``outputs/<stage>/summary.json`` (the metrics file of a run made
    before metrics files were flat mappings held them too); None where the stage has not run."""
    for path in (root / "outputs" / stage / "summary.json", root / "metrics" / f"{stage}.json"):
        value = _read_json(path)
        if isinstance(value, list) and value:
            return value
    return None


# ------------------------------------------------------------------------------------ sections


def baseline_section(page: Page, root: Path, settings: dict[str, Any], out_files: dict[str, str]) -> dict[str, float]:
    page.h(1, "Zero-shot baseline")
    summary = _first_json(root / "outputs/baseline_eval/summary.json", root / "metrics/baseline_eval.json")
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
    data = _first_json(root / "data/sft/sizes.json", root / "metrics/sft_data.json")
    if data and all(isinstance(values, dict) for values in data.values()):
        page.p("SFT data sets after filtering to the traces the grader accepts (`data/sft/sizes.json`):")
        page.table([{"set": name, **values} for name, values in data.items()])
    rows = _rows(root, "sft_experiment")
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
    rows = _rows(root, "expert_iteration")
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
    rows = _rows(root, "grpo")
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
    summary = _first_json(root / "outputs/difficulty/summary.json", root / "metrics/difficulty.json")
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


def ablations_section(page: Page, params: ReportParams, figure_sources: Path) -> int:
    """The GRPO ablations in MLflow: a table and a validation-accuracy plot each. Returns how many."""
    from tasks.plots import plot_curves
    from tasks.tracking import latest_ablations, metric_points, store_client

    page.h(1, "GRPO ablations")
    if not params.ablations_from_mlflow:
        page.p("Not read (`ablations_from_mlflow: false`).")
        return 0
    ablations = latest_ablations(params.tracking_uri, params.grpo_experiment)
    if not ablations:
        page.p(
            f"GRPO ablations: {NOT_RUN} (no parent run tagged `ablation` in MLflow experiment "
            f"`{params.grpo_experiment}`). Run one with `python -m flows.grpo --config params.yaml --ablation NAME`."
        )
        return 0
    reader = store_client(params.tracking_uri)
    page.p("The newest finished run of each ablation in MLflow (compare any runs with `python -m flows.compare`).")
    for name, (parent, children) in sorted(ablations.items()):
        page.h(2, f"{name}")
        page.p(f"MLflow run `{parent.info.run_id}`, {len(children)} settings.")
        page.table(
            [
                {
                    "setting": c.data.params.get("setting", c.info.run_name),
                    "final_accuracy": c.data.metrics.get("final_val_accuracy"),
                    "final_format_rate": c.data.metrics.get("final_val_format_rate"),
                    "wall_seconds": c.data.metrics.get("wall_seconds"),
                }
                for c in children
            ]
        )
        labels = [c.data.params.get("setting", c.info.run_name) for c in children]
        points = metric_points(reader, children, "val_accuracy", labels)
        if points:
            file = f"ablation_{name}_val_accuracy.png"
            plot_curves(figure_sources / file, points, "step", "val_accuracy", "run", f"{name}: validation accuracy")
            page.figure(figure_sources / file, file, f"{name}: validation accuracy by step")
    return len(ablations)


def leaderboard_section(page: Page, root: Path) -> dict[str, float]:
    summary = _read_json(root / "metrics/leaderboard.json")
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
                "format rate": _arrow(_value(before["format_rate"]), _value(metrics.get(f"{prefix}_format_rate"))),
            }
        )
    if "leaderboard_score" in metrics:
        rows.append({"stage": "Leaderboard run", "scored on": "", "accuracy": _value(metrics["leaderboard_score"])})
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
    return _value(value) + (f" ± {_value(se)}" if se is not None else "")


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


# ------------------------------------------------------------------------------------- writing


def check_root(root: Path) -> None:
    """Refuse a root that does not exist or holds no pipeline outputs: a report of it would say
    "not run" everywhere, hiding a mistyped ``--root``."""
    shown = str(root) if root.is_absolute() else f"{root} ({root.resolve()})"
    if not root.is_dir():
        raise FileNotFoundError(
            f"--root {shown} does not exist or is not a folder: pass --root the project folder the pipeline ran in"
        )
    if not (root / "metrics").is_dir() and not any((root / "outputs" / stage).is_dir() for stage in STAGE_OUTPUTS):
        raise ValueError(
            f"{shown} holds no pipeline outputs (metrics/, outputs/): run `make pipeline` first or "
            "pass --root the project folder the pipeline ran in"
        )


def check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that exists and is not a report folder (a file, or a folder that is neither empty nor
    marked as a report's, such as ``outputs/baseline_eval`` or a user's own report.md and figures): replacing it
    would delete it."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ValueError(
            f"--output-dir {out} exists and is not a report folder (a file); not replacing it: "
            "remove it or pick another --output-dir"
        )
    held = sorted(entry.name for entry in out.iterdir())
    if held and REPORT_MARKER not in held:
        listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(
            f"--output-dir {out} exists and is not a report folder (no {REPORT_MARKER}; it holds "
            f"{listed}); not replacing it: remove it or pick another --output-dir"
        )


def swap_in(built: Path, out: Path) -> None:
    """Replace folder ``out`` with the finished folder ``built`` (two renames: never half a report), when
    ``out`` is absent, empty or a report folder (:func:`check_replaceable`)."""
    check_replaceable(out)
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
        os.replace(out, old / out.name)
        os.replace(built, out)
        shutil.rmtree(old)
    else:
        os.replace(built, out)


def build_report(params: ReportParams) -> dict[str, Any]:
    """Write the report folder; returns its paths, the headline metrics and which sections ran."""
    root = Path(params.root)
    out = Path(params.output_dir)
    check_root(root)
    check_replaceable(out)  # before any work; swap_in checks again
    settings = stage_settings(root / params.params_file if params.params_file else None)
    for stage in (*STAGE_SECTIONS, "difficulty"):  # the settings each stage's run recorded, where at hand
        recorded = recorded_settings(root, stage_run(root, stage))
        if recorded:
            settings[stage] = {**settings.get(stage, {}), **recorded, "_recorded": True}
        elif stage == "difficulty" and "difficulty" not in settings:
            settings[stage] = _section(root / params.params_file if params.params_file else None, "difficulty")
    out.parent.mkdir(parents=True, exist_ok=True)
    built = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.new."))
    try:
        page, files, metrics = Page(), {}, {}
        page.h(1, "Summary")
        summary_at = len(page.blocks)
        profile = settings.get("_profile", {}).get("profile")
        metrics |= baseline_section(page, root, settings.get("baseline_eval", {}), files)
        metrics |= sft_section(page, root, settings.get("sft_experiment", {}))
        metrics |= ei_section(page, root, settings.get("expert_iteration", {}))
        metrics |= grpo_section(page, root, settings.get("grpo", {}))
        difficulty = difficulty_section(page, root, settings.get("difficulty", {}))
        n_ablations = ablations_section(page, params, built / "figures")
        metrics |= leaderboard_section(page, root)
        lead = [
            (
                "p",
                f"Settings: `{params.params_file}` with profile `{profile}`."
                if profile
                else "Results of the pipeline's stages (final validation accuracy of each).",
            )
        ]
        lead.append(
            (
                "p",
                "Each stage's accuracy (± its standard error over problems) and format rate on the problems it is "
                "scored on, before it trained (its starting model) → after.",
            )
        )
        rows = headline(metrics, settings)
        note = scored_sets_note(rows)
        page.blocks[summary_at:summary_at] = [*lead, ("table", rows), *([("p", note)] if note else [])]
        (built / "figures").mkdir(exist_ok=True)
        for name, source in page.figures.items():
            if source.parent != built / "figures":
                shutil.copyfile(source, built / "figures" / name)
        for name, text in files.items():
            write_text_atomic(built / name, text)
        write_text_atomic(built / "report.md", to_markdown(params.title, page))
        write_text_atomic(built / "report.html", to_html(params.title, page, built / "figures"))
        write_text_atomic(
            built / REPORT_MARKER,
            "A report folder written by flows.report: the next report replaces this folder whole.\n",
        )
        for folder in (built, built / "figures"):
            os.chmod(folder, 0o777 & ~_UMASK)  # mkdtemp makes 0700; give the folder the usual permissions
        swap_in(built, out)
    except BaseException:
        shutil.rmtree(built, ignore_errors=True)
        raise
    sections = {
        "baseline": "baseline_accuracy" in metrics,
        "sft": "sft_best_accuracy" in metrics,
        "ei": "ei_best_accuracy" in metrics,
        "grpo": "grpo_best_accuracy" in metrics,
        "ablations": n_ablations,
        "difficulty": difficulty,
    }
    return {
        "report_md": str(out / "report.md"),
        "report_html": str(out / "report.html"),
        "metrics": metrics,
        "sections": sections,
        "figures": sorted(page.figures),
        "headline": headline(metrics, settings),
    }


def log_report_run(params: ReportParams, result: dict[str, Any]) -> str:
    from tasks.tracking import log_files_run

    tags = {f"section_{k}": v for k, v in result["sections"].items()}
    return log_files_run(
        params.experiment,
        "report",
        params.tracking_uri,
        [params.output_dir],
        tags=tags,
        metrics=result["metrics"],
        skip=(REPORT_MARKER,),
    )


@flow(name="report")
def report(params: ReportParams = ReportParams()) -> dict:
    """The pipeline's one-page report (markdown + self-contained HTML), logged to MLflow (a run that spans
    its making)."""
    from tasks.flow_summary import publish
    from tasks.tracking import flow_run

    if params.log_to_mlflow:
        with flow_run(params.experiment, "report", params.tracking_uri):
            result = build_report(params)
            result["mlflow_run_id"] = log_report_run(params, result)
    else:
        result = {**build_report(params), "mlflow_run_id": None}
    publish(
        "report",
        "Pipeline report",
        result["headline"],
        experiment=params.experiment if params.log_to_mlflow else None,
        tracking_uri=params.tracking_uri,
        mlflow_run_id=result["mlflow_run_id"],
        paths={"report": result["report_md"], "html": result["report_html"]},
    )
    return {**result, "experiment": params.experiment}


def show(params: ReportParams, result: dict) -> None:
    for row in result["headline"]:
        change = f" (change {row['change']})" if row.get("change") else ""
        rates = f", format rate {row['format rate']}" if row.get("format rate") else ""
        place = f" on {row['scored on']}" if row["scored on"] else ""
        print(f"{row['stage']:>24}: accuracy {row['accuracy']}{change}{rates}{place}")
    print_paths({"report": result["report_md"], "html": result["report_html"]})
    if result["mlflow_run_id"]:
        print(f"mlflow run {result['mlflow_run_id']} (experiment {result['experiment']})")


main = flow_main(report, ReportParams, "report", __doc__, show=show)

if __name__ == "__main__":
    main(sys.argv[1:])
