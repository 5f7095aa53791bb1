import json

import pytest
import yaml

from a5core.data import DataError
from flows.prepare_data import build_manifest, main


def test_manifest_of_the_real_params(tmp_path, shared_data, monkeypatch):
    params = yaml.safe_load(open("params.yaml"))
    data = {k: {**v, "source": str(shared_data / v["source"].split("shared/data/")[1])} for k, v in params["data"].items()}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": data}))
    main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "m.json")])
    manifest = json.loads((tmp_path / "m.json").read_text())
    assert manifest["math_validation"]["records"] == 5000 and manifest["sft_traces"]["records"] == 1767
    # sha256 as published in shared/data/SOURCES.md
    assert manifest["math_validation"]["sha256"].startswith("05b28470947ca9af")


def test_manifest_rejects_an_unknown_format():
    with pytest.raises(DataError, match=r"params data\.x: needs format"):
        build_manifest({"x": {"format": "csv", "source": "a.csv"}})
