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

import os
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
from tasks.mlflow_store import DEFAULT_TRACKING_URI
from tasks.outputs import REPORT_MARKER  # written into every report folder: the mark of a folder this flow made
from tasks.report_folder import check_replaceable, swap_in
from tasks.report_inputs import check_root, recorded_settings, stage_run
from tasks.report_page import Page, to_html, to_markdown
from tasks.report_sections import (
    NOT_RUN,
    baseline_section,
    difficulty_section,
    ei_section,
    grpo_section,
    headline,
    leaderboard_section,
    scored_sets_note,
    sft_section,
)

_UMASK = os.umask(0)
os.umask(_UMASK)
STAGE_SECTIONS = {
    "baseline_eval": "baseline_eval",
    "sft_experiment": "sft_experiment",
    "expert_iteration": "expert_iteration",
    "grpo": "grpo",
    "leaderboard": "leaderboard",
}


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


def _section(params_file: Path | None, section: str) -> dict[str, Any]:
    """One section of params.yaml with its profile's overrides ({} without the file)."""
    if params_file is None or not params_file.is_file():
        return {}
    document = read_config(params_file)
    return section_settings(document, section, profile_name(document, None, params_file), params_file)


def ablations_section(page: Page, params: ReportParams, figure_sources: Path) -> int:
    """The GRPO ablations in MLflow: a table and a validation-accuracy plot each. Returns how many."""
    from tasks.mlflow_store import store_client
    from tasks.plots import plot_curves
    from tasks.run_reading import latest_ablations, metric_points

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
    from tasks.mlflow_runs import log_files_run

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
    from tasks.mlflow_runs import flow_run

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
