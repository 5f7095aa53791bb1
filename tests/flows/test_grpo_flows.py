"""The grpo flow and its ablation flows on CPU: MLflow parent/child runs, metrics, plots, resume, settings."""

import json
from pathlib import Path

import pytest

from a5core.grading.rewards import REWARD_FNS
from flows.grpo import ABLATIONS, GRPOParams, ablation_settings, grpo_baseline_ablation, grpo_flow, main
from tasks.tables import headline_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def single_run(client, result):
    """A one-run flow's training run: the child ``single`` of the flow's parent run."""
    parent = client.get_run(result["mlflow_run_id"])
    (run,) = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert run.data.params["setting"] == "single"
    return run


def tiny_params(tmp_path, model, **overrides) -> GRPOParams:
    settings = dict(
        model=str(model),
        backend="hf",
        train_data="arithmetic:30:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        val_limit=4,
        eval_every=1,
        n_grpo_steps=2,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=12,
        min_tokens=1,
        checkpoint_every=1,
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    return GRPOParams(**{**settings, **overrides})


def test_single_run_logs_every_step_and_the_validation_curves(prefect_harness, tiny_lm_dir, tmp_path):
    import mlflow

    params = tiny_params(tmp_path, tiny_lm_dir, val_samples=2)  # two samples a validation problem
    result = grpo_flow(params)
    assert [r["setting"] for r in result["summary"]] == ["single"]
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    run = single_run(client, result)
    per_step = {
        "reward_mean",
        "format_reward_mean",
        "answer_reward_mean",
        "advantage_mean",
        "advantage_std",
        "token_entropy",
        "response_tokens_mean",
        "loss",
        "grad_norm",
        "lr",
        "time_generate",
        "time_grade",
        "time_train",
        "time_weight_sync",
        "generate_tokens_per_s",
        "train_tokens_per_s",
        "wall_seconds",
        "mismatch_log_ratio_mean",
        "mismatch_log_ratio_max",
        "mismatch_kl_k3",
        "mismatch_over_cap",
    }
    assert per_step <= set(run.data.metrics)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")) == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")) == [0, 1, 2]
    assert client.get_metric_history(run.info.run_id, "val_accuracy_by_wall_seconds")
    assert run.data.metrics["final_val_n_problems"] == 4
    validation = {"val_accuracy_se", "val_avg_at_2", "val_pass_at_1", "val_pass_at_2", "val_pass_at_2_se"}
    validation.add("val_maj_at_2")
    assert validation | {f"final_{k}" for k in validation} <= set(run.data.metrics)
    assert run.data.metrics["final_val_pass_at_2"] >= run.data.metrics["final_val_pass_at_1"]
    assert run.data.params["loss_type"] == "reinforce_with_baseline"
    assert run.data.tags["model_path"] == str(tiny_lm_dir.resolve())  # the real folder the run started from
    assert [a.path for a in client.list_artifacts(run.info.run_id, "generations")]
    out = tmp_path / "out"
    for name in ("accuracy_vs_step.png", "accuracy_vs_wall_clock.png", "token_entropy_vs_step.png", "curves.csv"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "summary.json").read_text()) == result["summary"]
    (row,) = result["summary"]  # the metrics file: its headline, a flat mapping (a row of `dvc metrics show`)
    assert json.loads((tmp_path / "metrics.json").read_text()) == headline_metrics(row)
    assert set(headline_metrics(row)) == {"accuracy", "accuracy_se", "change", "change_se", "format_rate"}
    # The parent run holds the comparison and the child's curve; the final policy is registered (a5-grpo).
    parent = result["mlflow_run_id"]
    assert {"accuracy_vs_step.png", "summary.md"} <= {a.path for a in client.list_artifacts(parent)}
    assert sorted(m.step for m in client.get_metric_history(parent, "val_accuracy/single")) == [0, 1, 2]
    ((model,),) = [result["models"]]
    assert (model["name"], model["run_id"]) == ("a5-grpo", run.info.run_id)
    assert client.get_model_version("a5-grpo", model["version"]).run_id == run.info.run_id


def test_an_ablation_is_a_parent_with_a_child_per_setting_and_resumes(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    import mlflow

    import flows.grpo as flow_module

    params = tiny_params(tmp_path, tiny_lm_dir, eval_every=0)
    result = grpo_baseline_ablation(params)
    assert [r["setting"] for r in result["summary"]] == ["no_baseline", "reinforce_with_baseline"]
    mlflow.set_tracking_uri(params.tracking_uri)
    runs = mlflow.search_runs(experiment_names=["grpo"])
    children = runs[runs["tags.mlflow.parentRunId"] == result["mlflow_run_id"]]
    assert sorted(children["params.loss_type"]) == ["no_baseline", "reinforce_with_baseline"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(result["mlflow_run_id"])}
    assert {
        "accuracy_vs_step.png",
        "accuracy_vs_wall_clock.png",
        "summary.md",
        "train_curves.csv",
        "response_tokens_mean_vs_step.png",
    } <= artifacts
    # Again: nothing is trained, the same parent run is continued, though the settings of how and how fast it
    # runs changed (an H200 run resumed with --runner ray was refused: MLflow keeps a parameter's first value).
    monkeypatch.setattr(flow_module, "grpo", lambda *a, **k: pytest.fail("a finished child was trained again"))
    scheduled = {"ray_gpus_per_child": 0.25, "ray_cpus_per_child": 2.0, "max_tokens_per_microbatch": 4096}
    again = grpo_baseline_ablation(params.replace(**scheduled))
    assert again["mlflow_run_id"] == result["mlflow_run_id"] and again["summary"] == result["summary"]
    parent = mlflow.MlflowClient(params.tracking_uri).get_run(result["mlflow_run_id"])
    changed = {key: parent.data.tags[f"changed_on_resume.{key}"] for key in scheduled}
    assert changed == {key: str(v) for key, v in scheduled.items()}
    assert {key: parent.data.params[key] for key in scheduled} == {key: str(getattr(params, key)) for key in scheduled}


def test_runs_of_other_seeds_score_the_same_problems(prefect_harness, tiny_lm_dir, tmp_path):
    """The seed changes sampling and training order, not which problems score: a comparison's seeds pair
    problem by problem (the validation set is drawn and ordered the same for every seed)."""
    import mlflow

    from tasks.run_reading import final_per_problem

    scored = {}
    for seed in (0, 1):
        params = tiny_params(tmp_path / f"s{seed}", tiny_lm_dir, seed=seed, n_grpo_steps=1, eval_every=0)
        client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
        scored[seed] = [r["unique_id"] for r in final_per_problem(client, single_run(client, grpo_flow(params)))]
    # arithmetic:6:1 drawn with seed 1 shares few of its problems with seed 0's draw
    assert len(scored[0]) == 4 and scored[0] == scored[1]


def test_every_ablation_builds_valid_settings():
    params = GRPOParams()
    names = {name: list(ablation_settings(name, params)) for name in ABLATIONS}
    assert names["grpo_off_policy_sweep"] == ["on_policy", "E2_tb128", "E2_tb64", "E4_tb128", "E4_tb64"]
    assert names["grpo_prompt_ablation"] == ["r1_zero", "question_only"]
    off_policy = ablation_settings("grpo_off_policy_sweep", params)
    assert {p.train_batch_size // p.gradient_accumulation_steps for p in off_policy.values()} == {2}  # micro-batch kept
    assert (
        off_policy["E4_tb64"].loss_type == "grpo_clip"
        and off_policy["on_policy"].loss_type == "reinforce_with_baseline"
    )
    prompts = ablation_settings("grpo_prompt_ablation", params)
    assert {name: p.grader for name, p in prompts.items()} == {"r1_zero": "r1_zero", "question_only": "question_only"}
    clip = ablation_settings("grpo_clip_ablation", params)
    assert [p.loss_type for p in clip.values()] == ["grpo_clip", "grpo_no_clip"]
    tabled = params.replace(difficulty_table="data/difficulty/pass_rates.csv")
    sampling = ablation_settings("grpo_question_sampling_ablation", tabled)
    assert {name: p.question_sampling for name, p in sampling.items()} == {
        "uniform": "uniform",
        "learnable": "learnable",
    }
    assert {p.difficulty_table for p in sampling.values()} == {"data/difficulty/pass_rates.csv"}  # both read one table


def test_ablation_only_runs_the_named_settings_in_the_ablations_order():
    params = GRPOParams(ablation="grpo_dapo_ablation", ablation_only=["dapo", "grpo"])
    only = ablation_settings("grpo_dapo_ablation", params)
    assert list(only) == ["grpo", "dapo"]
    full = ablation_settings("grpo_dapo_ablation", params.replace(ablation_only=None))
    assert only["dapo"] == full["dapo"] and only["dapo"].ablation_only is None  # the child carries no filter
    with pytest.raises(ValueError, match=r"ablation_only: 'dapo2' not among grpo_dapo_ablation's settings \(grpo, dyn"):
        ablation_settings("grpo_dapo_ablation", params.replace(ablation_only=["dapo2"]))


def test_the_prompt_ablation_on_arithmetic_keeps_the_arithmetic_grader():
    """Graded by the MATH graders, whose answers may be any equal expression, an arithmetic run learns to copy the
    question: each prompt keeps the arithmetic task's grader, in that prompt's format."""
    params = GRPOParams(train_data="arithmetic:40:2", validation_data="arithmetic:8:2", reward_fn="arithmetic")
    prompts = ablation_settings("grpo_prompt_ablation", params)
    assert {name: (p.prompt, p.grader) for name, p in prompts.items()} == {
        "r1_zero": ("r1_zero", "arithmetic"),
        "question_only": ("question_only", "arithmetic_question_only"),
    }
    assert REWARD_FNS[prompts["question_only"].grader]("so \\boxed{58 + 74}", "132")["reward"] == 0.0


def test_a_grader_of_another_prompt_format_is_refused():
    with pytest.raises(ValueError, match="reward_fn 'arithmetic' reads r1_zero answers, but prompt 'question_only'"):
        GRPOParams(prompt="question_only", reward_fn="arithmetic")
    with pytest.raises(ValueError, match="use a grader of r1_zero answers \\(r1_zero, arithmetic\\)"):
        GRPOParams(reward_fn="question_only")
    assert GRPOParams(prompt="question_only", reward_fn="arithmetic_question_only").grader == "arithmetic_question_only"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loss-type", "grpo_clip"], "every ratio is 1"),
        (["--rollout-batch-size", "264"], "rollout_batch_size must be a multiple of train_batch_size"),
        (["--ablation", "grpo_off_policy_sweep", "--sweep-train-batch-sizes", "[100]"], "a multiple of"),
    ],
)
def test_cli_refuses_a_bad_combination_before_starting(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    code = stopped.value.code  # a message (exit 1), or 2 with the message on stderr (a bad parameter)
    text = code if isinstance(code, str) else capsys.readouterr().err
    assert message in text and "\n" not in text.strip(), text


def test_an_ablation_fans_its_children_out_over_ray(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """runner ray: the ablation hands its two children to flows.fanout.run_children_on_ray, they run at the
    same time on a local Ray instance, each in a worker process with its own engine, and land in MLflow
    exactly as the local runner's do. At the same time, shown without a clock: the test wraps the flow's
    child runner in a rendezvous (tests/ray_children.py) where each child, once started, waits until both
    have started, so children run one after another would fail after 120 s instead of passing."""
    import mlflow
    from ray_children import Rendezvous, meeting_fan_out

    import flows.grpo
    from flows import fanout

    rendezvous, handed = tmp_path / "rendezvous", []
    monkeypatch.setattr(fanout, "run_children_on_ray", meeting_fan_out(rendezvous, handed))
    for module in (fanout, flows.grpo):  # Ray's workers import their own, unpatched
        monkeypatch.setattr(module, "engine_for", lambda params: pytest.fail("the driver started an engine"))
    params = tiny_params(tmp_path, tiny_lm_dir, eval_every=0, runner="ray", ray_gpus_per_child=0)
    result = grpo_baseline_ablation(params)
    assert handed == [["no_baseline", "reinforce_with_baseline"]]  # one fan-out with both children
    assert [r["setting"] for r in result["summary"]] == ["no_baseline", "reinforce_with_baseline"]
    Rendezvous.check_met(rendezvous, handed[0])
    mlflow.set_tracking_uri(params.tracking_uri)
    runs = mlflow.search_runs(experiment_names=["grpo"])
    children = runs[runs["tags.mlflow.parentRunId"] == result["mlflow_run_id"]]
    assert sorted(children["params.loss_type"]) == ["no_baseline", "reinforce_with_baseline"]
    assert set(children["status"]) == {"FINISHED"}
    assert (tmp_path / "out/accuracy_vs_step.png").is_file()
    # A child's record names the flow that fanned it out (flows.reproduce re-runs that), not the Ray sub-flow.
    client = mlflow.MlflowClient(params.tracking_uri)
    for run_id in children["run_id"]:
        record = json.loads(Path(client.download_artifacts(run_id, "provenance.json", str(tmp_path))).read_text())
        assert record["flow"]["entrypoint"] == "flows.grpo:grpo_baseline_ablation", record["flow"]


# ------------------------------------------------------------------ the options beyond the handout


def test_every_grpo_setting_is_in_params_yaml_and_the_new_ones_read_from_flags():
    """``dvc exp run -S grpo.<field>=...`` and the Prefect form start from params.yaml's `grpo` section: it
    holds every setting of the loop. The command line sets the new options like any other."""
    from pathlib import Path

    import yaml

    from a5core.loops.grpo import GRPOConfig
    from a5core.runtime.settings import HOW_FAST_FIELDS
    from flows.arguments import parse_params

    section = yaml.safe_load((Path(__file__).resolve().parents[2] / "params.yaml").read_text())["grpo"]
    speed = set(HOW_FAST_FIELDS)  # how fast, not what: left to the GPU profiles
    assert {name for name in GRPOConfig.flat_fields() if name not in section} == speed
    flags = [
        "--dynamic-sampling", "true", "--max-extra-draws", "2", "--overlong-buffer", "64", "--overlong-penalty", "0.5",
        "--mask-truncated", "true", "--length-normalization", "token_mean", "--kl-coef", "0.01",
        "--kl-estimator", "k2", "--gspo-cliprange", "0.001",
    ]  # fmt: skip
    params = parse_params(GRPOParams, "grpo", flags)
    assert (params.dynamic_sampling, params.max_extra_draws, params.overlong_buffer, params.overlong_penalty) == (
        True,
        2,
        64,
        0.5,
    )
    assert (params.mask_truncated, params.length_normalization, params.kl_coef, params.kl_estimator) == (
        True,
        "token_mean",
        0.01,
        "k2",
    )
    assert params.gspo_cliprange == 0.001 and params.pipeline_depth == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pipeline-depth", "1", "--tis-cap", "2"], "pipeline_depth 1 generates the next step's rollouts while"),
        (["--ablation", "grpo_async_ablation"], "grpo_async_ablation, setting one_step_off: pipeline_depth 1"),
        (["--pipeline-depth", "1"], "tis_cap must be set"),
        (["--loss-type", "gspo"], "every ratio is 1"),
    ],
)
def test_the_new_options_refuse_what_cannot_run_before_starting(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    code = stopped.value.code
    text = code if isinstance(code, str) else capsys.readouterr().err
    assert message in text, text


def test_a_dapo_and_kl_run_through_the_flow(prefect_harness, tiny_lm_dir, tmp_path):
    import mlflow

    params = tiny_params(
        tmp_path,
        tiny_lm_dir,
        dynamic_sampling=True,
        length_normalization="token_mean",
        overlong_buffer=4,
        mask_truncated=True,
        kl_coef=0.05,
    )
    result = grpo_flow(params)
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    run = single_run(client, result)
    assert {"kl", "sampling_draws", "kept_groups", "overlong_penalty_mean"} <= set(run.data.metrics)
    assert run.data.params["kl_coef"] == "0.05" and run.data.params["length_normalization"] == "token_mean"
    assert len(client.get_metric_history(run.info.run_id, "kl")) == params.n_grpo_steps


def test_one_step_off_through_the_flow_with_the_engine_in_its_own_process(prefect_harness, tiny_lm_dir, tmp_path):
    """pipeline_depth 1 as users run it: the engine a RemoteEngine on the CPU (``engine_device: cpu``),
    weights pushed over gloo, the next step's rollouts generated in that process during training."""
    import mlflow

    params = tiny_params(tmp_path, tiny_lm_dir, n_grpo_steps=3, pipeline_depth=1, tis_cap=2.0, engine_device="cpu")
    result = grpo_flow(params)
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    run_id = single_run(client, result).info.run_id
    versions = client.get_metric_history(run_id, "rollout_policy_version")
    assert [m.value for m in sorted(versions, key=lambda m: m.step)] == [0, 0, 1]
    assert len(client.get_metric_history(run_id, "time_wait_rollouts")) == 2


def test_steps_without_a_learning_signal_are_said_and_the_run_ends_with_its_curves(
    prefect_harness, tiny_lm_dir, tmp_path, caplog
):
    """The tiny model never writes the r1_zero format: every group's rewards are equal (0), so with
    drop_uniform_groups no step trains. Each step says it had no learning signal, three in a row are warned of,
    and the run still writes its trends (no entropy where nothing was trained) and its report."""
    import csv
    import logging

    params = tiny_params(tmp_path, tiny_lm_dir, drop_uniform_groups=True, n_grpo_steps=3, eval_every=3)
    with caplog.at_level(logging.INFO, logger="a5core"):
        result = grpo_flow(params)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("no learning signal (every group's rewards equal)" in line for line in lines) == 3, lines
    assert any(line.startswith("GRPO steps 1-3 of 3: no learning signal in 3 steps in a row") for line in lines)
    with open(tmp_path / "out/train_curves.csv") as f:
        steps = list(csv.DictReader(f))
    assert [(s["frac_groups_all_equal"], s["token_entropy"]) for s in steps] == [("1.0", "")] * 3
    assert result["summary"][0]["final_accuracy"] == 0.0
