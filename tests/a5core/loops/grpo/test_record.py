"""A GRPO run's record (a5core.loops.grpo.record): every logged step, the wall-clock time since the run began
(killed attempts included), and the checkpoints it resumes from."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from tiny_loops import PROBLEMS, small_config

from a5core.loops.grpo import run_fingerprint
from a5core.loops.grpo.record import Record
from a5core.loops.question_sampling import QuestionSampler
from a5core.runtime.checkpoint import CheckpointMismatchError


class Log:
    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, metrics: dict, step: int) -> None:
        self.calls.append((step, dict(metrics)))


def record(config, checkpoint, log=None, problems=PROBLEMS) -> Record:
    """A fresh model, optimizer and sampler, and the record of the run under ``checkpoint``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = QuestionSampler(problems, config.questions, None)
    expected = run_fingerprint(config, problems)
    return Record(config, checkpoint, model, optimizer, sampler, expected, log or Log())


def test_a_fresh_run_starts_at_step_0_and_logs_each_step_with_its_wall_clock(tmp_path):
    log = Log()
    run = record(small_config(n_grpo_steps=2), tmp_path / "checkpoint", log)
    assert (run.step, run.history, run.finished) == (0, [], False)
    run.finish_step({"loss": 0.5}, 1)
    assert run.step == 1 and log.calls[0][0] == 1 and log.calls[0][1]["loss"] == 0.5
    assert run.history == [{"step": 1, "loss": 0.5, "wall_seconds": log.calls[0][1]["wall_seconds"]}]
    clock = json.loads((tmp_path / "checkpoint" / "wall_clock.json").read_text())
    assert clock["step"] == 1 and clock["wall_seconds"] == run.history[0]["wall_seconds"]


def test_a_saved_run_resumes_its_history_sampler_and_clock_and_a_finished_one_is_not_trained_again(tmp_path):
    config = small_config(n_grpo_steps=2, question_sampling="learnable")
    first = record(config, tmp_path)
    first.sampler.observe(PROBLEMS[:2], [1.0] * 4 + [0.0] * 4, 1)
    first.finish_step({"loss": 0.5}, 1)
    first.save(1)
    weights = first.model.weight.detach().clone()
    resumed = record(config, tmp_path)  # other starting weights: the checkpoint's are loaded
    assert (resumed.step, resumed.finished, resumed.history) == (1, False, first.history)
    assert torch.equal(resumed.model.weight, weights) and resumed.sampler.state() == first.sampler.state()
    assert time.monotonic() - resumed.started >= first.history[-1]["wall_seconds"]  # the clock continues
    resumed.finish_step({"loss": 0.4}, 2)
    resumed.save(2)
    finished = record(config, tmp_path)
    assert finished.finished and [h["step"] for h in finished.history] == [1, 2]


def test_another_runs_checkpoint_is_refused(tmp_path):
    run = record(small_config(n_grpo_steps=2), tmp_path)
    run.finish_step({"loss": 0.5}, 1)
    run.save(1)
    with pytest.raises(CheckpointMismatchError, match="learning_rate: 0.001 in the checkpoint, 0.002 now"):
        record(small_config(n_grpo_steps=2, learning_rate=2e-3), tmp_path)
    with pytest.raises(CheckpointMismatchError, match="problems: same number"):
        record(small_config(n_grpo_steps=2), tmp_path, problems=random.Random(0).sample(PROBLEMS, len(PROBLEMS)))
