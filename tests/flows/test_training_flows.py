"""The sft_experiment and expert_iteration flows on CPU: parent/child MLflow runs, plots, tables, resume."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Trace
from a5core.data.prompts import load_prompt
from a5core.runtime.writing import write_jsonl_atomic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def arithmetic_traces(n, split="train"):
    template = load_prompt("r1_zero")
    return [
        Trace(template.format(p.problem), f" {p.solution} </think> <answer> {p.answer} </answer>", p.answer)
        for p in arithmetic_problems(n, digits=1, split=split)
    ]


def children_of(parent_run_id, experiment):
    import mlflow

    runs = mlflow.search_runs(experiment_names=[experiment])
    return runs[runs["tags.mlflow.parentRunId"] == parent_run_id]


def test_sft_experiment_parent_children_plot_and_resume(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    import mlflow

    import flows.sft_experiment as flow_module
    from flows.sft_experiment import SFTExperimentParams, choose_best, sft_experiment
    from tasks.tables import headline_metrics

    write_jsonl_atomic(tmp_path / "train.jsonl", [asdict(t) for t in arithmetic_traces(24)])
    write_jsonl_atomic(tmp_path / "filtered.jsonl", [asdict(t) for t in arithmetic_traces(6)])
    validation = [p.__dict__ | {"type": "arithmetic"} for p in arithmetic_problems(6, digits=1, split="validation")]
    write_jsonl_atomic(tmp_path / "val.jsonl", validation)
    monkeypatch.chdir(tmp_path)
    params = SFTExperimentParams(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="train.jsonl",
        filtered_data="filtered.jsonl",
        sizes=[8, "full"],
        validation_data="val.jsonl",
        val_subset=3,
        val_limit=6,
        learning_rate=1e-3,
        batch_size=4,
        microbatch_size=2,
        epochs=1,
        eval_every=2,
        checkpoint_every=2,
        max_tokens=12,
        output_dir="out",
        metrics_path="metrics.json",
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    result = sft_experiment(params)
    assert [r["setting"] for r in result["summary"]] == ["8", "full", "filtered"]
    assert [r["steps"] for r in result["summary"]] == [2, 6, 2]
    assert (tmp_path / "out/accuracy_vs_step.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out/summary.json").read_text()) == result["summary"]
    best = choose_best(result["summary"])  # the metrics file: the chosen setting's headline, a flat mapping
    assert json.loads((tmp_path / "metrics.json").read_text()) == headline_metrics(best)
    curves = (tmp_path / "out/curves.csv").read_text().splitlines()
    assert (
        curves[0] == "setting,step,val_accuracy" and len(curves) == 1 + 2 + 4 + 2
    )  # evals at steps 0,2 | 0,2,4,6 | 0,2
    # each row holds its starting model's evaluation (step 0) beside the final one
    assert all(r["initial_accuracy"] is not None and r["initial_format_rate"] is not None for r in result["summary"])

    mlflow.set_tracking_uri(params.tracking_uri)
    children = children_of(result["mlflow_run_id"], "sft_experiment")
    assert sorted(children["tags.mlflow.runName"]) == ["sft-8", "sft-filtered", "sft-full"]
    assert set(children["metrics.final_val_n_problems"]) == {3.0}  # the score split: 6 problems less the 3 selecting
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result["mlflow_run_id"])}
    assert {"accuracy_vs_step.png", "summary.md", "curves.csv"} <= artifacts
    child_artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(children["run_id"].iloc[0], "generations")}
    assert child_artifacts  # a generations table per evaluation

    # Running again trains nothing: every child is done, the same parent run is continued.
    monkeypatch.setattr(flow_module, "train_sft", lambda *a, **k: pytest.fail("a finished setting was trained again"))
    again = sft_experiment(params)
    assert again["mlflow_run_id"] == result["mlflow_run_id"] and again["summary"] == result["summary"]


def tiny_ei_sweep(tmp_path, model, **overrides):
    """An EI sweep of two children (D_b 4 and 6) on one-digit arithmetic with a tiny model."""
    from flows.params import EIParams

    settings = dict(
        model=str(model),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        questions_per_step=4,
        max_tokens=12,
        min_tokens=0,
        batch_size=4,
        microbatch_size=2,
        sweep=True,
        sweep_rollouts_per_question=[2],
        sweep_epochs=[1],
        sweep_questions_per_step=[4, 6],
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    return EIParams(**{**settings, **overrides})


def test_expert_iteration_sweep_as_children(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    import mlflow

    from flows.expert_iteration import expert_iteration_flow

    monkeypatch.chdir(tmp_path)
    params = tiny_ei_sweep(tmp_path, tiny_lm_dir, val_limit=6, n_ei_steps=2)
    result = expert_iteration_flow(params)
    assert [r["setting"] for r in result["summary"]] == ["G2_E1_Db4", "G2_E1_Db6"]
    assert (tmp_path / "out/accuracy_vs_step.png").is_file()
    mlflow.set_tracking_uri(params.tracking_uri)
    children = children_of(result["mlflow_run_id"], "expert_iteration")
    assert len(children) == 2
    child = mlflow.MlflowClient().get_run(children["run_id"].iloc[0])
    assert {"kept_fraction", "rollout_mean_token_entropy", "val_accuracy", "final_val_accuracy"} <= set(
        child.data.metrics
    )
    history = mlflow.MlflowClient().get_metric_history(child.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [0, 1, 2]  # the starting policy, then after each of 2 rounds
    assert all(r["initial_accuracy"] is not None for r in result["summary"])


def test_the_ei_sweep_runs_its_children_at_once_on_ray(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """``runner: ray``: the grid's children run at the same time on a local Ray instance, each in a worker
    process with its own engine, under the one parent run. At the same time, shown without a clock: each
    child waits in a rendezvous (tests/ray_children.py) until both have started."""

    import mlflow
    from ray_children import Rendezvous, meeting_fan_out

    import flows.expert_iteration
    from flows import fanout
    from flows.expert_iteration import expert_iteration_flow

    monkeypatch.chdir(tmp_path)
    rendezvous, handed = tmp_path / "rendezvous", []
    monkeypatch.setattr(fanout, "run_children_on_ray", meeting_fan_out(rendezvous, handed))
    for module in (fanout, flows.expert_iteration):  # Ray's workers import their own, unpatched
        monkeypatch.setattr(module, "engine_for", lambda params: pytest.fail("the driver started an engine"))
    params = tiny_ei_sweep(tmp_path, tiny_lm_dir, val_limit=3, n_ei_steps=1, runner="ray", ray_gpus_per_child=0)
    result = expert_iteration_flow(params)
    assert handed == [["G2_E1_Db4", "G2_E1_Db6"]]  # one fan-out with both children
    assert [r["setting"] for r in result["summary"]] == ["G2_E1_Db4", "G2_E1_Db6"]
    Rendezvous.check_met(rendezvous, handed[0])
    mlflow.set_tracking_uri(params.tracking_uri)
    children = children_of(result["mlflow_run_id"], "expert_iteration")
    assert sorted(children["params.questions_per_step"]) == ["4", "6"] and set(children["status"]) == {"FINISHED"}
    assert (tmp_path / "out/accuracy_vs_step.png").is_file()


def test_sft_on_generated_arithmetic_hands_its_best_model_to_the_next_stage(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    """The cpu profile's chain: SFT on arithmetic:N:D traces, validated with the arithmetic grader, saves its
    best setting's model as output_dir/best_model; a stage starting from it is keyed by its files, so a
    retrained model is not mistaken for the one an earlier run finished with. Its run records the prompts its
    traces were written with, and its settings (append_eos among them)."""
    from flows.params import GRPOParams
    from flows.sft_experiment import SFTExperimentParams, sft_experiment
    from tasks.runs import run_key

    monkeypatch.chdir(tmp_path)
    params = SFTExperimentParams(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:12:1",
        filtered_data=None,
        sizes=["full"],
        validation_data="arithmetic:8:1",
        reward_fn="arithmetic",
        val_subset=4,
        val_limit=4,
        batch_size=4,
        microbatch_size=4,
        max_steps=1,
        eval_every=1,
        max_tokens=12,
        append_eos=True,
        save_models=True,
        output_dir="out",
        metrics_path=None,
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    result = sft_experiment(params)
    assert [(r["setting"], r["n_examples"], r["steps"]) for r in result["summary"]] == [("full", 12, 1)]
    best = tmp_path / "out/best_model"
    assert best.is_symlink() and (best / "config.json").is_file() and (best / "model.safetensors").is_file()
    import mlflow

    client = mlflow.MlflowClient(params.tracking_uri)
    tags = client.get_run(result["mlflow_run_id"]).data.tags
    assert tags["best_setting"] == "full" and tags["chosen_on"] == "one setting: nothing to choose"
    (row,) = result["summary"]  # so its curve scored the problems its final evaluation scores, and ends there
    assert row["selection_accuracy"] is None
    assert row["accuracy_change"] == pytest.approx(row["final_accuracy"] - row["initial_accuracy"])

    # The best model is registered (a5-sft), its run's final metrics its description; loaded back through the
    # registry it generates. Its weights are the saved folder's: the MLflow model holds no second copy.
    (child,) = children_of(result["mlflow_run_id"], "sft_experiment")["run_id"]
    assert result["models"] == [
        {"name": "a5-sft", "setting": "full", "run_id": child, "model_dir": str(best.resolve()), "version": "1"}
    ]
    logged = client.get_run(child).data.params
    assert logged["trace_prompts"] == "r1_zero" and logged["append_eos"] == "True" and logged["n_examples"] == "12"
    version = client.get_model_version("a5-sft", "1")
    assert version.run_id == child and version.tags["setting"] == "full"
    final = client.get_run(child).data.metrics["final_val_accuracy"]
    assert f"- final_val_accuracy: {final:.4g}" in version.description
    policy = mlflow.pyfunc.load_model("models:/a5-sft/1", model_config={"max_new_tokens": 6})
    (completion,) = policy.predict(["What is 1 + 2?"])
    assert isinstance(completion, str) and completion.strip()
    logged = Path(mlflow.artifacts.download_artifacts("models:/a5-sft/1", dst_path=str(tmp_path / "logged")))
    assert (logged / "MLmodel").is_file() and not list(logged.rglob("*.safetensors"))
    # The parent's chart view has the child's curve.
    assert {m.step for m in client.get_metric_history(result["mlflow_run_id"], "val_accuracy/full")} == {0, 1}
    key = run_key(GRPOParams(model=str(best)))
    sft_experiment(params.replace(learning_rate=1e-3))  # another SFT run: the link moves
    assert run_key(GRPOParams(model=str(best))) != key

    # A version's folder written over (here one file of it) is refused by name, not loaded as other weights.
    with open(Path(result["models"][0]["model_dir"]) / "config.json", "a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match=r"config\.json changed since this model version was registered"):
        mlflow.pyfunc.load_model("models:/a5-sft/1")


def test_append_eos_is_set_from_the_sft_flows_command_line(tmp_path, monkeypatch):
    from flows.arguments import parse_params
    from flows.params import SFTExperimentParams

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    flags = ["--config", "params.yaml", "--profile", "gpu-small", "--sizes", "[1024]", "--filtered-data", "null"]
    flags += ["--train-data", str(tmp_path / "both.jsonl"), "--append-eos", "true"]
    params = parse_params(SFTExperimentParams, "sft_experiment", flags)
    assert params.sft.append_eos is True and params.sizes == [1024] and params.filtered_data is None
    assert parse_params(SFTExperimentParams, "sft_experiment", flags[:-2]).sft.append_eos is False


def test_the_best_sft_setting_is_chosen_on_the_selection_split_alone():
    """Scores on the score split (final_*) permuted or altered: the same setting is chosen; the selection split
    alone decides. The two splits of the validation set are disjoint."""
    from a5core.data.problem_sets import load_problem_set, split_validation
    from flows.sft_experiment import choose_best

    rows = [
        {"setting": "128", "selection_accuracy": 0.2, "selection_format_rate": 0.9, "final_accuracy": 0.9},
        {"setting": "full", "selection_accuracy": 0.4, "selection_format_rate": 0.5, "final_accuracy": 0.1},
        {"setting": "filtered", "selection_accuracy": 0.4, "selection_format_rate": 0.8, "final_accuracy": 0.5},
    ]
    assert choose_best(rows)["setting"] == "filtered"  # a tie on accuracy broken by format rate
    for finals in ([0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]):
        altered = [r | {"final_accuracy": f, "final_format_rate": f} for r, f in zip(rows, finals, strict=True)]
        assert choose_best(altered)["setting"] == "filtered"
    problems = load_problem_set("arithmetic:20:1", "math", 0, "validation")
    selection, score = split_validation(problems, 5, None)
    assert len(selection) == 5 and len(score) == 15
    assert not {p.unique_id for p in selection} & {p.unique_id for p in score}
    assert split_validation(problems, 5, 4)[1] == score[:4]
    assert [len(part) for part in split_validation(problems, 500, None)] == [10, 10]  # at most half select
    with pytest.raises(ValueError, match="two at least"):
        split_validation(problems[:1], 1, None)
