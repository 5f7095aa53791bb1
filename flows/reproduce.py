"""Flow ``reproduce``: run an MLflow run again from its provenance record and put the metrics side by side.

The run's ``provenance.json`` (:mod:`tasks.provenance`) names the flow that made it and every setting it
resolved. Before anything runs, the present is checked against the record: the git commit and uncommitted
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

import argparse
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
from pydantic import Field, StrictBool

from flows.cli import cli_main, run_flow
from flows.params import TrackingStore
from tasks.provenance import differences, read_record
from tasks.tables import markdown_table
from tasks.tracking import store_client

# Metrics that time the run: shown, never judged.
TIMING = re.compile(r"(^time_|seconds|_per_s$)")


class ReproduceParams(TrackingStore):
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


def flow_of(record: dict[str, Any]) -> tuple[Any, type]:
    """The Prefect flow a record names and its parameter model; ValueError when it names none here. A record
    naming ``__main__:<function>`` is resolved to the one flow module here with that flow (:func:`main_module`)."""
    entrypoint = (record.get("flow") or {}).get("entrypoint")
    if not entrypoint:
        raise ValueError("the run's provenance names no flow (it ran outside a Prefect flow run): nothing to re-run")
    module, _, name = entrypoint.partition(":")
    if module == "__main__":
        module = main_module(entrypoint, (record.get("flow") or {}).get("name"))
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise ValueError(f"the run was made by flow {entrypoint}, which the code here does not have") from None
    (parameter,) = found.parameters.properties  # a flow takes one pydantic parameter model
    return found, typing.get_type_hints(found.fn)[parameter]


def replay_params(record: dict[str, Any], model: type, output_dir: str | None, run_id: str, tracking_uri: str) -> Any:
    """The recorded settings as ``model``, outputs in a new folder, logged to ``tracking_uri`` (not the store the
    record names, which is where the run was made: another machine's, for an archived run), no DVC metrics file."""
    settings = {k: v for k, v in record["settings"].items() if k in model.model_fields}
    settings["tracking_uri"] = tracking_uri
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    settings["output_dir"] = output_dir or str(Path(settings["output_dir"]) / f"reproduce-{run_id[:8]}-{stamp}")
    if "metrics_path" in settings:
        settings["metrics_path"] = None
    try:
        return model.model_validate(settings)
    except ValueError as error:
        raise ValueError(f"the run's recorded settings are not valid settings of the flow now: {error}") from None


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
    client = store_client(params.tracking_uri)
    record = read_record(client, params.run_id, params.tracking_uri)
    target, model = flow_of(record)
    found = differences(record, model)
    if found and not params.allow_differences:
        raise DifferencesError(
            f"run {params.run_id} was made under other conditions than these; not re-running it "
            "(--allow-differences re-runs it anyway):\n  " + "\n  ".join(found)
        )
    replay = replay_params(record, model, params.output_dir, params.run_id, params.into or params.tracking_uri)
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):  # computed again, not read from a cache
        result = target(replay)
    original = client.get_run(params.run_id)
    new_client = store_client(replay.tracking_uri)
    new_top = new_client.get_run(result["mlflow_run_id"])
    if "mlflow.parentRunId" in original.data.tags:  # a child run: match it among the new flow's runs
        originals = {original.info.run_name: original}
    else:
        originals = run_tree(client, original)
    news = run_tree(new_client, new_top)
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
    print(markdown_table(result["rows"], columns, number=lambda value: f"{value:.6g}", width=40))
    outcome = "exactly" if result["exact"] else "within noise" if result["reproduced"] else "NOT"
    print(f"reproduced {outcome}: run {result['mlflow_run_id']} (tag reproduces={result['reproduces']})")
    print(f"outputs  {result['output_dir']}")


@cli_main("flows.reproduce")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
