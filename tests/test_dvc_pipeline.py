"""`dvc repro` runs prepare_data → baseline_eval from a copy of the project, and a second repro does nothing."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_dvc_repro_then_nothing_to_do(tmp_path, tiny_lm_dir, shared_data):
    repo = tmp_path / "a5"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".venv", ".git", "outputs", "mlruns", "mlflow.db", "tmp", "cache", "data", "metrics", "dvc.lock", "__pycache__", ".whl"))
    (tmp_path / "shared").symlink_to(shared_data.parent, target_is_directory=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["profile"] = "test"
    params["profiles"]["test"] = {"baseline_eval": {"model": str(tiny_lm_dir), "backend": "hf", "limit": 2, "max_tokens": 8}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "prefect"),
           "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(repo)}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)

    def repro():
        result = subprocess.run(["dvc", "repro"], cwd=repo, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    first = repro()
    assert "Running stage 'prepare_data'" in first and "Running stage 'baseline_eval'" in first
    metrics = yaml.safe_load((repo / "metrics/baseline_eval.json").read_text())
    assert metrics["n_records"] == 2
    assert (repo / "outputs/baseline_eval/records.jsonl").is_file() and (repo / "mlflow.db").is_file()
    second = repro()
    assert "Running stage" not in second and "up to date" in second
