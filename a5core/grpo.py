"""GRPO (CS336 A5 §7, Algorithm 3): group-relative policy optimisation with verified rewards.

Each of ``n_grpo_steps`` steps of :func:`grpo`:

1. sample ``rollout_batch_size / group_size`` questions from the training problems (seeded per step);
2. push the policy's weights into the engine and draw ``group_size`` rollouts per question
   (temperature 1.0, min_tokens 4, max_tokens 1024, stop ``</answer>`` by default);
3. grade them with the reward function and normalise each reward within its group:
   A = (r − mean(group)) / (std(group) + advantage_eps), without the division if
   ``use_std_normalization`` is false (:func:`a5core.losses.compute_group_normalized_rewards`);
4. if the loss needs them (``grpo_clip``, ``grpo_no_clip``, ``gspo``, or the truncated importance-sampling
   correction), compute the rollouts' log-probs under the current policy once, without gradients:
   the "old" log-probs of every later optimizer step on this batch;
5. ``epochs_per_rollout_batch`` times, walk the rollouts (shuffled per epoch) in batches of
   ``train_batch_size``; each batch is one AdamW step, accumulated over micro-batches of
   ``train_batch_size / gradient_accumulation_steps`` rollouts (the loss of :mod:`a5core.pg_losses`,
   reduced and back-propagated by :func:`a5core.policy.policy_gradient_backward`), with the gradient norm
   clipped to ``grad_clip``.

:func:`grpo_step` is that step, top to bottom. What the settings add to it are pieces it composes, each a
no-op unless its setting is on: the rollout source (synchronous, or one step off) and DAPO's dynamic
sampling in :mod:`a5core.grpo_rollouts`; reward shaping and the batch's groups in :mod:`a5core.grpo_batch`;
token weights (importance sampling, truncation masking), the KL penalty, micro-batches by token budget and
the length normalisation's divisor in :mod:`a5core.grpo_pieces`; LoRA adapters (:mod:`a5core.lora`) and
compiled layers where the run is set up. :func:`grpo` is the run around the steps: setup, resume,
evaluation, logging, checkpoints.

One rollout batch with one epoch and ``train_batch_size == rollout_batch_size`` is on-policy (one
optimizer step per batch of rollouts); anything else is off-policy, which is when the clipped ratio
of ``grpo_clip`` means something.

Beyond the handout, off by default: ``tis_cap`` multiplies each token's loss by the truncated
importance weight min(π_old(o_t)/π_engine(o_t), tis_cap), correcting for the engine sampling from a
slightly different distribution than the policy computes (bf16 engine, other kernels; how different, every
step logs, tis_cap or not: ``mismatch_*``, :class:`a5core.grpo_pieces.EngineMismatch`);
``drop_uniform_groups`` removes the groups whose rewards are all equal (their advantages are all 0:
they only dilute the batch; with ``no_baseline`` they would not be 0, and are dropped too);
``cliprange_high`` is DAPO's asymmetric "clip-higher" upper bound 1 + cliprange_high. Also from DAPO:
``dynamic_sampling`` draws up to ``max_extra_draws`` more question sets (seeded per step and draw) until
the batch holds ``rollout_batch_size`` rollouts of groups whose rewards differ (fewer if the cap is hit);
``overlong_buffer`` adds :func:`a5core.losses.overlong_penalty` to the rewards before normalisation;
``mask_truncated`` zeroes the policy-gradient loss of rollouts cut at max_tokens (a KL term still
applies to them); ``length_normalization`` ``token_mean`` weighs every response token of a train batch
alike. ``loss_type`` ``gspo`` is GSPO's sequence-level ratio with its own clip range
(``gspo_cliprange``, ``gspo_cliprange_high``). ``kl_coef`` > 0 adds a KL penalty to a frozen copy of the
starting weights (``kl_estimator``); its log-probs come from the pass that computes the old log-probs.

``pipeline_depth`` 1 is one-step-off asynchronous GRPO: right after step k's rollouts are in, the
current weights are pushed and step k+1's rollouts are started in a background thread (this rank's
share; the gathering stays on the main thread), so the engine generates them while step k trains.
They come from weights one step older, which the truncated importance weight (``tis_cap``, required)
corrects. Each step logs the version (steps trained) of the weights that sampled it
(``rollout_policy_version``) and ``policy_lag``. An evaluation first waits for the background rollouts
(the engine is free again); the first step, and the first after a resume (the background rollouts of a
killed run are lost), generate synchronously. The engine needs its own copy of the weights.

Tokens: the policy trains on exactly the token ids the engine sampled (the prompt tokenised without
special tokens, as the engines do), so an EOS that ended a rollout is trained on and no re-tokenised
text can disagree with what was sampled.

Metrics leave through ``log(metrics, step)``; weights reach the engine through ``engine.load_weights``;
``evaluate(model, step)`` runs at step 0, every ``eval_every`` steps and after the last one.
Checkpoints (``checkpoint_dir``, every ``checkpoint_every`` steps and after the last; layout in
:mod:`a5core.checkpoint`) hold the weights, the optimizer, the step, the elapsed wall-clock seconds and
every step's metrics. Steps are seeded by (seed, step), so a resumed run redraws the same questions
and, on a seeded engine, the same rollouts. ``wall_seconds`` counts the run's whole wall-clock time,
killed attempts included: after each step, ``wall_clock.json`` beside the checkpoint records it, and a
resumed run continues from the later of that and its checkpoint's (a killed run's steps after its
last checkpoint cost time too; counting from the checkpoint, a resumed step was logged earlier in
wall-clock than the killed attempt's last one).

Several ranks (torchrun; the caller has called :func:`a5core.distributed.init_from_env` before loading
the model, and gives each rank its own engine): the policy is FSDP2-sharded in place (and stays so).
Each rank samples the groups of its block of the step's questions with its engine, which receives a
full copy of the weights (:func:`a5core.distributed.full_weights`); the completions are then gathered,
so every rank grades the whole rollout batch (cheap next to generation) and holds the same rewards,
advantages and rollout metrics as one process would. Old log-probs and training are split: rank r
takes rollouts r, r + N, … of each train batch, ``microbatch_size`` at a time, each micro-batch's
loss divided by the train batch's global number of rollouts, so the update does not depend on N or
the micro-batch size (``gradient_accumulation_steps`` counts micro-batches over all ranks). Training
metrics are accumulated on the device and reduced over ranks once per optimizer step. Only rank 0
calls ``log`` and writes checkpoints (whole tensors: they resume on any number of ranks); every rank
calls ``evaluate`` (a forward pass of a sharded model is a collective) and ``should_stop`` (the run
stops when any rank says so).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, StrictBool, model_validator

from a5core import distributed, progress
from a5core.checkpoint import NonFiniteLossError, fingerprint, read_state
from a5core.data import Problem, write_text_atomic
from a5core.grpo_batch import RolloutBatch, assemble, grade
from a5core.grpo_pieces import (
    EngineMismatch,
    KLPenalty,
    MicroBatches,
    PhaseTimer,
    StepStats,
    TokenWeights,
    normalize_constant,
)
from a5core.grpo_rollouts import DynamicSampling, Rollouts, rollout_source
from a5core.guards import DivergenceGuard, LearningSignal, warn_if_groups_are_uniform
from a5core.lora import LoRASettings, add_adapters
from a5core.losses import KLEstimator, LengthNormalization
from a5core.pg_losses import LossType, PolicyGradientLoss, policy_gradient_loss, users_of
from a5core.policy import (
    COMPILED_ACTIVATION_BUDGET,
    compile_decoder_layers,
    compiled_graphs,
    get_response_log_probs,
    policy_gradient_backward,
)
from a5core.prompts import PromptTemplate
from a5core.question_sampling import QuestionSampler, QuestionSamplingSettings
from a5core.rollout import Engine
from a5core.settings import (
    HOW_FAST_FIELDS,
    OptimizerSettings,
    PeriodicSettings,
    RolloutSamplingFields,
    SeedSettings,
    SpeedSettings,
    inherited,
)

logger = logging.getLogger(__name__)

# Fields that say how often side effects happen and how fast a step runs, not what is trained (see a5core.checkpoint).
UNFINGERPRINTED_FIELDS = ("checkpoint_every", "eval_every", *HOW_FAST_FIELDS)
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
RewardFn = Callable[[str, Any], dict[str, float]]


class GRPOConfig(
    OptimizerSettings,
    RolloutSamplingFields,
    QuestionSamplingSettings,
    LoRASettings,
    SpeedSettings,
    PeriodicSettings,
    SeedSettings,
):
    """Settings of one GRPO run; defaults are the A5 handout's. Invalid values or combinations raise
    ``ValueError`` naming the field at construction. ``compile_layers``: ``torch.compile`` the decoder
    layers (:func:`a5core.policy.compile_decoder_layers`; on a GPU faster and leaner after a first step
    that compiles; ``auto``, the default: on CUDA only). ``max_tokens_per_microbatch`` ``auto`` (the
    default): a token budget sized to the GPU (:mod:`a5core.token_budget`), micro-batches by count on the CPU.
    ``fsdp_reshard_after_forward`` False (several ranks): weights stay gathered from
    forward to backward (faster, more memory; see :func:`a5core.distributed.shard`)."""

    # GRPO's own defaults of the groups' settings (their type, constraints and description: the groups')
    learning_rate: float = inherited(1e-5)
    checkpoint_every: int = inherited(10)

    n_grpo_steps: int = Field(200, ge=1, description="GRPO steps (a rollout batch each)")
    advantage_eps: float = Field(1e-6, ge=0, allow_inf_nan=False, description="added to the group std")
    rollout_batch_size: int = Field(256, ge=1, description="rollouts per step: questions × group_size")
    group_size: int = Field(8, ge=2, description="rollouts per question (>= 2: advantages compare a group's)")
    epochs_per_rollout_batch: int = Field(1, ge=1, description="passes over each rollout batch (> 1: off-policy)")
    train_batch_size: int = Field(
        256, ge=1, description="rollouts per optimizer step (< rollout_batch_size: off-policy)"
    )
    gradient_accumulation_steps: int = Field(128, ge=1, description="micro-batches per optimizer step")
    loss_type: LossType = Field("reinforce_with_baseline", description="the policy-gradient loss")
    use_std_normalization: StrictBool = Field(True, description="divide advantages by their group's std")
    length_normalization: LengthNormalization = Field(
        "masked_mean", description="per-sequence mean, or sum / max_tokens (see docs/length_normalization.md)"
    )
    cliprange: float = Field(0.2, gt=0, allow_inf_nan=False, description="grpo_clip's clip range")
    cliprange_high: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="clip-higher upper range (grpo_clip); None: symmetric"
    )
    tis_cap: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="truncated importance-sampling cap (engine vs policy); None: off"
    )
    drop_uniform_groups: StrictBool = Field(False, description="drop groups whose rewards are all equal")
    # DAPO (Yu et al. 2025), each off by default.
    dynamic_sampling: StrictBool = Field(
        False, description="DAPO: draw more questions until the batch is full of groups whose rewards differ"
    )
    max_extra_draws: int = Field(3, ge=0, description="dynamic sampling: extra draws a step may make at most")
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO: the last N tokens before max_tokens cost up to overlong_penalty (0: off)"
    )
    overlong_penalty: float = Field(1.0, ge=0, allow_inf_nan=False, description="reward lost at max_tokens")
    mask_truncated: StrictBool = Field(False, description="DAPO: rollouts cut at max_tokens give no gradient")
    # GSPO (Zheng et al. 2025): loss_type gspo.
    gspo_cliprange: float = Field(3e-4, gt=0, allow_inf_nan=False, description="gspo's clip range (sequence ratio)")
    gspo_cliprange_high: float | None = Field(
        4e-4, gt=0, allow_inf_nan=False, description="gspo's upper clip range; None: symmetric"
    )
    # A KL penalty to the starting weights, frozen.
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False, description="KL penalty to the starting policy (0: off)")
    kl_estimator: KLEstimator = Field("k3", description="per-token KL estimator: k1, k2 or k3")
    # One-step-off asynchronous GRPO.
    pipeline_depth: int = Field(
        0,
        ge=0,
        le=1,
        description="1: generate step k+1's rollouts (from weights one step older) while step k trains; 0: synchronous",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "GRPOConfig":
        def fail(name: str, requirement: str) -> None:
            raise ValueError(f"GRPOConfig.{name} must be {requirement}, got {getattr(self, name)!r}")

        if self.rollout_batch_size % self.group_size:
            fail("rollout_batch_size", f"a multiple of group_size ({self.group_size})")
        if self.train_batch_size % self.gradient_accumulation_steps:
            fail("train_batch_size", f"a multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps})")
        if self.rollout_batch_size % self.train_batch_size:
            fail("rollout_batch_size", f"a multiple of train_batch_size ({self.train_batch_size})")
        if self.train_batch_size < self.group_size:
            fail("train_batch_size", f">= group_size ({self.group_size})")
        if self.policy_loss.needs_old_log_probs and not self.off_policy:
            raise ValueError(
                f"GRPOConfig.loss_type {self.loss_type!r} weighs each token by π/π_old, the ratio to the policy "
                "that sampled the rollouts; on-policy (epochs_per_rollout_batch 1 and train_batch_size == "
                "rollout_batch_size) every ratio is 1. Use reinforce_with_baseline, or make it off-policy."
            )
        if self.cliprange_high is not None and "cliprange_high" not in self.policy_loss.settings:
            fail("cliprange_high", f"None, or a number > 0 with loss_type {' or '.join(users_of('cliprange_high'))}")
        if self.overlong_buffer >= self.max_tokens:
            fail("overlong_buffer", f"below max_tokens ({self.max_tokens})")
        if self.dynamic_sampling and self.drop_uniform_groups:
            fail("drop_uniform_groups", "false with dynamic_sampling (which drops uniform groups and draws more)")
        if self.pipeline_depth and self.tis_cap is None:
            fail(
                "tis_cap",
                "set (e.g. 2.0) with pipeline_depth 1: the rollouts come from weights one step older, and the "
                "truncated importance weight against the engine's log-probs corrects for that",
            )
        if self.pipeline_depth and self.dynamic_sampling:
            fail("dynamic_sampling", "false with pipeline_depth 1 (its extra draws need the current weights)")
        return self

    @property
    def prompts_per_step(self) -> int:
        return self.rollout_batch_size // self.group_size

    @property
    def microbatch_size(self) -> int:
        return self.train_batch_size // self.gradient_accumulation_steps

    @property
    def off_policy(self) -> bool:
        return self.epochs_per_rollout_batch > 1 or self.train_batch_size < self.rollout_batch_size

    @property
    def policy_loss(self) -> PolicyGradientLoss:
        """The policy-gradient loss of ``loss_type``, with the clip ranges it reads (:mod:`a5core.pg_losses`)."""
        return policy_gradient_loss(self)

    @property
    def needs_old_log_probs(self) -> bool:
        """Whether a step computes the rollouts' old log-probs: for a ratio loss, or the importance weights."""
        return self.policy_loss.needs_old_log_probs or self.tis_cap is not None


def run_fingerprint(
    config: GRPOConfig, problems: Sequence[Problem], pass_rates: dict[str, float] | None = None
) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the config (less UNFINGERPRINTED_FIELDS), the
    problems, in order, and the pass-rate table the questions were sampled by."""
    settings = {k: v for k, v in config.values_of(GRPOConfig).items() if k not in UNFINGERPRINTED_FIELDS}
    if pass_rates:
        settings["pass_rates"] = fingerprint({}, sorted((k, repr(v)) for k, v in pass_rates.items()), "rates")["sha256"]
    return fingerprint(settings, ((p.problem, p.answer) for p in problems), "problems")


@dataclass
class _Run:
    """What every step of a run uses: the settings and the pieces they choose, the policy and its optimizer."""

    config: GRPOConfig
    model: torch.nn.Module
    tokenizer: Any
    template: PromptTemplate
    sampler: QuestionSampler
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    device: torch.device
    checkpoint: Path | None
    autocast: contextlib.AbstractContextManager
    timer: PhaseTimer
    rollouts: Rollouts
    dynamic_sampling: DynamicSampling
    loss: PolicyGradientLoss
    weights: TokenWeights
    kl: KLPenalty
    microbatches: MicroBatches
    guard: DivergenceGuard
    signal: LearningSignal


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
    """Train ``model`` in place with GRPO (see the module docstring); returns every logged metrics dict.

    ``pass_rates``: question id → pass rate, the table ``question_sampling`` starts from
    (:mod:`a5core.question_sampling`; None: none, every question unknown).

    ``should_stop(step)``, asked after each step (e.g. a wall-clock budget), ends the run early: a
    checkpoint of that step is written (not marked finished) and the history so far returned.

    Each step logs the rollouts' reward, format and answer reward, advantage statistics, mean token
    entropy, response lengths (all, correct, incorrect), loss, gradient norm, clip fraction, learning
    rate, ratio statistics (off-policy), the engine's mismatch to the policy (``mismatch_*``: see
    :class:`a5core.grpo_pieces.EngineMismatch`), the seconds of each phase (weight sync, generate, grade, old
    log-probs, train), tokens/s, and ``wall_seconds`` since the run began (resumes included); an
    evaluation's metrics are merged into its step's. A NaN/inf loss or gradient norm raises
    :class:`a5core.checkpoint.NonFiniteLossError` before the update, the last checkpoint intact.
    """
    problems = list(problems)
    _check_inputs(model, engine, problems, config)
    run = _setup(model, tokenizer, template, QuestionSampler(problems, config, pass_rates), config, checkpoint_dir)
    record = _Record(run, run_fingerprint(config, problems, pass_rates), evaluate, log)
    if record.finished:
        return record.history
    was_training = model.training
    steps_bar = progress.bar(desc="GRPO", total=config.n_grpo_steps, initial=record.step, unit="step", leave=True)
    try:
        if record.step == 0 and evaluate is not None and config.eval_every:
            run.timer.on_phase = functools.partial(_show_phase, steps_bar, 0)
            record.finish_step({}, 0)  # the starting policy: the first point of every curve
        for step in range(record.step + 1, config.n_grpo_steps + 1):  # step: the steps done once it is
            run.timer.on_phase = functools.partial(_show_phase, steps_bar, step)
            metrics = grpo_step(run, engine, reward_fn, step - 1)
            record.finish_step(metrics, step)
            steps_bar.update(1)
            last = step == config.n_grpo_steps
            stopping = should_stop is not None and not last and distributed.any_rank(should_stop(step))
            if run.checkpoint and (
                stopping or last or (config.checkpoint_every and step % config.checkpoint_every == 0)
            ):
                record.save(step)
            if stopping:
                logger.info("GRPO: stopped after step %d of %d (should_stop)", step, config.n_grpo_steps)
                break
    finally:
        run.rollouts.close()  # rollouts still generating in the background (a stopped or failed run) end first
        steps_bar.close()
    run.optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return record.history


def _show_phase(steps_bar: Any, step: int, phase: str) -> None:
    """Name the phase step ``step`` is in on the steps' bar (or its status lines)."""
    steps_bar.set_postfix_str(f"step {step}: {phase}", refresh=False)


def grpo_step(run: _Run, engine: Engine, reward_fn: RewardFn, step: int) -> dict[str, float]:
    """GRPO step ``step`` + 1, Algorithm 3's loop body: sample → reward → advantages → (old log-probs) →
    optimizer steps over micro-batch losses → the step's metrics."""
    config, model, timer = run.config, run.model, run.timer
    timer.times, began = {}, time.perf_counter()

    # 1. Sample group_size rollouts for each of prompts_per_step questions, seeded by (seed, step): a resumed
    # run redraws the same questions and, on a seeded engine, the same rollouts. The source pushes the
    # weights and generates, or (one step off) hands over what the engine generated while the last step
    # trained, from weights one version older.
    rng = random.Random(config.step_seed(step))
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
        run.sampler.observe(draw.questions, draw.correct.float().tolist(), step + 1)
    batch, metrics = assemble(config, draws, run.tokenizer, run.template)
    metrics.update(run.sampler.metrics())
    metrics.update({"rollout_policy_version": float(version), "policy_lag": float(step - version)})

    # 4. The log-probs of the policy that sampled (π_old: the ratio losses, the importance weights) and of the
    # frozen reference (the KL penalty), once, before the first update moves the policy.
    if len(batch) and (config.needs_old_log_probs or run.kl.reference is not None):
        where = f"GRPO step {step + 1}, log-probs pass"
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
    stats = StepStats(
        run.device,
        run.loss.metrics,
        kl=bool(run.kl.coef),
        ratios=config.needs_old_log_probs,
        mismatch=mismatch if batch.old_log_probs is None else None,
    )
    budget, lengths = run.microbatches.budget, batch.lengths
    with timer("train"), run.microbatches.naming(f"GRPO step {step + 1}, training"):
        for epoch, train_batch in _train_batches(config, len(batch), step):  # none if every group was dropped
            model.train()
            constant = normalize_constant(config, batch, train_batch, run.weights)
            # Out of memory under an auto budget: this optimizer step's accumulation again, after the engine
            # released its cache, else at half the budget.
            accumulate = functools.partial(_accumulate, run, batch, train_batch, stats, epoch, constant)
            rows = [lengths[i] for i in train_batch]
            budget.retrying(accumulate, f"GRPO step {step + 1}, training", rows, engine.release_memory)
            got = stats.read(torch.nn.utils.clip_grad_norm_(run.params, config.grad_clip or math.inf))
            if not (math.isfinite(got["loss"]) and math.isfinite(got["grad_norm"])):
                raise _non_finite(run, step, epoch, stats.optimizer_steps, got)  # before the update: weights intact
            run.guard.check(f"GRPO step {step + 1} of {config.n_grpo_steps}", got["loss"], got["grad_norm"])
            run.optimizer.step()
            budget.settle()  # auto: sized once, after the first update (AdamW's moments then hold their memory)
            stats.stepped(got)
        run.optimizer.zero_grad(set_to_none=True)

    # 6. The step's metrics: the rollouts' and the training's above, then phase times and throughput.
    compiled = {"compiled_graphs": float(compiled_graphs())} if config.compiles(run.device) else {}
    shapes = float(len(run.microbatches.shapes))
    metrics.update(stats.metrics(lr=run.optimizer.param_groups[0]["lr"], microbatch_shapes=shapes, **compiled))
    metrics.update(timer.times)
    generated = sum(float(d.lengths.sum()) for d in draws)
    metrics["time_step"] = time.perf_counter() - began
    metrics["generate_tokens_per_s"] = generated / max(timer.times["time_generate"], 1e-9)
    metrics["train_tokens_per_s"] = metrics.get("train_tokens", 0.0) / max(timer.times["time_train"], 1e-9)
    return metrics


def _accumulate(
    run: _Run, batch: RolloutBatch, train_batch: list[int], stats: StepStats, epoch: int, constant: float
) -> None:
    """One optimizer step's gradient, accumulated over the micro-batches of ``train_batch`` from zero (so
    that it can run again, at another budget, after running out of memory)."""
    world = distributed.rank_and_world()[1]
    run.optimizer.zero_grad(set_to_none=True)
    microbatches = run.microbatches.split(batch, train_batch)
    stats.begin(len(microbatches))
    for index in distributed.accumulating(run.model, microbatches):
        rows = index or train_batch[:1]  # an empty share still runs a pass (FSDP2), at zero weight
        t = run.microbatches.tensors(batch, index, rows)
        with run.microbatches.budget.measuring(t["input_ids"].numel()):
            with run.autocast:  # entropy is only logged: the first epoch's is enough
                out = get_response_log_probs(run.model, t["input_ids"], t["labels"], return_token_entropy=epoch == 0)
            per_token, loss_metadata = run.loss.per_token(out["log_probs"], t)
            # Dividing each micro-batch mean by len(train_batch) / (len(micro) · world) makes the sum over
            # micro-batches the batch mean (× world: FSDP2 averages the ranks' gradients).
            loss, meta = policy_gradient_backward(
                per_token,
                loss_metadata,
                out["log_probs"],
                t["response_mask"],
                len(train_batch) / (max(len(index), 1) * world),
                length_normalization=run.config.length_normalization,
                normalize_constant=constant,
                token_weights=run.weights(batch, rows, t),
                **run.kl.terms(t, live=bool(index)),
            )
        if index:
            stats.add(sum(len(batch.response_ids[i]) for i in index), t, out, loss, meta, world)


def _train_batches(config: GRPOConfig, n: int, step: int) -> Iterator[tuple[int, list[int]]]:
    """(epoch, rollouts) of each optimizer step of a step: every epoch walks the ``n`` rollouts in its own
    order, seeded by (seed, step, epoch), ``train_batch_size`` at a time."""
    for epoch in range(config.epochs_per_rollout_batch):
        generator = torch.Generator().manual_seed(config.step_seed(step) * 1_000 + epoch)
        order = torch.randperm(n, generator=generator).tolist()
        for first in range(0, n, config.train_batch_size):
            yield epoch, order[first : first + config.train_batch_size]


@torch.no_grad()
def log_probs_pass(run: _Run, batch: RolloutBatch) -> None:
    """One pass over the rollouts without gradients: their response-token log-probs under the current
    policy (``old_log_probs``, when the loss or the importance weights need them) and under the frozen
    reference (``ref_log_probs``, with a KL penalty). Each rank computes its share, all get all."""
    run.model.eval()
    models = {}
    if run.config.needs_old_log_probs:
        models["old_log_probs"] = run.model
    if run.kl.reference is not None:
        models["ref_log_probs"] = run.kl.reference
    mine: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in models}
    for index in run.microbatches.split(batch, range(len(batch))):
        t = run.microbatches.tensors(batch, index, [0])  # an empty share still runs a pass (FSDP2)
        mask = t["response_mask"]
        for name, model in models.items():
            with run.autocast:
                log_probs = get_response_log_probs(model, t["input_ids"], t["labels"])["log_probs"]
            if index:
                mine[name] += zip(index, log_probs[mask].float().cpu().split(mask.sum(dim=1).tolist()), strict=True)
    for name, pairs in mine.items():
        setattr(batch, name, [values for _, values in sorted(distributed.gather_lists(pairs), key=lambda p: p[0])])


def _non_finite(run: _Run, step: int, epoch: int, optimizer_steps: int, got: dict[str, float]) -> NonFiniteLossError:
    where = f"{run.checkpoint / 'latest'}, if written," if run.checkpoint else "the last checkpoint, if any,"
    return NonFiniteLossError(
        f"GRPO step {step + 1} of {run.config.n_grpo_steps} (epoch {epoch}, optimizer step {optimizer_steps}): "
        f"loss {got['loss']}, grad_norm {got['grad_norm']}; training stopped before the update; {where} "
        "still holds the last good step"
    )


def _check_inputs(model: torch.nn.Module, engine: Engine, problems: list[Problem], config: GRPOConfig) -> None:
    warn_if_groups_are_uniform(config.temperature, config.group_size)
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
    """The policy made ready to train (LoRA adapters, FSDP2 sharding, the optimizer, gradient checkpointing,
    compiled layers) and the pieces its settings choose."""
    kl = KLPenalty(config, model)  # first: the reference is the starting model, without adapters, unsharded
    add_adapters(model, config)
    distributed.setup_model(model, config.fsdp_reshard_after_forward)
    if kl.reference is not None:
        distributed.setup_model(kl.reference, config.fsdp_reshard_after_forward)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.adamw(params)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.compiles(device):
        compile_decoder_layers(model, activation_memory_budget=COMPILED_ACTIVATION_BUDGET)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    timer = PhaseTimer(device)
    return _Run(
        config,
        model,
        tokenizer,
        template,
        sampler,
        optimizer,
        params,
        device,
        Path(checkpoint_dir) if checkpoint_dir is not None else None,
        autocast,
        timer,
        rollout_source(config, model, sampler, template, timer),
        DynamicSampling(config),
        config.policy_loss,
        TokenWeights(config),
        kl,
        MicroBatches(config, tokenizer, device, params),
        DivergenceGuard(fixed_scale=False, vanishing_gradient=not config.policy_loss.clips),
        LearningSignal("advantages" in config.policy_loss.inputs),
    )


class _Record:
    """The run's record: every logged step (``history``), the wall-clock time since the run began (killed
    attempts included), the checkpoints. Built from the checkpoint, if there is one: a resumed run
    continues its history, its question sampler and its clock."""

    def __init__(
        self,
        run: _Run,
        expected: dict[str, Any],
        evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None,
        log: Callable[[dict[str, float], int], None],
    ) -> None:
        self.run, self.expected, self.evaluate, self.log = run, expected, evaluate, log
        checkpoint = run.checkpoint
        counts = {"step": run.config.n_grpo_steps}
        state = (
            distributed.load_checkpoint(checkpoint, expected, run.model, run.optimizer, None, counts)
            if checkpoint
            else None
        )
        self.finished = state is not None and state["finished"]
        self.step, self.history = (0, []) if state is None else (state["step"], state["history"])
        if self.finished:
            logger.info("GRPO: %s holds a finished run (%d steps); not training again", checkpoint, self.step)
            return
        if state is None:
            torch.manual_seed(run.config.seed)
        else:
            logger.info("GRPO: resuming from %s after step %d", checkpoint, self.step)
            if "sampler" in state:
                run.sampler.load_state(state["sampler"])
        elapsed = 0.0 if state is None else state["wall_seconds"]
        self.clock = checkpoint / "wall_clock.json" if checkpoint else None
        if self.clock is not None and self.clock.is_file():  # the time a killed attempt spent after its checkpoint
            spent = read_state(self.clock, ("wall_seconds",), "delete it: the run's clock restarts at its checkpoint's")
            if spent.get("fingerprint") == expected:
                elapsed = max(elapsed, spent["wall_seconds"])
        self.started = time.monotonic() - elapsed

    def finish_step(self, metrics: dict[str, float], step: int) -> None:
        """Evaluate when due (the engine free first), stamp the wall-clock time, record and log step ``step``."""
        run, config = self.run, self.run.config
        if self.evaluate is not None and (
            step == config.n_grpo_steps or (config.eval_every and step % config.eval_every == 0)
        ):
            run.rollouts.settle()  # rollouts generating in the background finish first
            run.timer.announce("evaluate")
            run.model.eval()
            metrics.update(self.evaluate(run.model, step))
        metrics["wall_seconds"] = time.monotonic() - self.started
        self.history.append({"step": step, **metrics})
        self.step = step
        if distributed.rank_and_world()[0] != 0:
            return
        if self.clock is not None:
            stamp = {"step": step, "wall_seconds": metrics["wall_seconds"], "fingerprint": self.expected}
            write_text_atomic(self.clock, json.dumps(stamp))
        self.log(metrics, step)
        note = run.signal.observe(step, config.n_grpo_steps, metrics) if step else ""
        progress.log_step(logger, "GRPO step", step, config.n_grpo_steps, metrics, STATUS_KEYS, note)

    def save(self, step: int) -> None:
        """A checkpoint after step ``step`` (every rank calls it; rank 0 writes)."""
        run = self.run
        state = {
            "step": step,
            "finished": step == run.config.n_grpo_steps,
            "wall_seconds": time.monotonic() - self.started,
            "history": self.history,
            "fingerprint": self.expected,
            "sampler": run.sampler.state(),
        }
        distributed.save_checkpoint(run.checkpoint, run.model, run.optimizer, None, state)
