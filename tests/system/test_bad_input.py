"""Bad input at the command line: each mistake ends the flow's CLI with one readable message naming what
and where (file and line, field, path, step), on stderr with a non-zero exit status, not a traceback.

Most cases call a flow's ``main(argv)`` in-process: input errors are found before any engine or flow
run starts (each flow's ``check_inputs``), and flows.cli.cli_main turns them into ``SystemExit(message)``
(exit status 1, the message on stderr); bad parameter values exit 2 through argparse. The NaN-loss cases
run a real flow: the loop stops at the bad step with the previous steps logged and their checkpoint
intact. One case of each kind also runs as ``python -m flows.X`` to see exactly what a user sees.
"""

from __future__ import annotations

import errno
import json
import pickle
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from test_flow_resume import cli_flags, flow_env, steps  # noqa: F401  (flow_env: a fixture)

import flows.baseline_eval
import flows.expert_iteration
import flows.grpo
import flows.sft_experiment
from a5core.data.files import Trace
from a5core.data.prompts import load_prompt
from a5core.runtime.writing import write_jsonl_atomic

REPO = Path(__file__).resolve().parents[2]
MAINS = {
    "grpo": flows.grpo.main,
    "expert_iteration": flows.expert_iteration.main,
    "sft_experiment": flows.sft_experiment.main,
    "baseline_eval": flows.baseline_eval.main,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def math_record(i: int) -> dict:
    return {
        "unique_id": f"test/{i}.json",
        "problem": f"What is {i} + 1?",
        "solution": f"It is $\\boxed{{{i + 1}}}$.",
        "answer": str(i + 1),
        "level": "Level 1",
        "type": "Prealgebra",
    }


def trace_record(i: int) -> dict:
    template = load_prompt("r1_zero")
    return asdict(
        Trace(
            template.format(f"What is {i} + 1?"), f" {i} + 1 = {i + 1} </think> <answer> {i + 1} </answer>", str(i + 1)
        )
    )


@pytest.fixture
def inputs(tiny_lm_dir, tmp_path) -> dict[str, str]:
    """Good input files, for the arguments a case does not break."""
    write_jsonl_atomic(tmp_path / "math.jsonl", [math_record(i) for i in range(8)])
    write_jsonl_atomic(tmp_path / "traces.jsonl", [trace_record(i) for i in range(8)])
    return {"model": str(tiny_lm_dir), "math": str(tmp_path / "math.jsonl"), "traces": str(tmp_path / "traces.jsonl")}


def flags(flow: str, inputs: dict[str, str], tmp_path: Path, **overrides) -> list[str]:
    """A small valid command line for ``flow``; ``overrides`` replace (or add) parameters."""
    common = {
        "model": inputs["model"],
        "backend": "hf",
        "output_dir": str(tmp_path / "out"),
        "metrics_path": str(tmp_path / "metrics.json"),
        "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    per_flow = {
        "grpo": {
            "train_data": inputs["math"],
            "validation_data": inputs["math"],
            "n_grpo_steps": 2,
            "rollout_batch_size": 4,
            "group_size": 2,
            "train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_tokens": 12,
        },
        "expert_iteration": {
            "train_data": inputs["math"],
            "validation_data": inputs["math"],
            "n_ei_steps": 1,
            "questions_per_step": 2,
            "rollouts_per_question": 2,
            "batch_size": 2,
            "microbatch_size": 2,
            "max_tokens": 12,
        },
        "sft_experiment": {
            "train_data": inputs["traces"],
            "filtered_data": None,
            "sizes": ["full"],
            "validation_data": inputs["math"],
            "batch_size": 2,
            "microbatch_size": 2,
            "max_tokens": 12,
        },
        "baseline_eval": {"data": inputs["math"], "max_tokens": 12},
    }[flow]
    return cli_flags(**{**common, **per_flow, **overrides})


def user_error(flow: str, argv: list[str]) -> str:
    """Run ``flow``'s main, which must stop with one message (exit status 1): the message."""
    with pytest.raises(SystemExit) as stopped:
        MAINS[flow](argv)
    message = stopped.value.code
    assert isinstance(message, str), f"exit status {message!r}, expected a message"
    assert message.startswith(f"flows.{flow}: error: ") and "\n" not in message, message
    return message


def parameter_error(flow: str, argv: list[str], capsys) -> str:
    """Run ``flow``'s main with a bad parameter value: exit status 2 and one ``error:`` line on stderr."""
    with pytest.raises(SystemExit) as stopped:
        MAINS[flow](argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: invalid parameters: " in err, err
    return err


# ----------------------------------------------------------------------------------------- data files

DATA_ARGUMENTS = [  # (flow, the parameter holding the file, its record kind)
    ("grpo", "train_data", "math"),
    ("grpo", "validation_data", "math"),
    ("expert_iteration", "train_data", "math"),
    ("expert_iteration", "validation_data", "math"),
    ("sft_experiment", "train_data", "traces"),
    ("sft_experiment", "filtered_data", "traces"),
    ("sft_experiment", "validation_data", "math"),
    ("baseline_eval", "data", "math"),
]
REQUIRED_KEY = {"math": "answer", "traces": "ground_truth"}


@pytest.mark.parametrize("flow, argument, kind", DATA_ARGUMENTS)
@pytest.mark.parametrize("mistake", ["broken_line", "missing_file", "empty_file", "missing_key"])
def test_a_bad_data_file_is_named_with_its_line(flow, argument, kind, mistake, inputs, tmp_path):
    path = tmp_path / "bad.jsonl"
    good = math_record(0) if kind == "math" else trace_record(0)
    if mistake == "broken_line":
        path.write_text(json.dumps(good) + "\n" + '{"problem": "What is 1 + 1?", \n')
        expected = f"{path}:2: malformed JSON"
    elif mistake == "missing_file":
        expected = f"{path}: no such data file"
    elif mistake == "empty_file":
        path.write_text("\n")
        expected = f"{path}: empty data file"
    else:
        del good[REQUIRED_KEY[kind]]
        path.write_text(
            json.dumps(math_record(1) if kind == "math" else trace_record(1)) + "\n" + json.dumps(good) + "\n"
        )
        expected = f"{path}:2: missing key(s) '{REQUIRED_KEY[kind]}'"
    assert expected in user_error(flow, flags(flow, inputs, tmp_path, **{argument: str(path)}))


@pytest.mark.parametrize("name", ["report.md", "summary.json", "run.json"])
def test_an_extra_set_named_as_an_output_file_is_refused(name, inputs, tmp_path, capsys):
    """An extra set's outputs go in ``output_dir/NAME/``: a name the evaluation's own files take collided with them
    at the end of the run, in a traceback."""
    argv = flags("baseline_eval", inputs, tmp_path, extra_sets={name: inputs["math"]})
    err = parameter_error("baseline_eval", argv, capsys)
    assert f"extra set name {name!r}: the name of a file the evaluation writes beside the sets' folders" in err


@pytest.mark.parametrize(
    "sweep",
    [{}, {"sweep": True, "sweep_rollouts_per_question": [2], "sweep_epochs": [1], "sweep_questions_per_step": [2, 9]}],
)
def test_ei_asked_for_more_questions_a_round_than_there_are_problems_is_refused(sweep, inputs, tmp_path):
    """D_b 9 of 8 problems: refused before an engine starts, not run with 8 while the run records 9."""
    message = user_error("expert_iteration", flags("expert_iteration", inputs, tmp_path, questions_per_step=9, **sweep))
    setting = ", setting G2_E1_Db9" if sweep else ""
    assert f"train_data {inputs['math']}{setting}: questions_per_step 9: more than the 8 training problems" in message


def test_a_models_cache_that_is_a_file_is_named(inputs, tmp_path, monkeypatch):
    """A5_CACHE_DIR naming a file: the embedded model cannot be converted there, and the command says why."""
    (tmp_path / "notes.txt").write_text("mine\n")
    monkeypatch.setenv("A5_CACHE_DIR", str(tmp_path / "notes.txt"))
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, model="smollm2-135m-instruct"))
    assert f"A5_CACHE_DIR {tmp_path / 'notes.txt'}: cannot be the folder converted models are kept in" in message
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_json_nested_too_deeply_is_named_not_a_traceback(inputs, tmp_path):
    """A data line, or a model's config.json, nested a hundred thousand levels deep (Python's JSON reader gives
    up with a RecursionError): one line naming the file."""
    import shutil

    deep = "[" * 100_000 + "]" * 100_000
    data = tmp_path / "deep.jsonl"
    data.write_text(json.dumps(math_record(0)) + "\n" + deep + "\n")
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, data=str(data)))
    assert f"{data}:2: JSON nested too deeply to read (not a data record)" in message
    model = tmp_path / "model"
    shutil.copytree(inputs["model"], model)
    (model / "config.json").write_text(deep)
    message = user_error("baseline_eval", flags("baseline_eval", inputs, tmp_path, model=str(model)))
    assert f"{model / 'config.json'}: not a model's config (JSON nested too deeply)" in message


@pytest.mark.parametrize(
    "spec", ["arithmetic:0:1", "arithmetic:ten:1", "arithmetic:8", "arithmetic:8:3-1", "arithmetic:8:2:bogus"]
)
def test_a_bad_arithmetic_spec_is_named(spec, inputs, tmp_path):
    message = user_error("grpo", flags("grpo", inputs, tmp_path, train_data=spec))
    assert f"{spec}: expected arithmetic:N:DIGITS" in message


def test_too_few_problems_for_a_grpo_step(inputs, tmp_path):
    message = user_error(
        "grpo",
        flags("grpo", inputs, tmp_path, rollout_batch_size=32, train_batch_size=32, gradient_accumulation_steps=16),
    )
    assert f"train_data {inputs['math']}: 8 problems, fewer than the 16 questions a step samples" in message


# --------------------------------------------------------------------------------- prompt, model path


@pytest.mark.parametrize("flow", ["expert_iteration", "sft_experiment", "baseline_eval"])
def test_a_prompt_template_without_the_question_placeholder(flow, inputs, tmp_path):
    template = tmp_path / "mine.prompt"
    template.write_text("Solve it. Answer: <answer>")
    message = user_error(flow, flags(flow, inputs, tmp_path, prompt=str(template), reward_fn="r1_zero"))
    assert f"prompt template '{template}' has no {{question}} placeholder" in message


@pytest.mark.parametrize("flow", ["expert_iteration", "grpo"])
def test_an_unknown_prompt_and_a_template_file_without_its_grader(flow, inputs, tmp_path, capsys):
    assert "no prompt template 'r2_zero': not a built-in (question_only, r1_zero) and no such file" in parameter_error(
        flow, flags(flow, inputs, tmp_path, prompt="r2_zero"), capsys
    )
    template = tmp_path / "mine.prompt"
    template.write_text("Q: {question}\nA:")
    assert f"prompt '{template}' is a template file: name its grader with reward_fn" in parameter_error(
        flow, flags(flow, inputs, tmp_path, prompt=str(template)), capsys
    )


@pytest.mark.parametrize("flow", list(MAINS))
def test_a_model_path_that_does_not_exist(flow, inputs, tmp_path):
    missing = str(tmp_path / "no_such_model")
    message = user_error(flow, flags(flow, inputs, tmp_path, model=missing))
    assert f"model path '{missing}' does not exist or is not a directory" in message


def test_a_model_folder_without_config(inputs, tmp_path):
    (tmp_path / "empty_model").mkdir()
    message = user_error("grpo", flags("grpo", inputs, tmp_path, model=str(tmp_path / "empty_model")))
    assert "has no config.json; not a Hugging Face model folder" in message


@pytest.mark.parametrize("flow", ["baseline_eval", "grpo"])
def test_a_model_folder_without_weights_or_with_fewer_layers_than_its_config_is_refused(
    flow, inputs, tmp_path, monkeypatch
):
    """A model folder whose weights are gone, or whose config.json asks for more layers than its weights hold (the
    others would start from random values): refused before any engine starts, naming the folder."""
    import shutil

    monkeypatch.setattr("tasks.evaluation.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    deeper, bare = tmp_path / "deeper", tmp_path / "bare"
    for folder in (deeper, bare):
        shutil.copytree(inputs["model"], folder)
    for weights in bare.glob("*.safetensors"):
        weights.unlink()
    config = json.loads((deeper / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(num_hidden_layers=layers + 2, layer_types=config["layer_types"] + config["layer_types"][:2])
    (deeper / "config.json").write_text(json.dumps(config))
    message = user_error(flow, flags(flow, inputs, tmp_path, model=str(deeper)))
    assert f"num_hidden_layers is {layers + 2}, but the weights in {deeper} hold {layers} " in message
    message = user_error(flow, flags(flow, inputs, tmp_path, model=str(bare)))
    assert f"model directory '{bare}' holds no weights (no *.safetensors or *.bin file)" in message


# ------------------------------------------------------------------------------------------ settings


def test_an_unknown_loss_type(inputs, tmp_path, capsys):
    err = parameter_error("grpo", flags("grpo", inputs, tmp_path, loss_type="ppo"), capsys)
    assert (
        "--loss-type 'ppo': Input should be 'no_baseline', 'reinforce_with_baseline', 'grpo_clip', "
        "'grpo_no_clip' or 'gspo'" in err
    )


@pytest.mark.parametrize(
    "flow, overrides, expected",
    [
        (
            "grpo",
            {"train_batch_size": 6, "gradient_accumulation_steps": 4, "rollout_batch_size": 12},
            "GRPOConfig.train_batch_size must be a multiple of gradient_accumulation_steps (4), got 6",
        ),
        (
            "grpo",
            {"rollout_batch_size": 6, "group_size": 4},
            "GRPOConfig.rollout_batch_size must be a multiple of group_size (4)",
        ),
        (
            "grpo",
            {"rollout_batch_size": 4, "train_batch_size": 8, "gradient_accumulation_steps": 2},
            "GRPOConfig.rollout_batch_size must be a multiple of train_batch_size (8)",
        ),
        ("grpo", {"ablation": "grpo_off_policy_sweep", "sweep_train_batch_sizes": [3]}, "must be a multiple of"),
        (
            "sft_experiment",
            {"batch_size": 5, "microbatch_size": 2},
            "batch_size must be a multiple of microbatch_size (2), got 5",
        ),
        (
            "expert_iteration",
            {"batch_size": 5, "microbatch_size": 2},
            "batch_size must be a multiple of microbatch_size (2), got 5",
        ),
        (
            "expert_iteration",
            {
                "sweep": True,
                "sweep_epochs": [1],
                "sweep_rollouts_per_question": [2],
                "sweep_questions_per_step": [2],
                "batch_size": 6,
                "microbatch_size": 4,
            },
            "batch_size",
        ),
    ],
)
def test_inconsistent_batch_sizes(flow, overrides, expected, inputs, tmp_path, capsys):
    """Checked when the parameters are read (exit 2, the message on stderr), or for a sweep's settings
    before anything starts (exit 1, the message)."""
    with pytest.raises(SystemExit) as stopped:
        MAINS[flow](flags(flow, inputs, tmp_path, **overrides))
    code = stopped.value.code
    text = code if isinstance(code, str) else capsys.readouterr().err
    assert expected in text and "Traceback" not in text and text.strip().count("\n") == 0, text


@pytest.mark.parametrize(
    "flow, field, value",
    [
        ("grpo", "n_grpo_steps", 0),
        ("grpo", "n_grpo_steps", -3),
        ("grpo", "max_tokens", 0),
        ("grpo", "rollout_batch_size", 0),
        ("grpo", "learning_rate", -1e-5),
        ("expert_iteration", "n_ei_steps", 0),
        ("expert_iteration", "questions_per_step", -1),
        ("sft_experiment", "max_steps", 0),
        ("sft_experiment", "epochs", -1),
        ("sft_experiment", "sizes", [0]),
        ("baseline_eval", "limit", 0),
        ("baseline_eval", "max_tokens", -2),
    ],
)
def test_a_zero_or_negative_budget(flow, field, value, inputs, tmp_path, capsys):
    flag = "--" + field.replace("_", "-")
    argv = [*flags(flow, inputs, tmp_path), f"{flag}={json.dumps(value)}"]  # "=": a value may start with "-"
    err = parameter_error(flow, argv, capsys)
    assert flag in err and "greater than" in err


# ------------------------------------------------------------------------------------ what users see


def test_the_command_line_prints_one_line_not_a_traceback(inputs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(math_record(0)) + "\n{oops\n")
    result = subprocess.run(
        [sys.executable, "-m", "flows.grpo", *flags("grpo", inputs, tmp_path, train_data=str(bad))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"flows.grpo: error: {bad}:2: malformed JSON")


@pytest.mark.parametrize(
    "flow, fans_out", [("grpo", {"ablation": "grpo_baseline_ablation"}), ("expert_iteration", {"sweep": True})]
)
def test_a_ray_cluster_that_does_not_answer_is_named_before_anything_starts(
    flow, fans_out, inputs, tmp_path, monkeypatch
):
    """An ablation's or a sweep's children sent to a Ray address where no cluster listens: one line, at once, not
    Ray's 46 s of attempts and a traceback."""
    from servers import free_port

    monkeypatch.setattr("tasks.engines.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    address = f"ray://127.0.0.1:{free_port()}"
    message = user_error(flow, flags(flow, inputs, tmp_path, runner="ray", ray_address=address, **fans_out))
    assert f"ray_address {address}: no Ray cluster answers there within 10 s (" in message
    assert message.endswith("start the cluster, or leave ray_address unset to start a local Ray")


def test_torchrun_variables_left_from_another_launch_end_the_command_in_one_line(
    inputs,
    flow_env,  # noqa: F811
    tmp_path,
):
    """RANK, WORLD_SIZE and MASTER_* left in a shell by another launch: the flow waited for ever for ranks that
    never came, deaf to Ctrl-C. Now it says so and stops."""
    from servers import free_port

    env = {**flow_env, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flows.baseline_eval", *flags("baseline_eval", inputs, tmp_path)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,  # a guard against the endless wait, not a timing assertion
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"the flow waited for ranks that never come:\n{expired.stderr}") from None
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"flows.baseline_eval: error: RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT={env['MASTER_PORT']} "
        "in the environment, but this process was not started by torchrun: it would wait for ranks that never come. "
        "Unset them (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT), or start it with "
        "torchrun"
    )
    assert not (tmp_path / "out" / "records.jsonl").exists()


def test_sft_nan_loss_stops_with_the_step_named_and_the_checkpoint_intact(inputs, flow_env, tmp_path):  # noqa: F811
    """A learning rate of 1e30 gives finite step-1 metrics and a NaN loss at step 2: the command ends with
    the step named, step 1 is logged and checkpointed, nothing of step 2 is."""
    from mlflow import MlflowClient

    argv = flags(
        "sft_experiment", inputs, tmp_path, learning_rate=1e30, lr_schedule="constant", eval_every=0, checkpoint_every=1
    )
    result = subprocess.run(
        [sys.executable, "-m", "flows.sft_experiment", *argv],
        cwd=tmp_path,
        env=flow_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (checkpoint,) = (tmp_path / "out").glob("runs-*/full/checkpoint")
    assert (
        f"flows.sft_experiment: error: SFT step 2 of 8: loss nan, grad_norm nan; training stopped before the update; "
        f"{checkpoint / 'latest'}, if written, still holds the last good step"
    ) in result.stderr.splitlines()
    state = json.loads((checkpoint / "latest/state.json").read_text())
    assert state["step"] == 1 and not state["finished"]
    run_id = (checkpoint.parent / "mlflow_run_id").read_text().strip()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert steps(client, run_id, "loss") == [1]
    assert client.get_run(run_id).info.status == "FAILED"


def test_grpo_nan_loss_stops_with_the_step_named_and_the_checkpoint_intact(
    prefect_harness, inputs, tmp_path, monkeypatch, capfd
):
    """The loss turns NaN in step 2 (a patched train step): the CLI ends with that step named, no
    traceback; step 1 is logged and checkpointed."""
    from mlflow import MlflowClient

    import a5core.loops.grpo.loop

    real, calls = a5core.loops.grpo.loop.microbatch_loss, []

    def nan_from_step_2(*args, **kwargs):  # two micro-batches a step
        loss, meta = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) > 2 else loss), meta

    monkeypatch.setattr(a5core.loops.grpo.loop, "microbatch_loss", nan_from_step_2)
    message = user_error(
        "grpo",
        flags("grpo", inputs, tmp_path, n_grpo_steps=3, eval_every=1, checkpoint_every=1, val_subset=2, val_limit=2),
    )
    (checkpoint,) = (tmp_path / "out").glob("runs-*/single/checkpoint")
    assert message.startswith("flows.grpo: error: GRPO step 2 of 3 (epoch 0, optimizer step 0): loss nan, grad_norm ")
    assert message.endswith(
        f"training stopped before the update; {checkpoint / 'latest'}, if written, still holds the last good step"
    )
    assert "Traceback" not in capfd.readouterr().err
    state = json.loads((checkpoint / "latest/state.json").read_text())
    assert state["step"] == 1 and not state["finished"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = (checkpoint.parent / "mlflow_run_id").read_text().strip()
    assert steps(client, run_id, "reward_mean") == [1] and steps(client, run_id, "val_accuracy") == [0, 1]


def test_grpo_out_of_memory_names_the_budget_and_a_lower_one_resumes_the_run(
    prefect_harness, inputs, tmp_path, monkeypatch, capfd
):
    """The GPU runs out of memory in step 2 (a patched forward): the CLI ends with the step, the micro-batch and
    ``max_tokens_per_microbatch`` named, no traceback; the same command with a lower budget resumes the run
    from step 1's checkpoint (a how-fast setting: the same run) and finishes it."""
    import torch
    from mlflow import MlflowClient

    import a5core.loops.grpo.loop

    real, calls = a5core.loops.grpo.loop.get_response_log_probs, []

    def out_of_memory_in_step_2(*args, **kwargs):  # one micro-batch a step: 4 rollouts of 256 positions at most
        calls.append(1)
        if len(calls) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(a5core.loops.grpo.loop, "get_response_log_probs", out_of_memory_in_step_2)
    argv = flags("grpo", inputs, tmp_path, n_grpo_steps=3, eval_every=0, checkpoint_every=1, val_subset=2, val_limit=2)
    message = user_error("grpo", [*argv, "--max-tokens-per-microbatch", "4096"])
    assert message.startswith("flows.grpo: error: GRPO step 2, training: out of GPU memory in a micro-batch of 4 ")
    assert "micro-batches are cut by max_tokens_per_microbatch 4,096: set a lower number" in message
    assert "Traceback" not in capfd.readouterr().err
    (checkpoint,) = (tmp_path / "out").glob("runs-*/single/checkpoint")
    assert json.loads((checkpoint / "latest/state.json").read_text())["step"] == 1
    run_id = (checkpoint.parent / "mlflow_run_id").read_text().strip()

    monkeypatch.setattr(a5core.loops.grpo.loop, "get_response_log_probs", real)
    MAINS["grpo"]([*argv, "--max-tokens-per-microbatch", "256"])
    assert (checkpoint.parent / "mlflow_run_id").read_text().strip() == run_id
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert steps(client, run_id, "reward_mean") == [1, 2, 3]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_check_across_fields_is_reported_without_a_flag(capsys):
    from pydantic import model_validator

    from a5core.runtime.settings import Settings
    from flows.arguments import parse_params

    class Ranged(Settings):
        low: int = 1
        high: int = 2

        @model_validator(mode="after")
        def ordered(self):
            if self.low > self.high:
                raise ValueError("low must not exceed high")
            return self

    with pytest.raises(SystemExit) as exit_:
        parse_params(Ranged, "ranged", ["--low", "5"])
    assert exit_.value.code == 2
    assert "invalid parameters: Value error, low must not exceed high" in capsys.readouterr().err


def test_a_full_disk_ends_with_one_message(capsys):
    import errno

    from flows.cli import cli_main

    @cli_main("flows.example")
    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "outputs/x/records.jsonl")

    with pytest.raises(
        SystemExit,
        match=r"flows.example: error: no space left on the device writing "
        r"outputs/x/records.jsonl; outputs written before are intact",
    ):
        main([])


def test_an_engine_that_cannot_start_ends_with_one_message(prefect_harness, monkeypatch):
    from flows.cli import cli_main
    from tasks.engines import start_engine

    def broken_backend(model, backend, **kwargs):
        raise RuntimeError("CUDA error: out of memory")

    @cli_main("flows.example")
    def main(argv):
        return start_engine.with_options(retry_delay_seconds=0)(broken_backend, "some/model", "vllm", dtype="auto")

    with pytest.raises(
        SystemExit,
        match=r"flows.example: error: could not start the rollout engine "
        r"\(some/model, vllm, dtype=auto\): RuntimeError: CUDA error: out of memory",
    ):
        main([])


@pytest.mark.parametrize(
    "error, tries",
    [
        (ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"), 2),
        (ValueError("Free memory on device cuda:0 (9.5/139.8 GiB) is less than desired GPU memory utilization"), 2),
        (OSError(errno.EADDRINUSE, "Address already in use"), 2),
        (ValueError("engine_dtype 'float8': not a dtype"), 1),
        (pickle.UnpicklingError("Weights only load failed"), 1),
        (OSError("Error no file named model.safetensors, or pytorch_model.bin, found in directory m"), 1),
    ],
)
def test_vllm_finding_its_memory_taken_while_it_starts_is_retried(prefect_harness, error, tries):
    """vLLM's ValueErrors when another process took GPU memory while it profiled (two engines started at once
    on one GPU) are retried, and the second try starts, as is a busy port; any other ValueError (a bad setting),
    weights torch refuses to unpickle and a missing weights file are not."""
    from tasks.engines import start_engine

    calls = []

    def backend(model, backend, **kwargs):
        calls.append(model)
        if len(calls) == 1:
            raise error
        return "engine"

    def starting():
        return start_engine.with_options(retry_delay_seconds=0)(backend, "some/model", "vllm")

    if tries == 1:
        with pytest.raises(Exception, match=re.escape(str(error))):
            starting()
    else:
        assert starting() == "engine"
    assert len(calls) == tries


# ------------------------------------------------------------------ --config files and flag values


def config_error(flow: str, argv: list[str], capsys) -> str:
    """Run ``flow``'s main with a bad --config or flag: exit status 2, the error on stderr's last line."""
    with pytest.raises(SystemExit) as stopped:
        MAINS[flow](argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("baseline_eval:\n  limit: [1, 2\n", r"params.yaml:3:1: malformed YAML"),
        ("baseline_eval: [1, 2]\n", r"`baseline_eval` must be a mapping of settings, got list"),
        ("profile: small\nprofiles:\n  small: 3\nbaseline_eval: {limit: 2}\n", r"`profiles.small` must be a mapping"),
        ("- a\n- b\n", r"expected a mapping of sections"),
        (
            "baseline_eval: {limitt: 2}\n",
            r"section `baseline_eval`: unknown setting 'limitt' \(did you mean limit\?\)",
        ),
        (
            "profile: p\nprofiles: {p: {baseline_eval: {max_token: 8}}}\nbaseline_eval: {}\n",
            r"\(with profile p\): unknown setting 'max_token' \(did you mean max_tokens\?\)",
        ),
    ],
)
def test_a_bad_config_file_is_one_message_naming_file_and_place(text, expected, tmp_path, capsys):
    import re

    config = tmp_path / "params.yaml"
    config.write_text(text)
    assert re.search(expected, config_error("baseline_eval", ["--config", str(config)], capsys))


# Six lines whose aliases expand to a million strings (each level ten of the one before); a few more lines and
# it is billions, which a plain YAML loader (and pydantic after it) would expand without end.
ALIAS_BOMB = 'l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]\n' + "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6)
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "profile: nosuch\nprofiles: {cpu: {baseline_eval: {limit: 1}}}\nbaseline_eval: {limit: 2}\n",
            "`profile: nosuch` names no profile of the file (it has: a5, cpu)",
        ),
        (
            "profile: nosuch\nbaseline_eval: {limit: 2}\n",
            "`profile: nosuch` names no profile of the file (it has: a5)",
        ),
        (
            "baseline_eval:\n  limit: 2\n  max_tokens: 12\n  limit: 1\n",
            "params.yaml:4:3: malformed YAML (key 'limit' given twice in one mapping (first on line 2))",
        ),
        (ALIAS_BOMB + "baseline_eval:\n  stop: *l5\n", "its aliases expand to more than 100,000 values"),
        ("baseline_eval:\n  stop: &s [a, *s]\n", "an alias inside its own anchor"),
        ("baseline_eval: {limit: true}\n", "--limit True: Value error, a boolean (true/false) where a number goes"),
        ("baseline_eval: {top_p: false}\n", "--top-p False: Value error, a boolean (true/false) where a number goes"),
    ],
)
def test_a_config_that_would_run_other_settings_than_it_says_is_refused(text, expected, tmp_path, capsys):
    """An unknown profile in the file (not only on the command line), a key given twice, a boolean for a
    number, and aliases that expand without end: each one line, nothing run."""
    config = tmp_path / "params.yaml"
    config.write_text(text)
    assert expected in config_error("baseline_eval", ["--config", str(config)], capsys)


def test_a_boolean_flag_value_for_a_number_is_refused(capsys):
    assert "--limit True: Value error, a boolean (true/false) where a number goes" in parameter_error(
        "baseline_eval", ["--limit", "true"], capsys
    )


def test_a_flag_is_taken_only_as_spelt_in_full(capsys):
    """argparse took a prefix of a flag for it: ``--epochs 3`` set GRPO's epochs_per_rollout_batch."""
    for flow, flag in (("grpo", "--epochs"), ("baseline_eval", "--lim")):
        with pytest.raises(SystemExit) as stopped:
            MAINS[flow]([flag, "3", "--show-config"])
        assert stopped.value.code == 2
        assert f"unrecognized arguments: {flag} 3" in capsys.readouterr().err


def test_a_profile_without_a_settings_file_is_refused(capsys):
    """``--profile cpu`` alone was ignored: the run took the defaults, not the profile it named."""
    assert "--profile cpu: a profile of a settings file; give the file with --config" in config_error(
        "baseline_eval", ["--profile", "cpu", "--show-config"], capsys
    )


def test_a_value_its_profile_replaces_is_checked_all_the_same(tmp_path, capsys):
    """``dvc exp run -S baseline_eval.limit=abc`` writes the section's value, which the selected profile replaces:
    the run went on with the profile's, the wrong value never read. It is refused, naming where it is."""
    config = tmp_path / "params.yaml"
    config.write_text("profile: cpu\nprofiles: {cpu: {baseline_eval: {limit: 32}}}\nbaseline_eval: {limit: abc}\n")
    err = parameter_error("baseline_eval", ["--config", str(config), "--show-config"], capsys)
    assert f"--config {config} section `baseline_eval`: limit 'abc': Input should be a valid integer" in err
    assert "(a later value replaces it, but it is wrong: fix or remove it)" in err
    err = parameter_error("baseline_eval", ["--config", str(config), "--limit", "8", "--show-config"], capsys)
    assert "section `baseline_eval`: limit 'abc'" in err  # replaced by a flag: the same


def test_a_settings_file_of_megabytes_is_refused_before_it_is_parsed(tmp_path, capsys):
    """A 6 MB file took 81 s to parse and was then called an alias bomb."""
    config = tmp_path / "params.yaml"
    config.write_text("baseline_eval:\n  stop:\n" + "    - a stop string of some length\n" * 200_000)
    assert f"--config {config}: 7.0 MB, not a settings file (those hold at most 1 MB" in config_error(
        "baseline_eval", ["--config", str(config)], capsys
    )
    config.write_text("baseline_eval:\n  stop: [" + ", ".join(["x"] * 100_001) + "]\n")
    assert "holds more than 100,000 values: not a settings file" in config_error(
        "baseline_eval", ["--config", str(config)], capsys
    )


def test_a_seed_the_generators_cannot_take_is_refused_naming_it(capsys):
    for flow in ("grpo", "baseline_eval"):
        err = parameter_error(flow, ["--seed", "99999999999999999999"], capsys)
        assert "--seed 99999999999999999999: Input should be less than or equal to 4294967295" in err


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / "params.yaml"
    config.write_bytes("baseline_eval: {prompt: r1_zéro}\n".encode("latin-1"))
    assert f"--config {config}: not UTF-8 text" in config_error("baseline_eval", ["--config", str(config)], capsys)


def test_a_flag_value_that_is_not_yaml(capsys):
    assert "--stop '[\"</answer>\"': not a YAML value" in config_error(
        "baseline_eval", ["--stop", '["</answer>"'], capsys
    )


def test_an_empty_sweep_is_refused(capsys):
    assert "--sweep-epochs []: List should have at least 1 item" in parameter_error(
        "expert_iteration", ["--sweep", "true", "--sweep-epochs", "[]"], capsys
    )


def test_an_unknown_engine_dtype_is_refused_before_anything_starts(capsys):
    assert "--engine-dtype 'float33': Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in parameter_error(
        "grpo", ["--engine-dtype", "float33"], capsys
    )


@pytest.mark.parametrize("flow", ["baseline_eval", "sft_experiment"])
def test_data_and_prompt_files_that_are_not_utf8_are_named(flow, inputs, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(
        json.dumps(math_record(0)).encode() + b"\n" + json.dumps(math_record(1)).encode()[:-2] + b'\xe9"}\n'
    )
    argument = "data" if flow == "baseline_eval" else "validation_data"
    assert f"{data}:2: not UTF-8 text" in user_error(flow, flags(flow, inputs, tmp_path, **{argument: str(data)}))
    prompt = tmp_path / "latin1.prompt"
    prompt.write_bytes("Question: {question} Réponse:".encode("latin-1"))
    assert f"prompt template {prompt}: not UTF-8 text" in user_error(
        flow, flags(flow, inputs, tmp_path, prompt=str(prompt), reward_fn="r1_zero")
    )


# ------------------------------------------------- what an engine would find only after it started


@pytest.mark.parametrize("flow", ["baseline_eval", "grpo", "expert_iteration", "sft_experiment"])
def test_max_tokens_beyond_the_context_is_refused_before_an_engine_starts(flow, inputs, tmp_path, monkeypatch):
    for where in ("tasks.engines", "tasks.evaluation"):  # where the flows' engine starts look it up
        monkeypatch.setattr(f"{where}.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    message = user_error(flow, flags(flow, inputs, tmp_path, max_tokens=100_000_000))
    assert f"max_tokens 100000000 does not fit the context of {inputs['model']}: 2048 tokens" in message


@pytest.mark.parametrize("flow", ["baseline_eval", "grpo"])
def test_a_problem_too_long_for_the_context_is_named(flow, inputs, tmp_path):
    data = tmp_path / "long.jsonl"
    write_jsonl_atomic(data, [math_record(0), {**math_record(1), "problem": "What is 1 + 1? " * 20_000}])
    argument = "data" if flow == "baseline_eval" else "validation_data"
    message = user_error(flow, flags(flow, inputs, tmp_path, **{argument: str(data)}))
    assert f"{data} problem test/1.json: its prompt is" in message and "does not fit the context" in message


@pytest.mark.parametrize("flow", list(MAINS))
def test_outputs_that_cannot_be_written_are_found_before_an_engine_starts(flow, inputs, tmp_path, monkeypatch, capsys):
    for where in ("tasks.engines", "tasks.evaluation"):  # where the flows' engine starts look it up
        monkeypatch.setattr(f"{where}.make_engine", lambda *a, **k: pytest.fail("an engine started"))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    err = parameter_error(flow, flags(flow, inputs, tmp_path, output_dir=str(blocker / "out")), capsys)
    assert f"output_dir {blocker / 'out'}: {blocker} is a file; give a path under a folder" in err
    assert blocker.read_text() == "not a folder"


def test_a_read_only_mlflow_store_is_found_before_an_engine_starts(inputs, tmp_path, monkeypatch):
    from tasks.experiments import ensure_experiment

    monkeypatch.chdir(tmp_path)  # MLflow's client makes the folder file:/… of this URI under the working directory
    ensure_experiment("baseline_eval", f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "mlruns"))
    read_only = f"sqlite:///file:{tmp_path / 'mlflow.db'}?mode=ro&uri=true"
    message = user_error("grpo", flags("grpo", inputs, tmp_path, tracking_uri=read_only))
    assert f"MLflow store {read_only}: it is read-only" in message


def test_a_full_disk_inside_torch_save_ends_with_one_message():
    import torch

    from flows.cli import cli_main

    @cli_main("flows.example")
    def main(argv):
        with open("/dev/full", "wb") as full:  # every write fails with ENOSPC
            torch.save({"weights": torch.zeros(100_000)}, full)

    with pytest.raises(SystemExit, match=r"flows.example: error: no space left on the device writing an output"):
        main([])


def test_compare_names_an_unknown_run_and_a_bad_filter(tmp_path):
    from flows.compare import main as compare
    from tasks.experiments import ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_experiment("grpo", uri, str(tmp_path / "mlruns"))
    with pytest.raises(SystemExit, match=r"flows.compare: error: --runs: no run 'abc123' in sqlite:///"):
        compare(["--runs", "abc123", "--tracking-uri", uri])
    with pytest.raises(SystemExit, match=r"flows.compare: error: --filter 'params.a ==== 3': "):
        compare(["--experiment", "grpo", "--filter", "params.a ==== 3", "--tracking-uri", uri])


# ------------------------------------------------------------------------------- numbers that would mislead


@pytest.mark.parametrize("flow, argument", [("baseline_eval", "data"), ("grpo", "train_data")])
def test_two_problems_sharing_an_id_are_refused_naming_both_lines(flow, argument, inputs, tmp_path):
    """Samples are grouped by problem id: two problems under one id would be scored as one (accuracy, pass@k,
    maj@k and their standard errors over the wrong groups)."""
    records = [math_record(i) for i in range(8)]
    records[5]["unique_id"] = records[2]["unique_id"]
    duplicated = tmp_path / "duplicated.jsonl"
    write_jsonl_atomic(duplicated, records)
    message = user_error(flow, flags(flow, inputs, tmp_path, **{argument: str(duplicated)}))
    assert f"{duplicated}:6: unique_id 'test/2.json' is also the id of {duplicated}:3" in message


def test_sft_that_would_train_on_no_token_is_refused(inputs, tmp_path):
    """max_seq_len below every prompt (215 tokens here) cuts every response away: each step would train on
    nothing (loss 0, gradient 0), and the run would be saved as if it had trained."""
    message = user_error("sft_experiment", flags("sft_experiment", inputs, tmp_path, max_seq_len=200))
    assert f"{inputs['traces']}: max_seq_len 200: no example keeps a response token to train on" in message
    assert "(the shortest prompt is 215 tokens)" in message
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("runs-*"))


def test_sft_that_cuts_some_responses_says_how_many(inputs, flow_env, tmp_path):  # noqa: F811
    """Two of the eight traces are longer than max_seq_len: the run trains, and says what share it cuts."""
    traces = [trace_record(i) for i in range(8)]
    for trace in traces[:2]:
        trace["response"] = " so" * 40 + trace["response"]
    write_jsonl_atomic(tmp_path / "long.jsonl", traces)
    argv = flags("sft_experiment", inputs, tmp_path, train_data=str(tmp_path / "long.jsonl"), max_seq_len=250)
    result = subprocess.run(
        [sys.executable, "-m", "flows.sft_experiment", *argv, "--max-steps", "1"],
        cwd=REPO,
        env=flow_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert "max_seq_len 250 cuts 2 of 8 examples (25%) to fit: they train on part of their response" in result.stderr


def test_a_generated_task_is_drawn_at_once_or_refused_at_once(inputs, tmp_path):
    """arithmetic:10:5 draws 10 of its 2·10¹⁰ problems at once (the command goes on to its next check, here a
    difficulty table that is missing), instead of counting them all first; two million problems are refused."""
    task = {"reward_fn": "arithmetic", "validation_data": "arithmetic:4:1"}
    missing = tmp_path / "missing.csv"
    argv = flags("grpo", inputs, tmp_path, train_data="arithmetic:10:5", difficulty_table=str(missing), **task)
    assert str(missing) in user_error("grpo", argv)
    message = user_error("grpo", flags("grpo", inputs, tmp_path, train_data="arithmetic:2000000:9", **task))
    assert "2,000,000 problems: the arithmetic task generates at most 1,000,000 at a time" in message
