"""Where a GRPO step's rollouts come from: :class:`Rollouts` (push the weights, generate now) or
:class:`OneStepOff` (``pipeline_depth`` 1: the engine generates step k+1's rollouts in a background thread
while step k trains); and DAPO's :class:`DynamicSampling`, which asks for more draws.

Each rank samples its block of the step's questions with its own random stream (seeded by step, rank and
draw), then all ranks get all the rollouts (group_size each, question order).
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from typing import Any

import torch

from a5core.data.files import Problem
from a5core.data.prompts import PromptTemplate
from a5core.engines import Completion, Engine, full_weights
from a5core.loops.grpo.batch import Draw
from a5core.loops.grpo.config import GRPOConfig
from a5core.loops.grpo.stats import PhaseTimer
from a5core.loops.question_sampling import QuestionSampler
from a5core.runtime import distributed

# Dynamic sampling's draw d > 0 of a step samples with seed + d × this: its own stream, distinct from any
# (step, rank) stream of draw 0 for steps below it.
_DRAW_SEED_STRIDE = 1_000_000_007


class Rollouts:
    """Synchronous rollouts: each step pushes the policy's weights into the engine and generates from them (a
    policy's version is the number of steps it has trained: step k is sampled by version k − 1). ``timer``: the
    step's phase timer (weight_sync, generate)."""

    def __init__(
        self,
        config: GRPOConfig,
        model: torch.nn.Module,
        sampler: QuestionSampler,
        template: PromptTemplate,
        timer: PhaseTimer,
    ) -> None:
        self.config, self.model, self.sampler, self.template, self.timer = config, model, sampler, template, timer

    def take(self, engine: Engine, step: int, rng: random.Random) -> tuple[list[Problem], list[Completion], int]:
        """Step ``step``'s questions, their rollouts and the policy version (steps trained) that sampled them."""
        questions = self.sampler.sample(rng, self.config.prompts_per_step)
        with self.timer("weight_sync"):
            engine.load_weights(full_weights(self.model))
        with self.timer("generate"):
            completions = self.generate(engine, questions, step)
        return questions, completions, step - 1

    def generate(self, engine: Engine, questions: list[Problem], step: int, draw: int = 0) -> list[Completion]:
        """Rollouts of ``questions`` from the weights the engine holds (draw ``draw`` of the step)."""
        return distributed.gather_lists(self.local(engine, questions, step, draw)[0])

    def local(
        self, engine: Engine, questions: list[Problem], step: int, draw: int = 0
    ) -> tuple[list[Completion], float]:
        """This rank's block of :meth:`generate` (no collective: it may run in a background thread) and the
        seconds it took. Draw d > 0 (dynamic sampling's extra draws) has a random stream of its own."""
        began = time.perf_counter()
        rank, world = distributed.rank_and_world()
        config = self.config
        prompts = [self.template.format(q.problem) for q in questions]
        sampling = config.sampling.engine_settings(
            self.template.stop,
            n=config.group_size,
            logprobs=True,  # every step: the engine mismatch is measured on each, tis_cap or not
            seed=config.seeding.step_seed(step) * world + rank + draw * _DRAW_SEED_STRIDE,
        )
        groups = engine.generate(prompts[distributed.rank_slice(len(prompts))], sampling)
        return [c for group in groups for c in group], time.perf_counter() - began

    def settle(self) -> None:
        """Wait until the engine is free (nothing runs in the background here)."""

    def close(self) -> None:
        """Wait for the engine and release what the source holds."""


class OneStepOff(Rollouts):
    """One-step-off rollouts (``pipeline_depth`` 1): step k trains on the rollouts the engine generated in the
    background during step k − 1's training, from the weights of one version before; right after taking them,
    the current weights are pushed and step k+1's rollouts started. The run's first step, and the first after
    a resume (a killed run's background rollouts are lost), generate synchronously."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "a5-rollouts")
        # The next step's rollouts being generated: (step, the policy version sampling them, its questions, future).
        self.in_flight: tuple[int, int, list[Problem], concurrent.futures.Future] | None = None

    def take(self, engine: Engine, step: int, rng: random.Random) -> tuple[list[Problem], list[Completion], int]:
        if self.in_flight is not None and self.in_flight[0] == step:
            _, version, questions, future = self.in_flight
            self.in_flight = None
            with self.timer("wait_rollouts"):
                local, self.timer.times["time_generate"] = future.result()
            completions = distributed.gather_lists(local)
        else:
            questions, completions, version = super().take(engine, step, rng)
        current = step - 1  # the policy's version: the steps trained before this one
        if step < self.config.n_grpo_steps:  # a step follows: its rollouts start now, from the current weights
            if version != current:
                with self.timer("weight_sync"):
                    engine.load_weights(full_weights(self.model))
            following = self.sampler.sample(
                random.Random(self.config.seeding.step_seed(step + 1)), self.config.prompts_per_step
            )
            future = self.pool.submit(self.local, engine, following, step + 1)
            self.in_flight = (step + 1, current, following, future)
        return questions, completions, version

    def settle(self) -> None:
        """Wait until the rollouts being generated in the background are done (kept for their step), so the
        engine is free: before an evaluation uses it, and before the run returns or raises."""
        if self.in_flight is not None:
            concurrent.futures.wait([self.in_flight[3]])

    def close(self) -> None:
        self.settle()
        self.pool.shutdown()


def rollout_source(
    config: GRPOConfig, model: torch.nn.Module, sampler: QuestionSampler, template: PromptTemplate, timer: PhaseTimer
) -> Rollouts:
    """The rollouts of ``config.pipeline_depth`` (0: synchronous, 1: one step off)."""
    return (OneStepOff if config.pipeline_depth else Rollouts)(config, model, sampler, template, timer)


class DynamicSampling:
    """DAPO's dynamic sampling: more draws of questions (at most ``max_extra_draws``) until the step holds
    ``prompts_per_step`` groups whose rewards differ: a group of equal rewards has advantages 0 and teaches
    nothing. Off (``dynamic_sampling`` false): one draw."""

    def __init__(self, config: GRPOConfig) -> None:
        self.on, self.groups, self.max_extra_draws = (
            config.dynamic_sampling,
            config.prompts_per_step,
            config.max_extra_draws,
        )

    def wants_more(self, draws: list[Draw]) -> bool:
        return self.on and sum(d.varied.count(True) for d in draws) < self.groups and len(draws) <= self.max_extra_draws
