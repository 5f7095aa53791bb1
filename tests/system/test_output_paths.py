"""Output settings cannot replace what is not an output: a tracked input (params.yaml), a folder given as a
file, another flow's output folder, a source folder. Each is refused as the parameters are read, on the
command line and in the parameter model the Prefect deployments validate, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import flows.baseline_eval
import flows.grpo
import flows.sft_data
from flows.params import BaselineEvalParams, DifficultyParams, GRPOParams
from tasks.outputs import OUTPUT_MARKER, REPORT_MARKER, link_model, write_output_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A git repository holding params.yaml, dvc.yaml (declaring metrics/eval.json) and both tracked, as cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("baseline_eval:\n  limit: 2\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  eval:\n    cmd: x\n    metrics:\n      - metrics/eval.json:\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/eval.json").write_text('{"accuracy": 0.5}\n')
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["git", "add", "params.yaml", "dvc.yaml", "metrics/eval.json"], check=True)
    return tmp_path


def refused(argv: list[str], capsys, monkeypatch) -> str:
    """Run flows.baseline_eval's main with ``argv``: it must stop with exit status 2 before any engine
    starts; its one-line message."""
    monkeypatch.setattr("tasks.evaluation.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    with pytest.raises(SystemExit) as stopped:
        flows.baseline_eval.main(["--data", "missing.jsonl", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_tracked_input_is_not_replaced_by_the_metrics_file(project, capsys, monkeypatch):
    before = (project / "params.yaml").read_bytes()
    err = refused(["--metrics-path", "params.yaml"], capsys, monkeypatch)
    assert "metrics_path params.yaml: a file git tracks, not an output of this flow" in err
    assert (project / "params.yaml").read_bytes() == before


def test_a_folder_given_as_the_metrics_file_is_refused_before_any_work(project, capsys, monkeypatch):
    (project / "outputs").mkdir()
    err = refused(["--metrics-path", "outputs"], capsys, monkeypatch)
    assert "metrics_path outputs: a folder; give the path of a file to write" in err


def test_a_users_own_file_is_not_replaced_by_the_metrics_file(project, capsys, monkeypatch):
    """Not notes, nor a JSON file of the user's that looks like metrics: a5 replaces only what it wrote."""
    (project / "notes.txt").write_text("my notes\n")
    (project / "results.json").write_text('{"accuracy": 0.9}\n')
    for name in ("notes.txt", "results.json"):
        err = refused(["--metrics-path", name], capsys, monkeypatch)
        assert f"metrics_path {name}: a file a5 did not write there (or one changed since)" in err
    assert (project / "notes.txt").read_text() == "my notes\n"
    assert (project / "results.json").read_text() == '{"accuracy": 0.9}\n'


def test_the_reports_folder_and_a_source_folder_are_not_output_folders(project, capsys, monkeypatch):
    report = project / "outputs/report"
    report.mkdir(parents=True)
    (report / REPORT_MARKER).write_text("")
    (report / "report.md").write_text("# the report\n")
    err = refused(["--output-dir", "outputs/report"], capsys, monkeypatch)
    assert "output_dir outputs/report: holds the report flow's outputs (.a5-report)" in err
    assert (report / "report.md").read_text() == "# the report\n"
    err = refused(["--output-dir", "."], capsys, monkeypatch)
    assert "output_dir .: holds files git tracks (dvc.yaml, metrics/eval.json, params.yaml)" in err


def test_a_folder_of_another_kind_of_run_is_refused_and_ones_own_is_claimed(project):
    from tasks.checks import check_outputs

    params = BaselineEvalParams(output_dir="outputs/eval", metrics_path=None, tracking_uri="sqlite:///mlflow.db")
    check_outputs(params)  # what the command line checks before an engine starts: the folder is claimed
    assert (project / "outputs/eval" / OUTPUT_MARKER).read_text() == "BaselineEval\n"
    BaselineEvalParams(output_dir="outputs/eval")  # its own kind: fine
    with pytest.raises(ValidationError, match=r"outputs/eval: holds the outputs of another kind of run \(BaselineEval"):
        GRPOParams(output_dir="outputs/eval")


def test_the_deployment_forms_models_refuse_the_same(project):
    """The models flows.serve deploys validate each flow run's parameters: the same refusals."""
    with pytest.raises(ValidationError, match="metrics_path params.yaml: a file git tracks"):
        GRPOParams(metrics_path="params.yaml")
    with pytest.raises(ValidationError, match="table metrics: a folder"):
        DifficultyParams(table="metrics")
    assert GRPOParams(metrics_path="metrics/eval.json").metrics_path == "metrics/eval.json"  # DVC's, in git
    with pytest.raises(ValidationError, match="tracking_uri sqlite:///params.yaml: params.yaml is a file git tracks"):
        BaselineEvalParams(tracking_uri="sqlite:///params.yaml")


def test_sft_data_refuses_the_same(project):
    with pytest.raises(SystemExit, match="sft_data filter: metrics params.yaml: a file git tracks"):
        flows.sft_data.main(["filter", "--metrics", "params.yaml"])
    with pytest.raises(SystemExit, match="sft_data math: out metrics: a folder"):
        flows.sft_data.main(["math", "--out", "metrics"])
    assert json.loads((project / "metrics/eval.json").read_text()) == {"accuracy": 0.5}


def test_an_earlier_runs_metrics_file_is_replaced_unless_changed_since(project):
    """What a flow wrote there is its to replace: the same command runs again. Edited since, it is the user's."""
    write_output_file(project / "rows.json", '[{"setting": "single", "final_accuracy": 0.5}]\n')
    assert GRPOParams(metrics_path="rows.json").metrics_path == "rows.json"
    (project / "rows.json").write_text('[{"setting": "single", "final_accuracy": 0.5, "note": "mine"}]\n')
    with pytest.raises(ValidationError, match="metrics_path rows.json: a file a5 did not write there"):
        GRPOParams(metrics_path="rows.json")


def test_a_dvc_output_folder_with_its_committed_gitignore_is_an_output_folder(project):
    """DVC commits a .gitignore beside the outputs it keeps out of git (data/sft/.gitignore): not a source file."""
    (project / "data/sft").mkdir(parents=True)
    (project / "data/sft/.gitignore").write_text("/math_solutions.jsonl\n")
    subprocess.run(["git", "add", "data/sft/.gitignore"], check=True)
    assert BaselineEvalParams(output_dir="data/sft").output_dir == "data/sft"
    flows.sft_data.check_output_dir("data/sft", "SFTData", "--out-dir")


def test_the_link_to_a_chosen_model_survives_moving_the_output_folder(tmp_path):
    """The link a flow writes to its best model is relative: the folder moved (or unpacked elsewhere) keeps it."""
    model = tmp_path / "out/runs-1/best"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    link_model(model, tmp_path / "out/best")
    link_model(model, tmp_path / "out/best")  # replaced, not refused
    (tmp_path / "out").rename(tmp_path / "moved")
    assert (tmp_path / "moved/best/config.json").read_text() == "{}"


# ----------------------------------------------------------------------- folders that are not the flow's


def test_a_read_only_data_folder_is_not_an_output_folder(project, capsys, monkeypatch):
    """The shared data is a read-only folder (r-x for all), which root may write all the same: neither it nor a
    new folder inside it takes outputs."""
    shared = project.parent / "shared"
    (shared / "data/math").mkdir(parents=True)
    (shared / "data/math/train.jsonl").write_text("{}\n")
    for folder in (shared / "data/math", shared / "data", shared):
        folder.chmod(0o555)
    try:
        for target in (shared, shared / "data/math", shared / "data/math/outputs"):
            err = refused(["--output-dir", str(target)], capsys, monkeypatch)
            assert f"output_dir {target}: " in err and "is read-only" in err, err
        assert sorted(p.name for p in shared.rglob("*")) == ["data", "math", "train.jsonl"]
    finally:
        for folder in (shared, shared / "data", shared / "data/math"):
            folder.chmod(0o755)


@pytest.mark.parametrize("folder", ["/etc", "/etc/a5-outputs", "/usr/local/share", "/"])
def test_a_system_folder_is_not_an_output_folder(folder, project, capsys, monkeypatch):
    err = refused(["--output-dir", folder], capsys, monkeypatch)
    assert f"output_dir {folder}: a system folder" in err
    assert not Path("/etc/a5-outputs").exists()


def test_a_folder_of_the_users_own_files_is_not_replaced(project, capsys, monkeypatch):
    """An untracked folder holding the user's report.md, summary.json and run.json (what baseline_eval writes):
    refused, the files untouched. An empty folder, or one a5 made, is fine."""
    mine = project / "mine"
    mine.mkdir()
    for name in ("report.md", "summary.json", "run.json"):
        (mine / name).write_text(f"my {name}\n")
    err = refused(["--output-dir", "mine"], capsys, monkeypatch)
    assert "output_dir mine: holds files a5 did not write (report.md, run.json, summary.json)" in err
    assert all((mine / name).read_text() == f"my {name}\n" for name in ("report.md", "summary.json", "run.json"))
    (project / "empty").mkdir()
    assert BaselineEvalParams(output_dir="empty").output_dir == "empty"
    (mine / OUTPUT_MARKER).write_text("BaselineEval\n")  # a5 made it: its own run's folder again
    assert BaselineEvalParams(output_dir="mine").output_dir == "mine"


@pytest.mark.parametrize("flow", ["baseline_eval", "grpo"])
def test_an_output_folder_name_too_long_is_one_line(flow, project, capsys, monkeypatch):
    main = {"baseline_eval": flows.baseline_eval.main, "grpo": flows.grpo.main}[flow]
    monkeypatch.setattr("tasks.evaluation.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    with pytest.raises(SystemExit) as stopped:
        main(["--output-dir", "x" * 300])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be used as a folder (File name too long)" in err, err


# ------------------------------------------------------------------ every entry point, one check


def test_prepare_data_does_not_write_its_manifest_over_a_tracked_file(project):
    """`flows.prepare_data --out README.md` replaced the tracked README (exit status 0): refused, as the command
    line gives its settings, the file intact."""
    (project / "README.md").write_text("# my project\n")
    subprocess.run(["git", "add", "README.md"], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "flows.prepare_data", "--out", "README.md"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "flows.prepare_data: error: out README.md: a file git tracks, not an output of this flow; not replacing it: "
        "give another path, or move the file away"
    )
    assert (project / "README.md").read_text() == "# my project\n"


def test_sft_data_does_not_replace_a_users_file(project):
    (project / "mine.jsonl").write_text('{"prompt": "p", "response": "r", "ground_truth": "1"}\n')
    with pytest.raises(SystemExit, match="sft_data traces: out mine.jsonl: a file a5 did not write there"):
        flows.sft_data.main(["traces", "--out", "mine.jsonl"])
    assert (project / "mine.jsonl").read_text() == '{"prompt": "p", "response": "r", "ground_truth": "1"}\n'


@pytest.mark.parametrize("name", ["/usr", "../../victim", ".."])
def test_an_experiment_name_is_a_name_not_a_path(name, project, capsys, monkeypatch):
    """`--experiment /usr` put the run's artifacts in /usr/<run id>/ (MLflow keeps them in mlruns/<name>)."""
    err = refused(["--experiment", name], capsys, monkeypatch)
    assert f"--experiment {name!r}: Value error, an experiment's name, not a path" in err
    assert not (project.parent.parent / "victim").exists()


def test_a_new_tracking_store_is_not_made_in_a_system_folder(project, capsys, monkeypatch):
    err = refused(["--tracking-uri", "sqlite:////usr/a5/mlflow.db"], capsys, monkeypatch)
    assert "tracking_uri /usr/a5/mlflow.db: in a system folder" in err
    assert not Path("/usr/a5").exists()
