"""A GRPO run's record: every logged step, the wall-clock time since the run began (killed attempts included)
and the checkpoints it resumes from (:class:`Record`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from a5core.loops.grpo.config import GRPOConfig
from a5core.loops.grpo.learning_signal import LearningSignal
from a5core.loops.question_sampling import QuestionSampler
from a5core.runtime import distributed, progress
from a5core.runtime.checkpoint import load_checkpoint, read_state, save_checkpoint
from a5core.runtime.writing import write_text_atomic

logger = logging.getLogger(__package__)  # the package's: every GRPO line is "a5core.loops.grpo"'s
STATUS_KEYS = (
    "reward_mean",
    "format_reward_mean",
    "loss",
    "grad_norm",
    "token_entropy",
    "response_tokens_mean",
    "frac_groups_all_equal",
    "val_accuracy",
)  # the per-step status line's metrics


class Record:
    """The run's record: every logged step (``history``), the wall-clock time since the run began (killed
    attempts included), the checkpoints under ``checkpoint``. Built from the checkpoint, if there is one: a
    resumed run continues its history, its question sampler and its clock; ``expected`` is the fingerprint the
    checkpoint must match (:func:`a5core.loops.grpo.config.run_fingerprint`)."""

    def __init__(
        self,
        config: GRPOConfig,
        checkpoint: Path | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: QuestionSampler,
        expected: dict[str, Any],
        log: Callable[[dict[str, float], int], None],
    ) -> None:
        self.config, self.checkpoint, self.model, self.optimizer = config, checkpoint, model, optimizer
        self.sampler, self.expected, self.log = sampler, expected, log
        self.signal = LearningSignal(config.uses_advantages)
        counts = {"step": config.n_grpo_steps}
        state = load_checkpoint(checkpoint, expected, model, optimizer, None, counts) if checkpoint else None
        self.finished = state is not None and state["finished"]
        self.step, self.history = (0, []) if state is None else (state["step"], state["history"])
        if self.finished:
            logger.info("GRPO: %s holds a finished run (%d steps); not training again", checkpoint, self.step)
            return
        if state is None:
            torch.manual_seed(config.seeding.seed)
        else:
            logger.info("GRPO: resuming from %s after step %d", checkpoint, self.step)
            if "sampler" in state:
                sampler.load_state(state["sampler"])
        elapsed = 0.0 if state is None else state["wall_seconds"]
        self.clock = checkpoint / "wall_clock.json" if checkpoint else None
        if self.clock is not None and self.clock.is_file():  # the time a killed attempt spent after its checkpoint
            spent = read_state(self.clock, ("wall_seconds",), "delete it: the run's clock restarts at its checkpoint's")
            if spent.get("fingerprint") == expected:
                elapsed = max(elapsed, spent["wall_seconds"])
        self.started = time.monotonic() - elapsed

    def finish_step(self, metrics: dict[str, float], step: int) -> None:
        """Stamp the wall-clock time, record and log step ``step`` (with its evaluation, if it had one)."""
        metrics["wall_seconds"] = time.monotonic() - self.started
        self.history.append({"step": step, **metrics})
        self.step = step
        if distributed.rank_and_world()[0] != 0:
            return
        if self.clock is not None:
            stamp = {"step": step, "wall_seconds": metrics["wall_seconds"], "fingerprint": self.expected}
            write_text_atomic(self.clock, json.dumps(stamp))
        self.log(metrics, step)
        note = self.signal.observe(step, self.config.n_grpo_steps, metrics) if step else ""
        progress.log_step(logger, "GRPO step", step, self.config.n_grpo_steps, metrics, STATUS_KEYS, note)

    def save(self, step: int) -> None:
        """A checkpoint after step ``step`` (every rank calls it; rank 0 writes)."""
        state = {
            "step": step,
            "finished": step == self.config.n_grpo_steps,
            "wall_seconds": time.monotonic() - self.started,
            "history": self.history,
            "fingerprint": self.expected,
            "sampler": self.sampler.state(),
        }
        save_checkpoint(self.checkpoint, self.model, self.optimizer, None, state)
