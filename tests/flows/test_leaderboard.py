"""The leaderboard flow on CPU: a wall-clock budget that ends training, the best checkpoint, the final score."""

import json
from pathlib import Path

import pytest

from flows.leaderboard import FINAL_SAMPLING, LeaderboardParams, leaderboard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_params(tmp_path, tiny_lm_dir, **overrides) -> LeaderboardParams:
    """A leaderboard run of the tiny model on 1-digit arithmetic: 4 rollouts a step, 12 tokens, 6 validation
    problems; ``overrides`` set the rest (the budget, the steps, the SFT phase)."""
    settings = dict(
        model=str(tiny_lm_dir),
        backend="hf",
        train_data="arithmetic:40:1",
        validation_data="arithmetic:6:1",
        val_subset=3,
        final_eval_limit=6,
        eval_every=1,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        max_tokens=12,
        output_dir=str(tmp_path / "out"),
        metrics_path=str(tmp_path / "metrics.json"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    return LeaderboardParams(**{**settings, **overrides})


def test_budget_stops_training_and_the_run_still_reports(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    import mlflow

    from a5core.grading import rewards
    from a5core.grading.rewards import arithmetic_reward_fn

    graded = []  # the arithmetic grader, asked for, grades the rollouts and every evaluation

    def recording_grader(response, ground_truth):
        graded.append(response)
        return arithmetic_reward_fn(response, ground_truth)

    monkeypatch.setitem(rewards.REWARD_FNS, "arithmetic", recording_grader)
    params = tiny_params(
        tmp_path, tiny_lm_dir, reward_fn="arithmetic", budget_hours=25 / 3600, final_eval_reserve_s=2.0
    )
    summary = leaderboard(params)
    assert summary["stopped_by_budget"] and 1 <= summary["grpo_steps"] < params.n_grpo_steps
    assert summary["n_final_problems"] == 6 and not summary["official"]
    assert 0.0 <= summary["final_score"] <= 1.0 and summary["best_step"] is not None
    best = tmp_path / "out/best"  # a link to the run's own folder: a run with other settings saves its own
    assert best.is_symlink() and best.resolve().parent.name == "leaderboard" and best.resolve().name == "best"
    assert (best / "config.json").is_file() and (best / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "metrics.json").read_text()) == summary
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.metrics["final_score"] == summary["final_score"]
    (version,) = client.search_model_versions("name = 'a5-leaderboard'")  # the scored checkpoint, where it stays
    assert version.run_id == run.info.run_id and f"saved at `{best.resolve()}`" in version.description
    assert client.get_metric_history(run.info.run_id, "val_accuracy_by_wall_seconds")
    assert run.data.params["length_normalization"] == "masked_normalize"
    evaluations = len(client.get_metric_history(run.info.run_id, "val_accuracy"))
    assert len(graded) == summary["grpo_steps"] * params.rollout_batch_size + evaluations * 3 + 6

    # A run finished before the best checkpoint stayed in the run's own folder: its row names no best_model and
    # output_dir/best is the checkpoint itself. Invoked again, it returns its summary, and the folder stays as it is.
    import shutil

    done = best.resolve().parent / "done.json"
    row = json.loads(done.read_text())
    del row["best_model"]
    done.write_text(json.dumps(row))
    saved = best.resolve()
    best.unlink()
    shutil.move(saved, best)
    assert leaderboard(params) == summary
    assert best.is_dir() and not best.is_symlink()


def test_the_rules_are_fixed():
    assert (FINAL_SAMPLING.temperature, FINAL_SAMPLING.top_p, FINAL_SAMPLING.max_tokens, FINAL_SAMPLING.stop) == (
        1.0,
        1.0,
        1024,
        ("</answer>",),
    )
    with pytest.raises(ValueError, match="prompt"):
        LeaderboardParams(prompt="question_only")
    with pytest.raises(ValueError, match="reward_fn arithmetic grades only the generated arithmetic task"):
        LeaderboardParams(reward_fn="arithmetic")  # on MATH
    with pytest.raises(ValueError, match="reward_fn"):
        LeaderboardParams(reward_fn="question_only")
    LeaderboardParams(reward_fn="arithmetic", train_data="arithmetic:40:2", validation_data="arithmetic:8:2")
    defaults = LeaderboardParams()
    assert (defaults.budget_hours, defaults.learning_rate, defaults.group_size, defaults.length_normalization) == (
        4.0,
        3e-5,
        8,
        "masked_normalize",
    )


def test_the_engines_first_call_does_not_count_as_evaluation_cost(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """An engine's first call compiles (≈45 s for the hf engine on an H200). Were it timed as part of the
    first evaluation, the final evaluation's reserve (per-problem cost × 1,024 / max_tokens × problems)
    would swallow the budget and end the run after one step, as a GPU smoke run once did."""
    import time

    import flows.leaderboard as module

    real_engine_for = module.engine_for

    class SlowFirstCall:
        def __init__(self, engine):
            self.engine, self.calls = engine, 0

        def generate(self, prompts, sampling):
            self.calls += 1
            if self.calls == 1:
                time.sleep(6.0)
            return self.engine.generate(prompts, sampling)

        def __getattr__(self, name):
            return getattr(self.engine, name)

    monkeypatch.setattr(module, "engine_for", lambda params: SlowFirstCall(real_engine_for(params)))
    params = tiny_params(
        tmp_path,
        tiny_lm_dir,
        final_eval_limit=2,
        n_grpo_steps=2,
        budget_hours=120 / 3600,
        final_eval_reserve_s=2.0,
        metrics_path=None,
    )
    summary = leaderboard(params)
    # Timed with the 6 s, the reserve would be 2 s per problem × 1024/12 × 1.25 × 2 ≈ 430 s > the budget;
    # untimed, it is ≈ 212 × the real cost per problem (well under 0.1 s here), and two steps end the run.
    assert summary["grpo_steps"] == 2 and not summary["stopped_by_budget"] and summary["within_budget"]


def test_the_command_line_checks_its_input_before_an_engine_starts(tiny_lm_dir, tmp_path, monkeypatch, capsys):
    from flows.leaderboard import main

    for where in ("tasks.engines", "tasks.evaluation"):  # where the flows' engine starts look it up
        monkeypatch.setattr(f"{where}.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    argv = [
        "--model",
        str(tiny_lm_dir),
        "--backend",
        "hf",
        "--train-data",
        "arithmetic:40:1",
        "--validation-data",
        "arithmetic:6:1",
        "--output-dir",
        str(tmp_path / "out"),
        "--tracking-uri",
        f"sqlite:///{tmp_path / 'mlflow.db'}",
    ]
    with pytest.raises(SystemExit, match=rf"^flows.leaderboard: error: {tmp_path}/missing.jsonl: no such data file$"):
        main([*argv, "--sft-data", str(tmp_path / "missing.jsonl"), "--sft-max-steps", "2"])
    with pytest.raises(SystemExit) as stopped:  # a bad parameter: exit 2, one line on stderr
        main([*argv, "--rollout-batch-size", "7"])
    assert stopped.value.code == 2 and "rollout_batch_size must be a multiple of group_size" in capsys.readouterr().err


def test_changed_settings_start_a_new_run_instead_of_reopening_the_last(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    """The MLflow run is keyed by the settings: after a run, one with another learning rate is a run of its
    own (reopening the first, MLflow refused the changed parameter: "Changing param values is not allowed").
    The first settings again: the finished run's summary, nothing trained or evaluated again."""
    import mlflow

    import flows.leaderboard as module

    settings = dict(
        final_eval_limit=2, eval_every=0, n_grpo_steps=1, budget_hours=1.0, final_eval_reserve_s=1.0, metrics_path=None
    )
    params = tiny_params(tmp_path, tiny_lm_dir, **settings)
    first = leaderboard(params)
    second = leaderboard(tiny_params(tmp_path, tiny_lm_dir, **settings, learning_rate=1e-4))
    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    assert first["mlflow_run_id"] != second["mlflow_run_id"]
    assert [client.get_run(s["mlflow_run_id"]).data.params["learning_rate"] for s in (first, second)] == [
        "3e-05",
        "0.0001",
    ]
    monkeypatch.setattr(module, "grpo", lambda *a, **k: pytest.fail("a finished run trained again"))
    monkeypatch.setattr(module, "validation_hook", lambda *a, **k: pytest.fail("a finished run evaluated again"))
    assert leaderboard(tiny_params(tmp_path, tiny_lm_dir, **settings)) == first


def test_the_sft_phase_takes_generated_column_traces(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """``sft_data: arithmetic:N:DIGITS:columns``, as sft_experiment's ``train_data`` takes it: the SFT phase
    trains on N generated traces worked column by column (the 2-digit recipe of docs/results.md), before GRPO."""
    import flows.leaderboard as module

    class Stop(Exception):
        pass

    seen = []

    def recording(model, tokenizer, traces, config, **kwargs):
        seen.append((traces, config))
        raise Stop

    monkeypatch.setattr(module, "train_sft", recording)
    params = tiny_params(
        tmp_path, tiny_lm_dir, reward_fn="arithmetic", sft_data="arithmetic:12:2:columns", sft_max_steps=3
    )
    with pytest.raises(Stop):
        leaderboard(params)
    ((traces, config),) = seen
    assert len(traces) == 12 and config.max_steps == 3
    assert all("Column by column, ones first." in t.response and t.response.endswith("</answer>") for t in traces)


def test_the_checkpoint_is_chosen_on_held_out_train_problems_never_on_the_scored_ones(
    prefect_harness, tiny_lm_dir, tmp_path, monkeypatch
):
    """The subset evaluations that pick the best checkpoint read only the selection split (train problems held
    out of training); the scored validation problems reach only the final evaluation. So no outcome on the
    scored problems can change which checkpoint is kept."""
    import flows.leaderboard as module

    hooks, trained = [], []
    real_hook, real_grpo = module.validation_hook, module.grpo

    def recording_hook(engine, tokenizer, problems, *args):
        hooks.append(list(problems))
        return real_hook(engine, tokenizer, problems, *args)

    def recording_grpo(model, tokenizer, engine, train, *args, **kwargs):
        trained.extend(train)
        return real_grpo(model, tokenizer, engine, train, *args, **kwargs)

    monkeypatch.setattr(module, "validation_hook", recording_hook)
    monkeypatch.setattr(module, "grpo", recording_grpo)
    params = tiny_params(tmp_path, tiny_lm_dir, n_grpo_steps=2, budget_hours=120 / 3600, final_eval_reserve_s=2.0)
    summary = leaderboard(params)
    (selection, *_), final = hooks[:-1], hooks[-1]
    scored = {p.problem for p in final}
    assert len(final) == summary["n_final_problems"] == 6 and summary["n_selection_problems"] == len(selection)
    assert selection and not scored & {p.problem for p in selection}  # chosen apart from the score
    assert not {p.unique_id for p in trained} & {p.unique_id for p in selection}  # and apart from training
    assert all(hook == selection for hook in hooks[:-1])
    assert summary["selection_split"].startswith("arithmetic:40:1") and summary["score_split"].startswith("arith")
    # every evaluation's per-problem table: each problem's id and reward, for comparisons paired over problems
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=params.tracking_uri)
    run_id = summary["mlflow_run_id"]
    tables = {a.path.split("/")[-1] for a in client.list_artifacts(run_id, "per_problem")}
    final_table = f"full_step_{summary['grpo_steps']:06d}.json"
    assert final_table in tables and any(t.startswith(f"subset{len(selection)}_") for t in tables)
    logged = json.loads(
        Path(client.download_artifacts(run_id, f"per_problem/{final_table}", str(tmp_path))).read_text()
    )
    rows = [dict(zip(logged["columns"], row, strict=True)) for row in logged["data"]]
    assert sorted(r["unique_id"] for r in rows) == sorted(p.unique_id for p in final)
    assert all(r["reward"] in (0.0, 1.0) and r["sample"] == 0 for r in rows)


def test_a_resumed_run_keeps_the_best_checkpoint_it_had_chosen(prefect_harness, tiny_lm_dir, tmp_path, monkeypatch):
    """Killed after its best evaluation (step 1), the run resumes from its checkpoint; later evaluations score
    lower, so the checkpoint of step 1 stays the one chosen and scored, not the first evaluated after resuming."""
    import flows.leaderboard as module

    real_hook, crashed = module.validation_hook, []
    accuracy = {0: 0.2, 1: 0.9, 2: 0.1, 3: 0.3, 4: 0.3}

    def scripted_hook(engine, tokenizer, problems, template, reward_fn, sampling, limit):
        hook = real_hook(engine, tokenizer, problems, template, reward_fn, sampling, limit)
        if limit is None:  # the final evaluation, on the scored problems
            return hook

        def evaluate(model, step):
            if step == 3 and not crashed:
                crashed.append(step)
                raise RuntimeError("killed")
            return {**hook(model, step), "val_accuracy": accuracy[step]}

        return evaluate

    monkeypatch.setattr(module, "validation_hook", scripted_hook)
    params = tiny_params(
        tmp_path, tiny_lm_dir, n_grpo_steps=4, checkpoint_every=1, budget_hours=600 / 3600, final_eval_reserve_s=2.0
    )
    with pytest.raises(RuntimeError, match="killed"):
        leaderboard(params)
    summary = leaderboard(params)
    assert crashed == [3] and summary["grpo_steps"] == 4
    assert (summary["best_step"], summary["best_subset_accuracy"]) == (1, 0.9)
