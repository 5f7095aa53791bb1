"""Flow ``compare``: put MLflow runs side by side — a table of what differs and what came out, and plots.

Pick the runs by id (``--runs id1,id2``), by experiment (``--experiment grpo``, optionally narrowed with
an MLflow filter string, ``--filter "params.loss_type = 'grpo_clip'"``), or as the children of a parent
run (``--parent ID``: an ablation or sweep). The flow writes into ``output_dir``:

- ``comparison.md``: first what differs in the runs' provenance records (code, data, settings, versions,
  device; also ``records.json``), then the results; ``comparison.csv`` / ``comparison.json``: one row per
  run with its name, the parameters whose values differ between the runs, and the final value of each
  chosen metric; and for runs that log every graded sample (evaluation runs; training runs' final
  evaluations, ``per_problem/``) the paired difference in per-problem accuracy against the first of them,
  with its standard error, on the problems both evaluated (also ``paired.json``);
- ``<metric>_vs_step.png``: one plot per plotted metric, the metric against step, one line per run;

and logs them as artifacts of a new run in MLflow experiment ``comparison``, tagged with the compared
run ids (``compared_run_ids``). Whether one setting beats another, and how sure that is, over runs paired by start
model and seed: ``flows.verdicts``.

    python -m flows.compare --help
    python -m flows.compare --experiment grpo
    python -m flows.compare --runs 3f2a...,9c41... --plot-metrics val_accuracy,token_entropy
    python -m flows.compare --experiment grpo --filter "tags.ablation = 'grpo_lr_sweep'"
    python -m flows.compare --parent <parent run id>       # the children of an ablation or sweep
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from prefect import flow
from pydantic import Field, ValidationInfo, field_validator

from a5core.grading.sample_metrics import paired_difference, problem_scores
from a5core.runtime.settings import Settings
from a5core.runtime.writing import write_text_atomic
from flows.cli import flow_main, print_paths
from flows.params import ExperimentName, LogToMLflow, OutputFolder, TrackingUri, output_folder_of_its_flow
from flows.served import check_served_reads, served_databases
from tasks.flow_summary import publish
from tasks.mlflow_runs import log_files_run
from tasks.mlflow_store import DEFAULT_TRACKING_URI, reading_client
from tasks.outputs import outputs_held
from tasks.plots import file_stem, plot_curves
from tasks.provenance import DamagedRecordError, read_record, record_rows
from tasks.run_reading import final_per_problem, find_runs, metric_points, run_labels, run_records
from tasks.tables import csv_text, json_text, markdown_table, markdown_text

# Final values shown when no metrics are named (those that some run holds), and metrics plotted by step.
DEFAULT_METRICS = (
    "final_val_accuracy",
    "final_val_format_rate",
    "val_accuracy",
    "reward_mean",
    "accuracy",
    "format_rate",
    "wall_seconds",
)
DEFAULT_PLOT_METRICS = ("val_accuracy", "reward_mean")


def _names(value: Any) -> Any:
    """``a,b`` (a flag) or a list (YAML, Python) → a list of stripped strings."""
    if value is None:
        return value
    if isinstance(value, str):
        value = value.split(",")
    return [str(v).strip() for v in value if str(v).strip()]


class CompareParams(Settings):
    output_dir: OutputFolder = "outputs/compare"
    tracking_uri: TrackingUri = DEFAULT_TRACKING_URI
    log_to_mlflow: LogToMLflow = True
    runs: list[str] = Field([], description="run ids to compare (comma-separated on the command line)")
    experiment: str | None = Field(None, description="compare the runs of this experiment (when no run ids are given)")
    filter: str | None = Field(
        None, description="MLflow search filter for --experiment, e.g. \"params.loss_type = 'grpo_clip'\""
    )
    parent: str | None = Field(
        None, validate_default=True, description="compare the child runs of this parent run (an ablation or sweep)"
    )
    max_runs: int = Field(50, gt=0, description="most runs taken from a search (newest first)")
    metrics: list[str] | None = Field(
        None, description=f"final metrics in the table (None: those of {list(DEFAULT_METRICS)} some run has)"
    )
    plot_metrics: list[str] = Field(
        list(DEFAULT_PLOT_METRICS), description="metrics plotted against step, where runs have them"
    )
    comparison_experiment: ExperimentName = "comparison"

    _output_folder = field_validator("output_dir")(output_folder_of_its_flow)

    @field_validator("runs", "metrics", "plot_metrics", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _names(value)

    @field_validator("parent")
    @classmethod
    def _one_selection(cls, parent: str | None, info: ValidationInfo) -> str | None:
        # On the last selection field (validated after runs, experiment, filter; default included), so the
        # error names a field as the CLI and the UI expect.
        if sum(bool(x) for x in (info.data.get("runs"), info.data.get("experiment"), parent)) != 1:
            raise ValueError("give exactly one of runs, experiment or parent")
        if info.data.get("filter") and not info.data.get("experiment"):
            raise ValueError("filter applies to experiment; give experiment too")
        return parent


# ----------------------------------------------------------------------------------- gathering


def differing_params(runs: list[Any]) -> list[str]:
    """Parameter names whose values are not the same in every run (all of them for a single run)."""
    keys = sorted({k for r in runs for k in r.data.params})
    if len(runs) == 1:
        return keys
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


def table_metrics(runs: list[Any], wanted: list[str] | None) -> list[str]:
    """The table's metric columns: ``wanted`` as given, or the defaults that some run holds (or, if none,
    every non-system metric)."""
    if wanted is not None:
        return list(wanted)
    held = {k for r in runs for k in r.data.metrics}
    chosen = [m for m in DEFAULT_METRICS if m in held]
    return chosen or sorted(k for k in held if not k.startswith("system/"))


def comparison_rows(runs: list[Any], metrics: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per run: run, run_id, (experiment if several), differing params, final metric values."""
    params = differing_params(runs)
    several_experiments = len({r.info.experiment_id for r in runs}) > 1
    rows = []
    for label, run in zip(run_labels(runs), runs, strict=True):
        row: dict[str, Any] = {"run": label, "run_id": run.info.run_id}
        if several_experiments:
            row["experiment_id"] = run.info.experiment_id
        row.update({p: run.data.params.get(p, "") for p in params})
        row.update({m: run.data.metrics.get(m) for m in metrics})
        rows.append(row)
    return rows, params


def paired_rows(client: Any, runs: list[Any]) -> list[dict[str, Any]]:
    """For runs that logged every graded sample (evaluation runs: ``generations.json``; training runs: their
    final evaluation's ``per_problem/`` table, :func:`tasks.run_reading.final_per_problem`), each one's paired
    difference in per-problem accuracy against the first such run
    (:func:`a5core.grading.sample_metrics.paired_difference`);
    [] when fewer than two runs hold records."""
    scored = []
    for label, run in zip(run_labels(runs), runs, strict=True):
        records = run_records(client, run) or final_per_problem(client, run)
        if records:
            scored.append((label, problem_scores(records)))
    if len(scored) < 2:
        return []
    (reference, base), rows = scored[0], []
    for label, scores in scored[1:]:
        try:
            rows.append({"run": label, "against": reference, **paired_difference(scores, base)})
        except ValueError:  # no problem in common
            rows.append({"run": label, "against": reference, "difference": None, "difference_se": None})
    return rows


def run_provenance(client: Any, runs: list[Any]) -> list[dict[str, str]]:
    """What differs between the runs' provenance records (:func:`tasks.provenance.record_rows`: code, data,
    settings, versions, device), one row an entry; [] when fewer than two runs are compared or none holds a
    record."""
    if len(runs) < 2:
        return []
    records = []
    for run in runs:
        try:
            records.append(read_record(client, run.info.run_id, ""))
        except DamagedRecordError:
            records.append("damaged")  # shown as such (record_rows)
        except ValueError:  # made before runs recorded their provenance, or by a flow that records none
            records.append(None)
    if all(r is None for r in records):
        return []
    return record_rows(run_labels(runs), records)


# ------------------------------------------------------------------------------------- writing


def plot_file_name(metric: str) -> str:
    return file_stem(metric) + "_vs_step.png"  # a file of its own for each metric (a/b and a_b: two files)


def write_comparison(
    client: Any, runs: list[Any], output_dir: Path, metrics: list[str] | None, plot_metrics: list[str], title: str = ""
) -> dict[str, Any]:
    """Write comparison.md/.csv/.json and one plot per plotted metric any run holds; returns
    ``{"rows", "params", "metrics", "plots": {metric: path}, "paths": {name: path}, "missing": [...]}``."""
    if not runs:
        raise ValueError("no runs to compare")
    columns = table_metrics(runs, metrics)
    rows, params = comparison_rows(runs, columns)
    held = {k for r in runs for k in r.data.metrics}
    records = run_provenance(client, runs)
    md = [f"# {markdown_text(title or 'Run comparison')}", ""]
    if records:
        md += [
            "## What differs in their records",
            "",
            "Code, data (content hashes), settings, versions and device, from each run's provenance.json.",
            "",
            markdown_table(records, width=48),
            "",
            "## Results",
            "",
        ]
    md += [
        f"{len(runs)} runs; parameters shown: those that differ between them"
        f"{' (all: one run)' if len(runs) == 1 else ''}; metrics: final values.",
        "",
        markdown_table(rows, width=48),
    ]
    plots: dict[str, Path] = {}
    for metric in plot_metrics:
        points = metric_points(client, runs, metric)
        if points:
            plots[metric] = plot_curves(
                output_dir / plot_file_name(metric), points, "step", metric, "run", f"{metric} by step"
            )
            md += [f"![{markdown_text(metric)} by step]({plots[metric].name})", ""]
    paired = paired_rows(client, runs)
    if paired:
        md += [
            f"## Paired differences against {markdown_text(paired[0]['against'])}",
            "",
            "Per-problem accuracy (mean over a problem's samples) on the problems both runs evaluated; the "
            "standard error is of the paired differences.",
            "",
            markdown_table(paired, width=48),
            "",
        ]
    missing = [m for m in [*columns, *plot_metrics] if m not in held]
    if missing:
        md += [markdown_text(f"No run holds: {', '.join(dict.fromkeys(missing))}."), ""]
    paths = {
        "table_md": write_text_atomic(output_dir / "comparison.md", "\n".join(md)),
        "table_csv": write_text_atomic(output_dir / "comparison.csv", csv_text(rows)),
        "table_json": write_text_atomic(output_dir / "comparison.json", json_text(rows)),
        **{f"plot_{m}": p for m, p in plots.items()},
    }
    if paired:
        paths["paired_json"] = write_text_atomic(output_dir / "paired.json", json_text(paired))
    if records:
        paths["records_json"] = write_text_atomic(output_dir / "records.json", json_text(records))
    return {
        "rows": rows,
        "records": records,
        "paired": paired,
        "params": params,
        "metrics": columns,
        "plots": {m: str(p) for m, p in plots.items()},
        "paths": {k: str(v) for k, v in paths.items()},
        "missing": list(dict.fromkeys(missing)),
    }


def log_comparison_run(params: CompareParams, runs: list[Any], result: dict[str, Any]) -> str:
    """A run in ``params.comparison_experiment`` holding the table and plots, tagged with the compared ids."""
    ids = [r.info.run_id for r in runs]
    tags = {"compared_run_ids": ",".join(ids)[:5000], "compared_runs": len(ids)}
    tags.update(
        {
            f"compared_{k}": v
            for k, v in (("experiment", params.experiment), ("filter", params.filter), ("parent", params.parent))
            if v
        }
    )
    return log_files_run(
        params.comparison_experiment,
        f"compare-{len(ids)}-runs",
        params.tracking_uri,
        list(result["paths"].values()),
        tags=tags,
        params={
            "metrics": ",".join(result["metrics"])[:6000],
            "plot_metrics": ",".join(params.plot_metrics),
            "differing_params": ",".join(result["params"])[:6000],
        },
    )


@flow(name="compare")
def compare(params: CompareParams) -> dict:
    """Compare MLflow runs: table (md/csv/json) and plots into output_dir, logged as a comparison run."""
    check_served_reads({"tracking_uri": served_databases([params.tracking_uri])})
    reader = reading_client(params.tracking_uri)  # read-only: a file that is not an MLflow store is left untouched
    runs = find_runs(reader, params)
    if not runs:
        raise ValueError(
            "no runs matched: "
            + (
                f"experiment {params.experiment!r} filter {params.filter!r}"
                if params.experiment
                else f"children of {params.parent}"
            )
        )
    with outputs_held(params):  # claimed, and no other flow writes there meanwhile
        result = write_comparison(reader, runs, Path(params.output_dir), params.metrics, params.plot_metrics)
    result["mlflow_run_id"] = log_comparison_run(params, runs, result) if params.log_to_mlflow else None
    publish(
        "compare",
        f"Comparison of {len(runs)} runs",
        [{k: v for k, v in row.items() if k != "run_id"} for row in result["rows"]],
        experiment=params.comparison_experiment if result["mlflow_run_id"] else None,
        tracking_uri=params.tracking_uri,
        mlflow_run_id=result["mlflow_run_id"],
        paths=result["paths"],
    )
    return result


def show(params: CompareParams, result: dict) -> None:
    print(markdown_table(result["rows"], [c for c in result["rows"][0] if c != "run_id"], width=48, escape=False))
    if result["missing"]:
        print(f"no run holds: {', '.join(result['missing'])}")
    print_paths(result["paths"])
    if result["mlflow_run_id"]:
        print(f"mlflow run {result['mlflow_run_id']} (experiment {params.comparison_experiment})")


main = flow_main(compare, CompareParams, "compare", __doc__, show=show)

if __name__ == "__main__":
    main(sys.argv[1:])
