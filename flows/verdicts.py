"""Flow ``verdicts``: decide expectations asked of runs — does DAPO beat GRPO here, and how sure are we?

Give the stores that hold the runs (``--stores``: tracking URIs, database files, or folders searched for
``mlflow.db``; default the project's store) and the expectations, as flags or in a YAML file
(:mod:`a5core.verdicts.expectations` for the form)::

    python -m flows.verdicts --expect "dapo >= grpo; kl_0 ~ kl_0.001" --scope grpo_dapo_ablation
    python -m flows.verdicts --expectations-file docs/expectations.yaml --stores sqlite:///mlflow.db
    python -m flows.verdicts --expect "1024 >= 128 on final_val_format_rate" --correction bh

Runs are paired by start model (its weights' content hash) and seed on the same problems; runs alike in start model,
settings and seed count once, as their mean. The rule (``--method anytime``, the default) tests each expectation's
pairs, and its start models' means, by confidence sequences that stay valid however many pairs were made and however
often the page was made again: pairs may be added until a row is decided. A verdict is general where the start
models' test decides it, else it holds for its start models only. Every test the page asks is read at α over their
number (``--correction bonferroni``; ``bh``: e-BH, a false-discovery rate). ``--method fixed`` is Student's t with
Holm's correction, valid only for a number of pairs fixed before the runs were looked at. Each expectation gets a
verdict: agrees / disagrees / within noise / inconclusive / too few runs, or "not judged" where its arms differ in
more than the setting under test or every run of both scored alike (:mod:`a5core.verdicts.decide`); a pair whose
start model favours one arm is set apart. Beside each: the start models and their spread, and each arm's compute
(rollouts, response tokens, seconds); ``A >= B at equal rollouts`` compares the runs where both had generated as
many rollouts. An arm label that no run carries is resolved, for an ablation's child, to the settings the ablation
gives it. The flow writes into ``output_dir``:

- ``verdicts.md``: the findings (each verdict before and after the correction, the differences beyond which it
  would have been decided, how many more pairs would likely decide it), how they were decided, the rules with the
  day each was adopted and the verdicts each changes, the pairs behind each, the runs made more than once, the
  runs left out, and each experiment's runs with their curves (``figures/``); ``--append`` adds Markdown files of
  your own after them;
- ``verdicts.json`` (everything, pairs included) and ``verdicts.csv`` (the findings);

and logs them as a run in MLflow experiment ``verdicts`` (``--tracking-uri``) and as the flow run's Prefect
artifact.
"""

from __future__ import annotations

import shlex
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from prefect import flow
from pydantic import Field, field_validator, model_validator

from a5core.runtime.reading import check_file_to_read, read_text_capped
from a5core.runtime.settings import Settings
from a5core.runtime.writing import write_text_atomic
from a5core.verdicts.anytime import MIXTURE_G
from a5core.verdicts.decide import Decision, Rule, decide, rule_changes
from a5core.verdicts.expectations import DEFAULT_METRIC, FINAL, Expectation, expectations_from, parse_expectation
from a5core.verdicts.pairing import RunRecord
from flows.ablations import ABLATIONS, ablation_overrides
from flows.cli import flow_main, print_paths
from flows.config_file import load_yaml
from flows.params import (
    PLACEMENT_FIELDS,
    ExperimentName,
    GRPOParams,
    LogToMLflow,
    OutputFolder,
    TrackingUri,
    output_folder_of_its_flow,
)
from flows.served import check_served_reads, served_databases
from tasks.flow_summary import publish
from tasks.mlflow_runs import log_files_run
from tasks.mlflow_store import DEFAULT_TRACKING_URI
from tasks.outputs import outputs_held, own_subfolder
from tasks.plots import file_stem, plot_curves
from tasks.servers import check_server
from tasks.store_runs import StoredRuns, finite_runs, read_runs
from tasks.tables import csv_text, json_text, markdown_table, markdown_text
from tasks.verdict_page import (
    experiments_section,
    findings_rows,
    left_out_section,
    made_again,
    pairs_sections,
    records,
    reruns_section,
    rule_text,
    rules_section,
    summary_rows,
)

# Parameters that say where or how fast a run ran, or which grid a sweep's parent ran, not what a run ran with.
NOT_WHAT_RAN = sorted(
    {*PLACEMENT_FIELDS, "ablation", "ablation_only", "sweep", "sweep_*", "clip_*", "model_dir", "file_sha256/*"}
)
PAGE, FIGURES = "verdicts.md", "figures"
MAX_READ_BYTES = 10_000_000  # an expectations file, a Markdown file appended: a few kB


class VerdictParams(Settings):
    output_dir: OutputFolder = "outputs/verdicts"
    tracking_uri: TrackingUri = DEFAULT_TRACKING_URI
    log_to_mlflow: LogToMLflow = True
    stores: list[str] = Field(
        [DEFAULT_TRACKING_URI],
        description="where the runs are: tracking URIs, database files, or folders (every mlflow.db under them)",
    )
    runs: list[str] = Field(
        [], description="only these runs of the stores (MLflow run ids; none: every run), such as a command's children"
    )
    expect: list[str] = Field(
        [], description='expectations, separated by ";": "dapo >= grpo; kl_0 ~ kl_0.001; 1024 >= 128 on METRIC"'
    )
    expectations_file: str | None = Field(None, description="a YAML file of expectations (and runs to exclude)")
    scope: str | None = Field(
        None, description="--expect's arms are labels of runs of this ablation, sweep or MLflow experiment"
    )
    metric: str = Field(DEFAULT_METRIC, description="--expect's metric unless one says `on METRIC`")
    endpoint: str = Field(FINAL, description="--expect's endpoint: final, or mean_last_K (the curve's last K points)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="the family's level: 1 − α")
    margin: float = Field(0.05, gt=0, description="within noise: a difference within ±margin")
    method: Literal["anytime", "fixed"] = Field(
        "anytime",
        description="anytime: confidence sequences, valid when pairs are added until decided; fixed: Student's t, "
        "valid only for a number of pairs fixed in advance",
    )
    correction: Literal["bonferroni", "holm", "bh", "none"] | None = Field(
        None,
        description="for the tests asked together: bonferroni (anytime's default) or holm (fixed's default) bound "
        "the chance of any false verdict, bh a false-discovery rate (default: the method's own)",
    )
    mixture_g: float = Field(MIXTURE_G, gt=0, description="anytime: the confidence sequence's mixture variance")
    start_model_level: bool = Field(
        True,
        description="anytime: a general verdict needs the start models' means to decide (else: for its start models)",
    )
    min_pairs: int = Field(3, ge=2, description="pairs a verdict needs")
    power: float = Field(0.8, gt=0, lt=1, description="'would likely decide': with this probability")
    ignore_settings: list[str] = Field(
        NOT_WHAT_RAN, description="parameters that are not what a run ran with (fnmatch patterns)"
    )
    append: list[str] = Field([], description="Markdown files added to the page after the verdicts")
    title: str = Field("Verdicts", description="the page's title")
    verdict_experiment: ExperimentName = "verdicts"

    _output_folder = field_validator("output_dir")(output_folder_of_its_flow)

    @field_validator("stores", "runs", "ignore_settings", "append", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("expect", mode="before")
    @classmethod
    def _split_expectations(cls, value: Any) -> Any:
        return [v.strip() for v in value.split(";") if v.strip()] if isinstance(value, str) else value

    @field_validator("expect")
    @classmethod
    def _parse(cls, value: list[str]) -> list[str]:
        for text in value:
            parse_expectation(text)
        return value

    @field_validator("stores")
    @classmethod
    def _stores(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one store")
        for entry in value:
            if "://" not in entry and not Path(entry).expanduser().exists():
                raise ValueError(f"{entry}: no such file or folder, and not a tracking URI")
        return value

    @field_validator("append")
    @classmethod
    def _files(cls, value: list[str]) -> list[str]:
        for path in value:
            check_file_to_read(path, "append")
            if not Path(path).expanduser().is_file():
                raise ValueError(f"{path}: no such file")
        return value

    @field_validator("expectations_file")
    @classmethod
    def _readable(cls, value: str | None) -> str | None:
        if value is not None:
            read_expectations(value)
        return value

    @model_validator(mode="after")
    def _something_asked(self) -> VerdictParams:
        if not self.expect and not self.expectations_file:
            raise ValueError("give expect (dapo >= grpo) or expectations_file")
        self.rule()  # a correction the method does not take, in one line
        for text in self.expect:
            parse_expectation(text, endpoint=self.endpoint)
        return self

    def rule(self) -> Rule:
        return Rule(
            self.confidence,
            self.margin,
            self.method,
            self.correction,
            self.min_pairs,
            self.power,
            self.mixture_g,
            self.start_model_level,
        )


def read_expectations(path: str) -> tuple[list[Expectation], dict[str, str]]:
    """The expectations and exclusions of a YAML file; ValueError naming the file and what is wrong."""
    where = f"expectations_file {path}"
    check_file_to_read(path, "expectations_file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        document = load_yaml(read_text_capped(file, "expectations_file", MAX_READ_BYTES))
    except (yaml.YAMLError, RecursionError) as error:
        raise ValueError(f"{where}: not a YAML file ({getattr(error, 'problem', None) or error})") from None
    return expectations_from(document, where)


def asked(params: VerdictParams) -> tuple[list[Expectation], dict[str, str]]:
    """The expectations asked, the file's first, and the runs the file excludes (id prefix → why)."""
    found, exclude = read_expectations(params.expectations_file) if params.expectations_file else ([], {})
    found += [
        parse_expectation(t, metric=params.metric, experiment=params.scope, endpoint=params.endpoint)
        for t in params.expect
    ]
    return found, exclude


def arm_settings(arm: str, scope: str | None, runs: Sequence[RunRecord]) -> dict[str, str] | None:
    """The settings that make ``arm`` a child of GRPO ablation ``scope``, from the ablation's table with the
    settings of one of its runs in the stores (its reference values): so that a label no run carries is found in
    the runs another experiment made with those settings (on_policy in the off-policy sweep is the DAPO ablation's
    grpo). None where ``scope`` is not an ablation, none of its runs is here, or it has no such child."""
    if scope not in ABLATIONS:
        return None
    base = next((r for r in runs if scope in (r.group, r.experiment)), None)
    if base is None:
        return None
    values = {}
    for key, text in base.settings.items():
        if key in GRPOParams.model_fields:
            try:
                values[key] = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
    params = GRPOParams.model_construct(**{**values, "ablation_only": None})
    try:
        overrides = ablation_overrides(scope, params).get(arm)
    except (TypeError, ValueError, ArithmeticError):
        return None
    return None if overrides is None else {key: str(value) for key, value in overrides.items()}


def figures(stored: StoredRuns, folder: Path) -> dict[str, list[Path]]:
    """Each experiment's validation accuracy by step, a line a setting (the mean over its runs that reached the
    step, their number in the legend): ``figures/<experiment>_val_accuracy.png`` (the experiment's name as a file
    name of its own: :func:`tasks.plots.file_stem`)."""
    points: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for run in stored.records:
        for step, value in run.curves.get("val_accuracy", {}).items():
            points[run.group][run.setting][step].append(value)
    made = {}
    for group, settings in points.items():
        runs = {setting: max(map(len, steps.values())) for setting, steps in settings.items()}
        rows = [
            {"step": step, "val_accuracy": sum(values) / len(values), "setting": f"{setting} ({runs[setting]} runs)"}
            for setting, steps in settings.items()
            for step, values in steps.items()
        ]
        name = file_stem(group) + "_val_accuracy.png"
        title = f"{group}: val_accuracy, mean over runs"
        made[group] = [plot_curves(folder / name, rows, "step", "val_accuracy", "setting", title)]
    return made


def page(
    params: VerdictParams, stored: StoredRuns, decision: Decision, changes: list, plots: dict[str, list[Path]]
) -> str:
    """The page: title, what it was made from, the findings, how they were decided, and the detail."""
    again = made_again(decision)
    lines = [
        f"# {markdown_text(params.title)}",
        "",
        "> "
        + markdown_text(
            f"Made by `{command(params)}` from {len(stored.records)} runs in {len(stored.stores)} MLflow "
            f"store{'s' * (len(stored.stores) != 1)}: do not edit by hand."
        ),
        "",
        "## Findings",
        "",
        markdown_table(findings_rows(decision)),
        rule_text(decision, len(again), max((c.spread for c in again), default=None)),
        "",
        *rules_section(changes),
        "## The pairs",
        "",
        *pairs_sections(decision),
        *reruns_section(again),
        *left_out_section(decision),
        *experiments_section(stored.records, plots, Path(params.output_dir), metrics_shown(decision)),
    ]
    for path in params.append:  # the user's own Markdown, as written
        lines += [read_text_capped(path, "append", MAX_READ_BYTES).rstrip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def command(params: VerdictParams) -> str:
    """The command that asks what ``params`` asks (where its outputs go left out)."""
    words = ["python", "-m", "flows.verdicts"]
    for name in sorted(params.explicit() - {"output_dir", "log_to_mlflow", "tracking_uri", "append"}):
        value = getattr(params, name)
        if isinstance(value, list):
            value = ("; " if name == "expect" else ",").join(value)
        words += [f"--{name.replace('_', '-')}", shlex.quote(str(value))]
    return " ".join(words)


def metrics_shown(decision: Decision) -> list[str]:
    asked_metrics = [v.expectation.metric for v in decision.verdicts]
    return list(dict.fromkeys([DEFAULT_METRIC, "final_val_format_rate", *asked_metrics]))


@flow(name="verdicts")
def verdicts(params: VerdictParams) -> dict:
    """Decide the expectations asked of the runs in ``params.stores``: page, JSON and CSV into output_dir, logged
    as a run of ``params.verdict_experiment`` and as the flow run's artifact."""
    check_served_reads(
        {
            "append": params.append,
            "expectations_file": [params.expectations_file],
            "stores": [s for s in params.stores if "://" not in s] + served_databases(params.stores),
        }
    )
    if params.log_to_mlflow:
        check_server(params.tracking_uri)  # where the verdicts are logged answers, before the stores are read
    expectations, exclude = asked(params)
    stored = read_runs(params.stores, params.ignore_settings)
    if params.runs:
        chosen = set(params.runs)
        stored = replace(stored, records=[r for r in stored.records if r.id in chosen])
    if not stored.records and not stored.left_out:
        raise ValueError(f"stores: no runs in {', '.join(stored.stores)}")
    usable, not_finite = finite_runs(stored.records, [e.metric for e in expectations])
    rule = params.rule()
    decision = decide(expectations, usable, rule, exclude, arm_settings)
    changes = rule_changes(expectations, usable, rule, exclude, arm_settings, decision)
    decision = replace(decision, left_out=[*decision.left_out, *stored.left_out, *not_finite])
    out = Path(params.output_dir)
    figures_folder = own_subfolder(out, FIGURES)
    with outputs_held(params):  # claimed, and no other flow writes there meanwhile
        plots = figures(stored, figures_folder)
        paths = {
            "page": write_text_atomic(out / PAGE, page(params, stored, decision, changes, plots)),
            "json": write_text_atomic(out / "verdicts.json", json_text(records(decision))),
            "csv": write_text_atomic(out / "verdicts.csv", csv_text(findings_rows(decision))),
        }
    if plots:
        paths["figures"] = out / FIGURES
    counts = decision.counts()
    run_id = None
    if params.log_to_mlflow:
        run_id = log_files_run(
            params.verdict_experiment,
            f"verdicts-{len(expectations)}",
            params.tracking_uri,
            list(paths.values()),
            tags={"stores": ",".join(stored.stores)[:5000], "runs_read": len(stored.records)},
            params={**asdict(rule), "correction": rule.corrected_by, "expectations": [e.text for e in expectations]},
            metrics={f"verdicts_{w.replace(' ', '_')}": float(n) for w, n in counts.items()},
        )
    publish(
        "verdicts",
        f"Verdicts on {len(expectations)} expectations ({', '.join(f'{n} {w}' for w, n in counts.items())})",
        summary_rows(decision),
        experiment=params.verdict_experiment if run_id else None,
        tracking_uri=params.tracking_uri,
        mlflow_run_id=run_id,
        output_dir=out,
        paths={k: str(v) for k, v in paths.items()},
    )
    return {
        "verdicts": records(decision)["verdicts"],
        "counts": counts,
        "runs_read": len(stored.records),
        "paths": {k: str(v) for k, v in paths.items()},
        "mlflow_run_id": run_id,
    }


def show(params: VerdictParams, result: dict) -> None:
    rows = [
        {
            "expectation": v["expectation"],
            "pairs": v["pairs"],
            "start models": v["start_models"],
            "mean": v["mean"],
            "verdict": v["verdict"] + (f" ({v['scope']})" if v["scope"] not in (None, "general") else ""),
        }
        for v in result["verdicts"]
    ]
    print(markdown_table(rows, number=lambda x: f"{x:+.3f}", escape=False))
    print_paths(result["paths"])
    if result["mlflow_run_id"]:
        print(f"mlflow run {result['mlflow_run_id']} (experiment {params.verdict_experiment})")


main = flow_main(verdicts, VerdictParams, "verdicts", __doc__, show=show)

if __name__ == "__main__":
    main(sys.argv[1:])
