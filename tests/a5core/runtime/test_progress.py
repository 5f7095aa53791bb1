"""Progress: the A5_PROGRESS switch, the per-step status line, and bars drawn by the loops, the engine and
the grader when switched on."""

from __future__ import annotations

import logging
import sys

import pytest

from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.grading.grader import grade_batch
from a5core.runtime import progress

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "value, tty, expected",
    [
        (None, False, False),
        (None, True, True),
        ("0", True, False),
        ("off", True, False),
        ("1", False, True),
    ],
)
def test_bars_show_on_a_terminal_unless_switched(value, tty, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, value)
    monkeypatch.setattr(sys, "stderr", type("Stream", (), {"isatty": lambda self: tty})())
    assert progress.enabled() is expected


def test_status_line_names_the_step_and_the_finite_metrics():
    metrics = {"loss": 0.012345, "reward_mean": 0.25, "grad_norm": float("nan"), "wall_seconds": 41.23, "other": 1}
    assert progress.status_line("GRPO step", 3, 200, metrics, ("reward_mean", "loss", "grad_norm", "val_accuracy")) == (
        "GRPO step 3/200: reward_mean 0.25, loss 0.01235 (41.2 s)"
    )


def test_grpo_logs_a_line_per_step_and_draws_bars_when_on(tiny_tokenizer, monkeypatch, caplog, capsys):
    from tiny_loops import make_model

    from a5core.engines.hf import HFEngine
    from a5core.loops.grpo import GRPOConfig, grpo

    monkeypatch.setenv(progress.ENV, "1")
    model = make_model(tiny_tokenizer)
    config = GRPOConfig(
        n_grpo_steps=2,
        learning_rate=1e-3,
        rollout_batch_size=4,
        group_size=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        temperature=1.0,
        min_tokens=1,
        max_tokens=8,
    )
    problems = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(4)]

    def reward(response, truth):  # a plain callable: graded through grade_batch's own bar
        return {"reward": float(len(response) % 2), "format_reward": 1.0, "answer_reward": 0.0}

    with caplog.at_level(logging.INFO, logger="a5core"):
        grpo(model, tiny_tokenizer, HFEngine(model, tiny_tokenizer), problems, load_prompt("r1_zero"), reward, config)
    lines = [r.getMessage() for r in caplog.records if r.name == "a5core.loops.grpo"]
    assert [line.split(":")[0] for line in lines] == ["GRPO step 1/2", "GRPO step 2/2"]
    assert "reward_mean" in lines[0] and "loss" in lines[0]
    err = capsys.readouterr().err
    assert "GRPO: 100%" in err and "generate" in err and "grade" in err


def test_sft_logs_a_line_per_step(tiny_tokenizer, caplog, monkeypatch, capsys):
    from tiny_loops import make_model

    from a5core.data.files import Trace
    from a5core.loops.sft import SFTConfig, train_sft

    monkeypatch.setenv(progress.ENV, "0")
    traces = [Trace(f"What is {i} + 1?", f" {i + 1} </answer>", str(i + 1)) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="a5core"):
        train_sft(
            make_model(tiny_tokenizer), tiny_tokenizer, traces, SFTConfig(batch_size=2, microbatch_size=2, epochs=1)
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SFT step")]
    assert [line.split(":")[0] for line in lines] == ["SFT step 1/2", "SFT step 2/2"]
    assert "SFT:" not in capsys.readouterr().err  # A5_PROGRESS=0: no bar


def test_grade_batch_of_a_plain_callable_is_unchanged():
    rewards = grade_batch(lambda r, t: {"reward": float(r == t)}, ["1", "2"], ["1", "3"])
    assert [r["reward"] for r in rewards] == [1.0, 0.0]


def test_off_a_terminal_a_long_bar_logs_a_status_line_at_each_interval_and_a_last_one(monkeypatch, caplog):
    """Where stderr is not a terminal, work that outlasts the interval is not silent: a plain line every
    interval (requests done / total, the postfix's tokens/s), and one when it ends; work under it adds none."""
    import time

    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", type("Log", (), {"isatty": lambda self: False, "write": len, "flush": id})())
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.2")
    with caplog.at_level(logging.INFO, logger="a5core.runtime.progress"):
        with progress.bar(desc="quick", total=1, unit="seq") as quick:
            quick.update(1)
        slow = progress.engine_bar(total=4, desc="Processed prompts", postfix="output: 0.00 toks/s")
        deadline = time.monotonic() + 30  # a generous wait for two intervals on a loaded machine
        while sum("generate" in r.getMessage() for r in caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        slow.postfix = "output: 12.50 toks/s"
        slow.update(4)
        slow.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "a5core.runtime.progress"]
    assert not any("quick" in line for line in lines), lines
    assert len(lines) >= 3 and lines[0].startswith("generate: 0/4 requests after "), lines
    assert lines[-1].startswith("generate: 4/4 requests after ") and lines[-1].endswith("(output: 12.50 toks/s); done")


def test_a_bad_interval_is_named(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match="A5_PROGRESS_INTERVAL='soon'"):
        progress.interval()


def test_status_line_carries_a_note():
    line = progress.status_line("GRPO step", 2, 8, {"loss": 0.0, "wall_seconds": 3.0}, ("loss",), "no learning signal")
    assert line == "GRPO step 2/8: loss 0; no learning signal (3.0 s)"


def test_vllm_logs_warnings_only_and_not_the_rotary_table_at_each_weight_push(monkeypatch, caplog):
    """vLLM's start-up report stays out of the log unless asked for (VLLM_LOGGING_LEVEL), and a weight push does
    not warn that the rotary embedding's table (computed, never loaded) failed to load; other layers still do."""
    import os

    from a5core.engines.vllm import _RELOAD_LOGGER, _quiet_computed_layers, set_vllm_env

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    set_vllm_env()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    set_vllm_env()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"  # the user's choice stands
    _quiet_computed_layers()
    reload_log = logging.getLogger(_RELOAD_LOGGER)
    with caplog.at_level(logging.WARNING, logger=_RELOAD_LOGGER):
        reload_log.warning("%s: Failed to load weights", "RotaryEmbedding")
        reload_log.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]


def test_off_a_terminal_transformers_loads_models_without_a_bar(tiny_lm_dir, monkeypatch, capsys):
    from transformers.utils import logging as transformers_logging

    from a5core.policy.causal_lm import load_policy

    monkeypatch.setenv(progress.ENV, "0")
    try:
        load_policy(tiny_lm_dir)
        assert not transformers_logging.is_progress_bar_enabled()
        assert "Loading weights" not in capsys.readouterr().err
    finally:
        transformers_logging.enable_progress_bar()
