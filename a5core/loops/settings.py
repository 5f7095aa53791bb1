"""The settings groups the training loops share, each declared once: AdamW, an SFT step's batch, how often a run
validates and checkpoints, and the seed (the machinery, and how a step runs on the hardware:
:mod:`a5core.runtime.settings`).

Where the loops differ on a default (the learning rate: 2e-5 for SFT, 1e-5 for EI and GRPO), the group gives
none and each loop's subclass gives its own with :func:`a5core.runtime.settings.inherited`.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from a5core.runtime.settings import MAX_SEED, Settings


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
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seed of data order, sampling and initialisation")

    def step_seed(self, step: int) -> int:
        """The seed of step ``step``'s draws (its questions, its sampling; steps numbered from 1, as logged: step 1
        draws with seed × 1,000,003): distinct for every (seed, step) pair with step ≤ 1,000,003, so two runs with
        different seeds never share a step's draws."""
        return self.seed * 1_000_003 + step - 1
