"""flows.report: one page from the stages' files (and the GRPO ablations in MLflow); missing stages say
"not run"; the folder is swapped in whole; the report is logged to MLflow."""

import json
import re

import pytest
import yaml

from flows.report import ReportParams, main, report
from tasks.training import plot_curves

BASELINE = {"n_records": 8, "n_problems": 8, "accuracy": 0.25, "format_rate": 0.5, "mean_response_tokens": 41.5,
            "count_format1_answer1": 2, "count_format1_answer0": 2, "count_format0_answer0": 4,
            "finish_length": 3, "finish_stop": 5}
CASES = ("# Evaluation case analysis\n\n8 responses to 8 problems: accuracy 0.250.\n\n"
         "Of the 4 format-0 responses, 1 contain a correct answer that the r1_zero format rules rejected "
         "(format/parser failures); the rest hold no correct answer (model failures).\n\n## format1_answer1 (2)\n")
SFT = [{"setting": "128", "n_examples": 128, "steps": 8, "final_accuracy": 0.1, "final_format_rate": 0.9},
       {"setting": "filtered", "n_examples": 60, "steps": 4, "final_accuracy": 0.3, "final_format_rate": 0.95}]
EI = [{"setting": "single", "final_accuracy": 0.35, "final_format_rate": 0.97}]
GRPO = [{"setting": "single", "final_accuracy": 0.45, "final_format_rate": 0.99, "wall_seconds": 321.0}]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if isinstance(text, str) else json.dumps(text))


def plot(path):
    plot_curves(path, [{"setting": "a", "step": s, "v": s / 10} for s in range(3)], "step", "v", "setting", path.stem)


def project(root, stages=("baseline", "sft", "ei", "grpo")):
    """A project folder holding what the named stages write."""
    params = {"profile": "cpu", "baseline_eval": {"model": "Qwen/Qwen2.5-Math-1.5B"}, "grpo": {"n_grpo_steps": 200},
              "report": {"title": "Test report"},
              "profiles": {"cpu": {"baseline_eval": {"model": "smollm2-135m-instruct"}, "grpo": {"n_grpo_steps": 2}}}}
    write(root / "params.yaml", yaml.safe_dump(params))
    if "baseline" in stages:
        write(root / "metrics/baseline_eval.json", BASELINE)
        write(root / "outputs/baseline_eval/summary.json", BASELINE)
        write(root / "outputs/baseline_eval/report.md", CASES)
    if "sft" in stages:
        write(root / "metrics/sft_data.json", {"teacher": {"raw": 10, "duplicates": 0, "filtered": 6, "kept_fraction": 0.6,
                                                           "format_rate": 0.8}})
        write(root / "metrics/sft_experiment.json", SFT)
        plot(root / "outputs/sft_experiment/accuracy_vs_step.png")
    if "ei" in stages:
        write(root / "metrics/expert_iteration.json", EI)
    if "grpo" in stages:
        write(root / "metrics/grpo.json", GRPO)
        for name in ("token_entropy_vs_step", "accuracy_vs_wall_clock", "accuracy_vs_step"):
            plot(root / f"outputs/grpo/{name}.png")
        plot(root / "outputs/grpo/runs-abc/single/ignored.png")  # only a stage folder's top level is shown


def log_ablation(uri, name, finals):
    """A GRPO ablation as the flow logs it: a parent tagged `ablation`, children with `setting` and metrics."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("grpo")
    with mlflow.start_run(run_name=name) as parent:
        for setting, final in finals.items():
            with mlflow.start_run(run_name=f"grpo-{setting}", nested=True):
                mlflow.log_param("setting", setting)
                for step in range(3):
                    mlflow.log_metric("val_accuracy", final * step / 2, step=step)
                mlflow.log_metrics({"final_val_accuracy": final, "final_val_format_rate": 1.0, "wall_seconds": 10.0})
        mlflow.set_tag("ablation", name)
    return parent.info.run_id


def test_full_report_with_plots_ablations_and_mlflow_run(prefect_harness, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    project(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log_ablation(uri, "grpo_baseline_ablation", {"no_baseline": 0.2, "reinforce_with_baseline": 0.4})  # older
    newest = log_ablation(uri, "grpo_baseline_ablation", {"no_baseline": 0.25, "reinforce_with_baseline": 0.5})

    result = report(ReportParams(tracking_uri=uri, title="Test report"))

    out = tmp_path / "outputs/report"
    md = (out / "report.md").read_text()
    assert md.startswith("# Test report")
    assert "Settings: `params.yaml` with profile `cpu`." in md
    assert "| Zero-shot baseline | 0.250 |" in md and "| SFT (best setting) | 0.300 |" in md
    assert "| Expert Iteration (best) | 0.350 |" in md and "| GRPO (best) | 0.450 |" in md
    assert "Settings: model `smollm2-135m-instruct`." in md  # the profile's override, as the stage ran
    assert "| format0_answer0 | format not followed | 4 | 0.500 |" in md
    assert "Of the 4 format-0 responses, 1 contain a correct answer" in md
    assert "Finish reasons: length 3, stop 5; `length` responses hit `max_tokens`." in md
    assert "Best: **filtered** at 0.300." in md and "| teacher | 10 | 0 | 6 | 0.600 | 0.800 |" in md
    assert "Settings: n_grpo_steps `2`. One run." in md and "Final validation accuracy: **0.450**." in md
    assert "not run" not in md
    figures = re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", md)
    assert figures == ["sft_experiment_accuracy_vs_step.png", "grpo_accuracy_vs_step.png", "grpo_accuracy_vs_wall_clock.png",
                       "grpo_token_entropy_vs_step.png", "ablation_grpo_baseline_ablation_val_accuracy.png"]
    for name in figures:
        assert (out / "figures" / name).stat().st_size > 1000
    # The ablation: its newest run only, one row per child.
    assert f"MLflow run `{newest}`, 2 settings." in md
    assert "| reinforce_with_baseline | 0.500 | 1.000 | 10.000 |" in md and "| 0.400 |" not in md
    assert (out / "baseline_cases.md").read_text() == CASES and "[baseline_cases.md](baseline_cases.md)" in md

    page = (out / "report.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == len(figures)
    assert "<td>format0_answer0</td>" in page and "<strong>0.450</strong>" in page

    assert result["sections"] == {"baseline": True, "sft": True, "ei": True, "grpo": True, "ablations": 1}
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result["mlflow_run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "report"
    assert run.data.metrics == {"baseline_accuracy": 0.25, "baseline_format_rate": 0.5, "sft_best_accuracy": 0.3,
                                "ei_best_accuracy": 0.35, "grpo_best_accuracy": 0.45}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.md", "report.html", "figures", "baseline_cases.md"} <= artifacts


def test_missing_stages_say_not_run_and_a_rerun_replaces_the_folder(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    project(tmp_path)
    report(ReportParams(log_to_mlflow=False))
    assert (tmp_path / "outputs/report/figures/grpo_accuracy_vs_step.png").is_file()
    assert (tmp_path / "outputs/report").stat().st_mode & 0o777 == (tmp_path / "outputs/grpo").stat().st_mode & 0o777

    for stale in ("metrics/sft_experiment.json", "metrics/sft_data.json", "metrics/grpo.json", "outputs/grpo/accuracy_vs_step.png",
                  "outputs/baseline_eval/report.md"):
        (tmp_path / stale).unlink()
    result = report(ReportParams(log_to_mlflow=False))
    md = (tmp_path / "outputs/report/report.md").read_text()
    assert "SFT sweep: not run." in md and "GRPO: not run." in md and "Expert Iteration: not run." not in md
    assert "| SFT (best setting) | not run |" in md and "| GRPO (best) | not run |" in md
    assert "GRPO ablations: not run" in md  # no MLflow store here; none is created to find that out
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "outputs/report/figures/grpo_accuracy_vs_step.png").exists()  # the whole folder was replaced
    assert not (tmp_path / "outputs/report/baseline_cases.md").exists()
    assert result["sections"]["sft"] is False and result["mlflow_run_id"] is None
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["baseline_eval", "grpo", "report", "sft_experiment"]


def test_nothing_run_yet(prefect_harness, tmp_path):
    report(ReportParams(root=str(tmp_path), output_dir=str(tmp_path / "r"), params_file=None, ablations_from_mlflow=False,
                        log_to_mlflow=False))
    md = (tmp_path / "r/report.md").read_text()
    assert md.count("| not run |") == 4 and "Baseline evaluation: not run." in md and "figures/" not in md
    assert "Not read (`ablations_from_mlflow: false`)." in md


def test_cli_reads_its_section_and_refuses_to_replace_a_foreign_folder(prefect_harness, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    project(tmp_path, stages=("baseline",))
    main(["--config", "params.yaml", "--log-to-mlflow", "false"])
    printed = capsys.readouterr().out
    assert "Zero-shot baseline: 0.250" in printed and "GRPO (best): not run" in printed
    assert (tmp_path / "outputs/report/report.md").read_text().startswith("# Test report")

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a report folder"):
        main(["--config", "params.yaml", "--log-to-mlflow", "false", "--output-dir", "elsewhere"])
    assert (tmp_path / "elsewhere/keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left behind
