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
``cliprange_high`` is DAPO's asymmetric "clip-higher" upper bound 1 + cliprange_high.

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
from a5core.checkpoint import NonFiniteLossError, fingerprint
from a5core.data import Problem, write_text_atomic
from a5core.losses import RATIO_LOSS_TYPES, LengthNormalization, LossType, compute_group_normalized_rewards
from a5core.policy import (
    COMPILED_ACTIVATION_BUDGET,
    compile_decoder_layers,
    get_response_log_probs,
    grpo_microbatch_train_step,
    pack_prompt_and_output_ids,
    pad_id_of,
)
from a5core.prompts import PromptTemplate
from a5core.rollout import Engine
from a5core.settings import OptimizerSettings, PeriodicSettings, RolloutSamplingFields, SeedSettings, SpeedSettings

logger = logging.getLogger(__name__)

# Fields that say how often side effects happen and how fast a step runs, not what is trained (see a5core.checkpoint).
UNFINGERPRINTED_FIELDS = ("checkpoint_every", "eval_every", "compile_layers", "fsdp_reshard_after_forward")
# What one optimizer step accumulates over its micro-batches (summed over ranks when read).
_STEP_SUMS = ("loss", "clipped", "ratio_sum", "entropy_sum", "response_tokens", "entropy_tokens", "tokens")
STATUS_KEYS = (
    "reward_mean",
    "format_reward_mean",
    "loss",
    "grad_norm",
    "token_entropy",
    "response_tokens_mean",
    "val_accuracy",
)  # the per-step status line's metrics


class GRPOConfig(OptimizerSettings, RolloutSamplingFields, SpeedSettings, PeriodicSettings, SeedSettings):
    """Settings of one GRPO run; defaults are the A5 handout's. Invalid values or combinations raise
    ``ValueError`` naming the field at construction. ``compile_layers``: ``torch.compile`` the decoder
    layers (:func:`a5core.policy.compile_decoder_layers`; on a GPU faster and leaner after a first step
    that compiles). ``fsdp_reshard_after_forward`` False (several ranks): weights stay gathered from
    forward to backward (faster, more memory; see :func:`a5core.distributed.shard`)."""

    n_grpo_steps: int = Field(200, ge=1, description="GRPO steps (a rollout batch each)")
    advantage_eps: float = Field(1e-6, ge=0, allow_inf_nan=False, description="added to the group std")
    rollout_batch_size: int = Field(256, ge=1, description="rollouts per step: questions × group_size")
    group_size: int = Field(8, ge=1, description="rollouts per question")
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


@dataclass
class RolloutBatch:
    """One step's graded rollouts, N of them, groups consecutive.

    prompt_ids, response_ids: N token-id lists; raw_rewards, advantages: (N,); correct: (N,) bool;
    old_log_probs, engine_log_probs: None or N 1-D fp32 tensors of the response's length.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    raw_rewards: torch.Tensor
    advantages: torch.Tensor
    correct: torch.Tensor
    old_log_probs: list[torch.Tensor] | None = None
    engine_log_probs: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, index: Sequence[int]) -> RolloutBatch:
        pick = torch.as_tensor(list(index), dtype=torch.long)
        return RolloutBatch(
            [self.prompt_ids[i] for i in index],
            [self.response_ids[i] for i in index],
            self.raw_rewards[pick],
            self.advantages[pick],
            self.correct[pick],
            None if self.old_log_probs is None else [self.old_log_probs[i] for i in index],
            None if self.engine_log_probs is None else [self.engine_log_probs[i] for i in index],
        )

    def tensors(self, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
        """input_ids, labels, response_mask (b, T); raw_rewards, advantages (b, 1); and old/engine
        log-probs (b, T), zero outside the response, when present."""
        packed = pack_prompt_and_output_ids(self.prompt_ids, self.response_ids, pad_id)
        mask = packed["response_mask"]

        def per_token(values: list[torch.Tensor]) -> torch.Tensor:
            out = torch.zeros(mask.shape, dtype=torch.float32)
            out[mask] = torch.cat(values)  # row-major: each row's response positions, in order
            return out.to(device)

        result = {k: v.to(device) for k, v in packed.items()}
        result["raw_rewards"] = self.raw_rewards.view(-1, 1).to(device)
        result["advantages"] = self.advantages.view(-1, 1).to(device)
        if self.old_log_probs is not None:
            result["old_log_probs"] = per_token(self.old_log_probs)
        if self.engine_log_probs is not None:
            result["engine_log_probs"] = per_token(self.engine_log_probs)
        return result


def run_fingerprint(config: GRPOConfig, problems: Sequence[Problem]) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the config (less UNFINGERPRINTED_FIELDS) and the
    problems, in order."""
    settings = {k: v for k, v in config.values_of(GRPOConfig).items() if k not in UNFINGERPRINTED_FIELDS}
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
) -> list[dict[str, float]]:
    """Train ``model`` in place with GRPO (see the module docstring); returns every logged metrics dict.

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
    rank, world = distributed.setup_model(model, config.fsdp_reshard_after_forward)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.adamw(params)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.compile_layers:
        compile_decoder_layers(model, activation_memory_budget=COMPILED_ACTIVATION_BUDGET)
    expected = run_fingerprint(config, problems)
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
        spent = json.loads(clock.read_text())
        if spent.get("fingerprint") == expected:
            elapsed = max(elapsed, spent["wall_seconds"])
    started = time.monotonic() - elapsed
    trainer = _Trainer(model, tokenizer, optimizer, params, config, device, checkpoint)

    def finish_step(metrics: dict[str, float], step: int) -> None:
        if evaluate is not None and (
            step == config.n_grpo_steps or (config.eval_every and step % config.eval_every == 0)
        ):
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
    while step < config.n_grpo_steps:
        metrics = trainer.step(engine, problems, template, reward_fn, step)
        step += 1
        finish_step(metrics, step)
        steps_bar.update(1)
        steps_bar.set_postfix(reward=f"{metrics['reward_mean']:.3g}", refresh=False)
        stopping = should_stop is not None and step < config.n_grpo_steps and distributed.any_rank(should_stop(step))
        if checkpoint and (
            stopping or step == config.n_grpo_steps or (config.checkpoint_every and step % config.checkpoint_every == 0)
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
                },
            )
        if stopping:
            logger.info("GRPO: stopped after step %d of %d (should_stop)", step, config.n_grpo_steps)
            break
    steps_bar.close()
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return history


class _Trainer:
    """The body of one GRPO step, phase by phase (each timed)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        config: GRPOConfig,
        device: torch.device,
        checkpoint: Path | None,
    ):
        self.model, self.tokenizer, self.optimizer, self.params = model, tokenizer, optimizer, params
        self.config, self.device, self.checkpoint = config, device, checkpoint
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
        self.times[f"time_{phase}"] = time.perf_counter() - start

    def step(
        self,
        engine: Engine,
        problems: list[Problem],
        template: PromptTemplate,
        reward_fn: Callable[[str, Any], dict[str, float]],
        step: int,
    ) -> dict[str, float]:
        config, self.times = self.config, {}
        start = time.perf_counter()
        rng = random.Random(config.step_seed(step))
        questions = rng.sample(problems, config.prompts_per_step)
        prompts = [template.format(q.problem) for q in questions]
        rank, world = distributed.rank_and_world()
        with self.timed("weight_sync"):
            engine.load_weights(distributed.full_weights(self.model))
        with self.timed("generate"):
            # This rank's block of questions, whole groups; each rank draws its own random stream.
            sampling = config.sampling(
                template.stop,
                n=config.group_size,
                logprobs=config.tis_cap is not None,
                seed=config.step_seed(step) * world + rank,
            )
            groups = engine.generate(prompts[distributed.rank_slice(len(prompts))], sampling)
            completions = distributed.gather_lists([c for group in groups for c in group])  # question order
        with self.timed("grade"):
            advantages, raw_rewards, metrics = compute_group_normalized_rewards(
                reward_fn,
                [c.text for c in completions],
                [q.answer for q in questions for _ in range(config.group_size)],
                config.group_size,
                config.advantage_eps,
                config.use_std_normalization,
            )
        prompt_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        batch = RolloutBatch(
            [prompt_ids[i // config.group_size] for i in range(len(completions))],
            [list(c.token_ids) for c in completions],
            raw_rewards,
            advantages,
            raw_rewards == 1.0,
            engine_log_probs=[torch.tensor(c.log_probs, dtype=torch.float32) for c in completions]
            if config.tis_cap is not None
            else None,
        )
        lengths = torch.tensor([len(ids) for ids in batch.response_ids], dtype=torch.float32)
        metrics.update(
            {
                "response_tokens_mean": lengths.mean().item(),
                "response_tokens_correct": lengths[batch.correct].mean().item() if batch.correct.any() else math.nan,
                "response_tokens_incorrect": lengths[~batch.correct].mean().item()
                if (~batch.correct).any()
                else math.nan,
                "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
            }
        )
        if config.drop_uniform_groups:
            grouped = raw_rewards.view(-1, config.group_size)
            varied = (grouped.max(dim=1).values != grouped.min(dim=1).values).tolist()
            keep = [i for i in range(len(batch)) if varied[i // config.group_size]]
            metrics["dropped_groups"] = float(varied.count(False))
            batch = batch.select(keep)
        if len(batch) and config.needs_old_log_probs:
            with self.timed("old_log_probs"):
                batch.old_log_probs = self.response_log_probs(batch)
        with self.timed("train"):
            metrics.update(self.train(batch, step) if len(batch) else {"optimizer_steps": 0.0})
        generated = float(lengths.sum())
        metrics.update(self.times)
        metrics["time_step"] = time.perf_counter() - start
        metrics["generate_tokens_per_s"] = generated / max(self.times["time_generate"], 1e-9)
        metrics["train_tokens_per_s"] = metrics.get("train_tokens", 0.0) / max(self.times["time_train"], 1e-9)
        return metrics

    @torch.no_grad()
    def response_log_probs(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Each rollout's response-token log-probs under the current policy, no graph: N tensors (each
        rank computes its share, then all ranks get all)."""
        self.model.eval()
        mine: list[tuple[int, torch.Tensor]] = []
        for index in distributed.rank_microbatches(range(len(batch)), self.config.microbatch_size):
            t = batch.select(index or [0]).tensors(self.pad_id, self.device)  # an empty share still runs a pass (FSDP2)
            with self.autocast:
                log_probs = get_response_log_probs(self.model, t["input_ids"], t["labels"])["log_probs"]
            mask = t["response_mask"]
            if index:
                mine += zip(index, log_probs[mask].float().cpu().split(mask.sum(dim=1).tolist()))
        return [log_probs for _, log_probs in sorted(distributed.gather_lists(mine), key=lambda pair: pair[0])]

    def train(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """``epochs_per_rollout_batch`` passes over ``batch`` in optimizer steps of ``train_batch_size``."""
        config, world = self.config, distributed.rank_and_world()[1]
        self.model.train()
        sums: dict[str, float] = {"loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "ratio_mean": 0.0}
        ratio_max, entropy_sum, entropy_tokens, tokens, optimizer_steps = 0.0, 0.0, 0.0, 0.0, 0
        for epoch in range(config.epochs_per_rollout_batch):
            generator = torch.Generator().manual_seed(config.step_seed(step) * 1_000 + epoch)
            order = torch.randperm(len(batch), generator=generator).tolist()
            for start in range(0, len(batch), config.train_batch_size):
                train_batch = order[start : start + config.train_batch_size]
                self.optimizer.zero_grad(set_to_none=True)
                # Statistics stay on the device (no sync per micro-batch) until read once, below.
                acc = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in _STEP_SUMS}
                ratio_peak = torch.zeros((), dtype=torch.float64, device=self.device)
                microbatches = distributed.rank_microbatches(train_batch, config.microbatch_size)
                for index in distributed.accumulating(self.model, microbatches):
                    t = batch.select(index or train_batch[:1]).tensors(self.pad_id, self.device)
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
                        cliprange=config.cliprange,
                        length_normalization=config.length_normalization,
                        normalize_constant=float(config.max_tokens),
                        cliprange_high=config.cliprange_high,
                        token_weights=weights,
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
                self.optimizer.step()
                optimizer_steps += 1
                sums["loss"] += got["loss"]
                sums["grad_norm"] += got["grad_norm"]
                sums["clip_fraction"] += got["clipped"] / max(got["response_tokens"], 1)
                sums["ratio_mean"] += got["ratio_sum"] / max(got["response_tokens"], 1)
                ratio_max = max(ratio_max, got["ratio_max"])
                entropy_sum += got["entropy_sum"]
                entropy_tokens += got["entropy_tokens"]
                tokens += got["tokens"]
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {k: v / optimizer_steps for k, v in sums.items()}
        if config.loss_type != "grpo_clip":
            del metrics["clip_fraction"]
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
            }
        )
        return metrics
