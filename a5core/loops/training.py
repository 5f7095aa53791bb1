"""The policy made ready to train, the accumulation of an optimizer step's gradient, and the update that ends
it: one setup shared by the SFT and GRPO loops (and so by Expert Iteration, whose rounds are SFT runs).

:func:`prepare` adds LoRA adapters, shards the policy with FSDP2 over several ranks, builds AdamW (and a
learning-rate schedule), turns on gradient checkpointing and compiled layers, and sizes the micro-batches'
token budget. :meth:`TrainedPolicy.accumulating` walks an optimizer step's micro-batches from zero gradients,
each with the divisor of its mean loss. :meth:`TrainedPolicy.update` is the end of an optimizer step: a
non-finite or diverged step is refused before it moves the weights; otherwise the optimizer and its schedule
step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from a5core.loops.settings import OptimizerSettings
from a5core.policy.causal_lm import COMPILED_ACTIVATION_BUDGET, compile_decoder_layers
from a5core.policy.lora import LoRASettings, add_adapters
from a5core.runtime import distributed
from a5core.runtime.checkpoint import NonFiniteLossError
from a5core.runtime.guards import DivergenceGuard
from a5core.runtime.settings import SpeedSettings
from a5core.runtime.token_budget import TokenBudget


class TrainingSettings(Protocol):
    """What :func:`prepare` reads of a loop's settings (SFTConfig, GRPOConfig): its LoRA, optimizer and speed
    groups."""

    lora: LoRASettings
    optimizer: OptimizerSettings
    speed: SpeedSettings


@dataclass
class TrainedPolicy:
    """The policy being trained and what moves it: its trainable ``params``, the ``optimizer`` (and its
    ``scheduler``, if any), the ``device``, the ``autocast`` its forward passes run under (bf16 on CUDA), the
    micro-batches' token ``budget`` and the divergence ``guard``."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR | None
    device: torch.device
    autocast: contextlib.AbstractContextManager
    budget: TokenBudget
    guard: DivergenceGuard
    grad_clip: float

    def accumulating(self, batch_size: int, microbatches: list[list[int]]) -> Iterator[tuple[list[int], float]]:
        """An optimizer step's gradient, accumulated from zero over this rank's ``microbatches`` of a batch of
        ``batch_size`` sequences on all ranks (from zero: a step that ran out of memory runs again after the engine
        released its cache, or at half the budget, :meth:`a5core.runtime.token_budget.TokenBudget.retrying`).
        Yields each micro-batch and its ``microbatch_mean_divisor``, len(batch) / (len(micro) · world): what the
        micro-batch's mean loss is divided by so that the micro-batches' losses add up to the batch mean (× world:
        FSDP2 averages the ranks' gradients). An empty micro-batch (this rank's share ran out) still runs a pass
        at weight 0: FSDP2's collectives need it."""
        self.optimizer.zero_grad(set_to_none=True)
        world = distributed.rank_and_world()[1]
        for index in distributed.accumulating(self.model, microbatches):
            yield index, batch_size / (max(len(index), 1) * world)

    def clip_gradients(self) -> torch.Tensor:
        """The accumulated gradient's norm (before clipping: the logged ``grad_norm``), clipped to ``grad_clip``
        (0: not clipped)."""
        return torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or math.inf)

    def update(self, where: str, loss: float, grad_norm: float, checkpoint: Path | None, detail: str = "") -> None:
        """Step the optimizer (and its schedule) after a step ``where`` (e.g. "SFT step 3 of 8") of ``loss`` and
        ``grad_norm``, summed over ranks. A NaN/inf loss or gradient norm raises :class:`NonFiniteLossError`,
        a diverged one :class:`a5core.runtime.guards.DivergenceError`, before the update: the weights, and the last
        checkpoint under ``checkpoint``, stay those of the last good step. ``detail``: said after ``where`` in
        the non-finite error."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kept = f"{checkpoint / 'latest'}, if written," if checkpoint else "the last checkpoint, if any,"
            raise NonFiniteLossError(
                f"{where}{detail}: loss {loss}, grad_norm {grad_norm}; training stopped before the update; {kept} "
                "still holds the last good step"
            )
        self.guard.check(where, loss, grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.budget.settle()  # auto: sized once, after the first update (AdamW's moments then hold their memory)


def prepare(
    model: torch.nn.Module,
    config: TrainingSettings,
    guard: DivergenceGuard,
    schedule: Callable[[int], float] | None = None,
) -> TrainedPolicy:
    """``model`` made ready to train under ``config``, in place: LoRA adapters (``lora_rank`` > 0; every other
    weight frozen), FSDP2 sharding over several ranks, AdamW over the trainable parameters (with the learning
    rate multiplied by ``schedule(optimizer step)``, if given), gradient checkpointing, compiled decoder layers
    (``compile_layers``), and the token budget of ``max_tokens_per_microbatch``."""
    speed = config.speed
    add_adapters(model, config.lora)
    distributed.setup_model(model, speed.fsdp_reshard_after_forward)
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.optimizer.adamw(params)
    scheduler = None if schedule is None else torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if speed.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if speed.compiles(device):
        compile_decoder_layers(model, activation_memory_budget=COMPILED_ACTIVATION_BUDGET)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    budget = TokenBudget(speed.max_tokens_per_microbatch, device, params)
    grad_clip = config.optimizer.grad_clip
    return TrainedPolicy(model, params, optimizer, scheduler, device, autocast, budget, guard, grad_clip)
