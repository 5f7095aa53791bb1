"""Where a GRPO step's rollouts come from (a5core.loops.grpo.rollouts): pushed weights and a seeded draw each step,
or one step off, the next step's drawn in the background from the weights before; DAPO's extra draws."""

from __future__ import annotations

import random

import torch
from tiny_loops import PROBLEMS, TEMPLATE, small_config

from a5core.engines import Completion
from a5core.loops.grpo.batch import Draw
from a5core.loops.grpo.rollouts import DynamicSampling, OneStepOff, Rollouts, rollout_source
from a5core.loops.grpo.stats import PhaseTimer
from a5core.loops.question_sampling import QuestionSampler

CPU = torch.device("cpu")


class CountingEngine:
    """Answers each prompt with n one-token completions; records the weights pushed (their version) and the
    sampling settings of each call."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.pushed, self.calls = model, [], []

    def load_weights(self, policy: torch.nn.Module) -> None:
        self.pushed.append(int(policy.version))

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling, int(self.model.version)))
        return [[Completion("x", (1,), "stop", (-0.1,)) for _ in range(sampling.n)] for _ in prompts]


def policy() -> torch.nn.Module:
    """A stand-in policy whose ``version`` buffer counts the optimizer steps it has taken."""
    model = torch.nn.Linear(1, 1)
    model.register_buffer("version", torch.tensor(0))
    return model


def source(config, model):
    return rollout_source(config, model, QuestionSampler(PROBLEMS, config.questions, None), TEMPLATE, PhaseTimer(CPU))


def test_each_step_pushes_the_weights_and_draws_from_its_own_seed():
    config = small_config(n_grpo_steps=3)
    model = policy()
    engine = CountingEngine(model)
    rollouts = source(config, model)
    assert type(rollouts) is Rollouts
    for step in (1, 2):
        questions, completions, version = rollouts.take(engine, step, random.Random(config.seeding.step_seed(step)))
        assert version == step - 1 and len(questions) == config.prompts_per_step == 2
        assert len(completions) == config.rollout_batch_size
        model.version += 1
    assert engine.pushed == [0, 1]
    seeds = [sampling.seed for _, sampling, _ in engine.calls]
    assert seeds == [config.seeding.step_seed(1), config.seeding.step_seed(2)]
    sampling = engine.calls[0][1]
    assert (sampling.n, sampling.logprobs, sampling.min_tokens, sampling.max_tokens) == (4, True, 2, 12)


def test_one_step_off_draws_the_next_steps_rollouts_from_the_weights_before_it():
    """Step 1 generates synchronously and starts step 2's from version 0; step 2 takes those (one version older),
    pushes version 1 and starts step 3's; the last step starts nothing."""
    config = small_config(n_grpo_steps=3, pipeline_depth=1, tis_cap=2.0)
    model = policy()
    engine = CountingEngine(model)
    rollouts = source(config, model)
    assert type(rollouts) is OneStepOff
    versions = []
    for step in (1, 2, 3):
        _, completions, version = rollouts.take(engine, step, random.Random(config.seeding.step_seed(step)))
        rollouts.settle()  # the background rollouts done before the step "trains"
        versions.append(version)
        assert len(completions) == config.rollout_batch_size
        model.version += 1
    rollouts.close()
    assert versions == [0, 0, 1]
    assert engine.pushed == [0, 1]  # step 2 pushes version 1 for step 3's rollouts; the last step pushes nothing
    assert [trained for *_, trained in engine.calls] == [0, 0, 1]  # each generated before its step trains
    assert [sampling.seed for _, sampling, _ in engine.calls] == [config.seeding.step_seed(s) for s in (1, 2, 3)]


def draw(varied: list[bool]) -> Draw:
    empty = torch.zeros(0)
    return Draw([], [], empty, empty, empty, empty, varied, {})


def test_dynamic_sampling_draws_again_until_enough_groups_differ_or_the_draws_run_out():
    config = small_config(rollout_batch_size=12, train_batch_size=12, gradient_accumulation_steps=3)
    assert not DynamicSampling(config).wants_more([draw([False, False, False])])  # off: one draw
    dynamic = DynamicSampling(config.replace(dynamic_sampling=True, max_extra_draws=2))
    assert dynamic.wants_more([draw([True, False, False])])
    assert dynamic.wants_more([draw([True, False, False]), draw([True, False, False])])
    assert not dynamic.wants_more([draw([True, False, True]), draw([True, False, False])])  # 3 groups differ
    assert not dynamic.wants_more([draw([False] * 3)] * 3)  # two extra draws made: no more
