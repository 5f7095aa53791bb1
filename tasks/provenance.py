"""A run's provenance record: what it takes to run it again and to say whether it is the same run.

Every training flow's top run and child runs hold the artifact ``provenance.json`` (:func:`log_provenance`,
called where a run logs its parameters):

- ``flow``: the Prefect flow that made the run (name and ``module:function`` entrypoint, the module by the name
  it is imported by: ``flows.grpo:grpo_flow`` for a run started with ``python -m flows.grpo``, not ``__main__``);
- ``settings``: every setting of the flow's parameter model as the run resolved it (defaults, ``params.yaml``
  and its profile, flags), ``explicit``: those given rather than defaulted, ``defaults``: each setting's
  default then, and ``seeds`` (the settings named ``*seed*``);
- ``inputs``: each setting that names what the run reads (:data:`a5core.runtime.settings.READS`: data, prompt
  template, difficulty table, the model) and names a file that exists, or a model folder, with its content
  hash: ``sha256:`` of a file's bytes, ``folder:`` over a model folder's files (:mod:`tasks.fingerprints`), a
  hub model by the revision the local cache holds; beside it ``dvc_md5`` where ``dvc.lock`` lists that file
  (DVC's own hash of it when it was last committed). Checks compare the content hash, which is the bytes there
  now. No other setting is read as a path, and a folder is hashed only as a model's (it holds ``config.json``);
- ``code``: the git commit, whether tracked files had uncommitted changes and the sha256 of that diff (logged as
  ``git_diff.patch`` when there is one);
- ``versions`` (Python, the project, torch, transformers, vLLM and the others :func:`tasks.run_tags.versions`
  lists) and ``device``; ``cwd``, which relative paths in the settings are relative to.

:func:`differences` compares a record with the checkout, data and environment here, naming each difference;
``flows.reproduce`` refuses to re-run while there are any (unless told to go on) and ``flows.compare`` puts
two runs' records side by side (:func:`record_rows`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined, to_jsonable_python

from a5core.runtime.reading import check_file_to_read, read_text_capped
from a5core.runtime.settings import Settings, read_settings
from tasks.fingerprints import file_digest, model_fingerprint
from tasks.git_checkout import PROJECT_ROOT, git
from tasks.mlflow_store import sqlite_database
from tasks.moved_stores import archive_top, moved_artifacts
from tasks.prefect_run import importable_module, prefect_flow_run
from tasks.run_tags import device_name, versions

ARTIFACT = "provenance.json"
DIFF_ARTIFACT = "git_diff.patch"


def _jsonable(value: Any) -> Any:
    return to_jsonable_python(value, fallback=str)


def git_state() -> dict[str, Any]:
    """The commit checked out, whether tracked files (dvc.lock aside) differ from it, and the diff (not recorded)."""
    commit = git("rev-parse", "HEAD")
    diff = (git("diff", "HEAD", "--", ".", ":(exclude)dvc.lock") or "") if commit else ""  # as run_tags's git.dirty
    return {
        "commit": commit,
        "dirty": bool(diff),
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
        "diff": diff,
    }


def _dvc_md5s() -> dict[str, str]:
    """The md5 of each single file ``dvc.lock`` lists (a stage's dependency or output), by its resolved path."""
    import yaml

    lock = PROJECT_ROOT / "dvc.lock"
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return {}
    found = {}
    for stage in stages.values():
        for entry in [*(stage.get("deps") or []), *(stage.get("outs") or [])]:
            md5 = str(entry.get("md5", ""))
            if md5 and not md5.endswith(".dir"):
                found[str((PROJECT_ROOT / entry["path"]).resolve())] = md5
    return found


def content_hash(setting: str, value: str) -> str | None:
    """The content hash of what input setting ``setting`` names: a file's bytes; for the model, a model folder's
    files (one holding ``config.json``: any other folder, ``/`` say, is no model and is not read) or a hub id's
    revision. None when it names neither here; ValueError for no file to read (a FIFO, a device, the system's
    ``/proc``), which is never hashed."""
    path = Path(value).expanduser()
    if not path.is_dir():
        check_file_to_read(path, setting)
    if setting == "model":
        return None if path.is_dir() and not (path / "config.json").is_file() else model_fingerprint(value)
    return f"sha256:{file_digest(path)}" if path.is_file() else None


def inputs(params: Settings) -> dict[str, dict[str, str]]:
    """Each input setting of ``params`` (:func:`a5core.runtime.settings.read_settings`) naming an existing file
    (or the model): path and content hash, and DVC's md5 where ``dvc.lock`` lists the file."""
    dvc = None
    found: dict[str, dict[str, str]] = {}
    for setting in read_settings(type(params)):
        value = getattr(params, setting)
        if not isinstance(value, str) or not value:
            continue
        digest = content_hash(setting, value)
        if digest is None:
            continue
        entry = {"path": value, "hash": digest}
        if digest.startswith("sha256:"):
            dvc = _dvc_md5s() if dvc is None else dvc
            md5 = dvc.get(str(Path(value).expanduser().resolve()))
            if md5:
                entry["dvc_md5"] = md5
        found[setting] = entry
    return found


def field_defaults(model: type[Settings]) -> dict[str, Any]:
    """Each field's default (JSON values), leaving out fields without one."""
    found = {}
    for name, field in model.flat_fields().items():
        default = field.get_default(call_default_factory=True)
        if default is not PydanticUndefined:
            found[name] = _jsonable(default)
    return found


# The flow a run is recorded as made by, where that is not the flow run it runs in: a sweep's child fanned out to
# a Ray worker runs in the fan-out's sub-flow, which cannot be re-run; its record names the flow that fanned it out.
_MADE_BY: ContextVar[dict[str, str] | None] = ContextVar("made_by", default=None)


@contextmanager
def recorded_as_made_by(flow: dict[str, str]) -> Iterator[None]:
    """While open, records name ``flow`` (:func:`tasks.prefect_run.prefect_flow_run` of the flow that started the
    work) as the flow that made their runs."""
    token = _MADE_BY.set(flow)
    try:
        yield
    finally:
        _MADE_BY.reset(token)


def build_record(params: Settings, code: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of a run of ``params`` in the present flow run (see the module docstring);
    ``code``: :func:`git_state`, where the caller has it already."""
    flow, code = _MADE_BY.get() or prefect_flow_run(), code or git_state()
    settings = params.flat(mode="json")
    return {
        "flow": {"name": flow.get("flow"), "entrypoint": flow.get("entrypoint")},
        "params_model": f"{importable_module(type(params).__module__)}.{type(params).__qualname__}",
        "settings": settings,
        "explicit": sorted(params.explicit()),
        "defaults": field_defaults(type(params)),
        "seeds": {k: v for k, v in settings.items() if "seed" in k},
        "inputs": inputs(params),
        "code": {k: v for k, v in code.items() if k != "diff"},
        "versions": versions(),
        "device": device_name(),
        "cwd": os.getcwd(),
    }


def log_provenance(params: Settings) -> dict[str, Any]:
    """Log :func:`build_record` as ``provenance.json`` into the active MLflow run (and the diff as
    ``git_diff.patch`` when tracked files have uncommitted changes); returns the record."""
    import mlflow

    code = git_state()
    record = build_record(params, code)
    mlflow.log_dict(record, ARTIFACT)
    if code["dirty"]:
        mlflow.log_text(code["diff"], DIFF_ARTIFACT)
    return record


def _no_record(run_id: str, tracking_uri: str) -> str:
    return (
        f"run {run_id} in {tracking_uri} holds no {ARTIFACT}: it was made by a flow or a version of the "
        "project that does not record its provenance, so there is nothing to re-run it from"
    )


# The largest record read (a record is a few kB: every setting of a flow, a few hashes and versions).
MAX_RECORD_BYTES = 10_000_000


class DamagedRecordError(ValueError):
    """A run's provenance record that cannot be read as one: not a file to read, too large, not UTF-8 JSON, nested
    too deeply, or not a JSON object. The message names the run and what is wrong."""


def parsed_record(text: str, run_id: str) -> dict[str, Any]:
    """A record's text as its JSON object; :class:`DamagedRecordError` naming the run otherwise."""
    damaged = f"run {run_id}: its {ARTIFACT} is damaged"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise DamagedRecordError(f"{damaged} (not a JSON document: {error})") from None
    except RecursionError:
        raise DamagedRecordError(f"{damaged} (JSON nested too deeply to read)") from None
    if not isinstance(record, dict):
        raise DamagedRecordError(f"{damaged} (a JSON {type(record).__name__}, not an object)")
    return record


def _record_text(path: Path, run_id: str) -> str:
    try:
        return read_text_capped(path, "the file", MAX_RECORD_BYTES)
    except ValueError as error:
        raise DamagedRecordError(f"run {run_id}: its {ARTIFACT} is damaged ({error})") from None


def read_record(client: Any, run_id: str, tracking_uri: str) -> dict[str, Any]:
    """The provenance record run ``run_id`` holds; ValueError naming the run when the store has no such run
    or the run holds no record, :class:`DamagedRecordError` when it holds one that cannot be read as a record (a
    FIFO or a link into ``/proc`` is never opened, a file of more than :data:`MAX_RECORD_BYTES` never read)."""
    import tempfile

    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise ValueError(f"no run {run_id!r} in {tracking_uri}") from None
    if sqlite_database(tracking_uri) is not None:  # a local store, perhaps unpacked from an archive elsewhere
        folder = moved_artifacts(tracking_uri, run.info.artifact_uri)
        if folder is None:  # a moved or packed store whose run's files did not come with it
            raise ValueError(
                f"run {run_id} in {tracking_uri} holds no {ARTIFACT} here: no file of the run is at "
                f"{run.info.artifact_uri}, where it was made, nor in an mlruns/ folder under "
                f"{archive_top(sqlite_database(tracking_uri))}. Either it logged none (a flow or a version of the "
                "project that records nothing), or its store was moved or packed without the run's files: bring the "
                "mlruns/ folder that holds them beside the store"
            )
        if not (folder / ARTIFACT).exists():
            raise ValueError(_no_record(run_id, tracking_uri))
        return parsed_record(_record_text(folder / ARTIFACT, run_id), run_id)
    if ARTIFACT not in {a.path for a in client.list_artifacts(run_id)}:
        raise ValueError(_no_record(run_id, tracking_uri))
    with tempfile.TemporaryDirectory() as folder:
        return parsed_record(_record_text(Path(client.download_artifacts(run_id, ARTIFACT, folder)), run_id), run_id)


# ------------------------------------------------------------------------------- checking the present


def _short(value: str | None) -> str:
    return "none" if value is None else value[:19] if value.startswith(("sha256:", "folder-")) else value


def code_differences(record: dict[str, Any]) -> list[str]:
    then, now = record.get("code") or {}, git_state()
    found = []
    if then.get("commit") != now["commit"]:
        found.append(f"code: the run was made at commit {then.get('commit')}, the checkout is at {now['commit']}")
    if then.get("diff_sha256") != now["diff_sha256"]:
        had = f"uncommitted changes ({DIFF_ARTIFACT} of the run)" if then.get("dirty") else "no uncommitted changes"
        has = "other uncommitted changes" if now["dirty"] else "none"
        found.append(f"code: the run had {had}; the checkout has {has}")
    return found


def input_differences(record: dict[str, Any], params: Settings) -> list[str]:
    """Each input of ``params`` (the re-run's settings: :func:`inputs`, never a path the record names) whose
    contents differ from what the record says the run read, or that is missing; a relative path is read from the
    working directory here, so one missing for another working directory says where the run ran."""
    found = []
    elsewhere = f" here; the run ran in {record['cwd']}" if record.get("cwd", os.getcwd()) != os.getcwd() else ""
    now = inputs(params)
    for setting, entry in (record.get("inputs") or {}).items():
        value = getattr(params, setting, None) if setting in read_settings(type(params)) else None
        if setting not in now:
            shown = entry["path"] if value is None else value
            found.append(f"data: {setting} {shown}: missing{elsewhere} (the run read {_short(entry['hash'])})")
        elif now[setting]["hash"] != entry["hash"]:
            found.append(
                f"data: {setting} {value}: its contents differ from the run's "
                f"({_short(entry['hash'])} then, {_short(now[setting]['hash'])} now)"
            )
    return found


def setting_differences(record: dict[str, Any], model: type[Settings]) -> list[str]:
    """Settings the flow no longer has, settings it has that the run did not, and defaults that changed for
    settings the run left to their default (the run is replayed with its recorded values either way)."""
    settings, explicit = record["settings"], set(record.get("explicit") or [])
    known = model.flat_fields()
    found = [f"setting {k}: recorded, but the flow has no such setting now" for k in settings if k not in known]
    found += [f"setting {k}: new since the run (the run had none)" for k in known if k not in settings]
    then, now = record.get("defaults") or {}, field_defaults(model)
    for name in sorted(set(then) & set(now) - explicit):
        if then[name] != now[name]:
            found.append(
                f"setting {name}: its default was {then[name]!r} when the run was made, is {now[name]!r} now "
                f"(the run used {settings.get(name)!r})"
            )
    return found


def environment_differences(record: dict[str, Any]) -> list[str]:
    then, now = record.get("versions") or {}, versions()
    found = [
        f"versions: {name} {then.get(name, 'not installed')} then, {now.get(name, 'not installed')} now"
        for name in sorted(set(then) | set(now))
        if then.get(name) != now.get(name)
    ]
    if record.get("device") != device_name():
        found.append(f"device: {record.get('device')} then, {device_name()} now")
    return found


def differences(record: dict[str, Any], params: Settings) -> list[str]:
    """Everything recorded that is not the same here for a re-run with ``params``: code, data, settings, versions
    and device."""
    return [
        *code_differences(record),
        *input_differences(record, params),
        *setting_differences(record, type(params)),
        *environment_differences(record),
    ]


# ------------------------------------------------------------------------------------ side by side


def flatten(record: dict[str, Any]) -> dict[str, str]:
    """A record as ``section.key → value`` strings, the parts that say what ran: code, inputs' hashes,
    settings, versions and device; ValueError for a damaged record (a section of the wrong kind)."""
    sections = [record.get(s) if isinstance(record, dict) else None for s in ("code", "inputs", "settings", "versions")]
    inputs = (sections[1] or {}).values() if isinstance(sections[1], dict) else []
    if (
        not isinstance(record, dict)
        or any(not isinstance(s or {}, dict) for s in sections)
        or any(not isinstance(item, dict) or not {"path", "hash"} <= set(item) for item in inputs)
    ):
        raise ValueError("a damaged record")
    flat = {f"code.{k}": str(v) for k, v in (record.get("code") or {}).items()}
    flat.update({f"data.{k}": f"{v['path']} {_short(v['hash'])}" for k, v in (record.get("inputs") or {}).items()})
    flat.update({f"setting.{k}": json.dumps(v) for k, v in (record.get("settings") or {}).items()})
    flat.update({f"versions.{k}": str(v) for k, v in (record.get("versions") or {}).items()})
    flat["device"] = str(record.get("device"))
    return flat


def record_rows(labels: list[str], records: list[dict[str, Any] | None]) -> list[dict[str, str]]:
    """The entries that differ between runs' records, one row each (``what`` and a column a run); a run
    without a record shows ``(no record)``, one whose record is damaged ``(damaged record)``."""
    flats: list[dict[str, str] | str] = []
    for record in records:
        try:
            flats.append(flatten(record) if record is not None else "(no record)")
        except ValueError:
            flats.append("(damaged record)")
    keys = sorted({k for f in flats if isinstance(f, dict) for k in f})
    rows = []
    for key in keys:
        values = [f.get(key, "") if isinstance(f, dict) else f for f in flats]
        if len(set(values)) > 1:
            rows.append({"what": key, **dict(zip(labels, values, strict=True))})
    return rows
