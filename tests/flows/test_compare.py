"""flows.compare: runs side by side (table of differing params and final metrics, a plot per metric by step),
logged as a comparison run; on hand-made runs and on a real (tiny) GRPO ablation's children."""

import csv
import json

import pytest

from flows.compare import CompareParams, compare, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def log_run(experiment, name, params, curves):
    import mlflow

    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params(params)
        for metric, values in curves.items():
            for step, value in enumerate(values):
                mlflow.log_metric(metric, value, step=step)
    return run.info.run_id


def test_compare_an_experiment_table_plots_and_comparison_run(prefect_harness, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    slow = log_run(
        "toy",
        "slow",
        {"learning_rate": "1e-5", "seed": "0"},
        {"val_accuracy": [0.1, 0.2, 0.3], "reward_mean": [0.0, 0.5], "loss": [2.0, 1.0]},
    )
    fast = log_run(
        "toy",
        "fast",
        {"learning_rate": "1e-4", "seed": "0"},
        {"val_accuracy": [0.1, 0.4, 0.6], "reward_mean": [0.2, 0.9], "loss": [2.0, 0.5]},
    )
    log_run("other", "elsewhere", {"learning_rate": "1"}, {"val_accuracy": [1.0]})

    result = compare(CompareParams(experiment="toy", output_dir=str(tmp_path / "cmp"), tracking_uri=uri))

    assert result["params"] == ["learning_rate"]  # seed is the same in both: not shown
    assert result["metrics"] == ["val_accuracy", "reward_mean"]
    by_name = {r["run"]: r for r in result["rows"]}
    assert set(by_name) == {"slow", "fast"}
    assert by_name["fast"] == {
        "run": "fast",
        "run_id": fast,
        "learning_rate": "1e-4",
        "val_accuracy": 0.6,
        "reward_mean": 0.9,
    }
    assert by_name["slow"]["val_accuracy"] == 0.3 and by_name["slow"]["run_id"] == slow

    out = tmp_path / "cmp"
    table = (out / "comparison.md").read_text()
    assert "| run | run_id | learning_rate | val_accuracy | reward_mean |" in table
    assert "| fast | " in table and "| 1e-4 | 0.6 | 0.9 |" in table
    assert "![val_accuracy by step](val_accuracy_vs_step.png)" in table
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert {r["run"]: r["learning_rate"] for r in rows} == {"slow": "1e-5", "fast": "1e-4"}
    assert json.loads((out / "comparison.json").read_text()) == result["rows"]
    for metric in ("val_accuracy", "reward_mean"):
        assert (out / f"{metric}_vs_step.png").stat().st_size > 1000

    client = mlflow.MlflowClient(tracking_uri=uri)
    logged = client.get_run(result["mlflow_run_id"])
    assert client.get_experiment(logged.info.experiment_id).name == "comparison"
    assert set(logged.data.tags["compared_run_ids"].split(",")) == {slow, fast}
    assert logged.data.tags["compared_experiment"] == "toy"
    artifacts = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert {
        "comparison.md",
        "comparison.csv",
        "comparison.json",
        "val_accuracy_vs_step.png",
        "reward_mean_vs_step.png",
    } <= artifacts

    # A filter narrows the search; named metrics replace the defaults; a metric no run holds is reported.
    narrowed = compare(
        CompareParams(
            experiment="toy",
            filter="params.learning_rate = '1e-4'",
            metrics=["loss", "nope"],
            plot_metrics=["loss"],
            output_dir=str(tmp_path / "cmp2"),
            tracking_uri=uri,
            log_to_mlflow=False,
        )
    )
    assert [r["run"] for r in narrowed["rows"]] == ["fast"]
    assert narrowed["rows"][0]["loss"] == 0.5 and narrowed["rows"][0]["nope"] is None
    assert narrowed["missing"] == ["nope"] and narrowed["mlflow_run_id"] is None
    assert (tmp_path / "cmp2/loss_vs_step.png").is_file()


def test_compare_the_children_of_a_real_grpo_ablation(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys):
    """Two GRPO runs (the baseline ablation's children) compared through the CLI, by id and as children."""
    import mlflow

    from flows.grpo import GRPOParams, grpo_baseline_ablation

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = GRPOParams(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=2,
        val_limit=2,
        eval_every=1,
        n_grpo_steps=2,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=8,
        min_tokens=1,
        checkpoint_every=0,
        output_dir=str(tmp_path / "grpo"),
        metrics_path=None,
        tracking_uri=uri,
    )
    parent = grpo_baseline_ablation(params)["mlflow_run_id"]

    main(["--parent", parent, "--output-dir", str(tmp_path / "by_parent"), "--tracking-uri", uri])
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "by_parent/comparison.json").read_text())
    assert [r["run"] for r in rows] == ["grpo-no_baseline", "grpo-reinforce_with_baseline"]
    assert [r["loss_type"] for r in rows] == ["no_baseline", "reinforce_with_baseline"]
    assert {"setting", "loss_type"} <= set(rows[0]) and "learning_rate" not in rows[0]  # only what differs
    assert all(0 <= r["final_val_accuracy"] <= 1 and r["reward_mean"] is not None for r in rows)
    for metric in ("val_accuracy", "reward_mean"):
        assert (tmp_path / f"by_parent/{metric}_vs_step.png").stat().st_size > 1000
    assert "grpo-no_baseline" in printed and "mlflow run" in printed

    ids = ",".join(r["run_id"] for r in reversed(rows))
    main(
        [
            "--runs",
            ids,
            "--plot-metrics",
            "token_entropy",
            "--output-dir",
            str(tmp_path / "by_id"),
            "--tracking-uri",
            uri,
        ]
    )
    again = json.loads((tmp_path / "by_id/comparison.json").read_text())
    assert [r["run"] for r in again] == ["grpo-reinforce_with_baseline", "grpo-no_baseline"]  # the order given
    assert (tmp_path / "by_id/token_entropy_vs_step.png").is_file()
    comparisons = mlflow.MlflowClient(tracking_uri=uri).search_runs(
        [mlflow.get_experiment_by_name("comparison").experiment_id]
    )
    assert sorted(r.data.tags["compared_run_ids"] for r in comparisons) == sorted(
        [ids, ",".join(r["run_id"] for r in rows)]
    )


def test_params_take_comma_lists_and_one_selection():
    assert CompareParams(runs="a, b,").runs == ["a", "b"]
    assert CompareParams(experiment="grpo", plot_metrics="x,y").plot_metrics == ["x", "y"]
    for bad in ({}, {"runs": ["a"], "experiment": "grpo"}, {"runs": ["a"], "filter": "params.x = '1'"}):
        with pytest.raises(ValueError):
            CompareParams(**bad)


def test_cli_says_what_is_wrong(tmp_path, prefect_harness, capsys):
    import mlflow

    argv = [
        "--experiment",
        "missing",
        "--tracking-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--log-to-mlflow",
        "false",
    ]
    with pytest.raises(SystemExit, match=r"tracking_uri sqlite:///.*/mlflow.db: no such database file \("):
        main(argv)
    assert not (tmp_path / "mlflow.db").exists()  # a store read is never created
    mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_experiments()  # a store, without it
    with pytest.raises(SystemExit, match="no MLflow experiment named 'missing'"):
        main(argv)
    with pytest.raises(SystemExit):
        main(["--runs", "a", "--parent", "b"])
    assert "give exactly one of runs, experiment or parent" in capsys.readouterr().err


def test_evaluation_runs_get_their_paired_difference(prefect_harness, tmp_path, monkeypatch):
    """Two evaluation runs (every graded sample logged as generations.json) on overlapping problems: the
    second against the first, per-problem accuracy differences on the shared problems, with their error."""
    import math
    import statistics

    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("evals")
    scores = {
        "base": {"p1": [1, 0], "p2": [0, 0], "p3": [1, 1], "p4": [0, 1]},
        "tuned": {"p1": [1, 1], "p2": [1, 0], "p3": [1, 1], "p5": [1, 1]},
    }
    ids = {}
    for name, problems in scores.items():
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_metric("accuracy", 0.5)
            rows = [(uid, i, float(r)) for uid, rewards in problems.items() for i, r in enumerate(rewards)]
            columns = dict(
                zip(("unique_id", "sample", "answer_reward"), map(list, zip(*rows, strict=True)), strict=True)
            )
            mlflow.log_table(columns, artifact_file="generations.json")
            ids[name] = run.info.run_id
    params = CompareParams(runs=[ids["base"], ids["tuned"]], tracking_uri=uri, output_dir=str(tmp_path / "out"))
    result = compare(params)
    ((row,),) = [result["paired"]]
    diffs = [1 - 0.5, 0.5 - 0, 1 - 1]  # p1, p2, p3 (p4 and p5 are in one run only)
    assert row["run"] == "tuned" and row["against"] == "base" and row["n_problems"] == 3
    assert row["difference"] == pytest.approx(statistics.mean(diffs))
    assert row["difference_se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    assert json.loads((tmp_path / "out/paired.json").read_text()) == result["paired"]
    assert "## Paired differences against base" in (tmp_path / "out/comparison.md").read_text()


def test_training_runs_are_paired_over_their_final_evaluations_problems(prefect_harness, tmp_path, monkeypatch):
    """Two training runs that logged per-problem tables (``per_problem/``): each is read at its final evaluation
    (the last step's largest table, not the curve's subset at that step), and the second is paired against the
    first on the problems both evaluated."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("grpo")
    finals = {"a": [1, 0, 1, 0], "b": [1, 1, 1, 1]}
    ids = {}
    for name, rewards in finals.items():
        with mlflow.start_run(run_name=name) as run:
            mlflow.log_metric("final_val_accuracy", sum(rewards) / 4)
            tables = {
                "subset2_step_000000.json": [0, 0],
                "subset2_step_000004.json": [0, 0],  # the curve at the last step: not the final evaluation
                "subset4_step_000004.json": rewards,
            }
            for table, scores in tables.items():
                columns = {"unique_id": [f"p{i}" for i in range(len(scores))], "sample": [0] * len(scores)}
                mlflow.log_table(columns | {"answer_reward": [float(r) for r in scores]}, f"per_problem/{table}")
            ids[name] = run.info.run_id
    result = compare(CompareParams(runs=[ids["a"], ids["b"]], tracking_uri=uri, output_dir=str(tmp_path / "out")))
    ((row,),) = [result["paired"]]
    assert row["run"] == "b" and row["against"] == "a" and row["n_problems"] == 4
    assert row["difference"] == pytest.approx(0.5)


def test_a_damaged_record_is_shown_as_such_not_a_traceback(prefect_harness, tmp_path, monkeypatch):
    """One run's provenance.json has sections of the wrong kind (a hand-edited or truncated record): the comparison
    still comes, that run's column saying its record is damaged."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("records")
    good = {"code": {"commit": "abc"}, "inputs": {"model": {"path": "m", "hash": "folder:1"}}, "device": "cpu"}
    for name, record in (("good", good), ("damaged", {"code": "abc", "inputs": 5}), ("list", [1, 2])):
        with mlflow.start_run(run_name=name):
            mlflow.log_metric("final_val_accuracy", 0.5)
            mlflow.log_dict(record, "provenance.json")
    result = compare(CompareParams(experiment="records", output_dir=str(tmp_path / "out"), tracking_uri=uri))
    by_what = {row["what"]: row for row in result["records"]}
    assert by_what["code.commit"]["good"] == "abc"
    assert by_what["code.commit"]["damaged"] == by_what["code.commit"]["list"] == "(damaged record)"
    assert "(damaged record)" in (tmp_path / "out/comparison.md").read_text()
