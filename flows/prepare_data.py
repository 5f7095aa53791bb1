"""Stage ``prepare_data``: validate every dataset named in params.yaml and record what was read.

Writes a manifest (record count and sha256 of each source) that later stages depend on, so a changed
dataset re-runs them. Any bad file stops the stage with a DataError naming file and line.

    python -m flows.prepare_data --params params.yaml --out data/prepared/manifest.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import yaml

from a5core.data import LOADERS, DataError, write_text_atomic
from flows.cli import cli_main



def build_manifest(data_params: dict) -> dict:
    """{dataset name: {format, source, records, sha256}} for each entry of params.yaml's ``data``."""
    manifest = {}
    for name, spec in data_params.items():
        if not isinstance(spec, dict) or spec.get("format") not in LOADERS or "source" not in spec:
            raise DataError(f"params data.{name}: needs format ({', '.join(LOADERS)}) and source, got {spec!r}")
        records = LOADERS[spec["format"]](spec["source"])
        path = Path(spec["source"])
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        manifest[name] = {"format": spec["format"], "source": spec["source"], "records": len(records), "sha256": digest}
    return manifest


@cli_main("flows.prepare_data")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--out", default="data/prepared/manifest.json")
    args = parser.parse_args(argv)
    manifest = build_manifest(yaml.safe_load(Path(args.params).read_text())["data"])
    write_text_atomic(args.out, json.dumps(manifest, indent=2) + "\n")
    for name, entry in manifest.items():
        print(f"{name:16} {entry['records']:>6} records  {entry['source']}")


if __name__ == "__main__":
    main()
