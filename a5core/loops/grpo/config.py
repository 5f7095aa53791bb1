"""The settings of a GRPO run (:class:`GRPOConfig`) and what a checkpoint must match to be resumed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field, StrictBool, model_validator

from a5core.data.files import Problem
from a5core.engines.engine import RolloutSamplingFields
from a5core.loops.question_sampling import QuestionSamplingSettings
from a5core.loops.settings import OptimizerSettings, PeriodicSettings, SeedSettings
from a5core.policy.lora import LoRASettings
from a5core.policy.losses import POLICY_GRADIENT_INPUTS, KLEstimator, LengthNormalization, LossType
from a5core.runtime.checkpoint import fingerprint
from a5core.runtime.settings import HOW_FAST_FIELDS, Settings, SpeedSettings, group, inherited

# Fields that say how often side effects happen and how fast a step runs, not what is trained
# (see a5core.runtime.checkpoint).
UNFINGERPRINTED_FIELDS = ("checkpoint_every", "eval_every", *HOW_FAST_FIELDS)
# The truncated importance cap a one-step-off run (pipeline_depth 1, which refuses to run without one) takes
# where none is given: what the refusal suggests and what the one-step-off ablation runs with.
ONE_STEP_OFF_TIS_CAP = 2.0


class GRPOOptimizer(OptimizerSettings):
    learning_rate: float = inherited(1e-5)


class GRPOSchedule(PeriodicSettings):
    checkpoint_every: int = inherited(10)


class GRPOConfig(Settings):
    """Settings of one GRPO run; defaults are the A5 handout's. Invalid values or combinations raise
    ``ValueError`` naming the field at construction. ``compile_layers``: ``torch.compile`` the decoder
    layers (:func:`a5core.policy.causal_lm.compile_decoder_layers`; on a GPU faster and leaner after a first step
    that compiles; ``auto``, the default: on CUDA only). ``max_tokens_per_microbatch`` ``auto`` (the
    default): a token budget sized to the GPU (:mod:`a5core.runtime.token_budget`), micro-batches by count on the CPU.
    ``fsdp_reshard_after_forward`` False (several ranks): weights stay gathered from
    forward to backward (faster, more memory; see :func:`a5core.runtime.distributed.shard`)."""

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

    optimizer: GRPOOptimizer = group(GRPOOptimizer, "AdamW and gradient clipping")
    sampling: RolloutSamplingFields = group(RolloutSamplingFields, "how rollouts are sampled")
    questions: QuestionSamplingSettings = group(QuestionSamplingSettings, "which questions a step draws")
    lora: LoRASettings = group(LoRASettings, "LoRA adapters (rank 0: full fine-tuning)")
    speed: SpeedSettings = group(SpeedSettings, "how a step runs: memory against speed")
    schedule: GRPOSchedule = group(GRPOSchedule, "how often the run validates and checkpoints")
    seeding: SeedSettings = group(SeedSettings, "the run's seed")

    def _fail(self, name: str, requirement: str) -> None:
        raise ValueError(f"GRPOConfig.{name} must be {requirement}, got {getattr(self, name)!r}")

    @model_validator(mode="after")
    def _batches_divide(self) -> "GRPOConfig":
        if self.rollout_batch_size % self.group_size:
            self._fail("rollout_batch_size", f"a multiple of group_size ({self.group_size})")
        if self.train_batch_size % self.gradient_accumulation_steps:
            self._fail(
                "train_batch_size", f"a multiple of gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.rollout_batch_size % self.train_batch_size:
            self._fail("rollout_batch_size", f"a multiple of train_batch_size ({self.train_batch_size})")
        if self.train_batch_size < self.group_size:
            self._fail("train_batch_size", f">= group_size ({self.group_size})")
        return self

    @model_validator(mode="after")
    def _options_agree(self) -> "GRPOConfig":
        if self.weighs_by_ratio and not self.off_policy:
            raise ValueError(
                f"GRPOConfig.loss_type {self.loss_type!r} weighs each token by π/π_old, the ratio to the policy "
                "that sampled the rollouts; on-policy (epochs_per_rollout_batch 1 and train_batch_size == "
                "rollout_batch_size) every ratio is 1. Use reinforce_with_baseline, or make it off-policy."
            )
        if self.cliprange_high is not None and self.loss_type != "grpo_clip":  # gspo has gspo_cliprange_high
            self._fail("cliprange_high", "None, or a number > 0 with loss_type grpo_clip")
        if self.overlong_buffer >= self.sampling.max_tokens:
            self._fail("overlong_buffer", f"below max_tokens ({self.sampling.max_tokens})")
        if self.dynamic_sampling and self.drop_uniform_groups:
            self._fail("drop_uniform_groups", "false with dynamic_sampling (which drops uniform groups and draws more)")
        if self.pipeline_depth and self.tis_cap is None:
            self._fail(
                "tis_cap",
                f"set (e.g. {ONE_STEP_OFF_TIS_CAP}) with pipeline_depth 1: the rollouts come from weights one step "
                "older, and the truncated importance weight against the engine's log-probs corrects for that",
            )
        if self.pipeline_depth and self.dynamic_sampling:
            self._fail("dynamic_sampling", "false with pipeline_depth 1 (its extra draws need the current weights)")
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
    def weighs_by_ratio(self) -> bool:
        """Whether ``loss_type`` weighs each token by π/π_old, the ratio to the policy that sampled."""
        return "old_log_probs" in POLICY_GRADIENT_INPUTS[self.loss_type]

    @property
    def clips(self) -> bool:
        """Whether ``loss_type`` clips the ratio (its gradient is 0, legitimately, where every token is clipped)."""
        return "cliprange" in POLICY_GRADIENT_INPUTS[self.loss_type]

    @property
    def uses_advantages(self) -> bool:
        """False for ``no_baseline``, the loss on the raw rewards."""
        return "advantages" in POLICY_GRADIENT_INPUTS[self.loss_type]

    @property
    def needs_old_log_probs(self) -> bool:
        """Whether a step computes the rollouts' log-probs under the policy that sampled them (π_old): for a loss
        that weighs by the ratio, or the truncated importance weight."""
        return self.weighs_by_ratio or self.tis_cap is not None


def run_fingerprint(
    config: GRPOConfig, problems: Sequence[Problem], pass_rates: dict[str, float] | None = None
) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: the config (less UNFINGERPRINTED_FIELDS), the
    problems, in order, and the pass-rate table the questions were sampled by."""
    settings = {k: v for k, v in config.values_of(GRPOConfig).items() if k not in UNFINGERPRINTED_FIELDS}
    if pass_rates:
        settings["pass_rates"] = fingerprint({}, sorted((k, repr(v)) for k, v in pass_rates.items()), "rates")["sha256"]
    return fingerprint(settings, ((p.problem, p.answer) for p in problems), "problems")
