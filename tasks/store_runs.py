"""Runs read from MLflow stores as the verdict engine sees them (:class:`a5core.verdicts.pairing.RunRecord`).

A store is a tracking URI (``sqlite:///mlflow.db``, ``http://127.0.0.1:5000``), a database file, or a folder:
every ``mlflow.db`` under it (records unpacked from archives: one store per run made side by side). A run held
by several stores (copied) is read once: the copy with more metrics, then the later end. A local store moved from
the machine that made it finds its runs' artifacts beside or above it (:func:`tasks.moved_stores.moved_artifacts`).

What a run ran with is its parameters, less the names ``ignore`` matches (where and how fast it ran, a sweep's
grid: ``fnmatch`` patterns) and less its label, seed and start model, which are fields of their own; where it
started is its provenance record's model hash (:mod:`tasks.provenance`); the model it made is the folder digest
of the files it registered (``file_sha256/*`` parameters, :func:`tasks.fingerprints.digest_of_files`); what it
generated, from a GRPO run's step metrics (rollouts: ``rollout_batch_size`` × ``sampling_draws`` a step; response
tokens: their mean × the rollouts; seconds: ``time_step``).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a5core.runtime.reading import not_a_file_to_read
from a5core.verdicts.pairing import Compute, RunRecord
from tasks.fingerprints import digest_of_files
from tasks.mlflow_store import read_only_uri
from tasks.provenance import ARTIFACT, DamagedRecordError, read_record
from tasks.tables import is_finite

STORE_FILE = "mlflow.db"
# Not what a run ran with, as settings: fields of a RunRecord of their own.
OWN_FIELDS = ("setting", "seed", "model", "model_path")
# Settings that runs made before they were parameters logged as tags.
SETTINGS_ONCE_TAGS = ("compile_layers", "fsdp_reshard_after_forward", "max_tokens_per_microbatch", "engine_device")
REGISTERED_FILES = "file_sha256/"
CURVES = ("val_accuracy", "val_format_rate")  # by step: for plots, endpoints, and a final metric's value at step 0
STEP_COST = ("time_step", "response_tokens_mean", "sampling_draws")  # by step: what a GRPO step generated


@dataclass
class StoredRuns:
    """The runs read (``records``, each with its validation curves), the stores they came from, and the runs that
    could not be read as records, each with why (``left_out``: a damaged provenance record, say)."""

    records: list[RunRecord]
    stores: list[str]
    left_out: list[tuple[RunRecord, str]] = field(default_factory=list)


def store_uris(entries: Sequence[str]) -> list[str]:
    """Tracking URIs for ``entries``: a URI as given, a database file as ``sqlite:///``, a folder as every
    ``mlflow.db`` under it; ValueError naming an entry that is none of these, or no file to read (a FIFO, a
    device, ``/proc``: never opened)."""
    uris = []
    for entry in entries:
        if "://" in entry:
            uris.append(entry)
            continue
        path = Path(entry).expanduser()
        problem = not_a_file_to_read(path) if not path.is_dir() else None
        if problem is not None:
            raise ValueError(f"stores: {entry}: {problem}")
        if path.is_file():
            uris.append(f"sqlite:///{path.resolve()}")
        elif path.is_dir():
            found = sorted(path.rglob(STORE_FILE))
            if not found:
                raise ValueError(f"stores: {entry}: no {STORE_FILE} under this folder")
            uris += [f"sqlite:///{db.resolve()}" for db in found]
        else:
            raise ValueError(f"stores: {entry}: no such file or folder, and not a tracking URI")
    return uris


def read_runs(entries: Sequence[str], ignore: Sequence[str]) -> StoredRuns:
    """Every active run of every store ``entries`` names (:func:`store_uris`), each once; each store read
    read-only (:func:`tasks.mlflow_store.read_only_uri`: a file that is not an MLflow store is refused untouched). A
    run that cannot be read as a record (a damaged provenance record) is left out with why, not fatal to its
    store."""
    uris = store_uris(entries)
    readers = {uri: read_only_uri(uri, "stores") for uri in uris}  # every store checked before any is read
    chosen: dict[str, tuple[tuple, RunRecord]] = {}
    damaged: dict[str, tuple[RunRecord, str]] = {}
    for uri in uris:
        for rank, record, why in _store_runs(uri, readers[uri], ignore):
            if why is not None:
                damaged.setdefault(record.id, (record, why))
            elif record.id not in chosen or rank > chosen[record.id][0]:
                chosen[record.id] = (rank, record)
    records = sorted((r for _, r in chosen.values()), key=lambda r: (r.start_time, r.id))
    left_out = [damaged[rid] for rid in damaged if rid not in chosen]  # a good copy elsewhere is read instead
    return StoredRuns(records, uris, left_out)


def finite_runs(
    records: Sequence[RunRecord], metrics: Sequence[str]
) -> tuple[list[RunRecord], list[tuple[RunRecord, str]]]:
    """The runs whose values of ``metrics`` (final, and at the start where recorded) are numbers a verdict can use,
    and the others with why: a NaN or an infinity (a diverged run, a metric logged as such) turns every mean and
    test over it into NaN, so such a run is left out and named rather than counted (MLflow keeps an infinity as the
    largest float: :func:`tasks.tables.is_finite`)."""
    kept, apart = [], []
    for run in records:
        bad = [
            f"{metric}{where} is {value if math.isnan(value) else '+inf' if value > 0 else '-inf'}"
            for metric in metrics
            for where, value in ((" at the start", run.starts.get(metric)), ("", run.finals.get(metric)))
            if value is not None and not is_finite(value)
        ]
        if bad:
            apart.append((run, f"{'; '.join(bad)}: not a number a verdict can use"))
        else:
            kept.append(run)
    return kept, apart


def _store_runs(uri: str, reader_uri: str, ignore: Sequence[str]) -> list[tuple[tuple, RunRecord, str | None]]:
    import mlflow
    from mlflow.entities import ViewType

    client = mlflow.MlflowClient(tracking_uri=reader_uri)
    experiments = {e.experiment_id: e.name for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)}
    runs: list[Any] = []
    token = None
    while experiments:
        page = client.search_runs(
            list(experiments), run_view_type=ViewType.ACTIVE_ONLY, max_results=1000, page_token=token
        )
        runs += list(page)
        token = page.token
        if not token:
            break
    by_id = {r.info.run_id: r for r in runs}
    found = []
    for run in runs:
        parent = by_id.get(run.data.tags.get("mlflow.parentRunId", ""))
        experiment = experiments.get(run.info.experiment_id, "")
        try:
            curves = {m: _history(client, run.info.run_id, m) for m in CURVES if m in run.data.metrics}
            record = _record(run, parent, experiment, ignore, curves, client, uri)
        except (DamagedRecordError, OSError, RecursionError) as error:  # this run's, not the store's: left out
            why = str(error) if isinstance(error, DamagedRecordError) else f"its files cannot be read ({error})"
            found.append(((), _unread(run, parent, experiment), why))
            continue
        found.append(((len(run.data.metrics), run.info.end_time or 0), record, None))
    return found


def _unread(run: Any, parent: Any, experiment: str) -> RunRecord:
    """A run that could not be read, as the list of runs left out shows it."""
    head = parent or run
    group = head.data.tags.get("ablation") or head.info.run_name or head.info.run_id
    return RunRecord(
        id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:8],
        group=str(group),
        setting=run.data.params.get("setting") or run.info.run_name or run.info.run_id[:8],
        settings={},
        seed=run.data.params.get("seed"),
        origin="",
        finals={},
        experiment=experiment,
        start_time=run.info.start_time or 0,
    )


def _compute(client: Any, run: Any) -> Compute | None:
    """What a GRPO run generated, from its step metrics (the module docstring); None for a run without them."""
    metrics, params = run.data.metrics, run.data.params
    if "time_step" not in metrics or "rollout_batch_size" not in params:
        return None
    try:
        batch = float(params["rollout_batch_size"])
    except ValueError:
        return None
    history = {m: _history(client, run.info.run_id, m) for m in STEP_COST if m in metrics}
    steps = sorted(history["time_step"])
    draws = history.get("sampling_draws", {})
    tokens = history.get("response_tokens_mean", {})
    rollouts, spent, made = 0.0, {}, 0.0
    for step in steps:
        step_rollouts = batch * draws.get(step, 1.0)
        rollouts += step_rollouts
        made += step_rollouts * tokens.get(step, 0.0)
        spent[step] = rollouts
    return Compute(rollouts, made, sum(history["time_step"].values()), spent)


def _history(client: Any, run_id: str, metric: str) -> dict[int, float]:
    points = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
    return {m.step: m.value for m in points}


def _record(
    run: Any, parent: Any, experiment: str, ignore: Sequence[str], curves: dict, client: Any, uri: str
) -> RunRecord:
    params, tags = run.data.params, run.data.tags
    settings = {k: v for k, v in params.items() if k not in OWN_FIELDS and not _matches(k, ignore)}
    settings |= {k: tags[k] for k in SETTINGS_ONCE_TAGS if k in tags and k not in params and not _matches(k, ignore)}
    finals = {k: v for k, v in run.data.metrics.items() if k.startswith("final_")}
    starts = {}
    for key in finals:
        before = curves.get(key.removeprefix("final_"), {})
        if 0 in before:
            starts[key] = before[0]
    head = parent or run
    group = head.data.tags.get("ablation") or head.data.params.get("ablation")
    if group in (None, "", "None"):
        group = head.info.run_name or head.info.run_id
    registered = {k.removeprefix(REGISTERED_FILES): v for k, v in params.items() if k.startswith(REGISTERED_FILES)}
    return RunRecord(
        id=run.info.run_id,
        name=run.info.run_name or run.info.run_id[:8],
        group=group,
        setting=params.get("setting") or run.info.run_name or run.info.run_id[:8],
        settings=settings,
        seed=params.get("seed"),
        origin=_origin(client, run, parent, uri),
        finals=finals,
        starts=starts,
        status=run.info.status,
        flow_status=head.info.status,
        made=f"folder:{digest_of_files(registered)}" if registered else None,
        experiment=experiment,
        start_time=run.info.start_time or 0,
        curves=curves,
        compute=_compute(client, run),
    )


def _origin(client: Any, run: Any, parent: Any, uri: str) -> str:
    """The content hash of the model the run started from (its provenance record's), else its parent run."""
    try:
        inputs = read_record(client, run.info.run_id, uri).get("inputs") or {}
    except DamagedRecordError:
        raise
    except ValueError:  # no record: made before runs recorded their provenance
        inputs = {}
    model = (inputs.get("model") or {}) if isinstance(inputs, dict) else None
    if not isinstance(model, dict):
        raise DamagedRecordError(f"run {run.info.run_id}: its {ARTIFACT} is damaged (its inputs' model is no mapping)")
    if model.get("hash"):
        return str(model["hash"])
    return f"parent run {(parent or run).info.run_id}"


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
