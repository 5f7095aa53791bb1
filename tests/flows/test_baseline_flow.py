"""The baseline_eval flow end to end: CLI, Prefect caching, outputs, MLflow run read back."""

import json
import subprocess
import sys


def test_cli_help_lists_every_parameter():
    from flows.baseline_eval import BaselineEvalParams

    out = subprocess.run(
        [sys.executable, "-m", "flows.baseline_eval", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in BaselineEvalParams.flat_fields():
        assert "--" + name.replace("_", "-") in out
    assert "--limit" in out and "--config" in out


def test_cli_rejects_bad_parameters():
    result = subprocess.run(
        [sys.executable, "-m", "flows.baseline_eval", "--temperature", "-1"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "temperature" in result.stderr


def test_config_profile_overrides(tmp_path):
    from flows.arguments import parse_params
    from flows.baseline_eval import BaselineEvalParams

    config = tmp_path / "params.yaml"
    config.write_text(
        "profile: cpu\nbaseline_eval: {limit: 100, max_tokens: 1024}\nprofiles: {cpu: {baseline_eval: {limit: 3}}}\n"
    )
    params = parse_params(BaselineEvalParams, "baseline_eval", ["--config", str(config), "--max-tokens", "7"])
    assert (params.limit, params.max_tokens, params.temperature) == (3, 7, 1.0)


def test_flow_runs_caches_and_logs_to_mlflow(prefect_harness, tiny_lm_dir, shared_data, tmp_path, monkeypatch):
    import mlflow

    import tasks.evaluation
    from a5core.data.files import load_math
    from flows.baseline_eval import BaselineEvalParams, baseline_eval

    engines = []
    real_make_engine = tasks.evaluation.make_engine
    monkeypatch.setattr(tasks.evaluation, "make_engine", lambda *a, **k: engines.append(a) or real_make_engine(*a, **k))
    params = BaselineEvalParams(
        model=str(tiny_lm_dir),
        backend="hf",
        data=str(shared_data / "math/validation.jsonl"),
        limit=4,
        n=2,
        max_tokens=12,
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    monkeypatch.chdir(tmp_path)  # artifacts go under ./mlruns
    first = baseline_eval(params)
    records = [json.loads(line) for line in (tmp_path / "out/records.jsonl").read_text().splitlines()]
    first_four = [p.unique_id for p in load_math(shared_data / "math/validation.jsonl")[:4]]
    assert [r["unique_id"] for r in records] == [i for i in first_four for _ in range(2)]
    assert json.loads((tmp_path / "out/summary.json").read_text())["n_records"] == 8
    assert set(json.loads((tmp_path / "metrics.json").read_text())) == {"accuracy", "accuracy_se", "format_rate"}
    assert "# Evaluation case analysis" in (tmp_path / "out/report.md").read_text()

    second = baseline_eval(params)
    assert len(engines) == 1, "unchanged inputs must not generate again"
    assert second["summary"] == first["summary"]

    mlflow.set_tracking_uri(params.tracking_uri)
    runs = mlflow.search_runs(experiment_names=["baseline_eval"])
    assert len(runs) == 2 and set(runs["metrics.n_records"]) == {8.0}
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(first["mlflow_run_id"])}
    assert {"generations.json", "summary.json", "report.md"} <= artifacts
    mlflow.set_experiment("baseline_eval")  # load_table searches the current experiment
    table = mlflow.load_table("generations.json", run_ids=[first["mlflow_run_id"]])
    assert len(table) == 8 and "response" in table.columns


def test_several_sets_and_samples_in_one_run(prefect_harness, tiny_lm_dir, shared_data, tmp_path, monkeypatch):
    """MATH500 beside the validation set, two samples a problem: each set's records, summary (with
    pass@k, maj@n and standard errors) and MLflow metrics (``math500/…``) and artifacts."""
    import mlflow

    from flows.baseline_eval import BaselineEvalParams, baseline_eval

    params = BaselineEvalParams(
        model=str(tiny_lm_dir),
        backend="hf",
        data=str(shared_data / "math/validation.jsonl"),
        extra_sets={"math500": str(shared_data / "math/math500.jsonl")},
        limit=3,
        n=2,
        max_tokens=8,
        output_dir=str(tmp_path / "out"),
        metrics_path=None,
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    monkeypatch.chdir(tmp_path)
    result = baseline_eval(params)
    extra = [json.loads(line) for line in (tmp_path / "out/math500/records.jsonl").read_text().splitlines()]
    assert len(extra) == 6 and {r["unique_id"] for r in extra}.isdisjoint(
        {json.loads(line)["unique_id"] for line in (tmp_path / "out/records.jsonl").read_text().splitlines()}
    )
    summary = result["sets"]["math500"]["summary"]
    assert {"accuracy_se", "pass_at_1", "pass_at_2", "maj_at_2", "pass_at_2_se"} <= set(summary)
    assert summary["samples_per_problem"] == 2 and summary["n_problems"] == 3
    run = mlflow.MlflowClient(params.tracking_uri).get_run(result["mlflow_run_id"])
    assert run.data.metrics["math500/n_records"] == 6 and "pass_at_2" in run.data.metrics
    artifacts = {a.path for a in mlflow.MlflowClient(params.tracking_uri).list_artifacts(run.info.run_id, "math500")}
    assert {"math500/summary.json", "math500/report.md", "math500/generations.json"} <= artifacts

    # The run spans the evaluation (generation included), its settings are parameters, and it says where it
    # came from: the Prefect flow run, the commit.
    written = (tmp_path / "out/math500/records.jsonl").stat().st_mtime * 1000
    assert run.info.start_time <= written <= run.info.end_time
    assert run.data.params["tracking_uri"] == params.tracking_uri and run.data.params["limit"] == "3"
    tags = run.data.tags
    assert len(tags["mlflow.source.git.commit"]) == 40 and tags["git.dirty"] in ("true", "false")
    assert tags["versions.torch"] and tags["device"] == "cpu"
    assert tags["mlflow.runName"] == f"{tiny_lm_dir.name}-r1_zero-3"  # named once the problems are counted

    # Prefect: the flow run's artifact holds the headline and the MLflow run's address; its logs the numbers.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the logs are sent in batches
    flow_run_id = tags["prefect.flow_run_id"]
    record = json.loads((tmp_path / "out/run.json").read_text())
    assert record["mlflow_run_id"] == run.info.run_id and record["prefect_flow_run_id"] == flow_run_id
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["baseline-eval-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    assert str(artifact.flow_run_id) == flow_run_id
    assert "| set | problems | accuracy | accuracy_se | format_rate |" in artifact.data
    assert "| math500 | 3 |" in artifact.data and f"[{run.info.run_id}]({record['mlflow_run_url']})" in artifact.data
    headline = [log.message for log in logs if log.message.startswith("Zero-shot evaluation: set math500")]
    assert headline and "problems 3, accuracy" in headline[0]


def test_an_extra_set_name_must_be_a_folder_name():
    import pytest

    from flows.baseline_eval import BaselineEvalParams

    with pytest.raises(ValueError, match="extra set name '../x'"):
        BaselineEvalParams(extra_sets={"../x": "a.jsonl"})


def test_the_case_report_of_hostile_data_carries_no_live_html(
    prefect_harness, tiny_lm_dir, tmp_path, capsys, monkeypatch
):
    """A data file whose problem holds a fenced block and an <img onerror>, whose id and answer hold HTML
    and backticks: the command's report.md, rendered by a CommonMark viewer, shows them as text."""
    from markdown_it import MarkdownIt

    from a5core.runtime.writing import write_jsonl_atomic
    from flows.baseline_eval import main

    record = {
        "unique_id": "<img src=x onerror=alert(1)>",
        "problem": "Solve:\n```\n<img src=x onerror=alert(2)>\n```\n<script>alert(3)</script>",
        "solution": "$\\boxed{7}$",
        "answer": "`<b>7</b>`",
        "level": "Level 1",
        "type": "Algebra",
    }
    write_jsonl_atomic(tmp_path / "hostile.jsonl", [record])
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts and the cached results go under the working directory
    main(
        ["--model", str(tiny_lm_dir), "--backend", "hf", "--data", str(tmp_path / "hostile.jsonl"), "--max-tokens", "4"]
        + ["--output-dir", str(tmp_path / "out"), "--metrics-path", "null"]
        + ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    )
    capsys.readouterr()
    page = MarkdownIt("commonmark").render((tmp_path / "out/report.md").read_text())
    assert "<img" not in page and "<script" not in page and "<b>" not in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page and "&lt;script&gt;alert(3)&lt;/script&gt;" in page
