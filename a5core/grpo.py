"""GRPO (CS336 A5 §7, Algorithm 3): group-relative policy optimisation with verified rewards.

Each of ``n_grpo_steps`` steps of :func:`grpo`:

1. sample ``rollout_batch_size / group_size`` questions from the training problems (seeded per step);
2. push the policy's weights into the engine and draw ``group_size`` rollouts per question
   (temperature 1.0, min_tokens 4, max_tokens 1024, stop ``</answer>`` by default);
3. grade them with the reward function and normalise each reward within its group:
   A = (r − mean(group)) / (std(group) + advantage_eps), without the division if
   ``use_std_normalization`` is false (:func:`a5core.losses.compute_group_normalized_rewards`);
4. if the loss needs them (``grpo_clip``/``grpo_no_clip``, or the truncated importance-sampling
   correction), compute the rollouts' log-probs under the current policy once, without gradients:
   the "old" log-probs of every later optimizer step on this batch;
5. ``epochs_per_rollout_batch`` times, walk the rollouts (shuffled per epoch) in batches of
   ``train_batch_size``; each batch is one AdamW step, accumulated over micro-batches of
   ``train_batch_size / gradient_accumulation_steps`` rollouts through
   :func:`a5core.policy.grpo_microbatch_train_step`, with the gradient norm clipped to ``grad_clip``.

One rollout batch with one epoch and ``train_batch_size == rollout_batch_size`` is on-policy (one
optimizer step per batch of rollouts); anything else is off-policy, which is when the clipped ratio
of ``grpo_clip`` means something.

Beyond the handout, off by default: ``tis_cap`` multiplies each token's loss by the truncated
importance weight min(π_old(o_t)/π_engine(o_t), tis_cap), correcting for the engine sampling from a
slightly different distribution than the policy computes (bf16 engine, other kernels);
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

import concurrent.futures
import contextlib
import copy
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
from a5core.guards import DivergenceGuard, warn_if_groups_are_uniform
from a5core.lora import LoRASettings, add_adapters
from a5core.losses import (
    RATIO_LOSS_TYPES,
    KLEstimator,
    LengthNormalization,
    LossType,
    compute_group_normalized_rewards,
    overlong_penalty,
)
from a5core.out_of_memory import naming_the_microbatch
from a5core.policy import (
    COMPILED_ACTIVATION_BUDGET,
    compile_decoder_layers,
    compiled_graphs,
    get_response_log_probs,
    grpo_microbatch_train_step,
    pack_prompt_and_output_ids,
    pad_id_of,
)
from a5core.prompts import PromptTemplate
from a5core.question_sampling import QuestionSampler, QuestionSamplingSettings
from a5core.rollout import Completion, Engine
from a5core.settings import (
    HOW_FAST_FIELDS,
    OptimizerSettings,
    PeriodicSettings,
    RolloutSamplingFields,
    SeedSettings,
    SpeedSettings,
)

logger = logging.getLogger(__name__)

# Fields that say how often side effects happen and how fast a step runs, not what is trained (see a5core.checkpoint).
UNFINGERPRINTED_FIELDS = ("checkpoint_every", "eval_every", *HOW_FAST_FIELDS)
# What one optimizer step accumulates over its micro-batches (summed over ranks when read).
_STEP_SUMS = ("loss", "clipped", "ratio_sum", "entropy_sum", "kl_sum", "response_tokens", "entropy_tokens", "tokens")
# Dynamic sampling's draw d > 0 of a step samples with seed + d × this: its own stream, distinct from any
# (step, rank) stream of draw 0 for steps below it.
_DRAW_SEED_STRIDE = 1_000_000_007
STATUS_KEYS = (
    "reward_mean",
    "format_reward_mean",
    "loss",
    "grad_norm",
    "token_entropy",
    "response_tokens_mean",
    "val_accuracy",
)  # the per-step status line's metrics


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
    that compiles). ``fsdp_reshard_after_forward`` False (several ranks): weights stay gathered from
    forward to backward (faster, more memory; see :func:`a5core.distributed.shard`)."""

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
        if self.loss_type in RATIO_LOSS_TYPES and not self.off_policy:
            raise ValueError(
                f"GRPOConfig.loss_type {self.loss_type!r} weighs each token by π/π_old, the ratio to the policy "
                "that sampled the rollouts; on-policy (epochs_per_rollout_batch 1 and train_batch_size == "
                "rollout_batch_size) every ratio is 1. Use reinforce_with_baseline, or make it off-policy."
            )
        if self.cliprange_high is not None and self.loss_type != "grpo_clip":
            fail("cliprange_high", "None, or a number > 0 with loss_type grpo_clip")
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
    def needs_old_log_probs(self) -> bool:
        return self.loss_type in RATIO_LOSS_TYPES or self.tis_cap is not None

    @property
    def clip_ranges(self) -> tuple[float, float | None]:
        """The loss's clip range and upper clip range (gspo has its own)."""
        if self.loss_type == "gspo":
            return self.gspo_cliprange, self.gspo_cliprange_high
        return self.cliprange, self.cliprange_high


@dataclass
class RolloutBatch:
    """One step's graded rollouts, N of them, groups consecutive.

    prompt_ids, response_ids: N token-id lists; raw_rewards, advantages: (N,); correct, truncated: (N,)
    bool (truncated: cut at max_tokens); old_log_probs, engine_log_probs, ref_log_probs: None or N 1-D
    fp32 tensors of the response's length.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor
    truncated: torch.Tensor
    old_log_probs: list[torch.Tensor] | None = None
    engine_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def lengths(self) -> list[int]:
        """Each rollout's trained positions, prompt and response (T before padding)."""
        return [len(p) + len(r) - 1 for p, r in zip(self.prompt_ids, self.response_ids)]

    def select(self, index: Sequence[int]) -> RolloutBatch:
        pick = torch.as_tensor(list(index), dtype=torch.long)
        return RolloutBatch(
            [self.prompt_ids[i] for i in index],
            [self.response_ids[i] for i in index],
            self.raw_rewards[pick],
            self.advantages[pick],
            self.correct[pick],
            self.truncated[pick],
            *(None if values is None else [values[i] for i in index] for values in self._per_token()),
        )

    def _per_token(self) -> tuple[list[torch.Tensor] | None, ...]:
        return self.old_log_probs, self.engine_log_probs, self.ref_log_probs

    def tensors(self, pad_id: int, device: torch.device, pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
        """input_ids, labels, response_mask (b, T); raw_rewards, advantages (b, 1); and old/engine/ref
        log-probs (b, T), zero outside the response, when present. T is padded up to a multiple of
        ``pad_to_multiple``."""
        packed = pack_prompt_and_output_ids(self.prompt_ids, self.response_ids, pad_id, pad_to_multiple)
        mask = packed["response_mask"]

        def per_token(values: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros(mask.shape, dtype=torch.float32)
            out[mask] = torch.cat(values)  # row-major: each row's response positions, in order
            return out.to(device)

        result = {k: v.to(device) for k, v in packed.items()}
        result["raw_rewards"] = self.raw_rewards.view(-1, 1).to(device)
        result["advantages"] = self.advantages.view(-1, 1).to(device)
        for name, values in zip(("old_log_probs", "engine_log_probs", "ref_log_probs"), self._per_token()):
            if values is not None:
                result[name] = per_token(values)
        return result


def run_fingerprint(
    config: GRPOConfig, problems: Sequence[Problem], pass_rates: dict[str, float] | None = None
) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the config (less UNFINGERPRINTED_FIELDS), the
    problems, in order, and the pass-rate table the questions were sampled by."""
    settings = {k: v for k, v in config.values_of(GRPOConfig).items() if k not in UNFINGERPRINTED_FIELDS}
    if pass_rates:
        settings["pass_rates"] = fingerprint({}, sorted((k, repr(v)) for k, v in pass_rates.items()), "rates")["sha256"]
    return fingerprint(settings, ((p.problem, p.answer) for p in problems), "problems")


def grpo(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: Engine,
    problems: Sequence[Problem],
    template: PromptTemplate,
    reward_fn: Callable[[str, Any], dict[str, float]],
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
    rate, ratio statistics (off-policy), the seconds of each phase (weight sync, generate, grade, old
    log-probs, train), tokens/s, and ``wall_seconds`` since the run began (resumes included); an
    evaluation's metrics are merged into its step's. A NaN/inf loss or gradient norm raises
    :class:`a5core.checkpoint.NonFiniteLossError` before the update, the last checkpoint intact.
    """
    problems = list(problems)
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
            "weights (an engine in its own process: engine_device), not the policy itself"
        )
    reference = _frozen_copy(model) if config.kl_coef else None
    add_adapters(model, config)  # after the reference is copied: it is the starting model, without adapters
    rank, world = distributed.setup_model(model, config.fsdp_reshard_after_forward)
    if reference is not None:
        distributed.setup_model(reference, config.fsdp_reshard_after_forward)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.adamw(params)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.compile_layers:
        compile_decoder_layers(model, activation_memory_budget=COMPILED_ACTIVATION_BUDGET)
    expected = run_fingerprint(config, problems, pass_rates)
    checkpoint = Path(checkpoint_dir) if checkpoint_dir is not None else None
    state = distributed.load_checkpoint(checkpoint, expected, model, optimizer, None) if checkpoint else None
    if state is not None and state["finished"]:
        logger.info("GRPO: %s holds a finished run (%d steps); not training again", checkpoint, state["step"])
        return state["history"]
    if state is None:
        step, history, elapsed = 0, [], 0.0
        torch.manual_seed(config.seed)
    else:
        step, history, elapsed = state["step"], state["history"], state["wall_seconds"]
        logger.info("GRPO: resuming from %s after step %d", checkpoint, step)
    clock = checkpoint / "wall_clock.json" if checkpoint else None
    if clock is not None and clock.is_file():  # the time a killed attempt spent after its last checkpoint
        spent = read_state(clock, ("wall_seconds",), "delete it: the run's clock restarts at its checkpoint's")
        if spent.get("fingerprint") == expected:
            elapsed = max(elapsed, spent["wall_seconds"])
    started = time.monotonic() - elapsed
    pool = concurrent.futures.ThreadPoolExecutor(1, "a5-rollouts") if config.pipeline_depth else None
    sampler = QuestionSampler(problems, config, pass_rates)
    if state is not None and "sampler" in state:
        sampler.load_state(state["sampler"])
    trainer = _Trainer(
        model, tokenizer, optimizer, params, config, device, checkpoint, sampler, template, reference, pool
    )

    def finish_step(metrics: dict[str, float], step: int) -> None:
        if evaluate is not None and (
            step == config.n_grpo_steps or (config.eval_every and step % config.eval_every == 0)
        ):
            trainer.settle()  # the engine is free (rollouts generating in the background finish first)
            model.eval()
            metrics.update(evaluate(model, step))
        metrics["wall_seconds"] = time.monotonic() - started
        history.append({"step": step, **metrics})
        if rank == 0 and clock is not None:
            write_text_atomic(
                clock, json.dumps({"step": step, "wall_seconds": metrics["wall_seconds"], "fingerprint": expected})
            )
        if rank == 0:
            log(metrics, step)
            progress.log_step(logger, "GRPO step", step, config.n_grpo_steps, metrics, STATUS_KEYS)

    was_training = model.training
    if step == 0 and evaluate is not None and config.eval_every:
        finish_step({}, 0)  # the starting policy: the first point of every curve
    steps_bar = progress.bar(desc="GRPO", total=config.n_grpo_steps, initial=step, unit="step", leave=True)
    try:
        while step < config.n_grpo_steps:
            metrics = trainer.step(engine, reward_fn, step)
            step += 1
            finish_step(metrics, step)
            steps_bar.update(1)
            steps_bar.set_postfix(reward=f"{metrics['reward_mean']:.3g}", refresh=False)
            stopping = (
                should_stop is not None and step < config.n_grpo_steps and distributed.any_rank(should_stop(step))
            )
            if checkpoint and (
                stopping
                or step == config.n_grpo_steps
                or (config.checkpoint_every and step % config.checkpoint_every == 0)
            ):
                distributed.save_checkpoint(
                    checkpoint,
                    model,
                    optimizer,
                    None,
                    {
                        "step": step,
                        "finished": step == config.n_grpo_steps,
                        "wall_seconds": time.monotonic() - started,
                        "history": history,
                        "fingerprint": expected,
                        "sampler": sampler.state(),
                    },
                )
            if stopping:
                logger.info("GRPO: stopped after step %d of %d (should_stop)", step, config.n_grpo_steps)
                break
    finally:
        trainer.settle()  # rollouts still generating in the background (a stopped or failed run) end first
        if pool is not None:
            pool.shutdown()
    steps_bar.close()
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return history


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``model`` (the KL penalty's reference), in eval mode, without gradients."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise ValueError(
            "GRPOConfig.kl_coef > 0 with a policy already sharded (FSDP2): the reference is copied from the "
            "starting weights before sharding; start GRPO from an unsharded model"
        )
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


@dataclass
class _Draw:
    """One draw of a step's rollouts, graded: its questions, their group_size rollouts each (question
    order), the (shaped) rewards, advantages, correctness, response lengths (N,), which groups' rewards
    differ (one bool a question), and the rollout metrics."""

    questions: list[Problem]
    completions: list[Completion]
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor
    lengths: torch.Tensor
    varied: list[bool]
    metrics: dict[str, float]


def _merged_metrics(draws: list[_Draw], group_size: int) -> dict[str, float]:
    """The rollout metrics of several draws (dynamic sampling), over all their rollouts."""
    rewards = torch.cat([d.raw_rewards for d in draws])
    advantages = torch.cat([d.advantages for d in draws])
    grouped = rewards.view(-1, group_size)
    merged = {key: sum(d.metrics[key] for d in draws) / len(draws) for key in draws[0].metrics}  # equal-size draws
    merged.update(
        {
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item(),
            "reward_max": rewards.max().item(),
            "reward_min": rewards.min().item(),
            "advantage_mean": advantages.mean().item(),
            "advantage_std": advantages.std().item(),
            "frac_groups_all_equal": (grouped.max(dim=1).values == grouped.min(dim=1).values).float().mean().item(),
        }
    )
    return merged


class _Trainer:
    """The body of one GRPO step, phase by phase (each timed). ``reference``: the frozen starting policy
    (``kl_coef`` > 0), else None; ``pool``: the thread that generates the next step's rollouts
    (``pipeline_depth`` 1), else None."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        config: GRPOConfig,
        device: torch.device,
        checkpoint: Path | None,
        sampler: QuestionSampler,
        template: PromptTemplate,
        reference: torch.nn.Module | None,
        pool: concurrent.futures.ThreadPoolExecutor | None,
    ):
        self.model, self.tokenizer, self.optimizer, self.params = model, tokenizer, optimizer, params
        self.config, self.device, self.checkpoint = config, device, checkpoint
        self.guard = DivergenceGuard(
            fixed_scale=False, vanishing_gradient=config.loss_type not in ("grpo_clip", "gspo")
        )
        self.sampler, self.template, self.reference, self.pool = sampler, template, reference, pool
        # The next step's rollouts being generated: (step, the policy version sampling them, its questions, future).
        self.in_flight: tuple[int, int, list[Problem], concurrent.futures.Future] | None = None
        self.shapes: set[tuple[int, ...]] = set()  # the (rows, positions) of every micro-batch so far
        self.last_shape: tuple[int, ...] | None = None  # the latest micro-batch's (rows, positions)
        self.pad_id = pad_id_of(tokenizer)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        )
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        key = f"time_{phase}"
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start

    def naming_the_microbatch(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Out of GPU memory inside: one error naming ``where``, the last micro-batch's shape and the setting."""
        count = f"gradient_accumulation_steps {self.config.gradient_accumulation_steps}: raise it"
        return naming_the_microbatch(where, self.config.max_tokens_per_microbatch, count, lambda: self.last_shape)

    def step(self, engine: Engine, reward_fn: Callable[[str, Any], dict[str, float]], step: int) -> dict[str, float]:
        """GRPO step ``step`` + 1: rollouts, rewards, the optional log-prob pass, the optimizer steps."""
        config, template, self.times = self.config, self.template, {}
        start = time.perf_counter()
        rng = random.Random(config.step_seed(step))
        pending = self.in_flight is not None and self.in_flight[0] == step  # generated in the background
        questions = self.in_flight[2] if pending else self.sampler.sample(rng, config.prompts_per_step)
        completions, version = self.rollouts(engine, questions, template, step)
        draws = [self.grade(questions, completions, reward_fn)]
        while (
            config.dynamic_sampling
            and sum(d.varied.count(True) for d in draws) < config.prompts_per_step
            and len(draws) <= config.max_extra_draws
        ):  # DAPO: more questions until the batch is full of groups that teach something
            questions = self.sampler.sample(rng, config.prompts_per_step)
            with self.timed("generate"):
                completions = self.generate(engine, questions, template, step, len(draws))
            draws.append(self.grade(questions, completions, reward_fn))
        for draw in draws:  # the pass rates seen, for the questions to come
            self.sampler.observe(draw.questions, draw.correct.float().tolist(), step + 1)
        batch, metrics = self.batch(draws)
        metrics.update(self.sampler.metrics())
        metrics.update({"rollout_policy_version": float(version), "policy_lag": float(step - version)})
        if len(batch) and (config.needs_old_log_probs or config.kl_coef):
            with self.timed("old_log_probs"), self.naming_the_microbatch(f"GRPO step {step + 1}, log-probs pass"):
                self.log_probs_pass(batch)
        with self.timed("train"), self.naming_the_microbatch(f"GRPO step {step + 1}, training"):
            metrics.update(self.train(batch, step) if len(batch) else {"optimizer_steps": 0.0})
        generated = sum(float(d.lengths.sum()) for d in draws)
        metrics.update(self.times)
        metrics["time_step"] = time.perf_counter() - start
        metrics["generate_tokens_per_s"] = generated / max(self.times["time_generate"], 1e-9)
        metrics["train_tokens_per_s"] = metrics.get("train_tokens", 0.0) / max(self.times["time_train"], 1e-9)
        return metrics

    def generate(
        self, engine: Engine, questions: list[Problem], template: PromptTemplate, step: int, draw: int = 0
    ) -> list[Completion]:
        """Rollouts of ``questions`` (group_size each, in question order) from the weights the engine holds:
        this rank samples its block of the questions with its own random stream, then all ranks get all."""
        return distributed.gather_lists(self.local_rollouts(engine, questions, template, step, draw)[0])

    def local_rollouts(
        self, engine: Engine, questions: list[Problem], template: PromptTemplate, step: int, draw: int = 0
    ) -> tuple[list[Completion], float]:
        """This rank's block of :meth:`generate` (no collective: it may run in a background thread) and
        the seconds it took. Draw d > 0 (dynamic sampling's extra draws) has a random stream of its own."""
        began = time.perf_counter()
        rank, world = distributed.rank_and_world()
        config = self.config
        prompts = [template.format(q.problem) for q in questions]
        sampling = config.sampling(
            template.stop,
            n=config.group_size,
            logprobs=config.tis_cap is not None,
            seed=config.step_seed(step) * world + rank + draw * _DRAW_SEED_STRIDE,
        )
        groups = engine.generate(prompts[distributed.rank_slice(len(prompts))], sampling)
        return [c for group in groups for c in group], time.perf_counter() - began

    def rollouts(
        self, engine: Engine, questions: list[Problem], template: PromptTemplate, step: int
    ) -> tuple[list[Completion], int]:
        """Step ``step``'s rollouts and the policy version (steps trained) that sampled them.

        Synchronous (``pipeline_depth`` 0): push the weights, generate now; the version is ``step``. One step
        off (1): the rollouts the engine generated in the background during the previous step's training,
        from the weights of one version before (this step's are generated now, synchronously, only at the
        run's first step and the first step after a resume); then the current weights are pushed and the
        next step's rollouts started in the background, to be generated while this step trains.
        """
        config = self.config
        if self.in_flight is not None and self.in_flight[0] == step:
            _, version, _, future = self.in_flight
            self.in_flight = None
            with self.timed("wait_rollouts"):
                local, self.times["time_generate"] = future.result()
            completions = distributed.gather_lists(local)
        else:
            with self.timed("weight_sync"):
                engine.load_weights(distributed.full_weights(self.model))
            version = step
            with self.timed("generate"):
                completions = self.generate(engine, questions, template, step)
        if config.pipeline_depth and step + 1 < config.n_grpo_steps:
            if version != step:
                with self.timed("weight_sync"):
                    engine.load_weights(distributed.full_weights(self.model))
            following = self.sampler.sample(random.Random(config.step_seed(step + 1)), config.prompts_per_step)
            self.in_flight = (
                step + 1,
                step,
                following,
                self.pool.submit(self.local_rollouts, engine, following, template, step + 1),
            )
        return completions, version

    def settle(self) -> None:
        """Wait until rollouts being generated in the background are done (kept for their step), so the
        engine is free: before an evaluation uses it, and before the run returns or raises."""
        if self.in_flight is not None:
            concurrent.futures.wait([self.in_flight[3]])

    def grade(
        self, questions: list[Problem], completions: list[Completion], reward_fn: Callable[[str, Any], dict[str, float]]
    ) -> _Draw:
        """Reward (with DAPO's overlong penalty, if set) and normalise one draw of rollouts."""
        config = self.config
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
        penalty = (
            overlong_penalty(lengths, config.max_tokens, config.overlong_buffer, config.overlong_penalty)
            if config.overlong_buffer
            else None
        )
        with self.timed("grade"):
            advantages, raw_rewards, metrics = compute_group_normalized_rewards(
                reward_fn,
                [c.text for c in completions],
                [q.answer for q in questions for _ in range(config.group_size)],
                config.group_size,
                config.advantage_eps,
                config.use_std_normalization,
                reward_offsets=penalty,
            )
        graded = raw_rewards if penalty is None else raw_rewards - penalty
        if penalty is not None:
            metrics["overlong_penalty_mean"] = penalty.mean().item()
        grouped = raw_rewards.view(-1, config.group_size)
        return _Draw(
            questions,
            completions,
            raw_rewards,
            advantages,
            graded == 1.0,
            lengths,
            (grouped.max(dim=1).values != grouped.min(dim=1).values).tolist(),
            metrics,
        )

    def batch(self, draws: list[_Draw]) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollouts a step trains on, and its rollout metrics (over every rollout drawn). With
        ``drop_uniform_groups`` or ``dynamic_sampling`` only the groups whose rewards differ are kept (at
        most rollout_batch_size rollouts, in draw order)."""
        config, group = self.config, self.config.group_size
        metrics = dict(draws[0].metrics) if len(draws) == 1 else _merged_metrics(draws, group)
        lengths = torch.cat([d.lengths for d in draws])
        correct = torch.cat([d.correct for d in draws])
        completions = [c for d in draws for c in d.completions]
        metrics.update(
            {
                "response_tokens_mean": lengths.mean().item(),
                "response_tokens_correct": lengths[correct].mean().item() if correct.any() else math.nan,
                "response_tokens_incorrect": lengths[~correct].mean().item() if (~correct).any() else math.nan,
                "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
            }
        )
        keep = list(range(len(completions)))
        if config.drop_uniform_groups or config.dynamic_sampling:
            varied = [v for d in draws for v in d.varied]
            kept_groups = [g for g, v in enumerate(varied) if v][: config.prompts_per_step]
            keep = [g * group + i for g in kept_groups for i in range(group)]
            metrics["dropped_groups"] = float(len(varied) - len(kept_groups))
        if config.dynamic_sampling:
            metrics["sampling_draws"] = float(len(draws))
            metrics["kept_groups"] = float(len(keep) // group)
        questions = [q for d in draws for q in d.questions]
        prompt_ids = self.tokenizer([self.template.format(q.problem) for q in questions], add_special_tokens=False)[
            "input_ids"
        ]
        batch = RolloutBatch(
            [prompt_ids[i // group] for i in keep],
            [list(completions[i].token_ids) for i in keep],
            torch.cat([d.raw_rewards for d in draws])[keep],
            torch.cat([d.advantages for d in draws])[keep],
            correct[keep],
            torch.tensor([completions[i].finish_reason == "length" for i in keep], dtype=torch.bool),
            engine_log_probs=[torch.tensor(completions[i].log_probs, dtype=torch.float32) for i in keep]
            if config.tis_cap is not None
            else None,
        )
        return batch, metrics

    @torch.no_grad()
    def log_probs_pass(self, batch: RolloutBatch) -> None:
        """One pass over the rollouts without gradients: their response-token log-probs under the current
        policy (``old_log_probs``, when the loss or the importance weights need them) and under the frozen
        reference (``ref_log_probs``, with a KL penalty). Each rank computes its share, all get all."""
        self.model.eval()
        models = {}
        if self.config.needs_old_log_probs:
            models["old_log_probs"] = self.model
        if self.reference is not None:
            models["ref_log_probs"] = self.reference
        mine: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in models}
        for index in self.microbatches(batch, range(len(batch))):
            t = self.tensors(batch, index or [0])  # an empty share still runs a pass (FSDP2)
            mask = t["response_mask"]
            for name, model in models.items():
                with self.autocast:
                    log_probs = get_response_log_probs(model, t["input_ids"], t["labels"])["log_probs"]
                if index:
                    mine[name] += zip(index, log_probs[mask].float().cpu().split(mask.sum(dim=1).tolist()))
        for name, pairs in mine.items():
            setattr(batch, name, [values for _, values in sorted(distributed.gather_lists(pairs), key=lambda p: p[0])])

    def microbatches(self, batch: RolloutBatch, items: Sequence[int]) -> list[list[int]]:
        """This rank's micro-batches of ``items`` (see :func:`a5core.distributed.rank_microbatches`): of
        ``microbatch_size`` rollouts, or by ``max_tokens_per_microbatch``."""
        budget = self.config.max_tokens_per_microbatch
        lengths = batch.lengths if budget is not None else None
        return distributed.rank_microbatches(items, self.config.microbatch_size, lengths, budget)

    def tensors(self, batch: RolloutBatch, index: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch ``index`` as tensors (padded to a multiple of 64 positions under a token budget,
        so compiled layers see few shapes); the shapes seen so far are counted."""
        multiple = distributed.PAD_MULTIPLE if self.config.max_tokens_per_microbatch is not None else 1
        t = batch.select(index).tensors(self.pad_id, self.device, multiple)
        self.last_shape = tuple(t["input_ids"].shape)
        self.shapes.add(self.last_shape)
        return t

    def masked(self, batch: RolloutBatch, i: int) -> bool:
        """Whether rollout ``i`` gives no policy gradient (``mask_truncated`` and cut at max_tokens)."""
        return self.config.mask_truncated and bool(batch.truncated[i])

    def train(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``epochs_per_rollout_batch`` passes over ``batch`` in optimizer steps of ``train_batch_size``."""
        config, world = self.config, distributed.rank_and_world()[1]
        self.model.train()
        sums = {"loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0, "kl": 0.0}
        ratio_max, entropy_sum, entropy_tokens, tokens, optimizer_steps, passes = 0.0, 0.0, 0.0, 0.0, 0, 0
        for epoch in range(config.epochs_per_rollout_batch):
            generator = torch.Generator().manual_seed(config.step_seed(step) * 1_000 + epoch)
            order = torch.randperm(len(batch), generator=generator).tolist()
            for start in range(0, len(batch), config.train_batch_size):
                train_batch = order[start : start + config.train_batch_size]
                self.optimizer.zero_grad(set_to_none=True)
                # Statistics stay on the device (no sync per micro-batch) until read once, below.
                acc = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in _STEP_SUMS}
                ratio_peak = torch.zeros((), dtype=torch.float64, device=self.device)
                microbatches = self.microbatches(batch, train_batch)
                passes += len(microbatches)
                normalize_constant = float(config.max_tokens)
                if config.length_normalization == "token_mean":  # the train batch's trained tokens per sequence
                    trained = sum(len(batch.response_ids[i]) for i in train_batch if not self.masked(batch, i))
                    normalize_constant = max(trained, 1) / len(train_batch)
                cliprange, cliprange_high = config.clip_ranges
                for index in distributed.accumulating(self.model, microbatches):
                    t = self.tensors(batch, index or train_batch[:1])
                    if not index:  # an empty share still runs a pass (FSDP2), at zero weight
                        for key in ("advantages", "raw_rewards"):
                            t[key] = torch.zeros_like(t[key])
                    with self.autocast:
                        out = get_response_log_probs(
                            self.model, t["input_ids"], t["labels"], return_token_entropy=epoch == 0
                        )
                    weights = None
                    if config.tis_cap is not None:
                        weights = torch.exp(t["old_log_probs"] - t["engine_log_probs"]).clamp(max=config.tis_cap)
                    if config.mask_truncated:
                        kept = torch.tensor([not self.masked(batch, i) for i in index or train_batch[:1]])
                        kept = kept.to(self.device, torch.float32).view(-1, 1)
                        weights = kept if weights is None else weights * kept
                    # Dividing each micro-batch mean by len(train_batch) / (len(micro) · world) makes the sum
                    # over micro-batches the batch mean (× world: FSDP2 averages the ranks' gradients).
                    micro_loss, meta = grpo_microbatch_train_step(
                        out["log_probs"],
                        t["response_mask"],
                        len(train_batch) / (max(len(index), 1) * world),
                        config.loss_type,
                        raw_rewards=t["raw_rewards"],
                        advantages=t["advantages"],
                        old_log_probs=t.get("old_log_probs"),
                        cliprange=cliprange,
                        length_normalization=config.length_normalization,
                        normalize_constant=normalize_constant,
                        cliprange_high=cliprange_high,
                        token_weights=weights,
                        ref_log_probs=t.get("ref_log_probs"),
                        kl_coef=config.kl_coef if index else 0.0,
                        kl_estimator=config.kl_estimator,
                    )
                    if not index:
                        continue
                    mask = t["response_mask"]
                    n_tokens = sum(len(batch.response_ids[i]) for i in index)
                    acc["loss"] += micro_loss / world
                    acc["response_tokens"] += n_tokens
                    acc["tokens"] += t["input_ids"].numel()
                    if "clip_fraction" in meta:
                        acc["clipped"] += meta["clip_fraction"].double() * n_tokens
                    if "kl" in meta:
                        acc["kl_sum"] += meta["kl"].double() * n_tokens
                    if "old_log_probs" in t:
                        ratio = torch.where(mask, torch.exp(out["log_probs"].detach() - t["old_log_probs"]), 0.0)
                        acc["ratio_sum"] += ratio.sum()
                        ratio_peak = torch.maximum(ratio_peak, ratio.max())
                    if "token_entropy" in out:
                        acc["entropy_sum"] += torch.where(mask, out["token_entropy"], 0.0).sum()
                        acc["entropy_tokens"] += n_tokens
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, config.grad_clip or math.inf)
                # The one read of the step: statistics summed (the ratio's peak: maximum) over ranks, and the norm.
                values = torch.cat(
                    [
                        distributed.global_sum(torch.stack(list(acc.values()))),
                        distributed.global_max(ratio_peak).view(1),
                        distributed.full_tensor(grad_norm).double().view(1),
                    ]
                ).tolist()
                got = dict(zip([*acc, "ratio_max", "grad_norm"], values))
                if not (math.isfinite(got["loss"]) and math.isfinite(got["grad_norm"])):
                    kept = (
                        f"{self.checkpoint / 'latest'}, if written,"
                        if self.checkpoint
                        else "the last checkpoint, if any,"
                    )
                    raise NonFiniteLossError(
                        f"GRPO step {step + 1} of {config.n_grpo_steps} "
                        f"(epoch {epoch}, optimizer step {optimizer_steps}): "
                        f"loss {got['loss']}, grad_norm {got['grad_norm']}; training stopped before the update; {kept} "
                        "still holds the last good step"
                    )
                self.guard.check(f"GRPO step {step + 1} of {config.n_grpo_steps}", got["loss"], got["grad_norm"])
                self.optimizer.step()
                optimizer_steps += 1
                sums["loss"] += got["loss"]
                sums["grad_norm"] += got["grad_norm"]
                sums["clip_fraction"] += got["clipped"] / max(got["response_tokens"], 1)
                sums["ratio_mean"] += got["ratio_sum"] / max(got["response_tokens"], 1)
                sums["kl"] += got["kl_sum"] / max(got["response_tokens"], 1)
                ratio_max = max(ratio_max, got["ratio_max"])
                entropy_sum += got["entropy_sum"]
                entropy_tokens += got["entropy_tokens"]
                tokens += got["tokens"]
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {k: v / optimizer_steps for k, v in sums.items()}
        if config.loss_type not in ("grpo_clip", "gspo"):
            del metrics["clip_fraction"]
        if not config.kl_coef:
            del metrics["kl"]
        if not config.needs_old_log_probs:
            del metrics["ratio_mean"]
        else:
            metrics["ratio_max"] = ratio_max
        metrics.update(
            {
                "token_entropy": entropy_sum / max(entropy_tokens, 1),
                "lr": self.optimizer.param_groups[0]["lr"],
                "optimizer_steps": float(optimizer_steps),
                "train_tokens": tokens,
                "microbatches": float(passes),
                "microbatch_shapes": float(len(self.shapes)),
            }
        )
        if self.config.compile_layers:
            metrics["compiled_graphs"] = float(compiled_graphs())
        return metrics
