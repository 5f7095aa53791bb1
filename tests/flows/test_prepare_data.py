import json
from pathlib import Path

import pytest
import yaml

from a5core.data.files import DataError
from flows.prepare_data import build_manifest, main

ROOT = Path(__file__).resolve().parents[2]


def test_manifest_of_the_real_params(tmp_path, shared_data, monkeypatch):
    params = yaml.safe_load(open("params.yaml"))
    data = {
        k: {**v, "source": str(shared_data / v["source"].split("shared/data/")[1])} for k, v in params["data"].items()
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": data}))
    main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "m.json")])
    manifest = json.loads((tmp_path / "m.json").read_text())["datasets"]
    assert manifest["math_validation"]["records"] == 5000 and manifest["sft_traces"]["records"] == 1767
    # sha256 as published in shared/data/SOURCES.md
    assert manifest["math_validation"]["sha256"].startswith("05b28470947ca9af")


def test_manifest_rejects_an_unknown_format():
    with pytest.raises(DataError, match=r"params data\.x: needs format"):
        build_manifest({"x": {"format": "csv", "source": "a.csv"}})


def _params_with(tmp_path, **replace) -> Path:
    """The project's params.yaml with some paths replaced, saved under tmp_path."""
    text = (ROOT / "params.yaml").read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    (tmp_path / "params.yaml").write_text(text)
    return tmp_path / "params.yaml"


def test_a_missing_data_file_is_named_with_its_keys_and_the_fixes_before_anything_is_written(tmp_path, shared_data):
    params = _params_with(
        tmp_path,
        **{
            "../shared/data": str(shared_data),
            f"{shared_data}/math/validation.jsonl": str(tmp_path / "gone/validation.jsonl"),
        },
    )
    out = tmp_path / "manifest.json"
    with pytest.raises(SystemExit) as stopped:
        # the handout's settings, under which the stages read the MATH validation set
        main(["--params", str(params), "--profile", "a5", "--dvc-file", str(ROOT / "dvc.yaml"), "--out", str(out)])
    message = str(stopped.value)
    assert message.startswith("flows.prepare_data: error: 1 data file(s)") and "Traceback" not in message
    missing_line = next(line for line in message.splitlines() if "gone/validation.jsonl" in line)
    for key in ("baseline_eval.data", "grpo.validation_data", "expert_iteration.validation_data"):
        assert key in missing_line  # every key that points at it
    assert "train.jsonl" not in message  # present files are not listed
    assert "-S 'baseline_eval.data=/path/to/file.jsonl'" in message and "Hugging Face dataset id" in message
    assert not out.exists()


def test_files_the_pipeline_writes_and_generated_tasks_are_not_checked(tmp_path, shared_data):
    params = _params_with(tmp_path, **{"../shared/data": str(shared_data)})
    out = tmp_path / "manifest.json"
    main(["--params", str(params), "--profile", "cpu", "--dvc-file", str(ROOT / "dvc.yaml"), "--out", str(out)])
    files = json.loads(out.read_text())["files"]
    assert str(shared_data / "math/validation.jsonl") in files  # read by the stages: hashed into the manifest
    assert not any(path.startswith(("data/", "arithmetic:")) for path in files)  # data/sft/*: made by sft_data


def test_dvc_repro_without_the_shared_data_stops_at_the_first_stage_with_the_message(tmp_path):
    """A clone with no ../shared beside it: `dvc repro` runs prepare_data, which names what is missing,
    and no other stage starts."""
    import os
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "a5"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".dvcignore", "bin", "flows", "a5core", "tasks", ".dvc"):
        source = ROOT / name
        (
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__", "cache", "tmp"))
            if source.is_dir()
            else shutil.copy2(source, repo / name)
        )
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "PYTHONPATH": str(repo),
    }
    result = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Running stage 'prepare_data'" in output and "Running stage 'baseline_eval'" not in output
    assert "../shared/data/math/validation.jsonl  ← data.math_validation.source" in output
    assert "Hugging Face dataset id" in output and "No such file or directory" not in output
