"""The settings groups the training loops share, each declared once: AdamW, how a step runs, an SFT step's
batch, how often a run validates and checkpoints, and the seed (the machinery: :mod:`a5core.runtime.settings`).

Where the loops differ on a default (the learning rate: 2e-5 for SFT, 1e-5 for EI and GRPO), the group gives
none and each loop's subclass gives its own with :func:`a5core.runtime.settings.inherited`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, StrictBool, field_validator, model_validator

from a5core.runtime.settings import Settings


class OptimizerSettings(Settings):
    """AdamW and gradient clipping (the learning rate's default: each loop's)."""

    learning_rate: float = Field(gt=0, allow_inf_nan=False, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="AdamW weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    grad_clip: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="gradient-norm clip (0: none; the norm is logged)"
    )

    @property
    def betas(self) -> tuple[float, float]:
        return (self.beta1, self.beta2)

    def adamw(self, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        """The loops' optimizer over ``params`` (fused where they are on CUDA)."""
        return torch.optim.AdamW(
            params,
            lr=self.learning_rate,
            betas=self.betas,
            weight_decay=self.weight_decay,
            fused=params[0].device.type == "cuda",
        )


class SpeedSettings(Settings):
    """How a step runs: memory against speed, and several GPUs. ``auto``: the fast path on CUDA (each choice
    measured faster there and giving the same update), today's on the CPU (docs/gpu.md)."""

    gradient_checkpointing: StrictBool = Field(False, description="recompute activations in backward (less memory)")
    max_tokens_per_microbatch: int | Literal["auto"] | None = Field(
        "auto",
        description="micro-batches by token budget: sequences sorted by length fill each micro-batch up to this "
        "many padded tokens (rows × length); auto: on CUDA sized to the memory free, halved and the pass run again "
        "on running out of memory (a5core.runtime.token_budget), on the CPU None; None: a fixed number of "
        "sequences per micro-batch",
    )
    compile_layers: StrictBool | Literal["auto"] = Field(
        "auto",
        description="torch.compile the decoder layers (GPU: faster, less memory; the first step compiles); "
        "auto: on CUDA, not on the CPU",
    )
    fsdp_reshard_after_forward: StrictBool = Field(
        True,
        description="several GPUs: False keeps each layer's gathered "
        "weights from forward to backward (faster, more memory)",
    )

    @field_validator("max_tokens_per_microbatch", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if value is None or value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError(
            "max_tokens_per_microbatch must be a whole number >= 1 (padded tokens per micro-batch), auto (sized to "
            f"the GPU) or null (micro-batches by count), got {value!r}"
        )

    @field_validator("compile_layers", mode="before")
    @classmethod
    def _compile(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError(f"compile_layers must be true, false or auto (on CUDA, not on the CPU), got {value!r}")

    def compiles(self, device: torch.device) -> bool:
        """Whether the decoder layers are compiled on ``device`` (``compile_layers`` auto: on CUDA)."""
        return self.compile_layers is True or (self.compile_layers == "auto" and device.type == "cuda")


# How fast a step runs, not what it computes (the update is the same to float rounding): a checkpoint or a run
# folder made with other values of these is the same run.
HOW_FAST_FIELDS = ("compile_layers", "fsdp_reshard_after_forward", "max_tokens_per_microbatch")


class SFTBatchSettings(Settings):
    """What one SFT optimizer step takes (epochs and max_seq_len: each loop's default)."""

    batch_size: int = Field(32, ge=1, description="sequences per optimizer step")
    microbatch_size: int = Field(2, ge=1, description="sequences per forward/backward (per rank)")
    epochs: int = Field(ge=1, description="passes over the examples")
    max_seq_len: int = Field(ge=2, description="prompt + response tokens; longer sequences lose their end")

    @model_validator(mode="after")
    def _whole_microbatches(self) -> "SFTBatchSettings":
        if self.batch_size % self.microbatch_size:
            raise ValueError(
                f"batch_size must be a multiple of microbatch_size ({self.microbatch_size}), got {self.batch_size}"
            )
        return self


class PeriodicSettings(Settings):
    """How often a run evaluates and checkpoints (0: only at the end; checkpoint_every: each loop's default)."""

    eval_every: int = Field(
        10,
        ge=0,
        description="optimizer steps between validations, after one of the starting model (0: only at the end)",
    )
    checkpoint_every: int = Field(ge=0, description="optimizer steps between checkpoints (0: only at the end)")


class SeedSettings(Settings):
    seed: int = Field(0, ge=0, description="seed of data order, sampling and initialisation")

    def step_seed(self, step: int) -> int:
        """The seed of step ``step``'s draws (its questions, its sampling; steps numbered from 1, as logged: step 1
        draws with seed × 1,000,003): distinct for every (seed, step) pair with step ≤ 1,000,003, so two runs with
        different seeds never share a step's draws."""
        return self.seed * 1_000_003 + step - 1
