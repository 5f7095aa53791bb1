"""Flow ``reproduce``: run an MLflow run again from its provenance record and put the metrics side by side.

The run's ``provenance.json`` (:mod:`tasks.provenance`) names the flow that made it and every setting it
resolved. A record is data, never code: it is checked field by field (a damaged one is named), the flow it
names must be one of this project's own flows (looked up by name, nothing else is imported), and the
re-run's outputs go inside the project or into a folder a5 made (its marker), never where a record points
otherwise. Before anything runs, the present is checked against the record: the git commit and uncommitted
changes, the content of each data file and model folder the run read, the flow's settings (one removed or
added, a default changed for a setting the run left to its default) and the versions and device. Any
difference is named and the flow stops, unless ``--allow-differences``. Then the same flow runs with the
recorded settings (cached tasks, such as an evaluation's generations, computed again rather than read
back), its outputs in a folder of their own (``<output_dir>/reproduce-<run id>-<time>``, no DVC
metrics file), as a new MLflow run in the same experiment, tagged ``reproduces=<original run id>`` (each child
run too, matched by name). Last, the metrics side by side, for the run and each of its child runs: the
original's final value, the reproduction's, the difference, and whether it is ``exact``, ``within noise``
(within two of the run's own standard errors, ``<metric>_se``, where it logged one) or ``differs``; a metric
logged at several steps is compared at every step (``curve``: the largest difference). Timings are shown
but not judged. A seeded run on the same kind of device with the same versions reproduces exactly.

    python -m flows.reproduce --run-id 3f2a...
    python -m flows.reproduce --run-id 3f2a... --allow-differences     # re-run whatever differs

Exit status 0 when every metric is exact or within noise, 1 when the run could not be re-run (what differs
is named) or a metric differs beyond its noise.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import Flow, flow
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings
from pydantic import BaseModel, Field, StrictBool, ValidationError

from a5core.runtime.settings import Settings, describe
from flows.arguments import argument_parser
from flows.cli import cli_main, run_flow
from flows.params import TrackingUri
from flows.served import check_served_reads, served_databases
from tasks.mlflow_store import DEFAULT_TRACKING_URI, reading_client, store_client
from tasks.outputs import OUTPUT_MARKER
from tasks.provenance import ARTIFACT, DamagedRecordError, differences, read_record
from tasks.tables import markdown_table

# Metrics that time the run: shown, never judged.
TIMING = re.compile(r"(^time_|seconds|_per_s$)")


class ReproduceParams(Settings):
    tracking_uri: TrackingUri = DEFAULT_TRACKING_URI
    run_id: str = Field(description="the MLflow run to reproduce (a flow's top run or one of its child runs)")
    allow_differences: StrictBool = Field(
        False, description="re-run even where the code, data, settings or versions differ from the record"
    )
    output_dir: str | None = Field(
        None, description="where the re-run's outputs go (None: <the run's output_dir>/reproduce-<run id>-<time>)"
    )
    into: str | None = Field(
        None,
        description="the MLflow store the re-run is logged to (None: the run's own, --tracking-uri); for a store "
        "unpacked from an archive, whose experiments keep their artifacts where the store was made",
    )


class DifferencesError(ValueError):
    """The present differs from a run's record; the message names each difference."""


def flow_modules(function: str, flow_name: str | None) -> list[str]:
    """The modules of the ``flows`` package here that define a Prefect flow whose function is ``function``
    (named ``flow_name``, when that is given); only modules whose source mentions ``function`` are imported."""
    import flows

    word = re.compile(rf"\b{re.escape(function)}\b")
    found = []
    for path in sorted(Path(flows.__file__).parent.glob("*.py")):
        if not word.search(path.read_text(encoding="utf-8", errors="replace")):
            continue
        module = importlib.import_module(f"flows.{path.stem}" if path.stem != "__init__" else "flows")
        candidate = getattr(module, function, None)
        if (
            isinstance(candidate, Flow)
            and candidate.fn.__name__ == function
            and candidate.fn.__module__ == module.__name__  # defined there, not imported
            and flow_name in (None, candidate.name)
        ):
            found.append(module.__name__)
    return found


def main_module(entrypoint: str, flow_name: str | None) -> str:
    """The module of the flows package that made a run whose record names its flow ``__main__:<function>`` (a
    flow started as a command, recorded before records named the module it ran): the one module with that flow;
    ValueError, saying what to do, when there is none or more than one."""
    function = entrypoint.partition(":")[2]
    found = flow_modules(function, flow_name)
    if len(found) == 1:
        return found[0]
    which = (
        f"several modules here have a flow {function}: {', '.join(found)}"
        if found
        else f"no module of the flows package here has a flow {function}" + (f" named {flow_name}" if flow_name else "")
    )
    raise ValueError(
        f"the run was made by flow {entrypoint}, a flow started as a command whose module was not recorded, and "
        f"{which}; it cannot be re-run from its record. Start the flow again with `python -m flows.<module> ...` "
        "(its runs record the module) and reproduce that run"
    )


class RecordedFlow(BaseModel):
    name: str | None = None
    entrypoint: str | None = None


class RecordedInput(BaseModel):
    path: str
    hash: str
    dvc_md5: str | None = None


class Record(BaseModel):
    """What :func:`tasks.provenance.build_record` writes, as reproducing reads it: every field's type."""

    flow: RecordedFlow
    settings: dict[str, Any]
    explicit: list[str] = []
    defaults: dict[str, Any] = {}
    inputs: dict[str, RecordedInput] = {}
    code: dict[str, str | bool | None] = {}
    versions: dict[str, str | None] = {}
    device: str | None = None
    cwd: str | None = None


def checked_record(client: Any, run_id: str, tracking_uri: str) -> dict[str, Any]:
    """Run ``run_id``'s provenance record, every field of the type it is written with; ValueError naming the
    run's ``provenance.json`` and what is wrong with it when it cannot be read (truncated, not JSON) or a
    field is missing or of another type."""
    damaged = f"run {run_id}: its {ARTIFACT} is damaged"
    try:
        record = read_record(client, run_id, tracking_uri)
    except DamagedRecordError as error:
        raise ValueError(f"{error}; it cannot be re-run from it") from None
    try:
        Record.model_validate(record)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the record"
        raise ValueError(f"{damaged} ({where}: {first['msg']}); it cannot be re-run from it") from None
    return record


# The flows whose runs hold a provenance record (tasks.provenance.log_provenance), by flow name, and the GRPO
# ablations' (flows.ablations.ABLATIONS): the only flows a record may re-run. Any other (this one, compare, report,
# the data flows) makes no run a record could name.
RECORDING_FLOWS = ("baseline_eval", "difficulty", "sft_experiment", "expert_iteration", "grpo", "leaderboard")
# The sub-flow a sweep's children ran in on Ray (flows.fanout), which records once named: it runs no child alone.
FAN_OUT = "flows.fanout:fan_out"


def project_flows() -> dict[str, Any]:
    """This project's flows whose runs hold records (:data:`RECORDING_FLOWS` and the GRPO ablations), by the
    entrypoint a record names them with (``flows.grpo:grpo_flow``): the allow-list of what a record may run."""
    from flows.ablations import ABLATIONS
    from flows.serve import discover_flows

    return {
        f"{f.fn.__module__}:{f.fn.__name__}": f
        for name, f in discover_flows().items()
        if name in RECORDING_FLOWS or name in ABLATIONS
    }


def parameter_model(flow: Any) -> type:
    (parameter,) = flow.parameters.properties  # a flow takes one pydantic parameter model
    return typing.get_type_hints(flow.fn)[parameter]


def child_flow(record: dict[str, Any]) -> Any:
    """The flow that runs one child of a sweep recorded with ``record``: the recording flow of the record's
    parameter model that is no ablation (GRPOParams: ``grpo``, one run; EIParams: ``expert_iteration``);
    ValueError saying why when there is none."""
    from flows.ablations import ABLATIONS

    wanted = record.get("params_model")
    found = [
        f
        for f in project_flows().values()
        if f.name not in ABLATIONS and f"{parameter_model(f).__module__}.{parameter_model(f).__qualname__}" == wanted
    ]
    if len(found) != 1:
        raise ValueError(
            "the run is a child of a sweep run on Ray, and its record names no parameter model of a flow here "
            f"({str(wanted)[:200]!r}): which flow ran it cannot be told, so it cannot be re-run from its record"
        )
    return found[0]


def flow_of(record: dict[str, Any], child: bool) -> tuple[Any, type]:
    """The Prefect flow to re-run a record with, one of this project's that record their runs
    (:func:`project_flows`), and its parameter model; ValueError, before anything the record names is imported,
    when it names no such flow. A record naming ``__main__:<function>`` is resolved to the one flow module here
    with that flow (:func:`main_module`). A ``child`` run (of a sweep or an ablation, its settings those of one
    run) is re-run alone, with the flow of one child (:func:`child_flow`), whichever flow fanned it out."""
    entrypoint = record["flow"].get("entrypoint")
    if not entrypoint:
        raise ValueError("the run's provenance names no flow (it ran outside a Prefect flow run): nothing to re-run")
    module, _, name = entrypoint.partition(":")
    if module == "__main__":
        module = main_module(entrypoint, record["flow"].get("name"))
    found = project_flows().get(f"{module}:{name}")
    if found is None and entrypoint != FAN_OUT:
        raise ValueError(
            f"the run's record names flow {entrypoint[:200]!r}, which is not one of this project's flows that "
            "record their runs; a record is re-run only with one of them (such as flows.grpo:grpo_flow), never with "
            "other code"
        )
    if child or found is None:
        found = child_flow(record)
    return found, parameter_model(found)


# Where a run connected: never taken from a record (a re-run's store is --into or the one read; a Ray cluster's
# address, the local instance's default).
CONNECTIONS = ("tracking_uri", "ray_address")


def replay_params(record: dict[str, Any], model: type, params: ReproduceParams) -> Any:
    """The recorded settings as ``model`` (the run's own settings only; none of :data:`CONNECTIONS`): outputs in
    a new folder (``params.output_dir``, else one inside the run's recorded output folder:
    :func:`recorded_output_dir`) with any output file in it, no DVC metrics file, and MLflow runs into
    ``params.into``, else the store the record was read from (not the store the record names, which is where the
    run was made: another machine's, for an archived run)."""
    known = model.flat_fields()
    settings = {k: v for k, v in record["settings"].items() if k in known and k not in CONNECTIONS}
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    folder = params.output_dir or str(recorded_output_dir(settings) / f"reproduce-{params.run_id[:8]}-{stamp}")
    settings["output_dir"] = folder
    if "metrics_path" in settings:
        settings["metrics_path"] = None
    if "table" in settings:  # the difficulty flow's table
        settings["table"] = str(Path(folder) / Path(str(settings["table"])).name)
    settings["tracking_uri"] = params.into or params.tracking_uri
    try:
        return model.model_validate(settings)
    except ValidationError as error:
        raise ValueError(
            f"the run's recorded settings are not valid settings of the flow now: {describe(error)}"
        ) from None


def recorded_output_dir(settings: dict[str, Any]) -> Path:
    """The run's recorded ``output_dir``, which must be inside the project (the working directory) or a folder
    a5 made (its marker: the run's own folder); ValueError saying to give ``--output-dir`` otherwise."""
    recorded = settings.get("output_dir")
    folder = Path(str(recorded)).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"the run's record puts its outputs in {str(recorded)[:200]!r}, a file, not a folder; give the re-run's "
            "folder with --output-dir"
        )
    inside = isinstance(recorded, str) and Path.cwd() in (folder.resolve(), *folder.resolve().parents)
    if not (inside or (folder / OUTPUT_MARKER).is_file()):
        raise ValueError(
            f"the run's record puts its outputs in {str(recorded)[:200]!r}, which is neither inside this project "
            "nor a folder a5 made; give the re-run's folder with --output-dir"
        )
    return folder


def run_tree(client: Any, run: Any) -> dict[str, Any]:
    """A run and its child runs, by run name."""
    children = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run.info.run_id}'"
    )
    return {r.info.run_name: r for r in [run, *children]}


def verdict(metric: str, difference: float, curve_difference: float, se: float | None) -> str:
    if TIMING.search(metric):
        return "timing"
    if difference == 0 and curve_difference == 0:
        return "exact"
    if se is not None and math.isfinite(se) and max(abs(difference), curve_difference) <= 2 * se:
        return "within noise"
    return "differs"


def metric_rows(client: Any, name: str, original: Any, new: Any, new_client: Any) -> list[dict[str, Any]]:
    """One row per metric of ``original`` (in ``client``'s store; system metrics left out) against ``new`` (in
    ``new_client``'s): final values, difference, verdict, and for a metric logged at several steps the largest
    difference at any step both logged."""
    rows = []
    for metric in sorted(m for m in original.data.metrics if not m.startswith("system/")):
        then, now = original.data.metrics[metric], new.data.metrics.get(metric)
        if now is None:
            rows.append({"run": name, "metric": metric, "original": then, "verdict": "missing"})
            continue
        old_curve = {m.step: m.value for m in client.get_metric_history(original.info.run_id, metric)}
        new_curve = {m.step: m.value for m in new_client.get_metric_history(new.info.run_id, metric)}
        steps = sorted(set(old_curve) & set(new_curve))
        curve = max((abs(new_curve[s] - old_curve[s]) for s in steps), default=0.0)
        if set(old_curve) != set(new_curve):
            curve = math.inf
        difference = now - then
        se = original.data.metrics.get(f"{metric}_se")
        rows.append(
            {
                "run": name,
                "metric": metric,
                "original": then,
                "reproduced": now,
                "difference": difference,
                "curve": f"{len(old_curve)} steps, max |diff| {curve:.3g}" if len(old_curve) > 1 else "",
                "verdict": verdict(metric, difference, curve, se),
            }
        )
    return rows


@flow(name="reproduce")
def reproduce(params: ReproduceParams) -> dict:
    """Check the present against a run's provenance record, run its flow again with the recorded settings as a
    new MLflow run tagged ``reproduces``, and compare the metrics."""
    check_served_reads({"tracking_uri": served_databases([params.tracking_uri])})
    client = reading_client(params.tracking_uri)  # read-only: the record's store is never written to
    record = checked_record(client, params.run_id, params.tracking_uri)
    original = client.get_run(params.run_id)
    child = "mlflow.parentRunId" in original.data.tags
    target, model = flow_of(record, child)
    replay = replay_params(record, model, params)
    found = differences(record, replay)
    if found and not params.allow_differences:
        raise DifferencesError(
            f"run {params.run_id} was made under other conditions than these; not re-running it "
            "(--allow-differences re-runs it anyway):\n  " + "\n  ".join(found)
        )
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):  # computed again, not read from a cache
        result = target(replay)
    new_client = store_client(replay.tracking_uri)
    new_top = new_client.get_run(result["mlflow_run_id"])
    news = run_tree(new_client, new_top)
    originals = {original.info.run_name: original} if child else run_tree(client, original)
    alone = [name for name, run in news.items() if run is not new_top]
    if child and original.info.run_name not in news and len(alone) == 1:  # re-run alone: its flow names it anew
        news = {original.info.run_name: news[alone[0]]}
    rows, pairs = [], {}
    for name, run in originals.items():
        if name in news:
            new_client.set_tag(news[name].info.run_id, "reproduces", run.info.run_id)
            pairs[name] = news[name].info.run_id
            rows += metric_rows(client, name, run, new_client.get_run(news[name].info.run_id), new_client)
        else:
            rows.append({"run": name, "metric": "(the whole run)", "verdict": "missing"})
    judged = [r["verdict"] for r in rows if r["verdict"] != "timing"]
    return {
        "rows": rows,
        "differences": found,
        "runs": pairs,
        "mlflow_run_id": new_top.info.run_id,
        "reproduces": params.run_id,
        "exact": all(v == "exact" for v in judged),
        "reproduced": all(v in ("exact", "within noise") for v in judged),
        "output_dir": replay.output_dir,
    }


def show(result: dict) -> None:
    if result["differences"]:
        print("re-run despite these differences:\n  " + "\n  ".join(result["differences"]))
    columns = ["run", "metric", "original", "reproduced", "difference", "curve", "verdict"]
    print(markdown_table(result["rows"], columns, number=lambda value: f"{value:.6g}", width=40, escape=False))
    outcome = "exactly" if result["exact"] else "within noise" if result["reproduced"] else "NOT"
    print(f"reproduced {outcome}: run {result['mlflow_run_id']} (tag reproduces={result['reproduces']})")
    print(f"outputs  {result['output_dir']}")


@cli_main("flows.reproduce")
def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--run-id", required=True, help=ReproduceParams.model_fields["run_id"].description)
    parser.add_argument("--tracking-uri", default=ReproduceParams.model_fields["tracking_uri"].default)
    parser.add_argument(
        "--allow-differences", action="store_true", help=ReproduceParams.model_fields["allow_differences"].description
    )
    parser.add_argument("--output-dir", help=ReproduceParams.model_fields["output_dir"].description)
    parser.add_argument("--into", help=ReproduceParams.model_fields["into"].description)
    params = ReproduceParams(**vars(parser.parse_args(argv)))
    result = run_flow(reproduce, params)
    if result is not None:
        show(result)
        if not result["reproduced"]:
            raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
