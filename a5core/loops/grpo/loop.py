"""GRPO (CS336 A5 §7, Algorithm 3): :func:`grpo` runs the steps, :func:`grpo_step` is one step read top to
bottom: rollouts → rewards and group-normalised advantages → micro-batched updates, each micro-batch's loss
:func:`a5core.loops.grpo.objective.microbatch_loss`. The options, several ranks, resuming: docs/grpo.md.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from a5core.data.files import Problem
from a5core.data.prompts import PromptTemplate
from a5core.engines import Engine
from a5core.loops.grpo.batch import RolloutBatch, assemble, grade
from a5core.loops.grpo.config import GRPOConfig, run_fingerprint
from a5core.loops.grpo.learning_signal import warn_if_groups_are_uniform
from a5core.loops.grpo.microbatches import MicroBatches
from a5core.loops.grpo.objective import loss_metrics, microbatch_loss, token_sum_divisor_for
from a5core.loops.grpo.record import Record
from a5core.loops.grpo.rollouts import DynamicSampling, Rollouts, rollout_source
from a5core.loops.grpo.stats import EngineMismatch, PhaseTimer, StepStats
from a5core.loops.question_sampling import QuestionSampler
from a5core.loops.training import TrainedPolicy, prepare
from a5core.policy.causal_lm import compiled_graphs, get_response_log_probs
from a5core.runtime import distributed, progress
from a5core.runtime.guards import DivergenceGuard

logger = logging.getLogger(__package__)  # the package's: every GRPO line is "a5core.loops.grpo"'s
RewardFn = Callable[[str, Any], dict[str, float]]


@dataclass
class _Run:
    """What every step of a run uses: the settings, the policy and what trains it, where rollouts come from."""

    config: GRPOConfig
    policy: TrainedPolicy
    reference: torch.nn.Module | None  # the KL penalty's frozen starting policy (kl_coef > 0)
    sampler: QuestionSampler
    rollouts: Rollouts
    dynamic_sampling: DynamicSampling
    microbatches: MicroBatches
    timer: PhaseTimer
    tokenizer: Any
    template: PromptTemplate
    checkpoint: Path | None


def grpo(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: RewardFn,
    config: GRPOConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
    log: Callable[[dict[str, float], int], None] = lambda metrics, step: None,
    should_stop: Callable[[int], bool] | None = None,
    pass_rates: dict[str, float] | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` in place with GRPO (docs/grpo.md); returns every logged metrics dict.

    ``pass_rates``: question id → pass rate, the table ``question_sampling`` starts from
    (:mod:`a5core.loops.question_sampling`; None: none, every question unknown).

    ``should_stop(step)``, asked after each step (e.g. a wall-clock budget), ends the run early: a
    checkpoint of that step is written (not marked finished) and the history so far returned.

    Each step logs the rollouts' reward, format and answer reward, advantage statistics, mean token
    entropy, response lengths (all, correct, incorrect), loss, gradient norm, clip fraction, learning
    rate, ratio statistics (off-policy), the engine's mismatch to the policy (``mismatch_*``: see
    :class:`a5core.loops.grpo.stats.EngineMismatch`), the seconds of each phase (weight sync, generate, grade, old
    log-probs, train), tokens/s, and ``wall_seconds`` since the run began (resumes included); an
    evaluation's metrics are merged into its step's. A NaN/inf loss or gradient norm raises
    :class:`a5core.runtime.checkpoint.NonFiniteLossError` before the update, the last checkpoint intact.
    """
    problems = list(problems)
    _check_inputs(model, engine, problems, config)
    run = _setup(
        model, tokenizer, template, QuestionSampler(problems, config.questions, pass_rates), config, checkpoint_dir
    )
    optimizer, expected = run.policy.optimizer, run_fingerprint(config, problems, pass_rates)
    record = Record(config, run.checkpoint, model, optimizer, run.sampler, expected, log)
    if record.finished:
        return record.history
    was_training = model.training
    steps_bar = progress.bar(desc="GRPO", total=config.n_grpo_steps, initial=record.step, unit="step", leave=True)
    try:
        if record.step == 0 and evaluate is not None and config.schedule.eval_every:
            run.timer.on_phase = functools.partial(_show_phase, steps_bar, 0)
            record.finish_step(_evaluated(run, evaluate, {}, 0), 0)  # the starting policy: every curve's first point
        for step in range(record.step + 1, config.n_grpo_steps + 1):  # step: the steps done once it is
            run.timer.on_phase = functools.partial(_show_phase, steps_bar, step)
            metrics = grpo_step(run, engine, reward_fn, step)
            record.finish_step(_evaluated(run, evaluate, metrics, step), step)
            steps_bar.update(1)
            last = step == config.n_grpo_steps
            stopping = should_stop is not None and not last and distributed.any_rank(should_stop(step))
            every = config.schedule.checkpoint_every
            if run.checkpoint and (stopping or last or (every and step % every == 0)):
                record.save(step)
            if stopping:
                logger.info("GRPO: stopped after step %d of %d (should_stop)", step, config.n_grpo_steps)
                break
    finally:
        run.rollouts.close()  # rollouts still generating in the background (a stopped or failed run) end first
        steps_bar.close()
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return record.history


def grpo_step(run: _Run, engine: Engine, reward_fn: RewardFn, step: int) -> dict[str, float]:
    """GRPO step ``step`` (from 1), Algorithm 3's loop body: sample → reward → advantages → (old log-probs) →
    optimizer steps over micro-batch losses → the step's metrics."""
    config, policy, timer = run.config, run.policy, run.timer
    timer.times, began = {}, time.perf_counter()

    # 1. Sample group_size rollouts for each of prompts_per_step questions, seeded by (seed, step): a resumed
    # run redraws the same questions and, on a seeded engine, the same rollouts. The source pushes the
    # weights and generates, or (one step off) hands over what the engine generated while the last step
    # trained, from weights one version older.
    rng = random.Random(config.seeding.step_seed(step))
    questions, completions, version = run.rollouts.take(engine, step, rng)

    # 2-3. Reward each rollout, and make its advantage its reward against its group's: no value network, the
    # other answers to the same question are the baseline.
    with timer("grade"):
        draws = [grade(config, questions, completions, reward_fn)]
    while run.dynamic_sampling.wants_more(draws):  # DAPO: groups of equal rewards teach nothing; draw more
        questions = run.sampler.sample(rng, config.prompts_per_step)
        with timer("generate"):
            completions = run.rollouts.generate(engine, questions, step, len(draws))
        with timer("grade"):
            draws.append(grade(config, questions, completions, reward_fn))
    for draw in draws:  # the pass rates seen, for the questions to come
        run.sampler.observe(draw.questions, draw.correct.float().tolist(), step)
    batch, metrics = assemble(config, draws, run.tokenizer, run.template)
    metrics.update(run.sampler.metrics())
    # A policy's version counts the steps it has trained: this step trains version step − 1, and its rollouts
    # came from version ``version`` (one older, one step off).
    metrics.update({"rollout_policy_version": float(version), "policy_lag": float(step - 1 - version)})

    # 4. The log-probs of the policy that sampled (π_old: the ratio losses, the importance weights) and of the
    # frozen reference (the KL penalty), once, before the first update moves the policy.
    if len(batch) and (config.needs_old_log_probs or run.reference is not None):
        where = f"GRPO step {step}, log-probs pass"
        with timer("old_log_probs"), run.microbatches.naming(where):
            run.microbatches.budget.retrying(
                functools.partial(log_probs_pass, run, batch), where, batch.lengths, engine.release_memory
            )

    # How far the engine's log-probs of the tokens it sampled are from the policy's at the same weights, at no
    # forward pass of its own: the old log-probs are the policy's at those weights where this step computed them;
    # else the first optimizer step's training forward gives them (its micro-batches all run before an update).
    mismatch = EngineMismatch(config.tis_cap)
    if batch.old_log_probs is not None:
        metrics.update(mismatch.of_rollouts(batch.old_log_probs, batch.engine_log_probs))

    # 5. epochs_per_rollout_batch passes over the rollouts, shuffled per epoch, in optimizer steps of
    # train_batch_size rollouts (more than one step a batch: off-policy, where the ratio π/π_old matters).
    ratios = config.needs_old_log_probs
    stats = StepStats(policy.device, loss_metrics(config), ratios, mismatch if batch.old_log_probs is None else None)
    where, steps, positions = f"GRPO step {step}, training", config.n_grpo_steps, batch.lengths
    with timer("train"), run.microbatches.naming(where):
        for epoch, train_batch in _train_batches(config, len(batch), step):  # none if every group was dropped
            policy.model.train()
            lengths = [len(batch.response_ids[i]) for i in train_batch]
            token_sum_divisor = token_sum_divisor_for(config, lengths, batch.truncated[train_batch].tolist())
            accumulate = functools.partial(_accumulate, run, batch, train_batch, stats, epoch, token_sum_divisor)
            policy.budget.retrying(accumulate, where, [positions[i] for i in train_batch], engine.release_memory)
            got = stats.read(policy.clip_gradients())
            # Refused before the update if non-finite or diverged: the weights stay the last good step's.
            detail = f" (epoch {epoch}, optimizer step {stats.optimizer_steps})"
            policy.update(f"GRPO step {step} of {steps}", got["loss"], got["grad_norm"], run.checkpoint, detail)
            stats.stepped(got)
        policy.optimizer.zero_grad(set_to_none=True)

    # 6. The step's metrics: the rollouts' and the training's above, then phase times and throughput.
    compiled = {"compiled_graphs": float(compiled_graphs())} if config.speed.compiles(policy.device) else {}
    shapes = float(len(run.microbatches.shapes))
    metrics.update(stats.metrics(lr=policy.optimizer.param_groups[0]["lr"], microbatch_shapes=shapes, **compiled))
    metrics.update(timer.times)
    generated = sum(float(d.lengths.sum()) for d in draws)
    metrics["time_step"] = time.perf_counter() - began
    metrics["generate_tokens_per_s"] = generated / max(timer.times["time_generate"], 1e-9)
    metrics["train_tokens_per_s"] = metrics.get("train_tokens", 0.0) / max(timer.times["time_train"], 1e-9)
    return metrics


def _accumulate(
    run: _Run,
    batch: RolloutBatch,
    train_batch: list[int],
    stats: StepStats,
    epoch: int,
    token_sum_divisor: float | None,
) -> None:
    """One optimizer step's gradient, accumulated over the micro-batches of ``train_batch``
    (:meth:`a5core.loops.training.TrainedPolicy.accumulating`). ``token_sum_divisor``: what each sequence's summed
    token losses are divided by (:func:`a5core.loops.grpo.objective.token_sum_divisor_for`)."""
    world, policy = distributed.rank_and_world()[1], run.policy
    microbatches = run.microbatches.split(batch, train_batch)
    stats.begin(len(microbatches))
    for index, microbatch_mean_divisor in policy.accumulating(len(train_batch), microbatches):
        mb = run.microbatches.tensors(batch, index, index or train_batch[:1])  # an empty share: a stand-in, weight 0
        with policy.budget.measuring(mb.input_ids.numel()):
            with policy.autocast:  # entropy is only logged: the first epoch's is enough
                out = get_response_log_probs(policy.model, mb.input_ids, mb.labels, return_token_entropy=epoch == 0)
            loss, meta = microbatch_loss(
                run.config, out["log_probs"], mb, token_sum_divisor, microbatch_mean_divisor, live=bool(index)
            )
            loss.backward()
        if index:
            stats.add(sum(len(batch.response_ids[i]) for i in index), mb, out, loss.detach(), meta, world)


def _train_batches(config: GRPOConfig, n: int, step: int) -> Iterator[tuple[int, list[int]]]:
    """(epoch, rollouts) of each optimizer step of step ``step``: every epoch walks the ``n`` rollouts in its own
    order, seeded by (seed, step, epoch), ``train_batch_size`` at a time."""
    for epoch in range(config.epochs_per_rollout_batch):
        generator = torch.Generator().manual_seed(config.seeding.step_seed(step) * 1_000 + epoch)
        order = torch.randperm(n, generator=generator).tolist()
        for first in range(0, n, config.train_batch_size):
            yield epoch, order[first : first + config.train_batch_size]


@torch.no_grad()
def log_probs_pass(run: _Run, batch: RolloutBatch) -> None:
    """One pass over the rollouts without gradients: their response-token log-probs under the current
    policy (``old_log_probs``, when the loss or the importance weights need them) and under the frozen
    reference (``ref_log_probs``, with a KL penalty). Each rank computes its share, all get all."""
    run.policy.model.eval()
    models = {}
    if run.config.needs_old_log_probs:
        models["old_log_probs"] = run.policy.model
    if run.reference is not None:
        models["ref_log_probs"] = run.reference
    mine: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in models}
    for index in run.microbatches.split(batch, range(len(batch))):
        mb = run.microbatches.tensors(batch, index, [0])  # an empty share still runs a pass (FSDP2)
        mask = mb.response_mask
        for name, model in models.items():
            with run.policy.autocast:
                log_probs = get_response_log_probs(model, mb.input_ids, mb.labels)["log_probs"]
            if index:
                mine[name] += zip(index, log_probs[mask].float().cpu().split(mask.sum(dim=1).tolist()), strict=True)
    for name, pairs in mine.items():
        setattr(batch, name, [values for _, values in sorted(distributed.gather_lists(pairs), key=lambda p: p[0])])


def _evaluated(
    run: _Run, evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None, metrics: dict, step: int
) -> dict[str, float]:
    """``metrics`` with the evaluation's after step ``step``, when one is due (at step 0, every ``eval_every``
    steps and after the last): the engine is free first (rollouts generating in the background finish)."""
    config, every = run.config, run.config.schedule.eval_every
    if evaluate is not None and (step == config.n_grpo_steps or (every and step % every == 0)):
        run.rollouts.settle()
        run.timer.announce("evaluate")
        run.policy.model.eval()
        metrics.update(evaluate(run.policy.model, step))
    return metrics


def _show_phase(steps_bar: Any, step: int, phase: str) -> None:
    """Name the phase step ``step`` is in on the steps' bar (or its status lines)."""
    steps_bar.set_postfix_str(f"step {step}: {phase}", refresh=False)


def _check_inputs(model: torch.nn.Module, engine: Engine, problems: list[Problem], config: GRPOConfig) -> None:
    warn_if_groups_are_uniform(config.sampling.temperature, config.group_size)
    if len(problems) < config.prompts_per_step:
        raise ValueError(f"GRPO samples {config.prompts_per_step} questions per step but got {len(problems)} problems")
    world = distributed.rank_and_world()[1]
    if world > config.prompts_per_step:
        raise ValueError(
            f"GRPO on {world} ranks needs at least {world} questions per step (rollout_batch_size / "
            f"group_size), got {config.prompts_per_step}"
        )
    if world > 1 and getattr(engine, "model", None) is model:
        raise ValueError("GRPO on several ranks needs an engine with its own copy of the model (the policy is sharded)")
    if config.pipeline_depth and getattr(engine, "model", None) is model:
        raise ValueError(
            "GRPOConfig.pipeline_depth 1 generates while the policy trains: the engine needs its own copy of the "
            "weights (an engine in its own process, on this GPU or another: engine_device), not the policy itself"
        )


def _setup(
    model: torch.nn.Module,
    tokenizer: Any,
    template: PromptTemplate,
    sampler: QuestionSampler,
    config: GRPOConfig,
    checkpoint_dir: str | os.PathLike | None,
) -> _Run:
    """The policy made ready to train (:func:`a5core.loops.training.prepare`), the KL penalty's reference, and the
    pieces the settings choose."""
    reference = _frozen_copy(model) if config.kl_coef else None  # first: the starting model, unsharded, no adapters
    policy = prepare(model, config, DivergenceGuard(fixed_scale=False, vanishing_gradient=not config.clips))
    if reference is not None:
        distributed.setup_model(reference, config.speed.fsdp_reshard_after_forward)
    timer = PhaseTimer(policy.device)
    advice = f"gradient_accumulation_steps {config.gradient_accumulation_steps}: raise it"
    return _Run(
        config,
        policy,
        reference,
        sampler,
        rollout_source(config, model, sampler, template, timer),
        DynamicSampling(config),
        MicroBatches(config.microbatch_size, policy.budget, advice, tokenizer, policy.device),
        timer,
        tokenizer,
        template,
        Path(checkpoint_dir) if checkpoint_dir is not None else None,
    )


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the starting weights: the KL penalty's reference π_ref."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise ValueError(
            "GRPOConfig.kl_coef > 0 with a policy already sharded (FSDP2): the reference is copied from the "
            "starting weights before sharding; start GRPO from an unsharded model"
        )
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference
