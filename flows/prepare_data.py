"""Stage ``prepare_data``: check every data file params.yaml points at, validate the datasets, record them.

The first stage of the pipeline, run on every ``dvc repro`` (``always_changed``: it reads the data, a
few seconds). Before any other stage starts it finds every setting, in every stage's section with the
selected profile's overrides, whose value is a local data file the pipeline does not make itself
(``../shared/data/math/validation.jsonl``; not ``data/sft/…``, which a stage writes, nor a generated
``arithmetic:N:DIGITS`` task, nor a hub dataset id), and stops with one message naming each missing
file, the params.yaml keys that point at it and the two ways to fix it. Then it validates every dataset
of params.yaml's ``data`` section (a DataError names file and line) and writes a manifest: records and
sha256 of each ``data`` entry, and the sha256 of every other file a stage reads. The later stages depend
on the manifest, so a changed dataset re-runs them, and an unchanged one leaves them cached.

    python -m flows.prepare_data --params params.yaml --out data/prepared/manifest.json

It is also the Prefect flow ``prepare_data`` (a deployment of ``python -m flows.serve``). The command line
runs it as a Prefect flow run when ``PREFECT_API_URL`` names a server (the run, its logs and its summary
artifact show there); without one it runs plain, as ``dvc repro`` does on every call, without the
temporary Prefect server (20 s) that a flow run would start.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml
from prefect import flow
from pydantic import BaseModel, ConfigDict, Field, field_validator

from a5core.data.files import LOADERS, DataError
from flows.arguments import argument_parser
from flows.cli import cli_main
from flows.config_file import profile_name, read_config, section_settings
from tasks.flow_summary import publish
from tasks.outputs import check_output_file, write_output_file
from tasks.prefect_server import check_prefect_api

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
HUB_EXAMPLE = "HuggingFaceH4/MATH-500"  # MATH's record keys: problem, solution, answer, subject, level, unique_id


def build_manifest(data_params: dict) -> dict:
    """{dataset name: {format, source, records, sha256}} for each entry of params.yaml's ``data``."""
    manifest = {}
    for name, spec in data_params.items():
        if not isinstance(spec, dict) or spec.get("format") not in LOADERS or "source" not in spec:
            raise DataError(f"params data.{name}: needs format ({', '.join(LOADERS)}) and source, got {spec!r}")
        records = LOADERS[spec["format"]](spec["source"])
        manifest[name] = {
            "format": spec["format"],
            "source": spec["source"],
            "records": len(records),
            "sha256": _sha256(spec["source"]),
        }
    return manifest


def _sha256(source: str) -> str | None:
    path = Path(source).expanduser()
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def pipeline_outputs(dvc_file: Path) -> set[str]:
    """Every ``outs`` path of dvc.yaml's stages: files the pipeline writes itself."""
    if not dvc_file.is_file():
        return set()
    stages = (yaml.safe_load(dvc_file.read_text()) or {}).get("stages") or {}
    outs = set()
    for stage in stages.values():
        for out in stage.get("outs") or []:
            outs.add(str(Path(next(iter(out)) if isinstance(out, dict) else out)))
    return outs


def data_files(document: dict[str, Any], profile: str | None, produced: set[str]) -> dict[str, list[str]]:
    """{local data file: the params.yaml keys that point at it}: every string setting, in every section
    (profile applied), that names a ``.jsonl``/``.json``/``.parquet``/``.csv`` file and is not a
    pipeline output."""
    found: dict[str, list[str]] = {}

    def visit(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{key}.{k}", v)
        elif isinstance(value, str) and _looks_like_data(value) and str(Path(value)) not in produced:
            found.setdefault(value, []).append(key)

    for section in document:
        if section in ("profile", "profiles") or not isinstance(document[section], dict):
            continue
        visit(section, section_settings(document, section, profile))
    return found


def _looks_like_data(value: str) -> bool:
    """A local data file's path (a hub id has no such suffix; a URL is not data)."""
    return value.endswith(DATA_SUFFIXES) and not value.startswith(("arithmetic:", "http://", "https://"))


def check_data_files(files: dict[str, list[str]], params_file: str, profile: str | None) -> None:
    """DataError naming every missing file, its keys and the two fixes; nothing when all exist."""
    missing = {path: keys for path, keys in files.items() if not Path(path).expanduser().is_file()}
    if not missing:
        return
    where = f"{params_file}" + (f" (profile {profile})" if profile else "")
    lines = [f"{len(missing)} data file(s) that {where} points at do not exist:"]
    lines += [f"  {path}  ← {', '.join(keys)}" for path, keys in missing.items()]
    keys = [k for ks in missing.values() for k in ks]
    key = next((k for k in keys if not k.startswith("data.")), keys[0])  # a stage's key: what -S sets
    lines += [
        "The defaults read ../shared/data beside this clone (MATH, GSM8K and the SFT traces; see the README). Either:",
        "  - put the file(s) there, or set those keys to local .jsonl files of the same record format "
        f"(edit {params_file}, or `dvc exp run -S '{key}=/path/to/file.jsonl'`), or",
        "  - set them to a Hugging Face dataset id, read through `datasets` (needs the hub), e.g. "
        f"`-S '{key}={HUB_EXAMPLE}'` for MATH-format problems.",
    ]
    raise DataError("\n".join(lines))


class PrepareDataParams(BaseModel):
    """The data check's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str = Field("params.yaml", description="the settings file whose data files are checked")
    profile: str | None = Field(None, description="the profile whose overrides apply (default: the file's)")
    dvc_file: str = Field("dvc.yaml", description="its stages' outs are files the pipeline makes")
    out: str = Field("data/prepared/manifest.json", description="the manifest written")

    @field_validator("out")
    @classmethod
    def _an_output_file(cls, value: str) -> str:
        check_output_file(value, "out")
        return value


@flow(name="prepare_data")
def prepare_data(params: PrepareDataParams = PrepareDataParams()) -> dict:
    """Check every data file the settings point at, validate the datasets, write the manifest; returns the
    manifest, the profile and how many files the stages read."""
    document = read_config(params.config)
    profile = profile_name(document, params.profile, params.config)
    files = data_files(document, profile, pipeline_outputs(Path(params.dvc_file)))
    check_data_files(files, params.config, profile)
    manifest = build_manifest(document.get("data") or {})
    manifest_files = {path: {"sha256": _sha256(path), "keys": keys} for path, keys in sorted(files.items())}
    write_output_file(params.out, json.dumps({"datasets": manifest, "files": manifest_files}, indent=2) + "\n")
    publish(
        "prepare_data",
        "Data check",
        [{"dataset": name, "records": e["records"], "source": e["source"]} for name, e in manifest.items()],
        paths={"manifest": params.out},
    )
    return {"datasets": manifest, "files": manifest_files, "profile": profile}


@cli_main("flows.prepare_data")
def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--profile", default=None, help="the profile whose overrides apply (default: the file's)")
    parser.add_argument("--dvc-file", default="dvc.yaml", help="its stages' outs are files the pipeline makes")
    parser.add_argument("--out", default="data/prepared/manifest.json")
    args = parser.parse_args(argv)
    params = PrepareDataParams(config=args.params, profile=args.profile, dvc_file=args.dvc_file, out=args.out)
    if os.environ.get("PREFECT_API_URL"):
        check_prefect_api()
    result = (prepare_data if os.environ.get("PREFECT_API_URL") else prepare_data.fn)(params)
    for name, entry in result["datasets"].items():
        print(f"{name:16} {entry['records']:>6} records  {entry['source']}")
    print(f"{len(result['files'])} data files read by the stages (profile {result['profile']}): all present")


if __name__ == "__main__":
    main()
