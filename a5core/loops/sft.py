"""Supervised fine-tuning (CS336 A5 §3): maximise log p(response | prompt) on reasoning traces.

``train_sft(model, tokenizer, traces, SFTConfig(...), evaluate=..., log=...)`` is one plain loop: no
trainer class, metrics leave through ``log(metrics, step)``, weights reach an inference engine through
the caller's ``evaluate(model, step)``. :func:`sft_step` is one optimizer step, top to bottom.

The objective is the handout's: for each sequence, the summed log-probability of its response tokens
divided by ``normalize_constant``; the loss of a step is minus its mean over the step's sequences. Prompt
and padding tokens carry no loss. With ``append_eos`` each response is followed by the tokenizer's EOS token,
which carries loss like the response's own (the model learns to stop there).

Data order: epoch ``e`` walks the examples in the permutation drawn by a ``torch.Generator`` seeded with
``seed + e``, ``batch_size`` at a time. The last batch of an epoch keeps the remainder when
``len(examples)`` is not a multiple of ``batch_size`` (each epoch draws a new permutation, so no example
is dropped; a set smaller than one batch still trains); that step averages over its smaller batch. One
epoch is therefore ``ceil(n / batch_size)`` optimizer steps, and the run ``epochs`` of them, or
``max_steps`` if that is fewer.

A step: the batch is cut into micro-batches of ``microbatch_size`` (or by ``max_tokens_per_microbatch``);
each is tokenised on its own (so padding only reaches its longest member), cut to ``max_seq_len`` tokens,
run forward (under bf16 autocast when the model is on CUDA; the model's own dtype is the caller's choice)
and back-propagated through :func:`a5core.policy.causal_lm.sft_microbatch_train_step`, whose divisor makes the
accumulated gradient the gradient of the batch mean. Then the gradient norm is clipped to ``grad_clip``
and AdamW (fused on CUDA) steps at the scheduled learning rate (see :func:`lr_multiplier`). A NaN/inf loss
or gradient norm raises :class:`a5core.runtime.checkpoint.NonFiniteLossError` naming the step *before* the
update: the weights stay those of the previous step and no checkpoint is written from them.

Each step calls ``log`` with ``loss`` (per-sequence mean, not scaled for accumulation), ``token_nll``
(mean negative log-prob per response token), ``lr`` (the rate the step used), ``grad_norm`` (before
clipping), ``tokens`` (response tokens trained on), ``truncated`` (sequences cut by ``max_seq_len``) and
``epoch`` (epochs done, fractional). ``evaluate(model, step)`` runs every ``eval_every`` steps and after the
last one, with the model in eval mode; what it returns is merged, as named, into that step's metrics. With
``eval_every`` set, a run that starts fresh also evaluates the starting model, logged at step 0 (the first
point of every curve, the "before" of the run). The returned dict is the last step's metrics (with the
final evaluation) plus ``step``.

Checkpoints (``checkpoint_dir``; layout in :mod:`a5core.runtime.checkpoint`): ``latest/`` holds weights, optimizer,
scheduler, RNG states and the data position, every ``checkpoint_every`` steps and after the last. A run
whose checkpoint exists resumes from it exactly, and refuses
(:class:`a5core.runtime.checkpoint.CheckpointMismatchError`) if it was written with another config or other
examples. A finished checkpoint is not trained again: its final
weights are loaded into ``model`` and its final metrics returned.

Several ranks (torchrun; the caller has called :func:`a5core.runtime.distributed.init_from_env` before loading the
model): ``model`` is FSDP2-sharded in place (and stays so). Rank r takes sequences r, r + N, … of each
batch, ``microbatch_size`` at a time (so ``microbatch_size`` is per rank), and each micro-batch's loss is
divided by the batch's global number of sequences: the update is the one process's, whatever N and
``microbatch_size``. The metrics are the whole batch's (reduced over ranks) and the same on every rank;
only rank 0 calls ``log``; every rank calls ``evaluate`` with the sharded model (push it to an engine with
:func:`a5core.engines.full_weights`) and gets the same return value. Checkpoints are written whole by
rank 0 and resume on any number of ranks.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, StrictBool

from a5core.data.files import Trace
from a5core.loops.settings import OptimizerSettings, PeriodicSettings, SeedSettings, SFTBatchSettings
from a5core.loops.training import TrainedPolicy, prepare
from a5core.policy.causal_lm import (
    get_response_log_probs,
    output_ids,
    pad_id_of,
    pad_positions,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)
from a5core.policy.lora import LoRASettings
from a5core.runtime import distributed, progress
from a5core.runtime.checkpoint import fingerprint, load_checkpoint, save_checkpoint
from a5core.runtime.guards import DivergenceGuard
from a5core.runtime.out_of_memory import naming_the_microbatch
from a5core.runtime.settings import HOW_FAST_FIELDS, Settings, SpeedSettings, group, inherited

logger = logging.getLogger(__name__)

STATUS_KEYS = ("loss", "token_nll", "lr", "grad_norm", "val_accuracy")  # the per-step status line's metrics
# Fields that say how often side effects happen and how fast a step runs, not what is trained: a run may
# be resumed with them changed (checkpoints or evaluations more or less often).
UNFINGERPRINTED_FIELDS = ("checkpoint_every", "eval_every", *HOW_FAST_FIELDS)


class SFTOptimizer(OptimizerSettings):
    learning_rate: float = inherited(2e-5)


class SFTBatch(SFTBatchSettings):
    epochs: int = inherited(2)
    max_seq_len: int = inherited(1024)


class SFTSchedule(PeriodicSettings):
    checkpoint_every: int = inherited(20)


class SFTConfig(Settings):
    """Settings of one SFT run; invalid values raise ``ValueError`` naming the field.

    ``batch_size`` sequences make one optimizer step, processed ``microbatch_size`` at a time
    (gradient accumulation over ``batch_size // microbatch_size`` micro-batches). ``lr_schedule``:
    linear warmup over ``warmup_steps`` steps, then ``constant`` or ``cosine`` decay to 0 at the end
    of the run (see :func:`lr_multiplier`). ``grad_clip`` 0 disables clipping (the norm is still logged).
    ``max_seq_len`` caps prompt + response tokens; longer sequences lose the end of their response.
    ``eval_every``/``checkpoint_every`` 0 mean "only at the end". ``compile_layers``: ``torch.compile``
    the decoder layers (:func:`a5core.policy.causal_lm.compile_decoder_layers`; on a GPU faster and leaner, after a
    first step that compiles; ``auto``, the default: on CUDA only). ``max_tokens_per_microbatch`` ``auto``
    (the default): a token budget sized to the GPU (:mod:`a5core.runtime.token_budget`), by count on the CPU.
    ``fsdp_reshard_after_forward`` False (several ranks): weights stay gathered
    from forward to backward (faster, more memory; see :func:`a5core.runtime.distributed.shard`).
    ``append_eos``: each response ends with the tokenizer's EOS token, in the loss and in every length the run
    counts (:func:`token_lengths`).
    """

    optimizer: SFTOptimizer = group(SFTOptimizer, "AdamW and gradient clipping")
    batch: SFTBatch = group(SFTBatch, "what one optimizer step takes")
    lora: LoRASettings = group(LoRASettings, "LoRA adapters (rank 0: full fine-tuning)")
    speed: SpeedSettings = group(SpeedSettings, "how a step runs: memory against speed")
    schedule: SFTSchedule = group(SFTSchedule, "how often the run validates and checkpoints")
    seeding: SeedSettings = group(SeedSettings, "the run's seed")

    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warmup: cosine decay to 0, or constant"
    )
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warmup steps")
    max_steps: int | None = Field(None, ge=1, description="cap on optimizer steps (None: epochs decide)")
    normalize_constant: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="the summed response log-prob of a sequence is divided by it"
    )
    append_eos: StrictBool = Field(
        False,
        description="each response is followed by the tokenizer's EOS token in the loss, so the model learns to "
        "stop where a response ends (what a prompt that stops only at EOS, question_only, needs)",
    )


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """The learning-rate factor for the optimizer step with 0-based index ``step`` (of ``total_steps``).

    Warmup: step ``t < warmup_steps`` uses ``(t + 1) / warmup_steps``, so the first step already
    learns and step ``warmup_steps − 1`` reaches the full rate. Then ``constant`` keeps 1; ``cosine``
    uses ``0.5·(1 + cos(π·(t − W)/(total − W)))``: 1 at the first step after warmup, falling to 0 at
    ``t = total_steps``, just past the last step (no step is spent at lr 0).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class _Run:
    """What every step of a run uses: the settings, the policy and what trains it (its optimizer, schedule and
    token budget: :class:`a5core.loops.training.TrainedPolicy`), the examples."""

    config: SFTConfig
    policy: TrainedPolicy
    tokenizer: Any
    examples: list[Trace]
    positions: list[int] | None  # under a token budget: each example's trained positions
    total_steps: int
    checkpoint: Path | None
    last_shape: tuple[int, ...] | None = None  # the latest micro-batch's (rows, positions)
    release_memory: Callable[[], bool] | None = None  # a rollout engine's in this process (train_sft's argument)


def train_sft(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[Trace],
    config: SFTConfig,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    evaluate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
    log: Callable[[dict[str, float], int], None] = lambda metrics, step: None,
    release_memory: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Fine-tune ``model`` in place on ``(trace.prompt, trace.response)`` pairs; return the last metrics
    (with ``step``). The objective, data order, metrics, checkpoints and several ranks: the module docstring.

    ``release_memory``: the :meth:`~a5core.engines.Engine.release_memory` of a rollout engine in this process
    (expert iteration's, an evaluation's), asked once before a pass that ran out of memory under
    ``max_tokens_per_microbatch: auto`` runs again (:meth:`a5core.runtime.token_budget.TokenBudget.retrying`)."""
    examples = list(examples)
    if not examples:
        raise ValueError("train_sft needs at least one example")
    batch_size, schedule = config.batch.batch_size, config.schedule
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total_steps = min(steps_per_epoch * config.batch.epochs, config.max_steps or math.inf)
    checkpoint = Path(checkpoint_dir) if checkpoint_dir is not None else None
    run = _setup(model, tokenizer, examples, config, total_steps, checkpoint)
    run.release_memory = release_memory
    fingerprint = run_fingerprint(config, examples)
    state = _start(run, fingerprint, steps_per_epoch)
    if state["finished"]:
        return {**state["metrics"], "step": state["step"]}
    done, epoch, batch_in_epoch, metrics = state["step"], state["epoch"], state["batch_in_epoch"], state["metrics"]
    rank = distributed.rank_and_world()[0]
    was_training = model.training
    steps_bar = progress.bar(desc="SFT", total=total_steps, initial=done, unit="step", leave=True)  # evaluation too
    if done == 0 and evaluate is not None and schedule.eval_every:
        model.eval()
        start = evaluate(model, 0)  # the starting model: step 0 of the curves
        if rank == 0:
            log(start, 0)
    model.train()
    for step in range(done + 1, total_steps + 1):  # step: the steps done once it is
        seeded = torch.Generator().manual_seed(config.seeding.seed + epoch)
        order = torch.randperm(len(examples), generator=seeded).tolist()
        metrics = sft_step(run, order[batch_in_epoch * batch_size : (batch_in_epoch + 1) * batch_size], step)
        batch_in_epoch += 1
        if batch_in_epoch == steps_per_epoch:
            epoch, batch_in_epoch = epoch + 1, 0
        metrics["epoch"] = step / steps_per_epoch
        if evaluate is not None and (step == total_steps or (schedule.eval_every and step % schedule.eval_every == 0)):
            model.eval()
            metrics.update(evaluate(model, step))
            model.train()
        if rank == 0:
            log(metrics, step)
            progress.log_step(logger, "SFT step", step, total_steps, metrics, STATUS_KEYS)
        steps_bar.update(1)
        steps_bar.set_postfix(loss=f"{metrics['loss']:.4g}", refresh=False)
        every = schedule.checkpoint_every
        if checkpoint and (step == total_steps or (every and step % every == 0)):
            position = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, "total_steps": total_steps}
            progress_state = {
                **position,
                "finished": step == total_steps,
                "metrics": metrics,
                "fingerprint": fingerprint,
            }
            save_checkpoint(checkpoint, model, run.policy.optimizer, run.policy.scheduler, progress_state)
        done = step
    steps_bar.close()
    run.policy.optimizer.zero_grad(set_to_none=True)  # free the gradients (a model's worth of memory) for what's next
    model.train(was_training)
    return {**metrics, "step": done}


def sft_step(run: _Run, batch_order: list[int], step: int) -> dict[str, float]:
    """Optimizer step ``step`` (from 1) on the examples ``batch_order``: micro-batch losses, back-propagated and
    accumulated; the gradient norm clipped; AdamW at the scheduled rate. Returns the step's metrics, the
    whole batch's (summed over ranks)."""
    config, policy = run.config, run.policy
    count = f"microbatch_size {config.batch.microbatch_size}: lower it"
    where = f"SFT step {step}"
    with naming_the_microbatch(where, lambda: policy.budget.value, count, lambda: run.last_shape):
        lengths = [run.positions[i] for i in batch_order] if run.positions is not None else []
        accumulate = functools.partial(_accumulate, run, batch_order)
        loss, nll, tokens, truncated = policy.budget.retrying(accumulate, where, lengths, run.release_memory)
    grad_norm_value = distributed.full_tensor(policy.clip_gradients()).item()
    cut = torch.tensor(truncated, dtype=torch.float64, device=policy.device)
    sums = torch.stack([loss.double(), nll.double(), tokens.double(), cut])
    loss_value, nll_value, token_count, truncated = distributed.global_sum(sums).tolist()  # the whole batch's
    lr = policy.scheduler.get_last_lr()[0]  # the rate this step uses
    policy.update(f"SFT step {step} of {run.total_steps}", loss_value, grad_norm_value, run.checkpoint)
    return {
        "loss": loss_value,
        "token_nll": nll_value / max(token_count, 1),
        "lr": lr,
        "grad_norm": grad_norm_value,
        "tokens": token_count,
        "truncated": truncated,
    }


def _accumulate(run: _Run, batch_order: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The gradient of the examples ``batch_order``, accumulated over their micro-batches
    (:meth:`a5core.loops.training.TrainedPolicy.accumulating`): this rank's loss, summed negative log-probs,
    response tokens and truncated sequences."""
    config, policy, world = run.config, run.policy, distributed.rank_and_world()[1]
    model, device = policy.model, policy.device
    batch = [run.examples[i] for i in batch_order]
    loss = torch.zeros((), device=device)
    nll = torch.zeros((), device=device)
    tokens = torch.zeros((), dtype=torch.long, device=device)
    truncated = 0
    budget = policy.budget.value
    lengths = None if budget is None else [run.positions[i] for i in batch_order]
    microbatches = distributed.rank_microbatches(range(len(batch)), config.batch.microbatch_size, lengths, budget)
    for index, microbatch_mean_divisor in policy.accumulating(len(batch), microbatches):
        micro = [batch[i] for i in index] or batch[:1]  # an empty share still runs a pass (FSDP2), at weight 0
        input_ids, labels, response_mask, cut = _microbatch(run, micro, live=bool(index))
        truncated += cut
        run.last_shape = tuple(input_ids.shape)
        with policy.budget.measuring(input_ids.numel()):
            with policy.autocast:
                log_probs = get_response_log_probs(model, input_ids, labels)["log_probs"]  # (b, T) fp32
            micro_loss, meta = sft_microbatch_train_step(
                log_probs, response_mask, microbatch_mean_divisor, config.normalize_constant
            )
        loss += micro_loss / world
        nll -= (log_probs.detach() * response_mask).sum()
        tokens += meta["response_tokens"]
    return loss, nll, tokens, truncated


def _microbatch(run: _Run, micro: list[Trace], live: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A micro-batch's input_ids, labels, response_mask (b, T) on the device, cut to ``max_seq_len`` tokens
    (under a token budget padded to a multiple of 64 positions, so compiled layers see few shapes), and how
    many sequences the cut shortened. Not ``live`` (an empty share's stand-in): no response token."""
    prompts, responses = [t.prompt for t in micro], [t.response for t in micro]
    encoded = tokenize_prompt_and_output(prompts, responses, run.tokenizer, run.config.append_eos)
    if not live:
        encoded["response_mask"].zero_()
    keep = run.config.batch.max_seq_len - 1  # positions of (input, label) pairs within max_seq_len tokens
    cut = int(encoded["response_mask"][:, keep:].any(dim=-1).sum())
    input_ids, labels, response_mask = (encoded[k][:, :keep] for k in ("input_ids", "labels", "response_mask"))
    if run.policy.budget.value is not None:
        input_ids, labels, response_mask = pad_positions(input_ids, labels, response_mask, pad_id_of(run.tokenizer))
    input_ids, labels, response_mask = (x.to(run.policy.device) for x in (input_ids, labels, response_mask))
    return input_ids, labels, response_mask, cut


def _setup(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: list[Trace],
    config: SFTConfig,
    total_steps: int,
    checkpoint: Path | None,
) -> _Run:
    """The policy made ready to train (:func:`a5core.loops.training.prepare`: AdamW with its warmup and decay) and,
    under a token budget, each example's trained positions."""
    schedule = functools.partial(
        lr_multiplier, warmup_steps=config.warmup_steps, total_steps=total_steps, schedule=config.lr_schedule
    )
    policy = prepare(model, config, DivergenceGuard(fixed_scale=True), schedule)
    prompt_lengths, response_lengths = token_lengths(examples, tokenizer, config.append_eos)
    check_cut(prompt_lengths, response_lengths, config.batch.max_seq_len)
    positions = None
    if policy.budget.value is not None:  # each example's trained positions: prompt + response tokens − 1, cut
        lengths = zip(prompt_lengths, response_lengths, strict=True)
        positions = [min(p + r - 1, config.batch.max_seq_len - 1) for p, r in lengths]
    return _Run(config, policy, tokenizer, examples, positions, total_steps, checkpoint)


def _start(run: _Run, fingerprint: dict[str, Any], steps_per_epoch: int) -> dict[str, Any]:
    """Where the run starts: its checkpoint's position (the weights, optimizer, schedule and RNG states
    loaded), or step 0 with every RNG seeded."""
    config, checkpoint, policy = run.config, run.checkpoint, run.policy
    counts = {"step": run.total_steps, "epoch": config.batch.epochs, "batch_in_epoch": steps_per_epoch - 1}
    state = (
        load_checkpoint(checkpoint, fingerprint, policy.model, policy.optimizer, policy.scheduler, counts)
        if checkpoint
        else None
    )
    if state is not None and state["finished"]:
        logger.info("SFT: %s holds a finished run (%d steps); not training again", checkpoint, state["step"])
        return state
    if state is None:
        state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "metrics": {}, "finished": False}
        random.seed(config.seeding.seed)
        np.random.seed(config.seeding.seed)
        torch.manual_seed(config.seeding.seed)  # all devices
    else:
        logger.info(
            "SFT: resuming from %s at step %d (epoch %d, batch %d)",
            checkpoint,
            state["step"],
            state["epoch"],
            state["batch_in_epoch"],
        )
    logger.info(
        "SFT: %d examples, %d steps (%d per epoch), batch %d = %d micro-batches of %d",
        len(run.examples),
        run.total_steps,
        steps_per_epoch,
        config.batch.batch_size,
        config.batch.batch_size // config.batch.microbatch_size,
        config.batch.microbatch_size,
    )
    return state


def token_lengths(examples: Sequence[Trace], tokenizer: Any, append_eos: bool = False) -> tuple[list[int], list[int]]:
    """Each example's prompt and response lengths in tokens, tokenised as a step tokenises them (``append_eos``:
    each response with its EOS token)."""
    prompts = tokenizer([t.prompt for t in examples], add_special_tokens=False)["input_ids"]
    responses = output_ids([t.response for t in examples], tokenizer, append_eos)
    return [len(p) for p in prompts], [len(r) for r in responses]


def check_cut(prompt_lengths: list[int], response_lengths: list[int], max_seq_len: int, warn: bool = True) -> None:
    """ValueError when ``max_seq_len`` cuts every example's whole response (each step would train on no token:
    loss 0, gradient 0); with ``warn``, a warning naming the share of examples it cuts when it cuts some.
    An example of prompt length p and response length r trains on max(0, min(p + r, max_seq_len) − p) tokens."""
    pairs = list(zip(prompt_lengths, response_lengths, strict=True))
    if pairs and not any(min(p + r, max_seq_len) > p for p, r in pairs):
        raise ValueError(
            f"max_seq_len {max_seq_len}: no example keeps a response token to train on (the shortest prompt is "
            f"{min(prompt_lengths)} tokens), so every step would train on nothing; raise max_seq_len above the prompts"
        )
    cut = sum(p + r > max_seq_len for p, r in pairs)
    if cut and warn:
        emptied = sum(p >= max_seq_len for p, r in pairs)
        logger.warning(
            "max_seq_len %d cuts %d of %d examples (%.0f%%) to fit%s: they train on part of their response; raise "
            "it to train on whole responses",
            max_seq_len,
            cut,
            len(pairs),
            100 * cut / len(pairs),
            f", {emptied} of them to no response token at all" if emptied else "",
        )


def run_fingerprint(config: SFTConfig, examples: Sequence[Trace]) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the config (less UNFINGERPRINTED_FIELDS) and the
    examples' prompts and responses, in order (see :func:`a5core.runtime.checkpoint.fingerprint`)."""
    settings = {k: v for k, v in config.values_of(SFTConfig).items() if k not in UNFINGERPRINTED_FIELDS}
    return fingerprint(settings, ((t.prompt, t.response) for t in examples), "examples")
