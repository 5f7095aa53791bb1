"""flows.verdicts: a user's own store (a real, tiny GRPO ablation made here, three seeds) gets its verdict from one
command; stores with planted results, spread over folders as unpacked archives leave them, give the verdicts the
rule gives on the same runs (a run copied into two stores read once, a failed flow's run shown apart, a start
model trained for one arm's prompt refused); an ablation's child no run is labelled with is found by its settings,
an unknown label answered with the labels there are; and parameters that cannot be answered are refused in one
line."""

import json
import math
import random

import pytest
from verdict_runs import BASE

from a5core.verdicts.decide import PAIRS, Rule, decide
from a5core.verdicts.expectations import parse_expectation
from a5core.verdicts.pairing import RunRecord
from flows.verdicts import NOT_WHAT_RAN, VerdictParams, main, verdicts
from tasks.fingerprints import digest_of_files

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_users_grpo_ablation_gets_its_verdict_from_one_command(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch, capsys
):
    import mlflow

    from flows.grpo import GRPOParams, grpo_baseline_ablation

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for seed in (0, 1, 2):
        grpo_baseline_ablation(
            GRPOParams(
                model=str(tiny_lm_dir),
                backend="hf",
                train_data="arithmetic:30:1",
                validation_data="arithmetic:6:1",
                val_subset=2,
                val_limit=4,
                eval_every=1,
                n_grpo_steps=1,
                rollout_batch_size=4,
                group_size=2,
                train_batch_size=4,
                gradient_accumulation_steps=2,
                max_tokens=8,
                min_tokens=1,
                checkpoint_every=0,
                seed=seed,
                output_dir=str(tmp_path / f"grpo{seed}"),
                metrics_path=None,
                tracking_uri=uri,
            )
        )
    main(
        [
            "--stores",
            uri,
            "--expect",
            "reinforce_with_baseline >= no_baseline;"
            " no_baseline ~ reinforce_with_baseline on final_val_mean_token_entropy",
            "--scope",
            "grpo_baseline_ablation",
            "--output-dir",
            str(tmp_path / "verdicts"),
            "--tracking-uri",
            uri,
        ]
    )
    printed = capsys.readouterr().out
    found = json.loads((tmp_path / "verdicts/verdicts.json").read_text())
    accuracy, entropy = found["verdicts"]
    assert accuracy["pairs"] == 3 and accuracy["defining_settings"] == ["loss_type"]
    assert {p["seed"] for p in accuracy["pair_list"]} == {"0", "1", "2"}
    assert {p["start_model"][:7] for p in accuracy["pair_list"]} == {"folder:"}  # the tiny model's content hash
    assert len({p["start_model"] for p in accuracy["pair_list"]}) == 1
    # a tiny model's accuracy is mostly 0 in every run: then no verdict, since the runs cannot tell the arms apart
    values = {x for p in accuracy["pair_list"] for x in p["a_values"] + p["b_values"]}
    judged = [entropy] if len(values) == 1 else [accuracy, entropy]
    if len(values) == 1:
        assert accuracy["verdict"] == "not judged" and "every run of both arms scored" in accuracy["not_judged"]
    for verdict in judged:
        assert verdict["verdict"] in ("agrees", "disagrees", "within noise", "inconclusive")
        test = verdict["tests"]["pairs"]
        assert 0 <= test["p_difference"] <= test["adjusted_p_difference"] <= 1
        assert verdict["start_models"] == 1 and "start models" not in verdict["tests"]  # one start model
    assert found["rule"]["method"] == "anytime" and found["rule"]["correction"] == "bonferroni"
    assert found["rule"]["family"] == 4  # two expectations, each on its pairs and its start models
    page = (tmp_path / "verdicts/verdicts.md").read_text()
    assert "`reinforce_with_baseline >= no_baseline`" in page and "Bonferroni's level" in page
    assert "## The rules and what each changed" in page and "2026-12-07" in page
    assert "### `grpo_baseline_ablation`" in page and "![grpo_baseline_ablation_val_accuracy]" in page
    assert (tmp_path / "verdicts/figures/grpo_baseline_ablation_val_accuracy.png").stat().st_size > 1000
    assert "reinforce_with_baseline >= no_baseline" in printed and "mlflow run" in printed
    client = mlflow.MlflowClient(tracking_uri=uri)
    (logged,) = client.search_runs([client.get_experiment_by_name("verdicts").experiment_id])
    assert {a.path for a in client.list_artifacts(logged.info.run_id)} >= {
        "verdicts.md",
        "verdicts.json",
        "verdicts.csv",
    }
    assert logged.data.params["correction"] == "bonferroni" and logged.data.params["method"] == "anytime"


# ----------------------------------------------------------------------------------------------- planted stores


def log_run(client, experiment_id, name, params, metrics, parent=None, status="FINISHED", origin=None, files=None):
    """A run as the flows leave one: params, final metrics (and val_* at step 0), a provenance record naming its
    start model, registered file digests (the model it made)."""
    tags = {"mlflow.parentRunId": parent} if parent else {}
    made = client.create_run(experiment_id, run_name=name, tags=tags)
    rid = made.info.run_id
    for key, value in {**params, **{f"file_sha256/{k}": v for k, v in (files or {}).items()}}.items():
        client.log_param(rid, key, value)
    for key, value in metrics.items():
        client.log_metric(rid, key, value, step=5)
        if key.startswith("final_"):
            client.log_metric(rid, key.removeprefix("final_"), value / 10, step=0)
    if origin:
        client.log_dict(rid, {"inputs": {"model": {"path": "m", "hash": origin}}}, "provenance.json")
    client.set_terminated(rid, status)
    return rid


def planted_page(root, rng):
    """Two folders of stores (as archives unpack: each flow its own mlflow.db, its mlruns/ at the archive's top):
    an SFT model made with prompt r1_zero; its GRPO runs of a baseline ablation and a prompt ablation, four
    seeds; one child of a flow that failed; one run copied into a second store. Returns what the rule sees."""
    import mlflow

    sft_files = {"model.safetensors": "ab" * 32, "config.json": "cd" * 32}
    sft_hash = f"folder:{digest_of_files(sft_files)}"
    expected = []

    def store(folder, name):
        (folder / name).mkdir(parents=True)
        return mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder / name / 'mlflow.db'}")

    archive = root / "archive1"
    client = store(archive, "sft")
    experiment = client.create_experiment("sft_experiment", artifact_location=str(archive / "mlruns" / "sft"))
    parent = log_run(client, experiment, "sft_experiment", {}, {})
    sft_id = log_run(
        client,
        experiment,
        "sft-1024",
        {"setting": "1024", "prompt": "r1_zero", "seed": "0"},
        {"final_val_accuracy": 0.01},
        parent=parent,
        origin="folder:base",
        files=sft_files,
    )
    expected.append(
        RunRecord(
            id=sft_id,
            name="sft-1024",
            group="sft_experiment",
            setting="1024",
            settings={"prompt": "r1_zero"},
            seed="0",
            origin="folder:base",
            finals={"final_val_accuracy": 0.01},
            made=sft_hash,
        )
    )
    for seed in range(4):
        for ablation, settings in (
            ("grpo_baseline_ablation", {"no_baseline": {"loss_type": "no_baseline"}, "reinforce_with_baseline": {}}),
            (
                "grpo_prompt_ablation",
                {"r1_zero": {}, "question_only": {"prompt": "question_only", "reward_fn": "arithmetic_question_only"}},
            ),
        ):
            folder = root / ("archive1" if seed < 2 else "archive2")
            client = store(folder, f"{ablation}_{seed}")
            experiment = client.create_experiment(
                "grpo", artifact_location=str(folder / "mlruns" / f"{ablation}{seed}")
            )
            failed = ablation == "grpo_baseline_ablation" and seed == 3
            parent = log_run(
                client, experiment, ablation, {"ablation": ablation}, {}, status="FAILED" if failed else "FINISHED"
            )
            for setting, changes in settings.items():
                value = 0.4 + rng.gauss(0, 0.03) + (0.08 if setting == "reinforce_with_baseline" else 0.0)
                params = {**BASE, **changes, "setting": setting, "seed": str(seed), "output_dir": f"out{seed}"}
                rid = log_run(
                    client,
                    experiment,
                    f"grpo-{setting}",
                    params,
                    {"final_val_accuracy": value},
                    parent=parent,
                    origin=sft_hash,
                )
                expected.append(
                    RunRecord(
                        id=rid,
                        name=f"grpo-{setting}",
                        group=ablation,
                        setting=setting,
                        settings={k: v for k, v in params.items() if k not in ("setting", "seed", "output_dir")},
                        seed=str(seed),
                        origin=sft_hash,
                        finals={"final_val_accuracy": value},
                        flow_status="FAILED" if failed else "FINISHED",
                        start_time=len(expected),
                    )
                )
    # the same run copied into another store (an archive packed twice): read once
    import shutil

    shutil.copy(root / "archive1" / "grpo_prompt_ablation_0" / "mlflow.db", root / "archive2" / "copy.db")
    return expected


def test_planted_stores_give_the_verdicts_the_rule_gives(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = planted_page(tmp_path / "records", random.Random(5))
    asked = ["reinforce_with_baseline >= no_baseline", "question_only >= r1_zero"]
    result = verdicts(
        VerdictParams(
            stores=[str(tmp_path / "records" / "archive1"), str(tmp_path / "records" / "archive2")],
            expect=asked,
            output_dir=str(tmp_path / "out"),
            log_to_mlflow=False,
        )
    )
    rule_says = decide([parse_expectation(t) for t in asked], expected, Rule())
    baseline, prompt = result["verdicts"]
    want = rule_says.verdicts[0]
    assert baseline["pairs"] == want.k == 3  # seed 3's flow failed: shown apart, not paired
    assert baseline["mean"] == pytest.approx(want.sample.mean) and baseline["verdict"] == want.word
    assert baseline["tests"]["pairs"]["adjusted_p_difference"] == pytest.approx(want.tests[PAIRS].adjusted_difference)
    assert prompt["verdict"] == "not judged" and "trained with prompt=r1_zero" in prompt["not_judged"]
    assert prompt["pairs"] == 0 and len(prompt["set_apart"]) == 4  # each from the start model trained for r1_zero
    assert all("trained with prompt=r1_zero" in pair["why"] for pair in prompt["set_apart"])
    page = (tmp_path / "out/verdicts.md").read_text()
    assert "Set apart (4 pairs, not judged):" in page
    assert "## Runs left out" in page and "the flow that ran it ended FAILED" in page
    assert result["runs_read"] == 2 + 8 * 3  # every run once (parents too): not the 3 of the copied store again


def test_a_start_model_trained_on_traces_of_both_prompts_read_from_a_store_is_fair(tmp_path):
    """The SFT run's trace_prompts reaches its record's settings, and its model, trained for both prompts alike,
    favours neither arm of the prompt ablation: every pair is judged."""
    import mlflow

    from a5core.verdicts.pairing import pair_arms
    from tasks.store_runs import read_runs

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("a5", artifact_location=str(tmp_path / "mlruns"))
    files = {"model.safetensors": "ab" * 32}
    made = f"folder:{digest_of_files(files)}"
    sft = {"setting": "1024", "prompt": "r1_zero", "trace_prompts": "question_only,r1_zero", "seed": "0"}
    sft_id = log_run(
        client, experiment, "sft-1024", sft, {"final_val_accuracy": 0.01}, origin="folder:base", files=files
    )
    question_only = {"prompt": "question_only", "reward_fn": "arithmetic_question_only"}
    for seed in range(3):
        for setting, changes in (("r1_zero", {}), ("question_only", question_only)):
            params = {**BASE, **changes, "setting": setting, "seed": str(seed)}
            log_run(
                client, experiment, f"grpo-{setting}", params, {"final_val_accuracy": 0.4 + seed / 100}, origin=made
            )
    runs = read_runs([str(tmp_path / "mlflow.db")], NOT_WHAT_RAN).records
    (maker,) = [r for r in runs if r.id == sft_id]
    assert maker.made == made and maker.settings["trace_prompts"] == "question_only,r1_zero"
    found = pair_arms(parse_expectation("question_only >= r1_zero"), runs)
    assert len(found.pairs) == 3 and found.set_apart == [] and found.not_judged == ""


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "give expect"),
        ({"expect": "a > b"}, "write A >= B"),
        ({"expect": "a >= b", "append": ["nowhere.md"]}, "nowhere.md: no such file"),
        ({"expectations_file": "missing.yaml"}, "expectations_file missing.yaml: no such file"),
        ({"expect": "a >= b", "correction": "holm"}, "correction 'holm' with the anytime method"),
        ({"expect": "a >= b", "method": "fixed", "correction": "bonferroni"}, "with the fixed method"),
        ({"expect": "a >= b", "endpoint": "last"}, "endpoint 'last': final or mean_last_K"),
        ({"expect": "a >= b", "confidence": 1.5}, "confidence"),
    ],
)
def test_params_refuse_what_cannot_be_answered(params, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        VerdictParams(**params)


def test_a_bad_expectations_file_or_store_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e.yaml").write_text("expectations:\n  - dapo >> grpo\n")
    for argv, message in (
        (["--expectations-file", "e.yaml"], "expectations_file e.yaml: expectations[1]: expectation 'dapo >> grpo'"),
        (["--expect", "a >= b", "--stores", "no/such/folder"], "no/such/folder: no such file or folder"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "e.yaml").write_text("expectations: [a >= b\n")
    with pytest.raises(SystemExit):
        main(["--expectations-file", "e.yaml"])
    assert "expectations_file e.yaml: not a YAML file" in capsys.readouterr().err


def test_what_a_run_ran_with_leaves_out_where_and_how_fast_it_ran():
    assert {"output_dir", "tracking_uri", "max_tokens_per_microbatch", "gpu_memory_fraction"} <= set(NOT_WHAT_RAN)
    assert not {"learning_rate", "loss_type", "prompt", "reward_fn"} & set(NOT_WHAT_RAN)
    assert math.isclose(VerdictParams(expect="a >= b").confidence, 0.95)


def test_an_ablations_child_no_run_is_labelled_with_is_found_by_its_settings(tmp_path, monkeypatch):
    """E4_tb64 >= on_policy on a store whose on-policy runs were made by the DAPO ablation (labelled grpo): the
    off-policy sweep's table says what on_policy sets, and the grpo runs have those settings."""
    import mlflow

    from flows.ablations import ablation_overrides
    from flows.params import GRPOParams

    monkeypatch.chdir(tmp_path)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("grpo", artifact_location=str(tmp_path / "mlruns"))
    defaults = GRPOParams()
    base = {k: str(getattr(defaults, k)) for k in ("loss_type", "epochs_per_rollout_batch", "train_batch_size")}
    base |= {"gradient_accumulation_steps": str(defaults.gradient_accumulation_steps)}
    e4 = {k: str(v) for k, v in ablation_overrides("grpo_off_policy_sweep", defaults)["E4_tb64"].items()}
    for ablation, setting, changes in (("grpo_off_policy_sweep", "E4_tb64", e4), ("grpo_dapo_ablation", "grpo", {})):
        parent = log_run(client, experiment, ablation, {"ablation": ablation}, {})
        for seed in range(8):
            value = 0.3 + seed / 100 + (0.0 if setting == "grpo" else -0.1 + (seed % 2) / 100)
            params = {**base, **changes, "setting": setting, "seed": str(seed)}
            log_run(client, experiment, setting, params, {"final_val_accuracy": value}, parent=parent, origin="m1")
    result = verdicts(
        VerdictParams(
            expect="E4_tb64 >= on_policy; E4_tb64 >= on_polcy",
            scope="grpo_off_policy_sweep",
            stores=[str(tmp_path / "mlflow.db")],
            output_dir=str(tmp_path / "out"),
            log_to_mlflow=False,
        )
    )
    found, typo = result["verdicts"]
    assert found["pairs"] == 8 and found["verdict"] == "disagrees" and found["scope"] == "for this start model"
    assert set(found["defining_settings"]) == {
        "epochs_per_rollout_batch",
        "train_batch_size",
        "loss_type",
        "gradient_accumulation_steps",
    }
    assert typo["verdict"] == "not measured"
    assert typo["not_measured"].endswith("the labels in grpo_off_policy_sweep: E4_tb64")


def test_what_a_grpo_run_generated_is_read_from_its_step_metrics(tmp_path):
    """Rollouts: rollout_batch_size × sampling_draws a step (1 without dynamic sampling); tokens: their mean × the
    rollouts; seconds: time_step; and the rollouts by each step, for comparisons at equal rollouts."""
    import mlflow

    from tasks.store_runs import read_runs

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("grpo", artifact_location=str(tmp_path / "mlruns"))
    rid = log_run(client, experiment, "ds", {"rollout_batch_size": "8", "seed": "0"}, {"final_val_accuracy": 0.5})
    for step, (draws, tokens, seconds) in enumerate([(1, 10.0, 2.0), (3, 20.0, 5.0), (2, 10.0, 3.0)], start=1):
        client.log_metric(rid, "sampling_draws", draws, step=step)
        client.log_metric(rid, "response_tokens_mean", tokens, step=step)
        client.log_metric(rid, "time_step", seconds, step=step)
    plain = log_run(client, experiment, "sft", {"seed": "0"}, {"final_val_accuracy": 0.1})
    runs = {r.id: r for r in read_runs([str(tmp_path / "mlflow.db")], NOT_WHAT_RAN).records}
    compute = runs[rid].compute
    assert compute.rollouts == 8 * (1 + 3 + 2) and compute.seconds == 10.0
    assert compute.tokens == 8 * (1 * 10 + 3 * 20 + 2 * 10)
    assert dict(compute.rollouts_by_step) == {1: 8.0, 2: 32.0, 3: 48.0}
    assert runs[plain].compute is None and runs[rid].curves["val_accuracy"] == {0: 0.05}
