"""Settings: every knob of the training loops declared once, typed, validated and described here.

Each loop takes one frozen settings model (:class:`a5core.loops.sft.SFTConfig`,
:class:`a5core.loops.expert_iteration.EIConfig`, :class:`a5core.loops.grpo.GRPOConfig`), composed from the groups
below, so that a setting two loops share (the learning rate, the sampling temperature) has one declaration: its
type, constraints and description. The flows' parameter models (``flows/params.py``) compose the same groups with
the pipeline's own (engine, data, tracking), so the command lines, the Prefect UI's forms and ``params.yaml``'s
validation all derive from these declarations.

Each setting has one default. A group gives it where every loop agrees (the sampling temperature); where the
loops differ (the learning rate: 2e-5 for SFT, 1e-5 for EI and GRPO), the group gives none and each loop's
config redeclares the field with its own, ``learning_rate: float = inherited(2e-5)`` (:func:`inherited`). A
flow with a purpose of its own (the leaderboard's tuned recipe) may give a loop's setting another default the
same way, once; a restatement of the value it replaces is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from a5core.engines import SamplingSettings


@dataclass(frozen=True)
class _Inherited:
    """The value of a field a class redeclares to give it another default (see :func:`inherited`)."""

    default: Any


def inherited(default: Any) -> Any:
    """In a class body, ``name: TYPE = inherited(value)``: the field ``name`` the class inherits, its type,
    constraints and description unchanged, with ``value`` for default. Refused (TypeError, as the class is
    made): a field the class does not inherit, or ``value`` the default it had (one place each)."""
    return _Inherited(default)


def _inherited_field(cls: type[BaseModel], name: str) -> FieldInfo | None:
    """Field ``name`` as the nearest class after ``cls`` in its MRO declares it, or None where none does."""
    for base in cls.__mro__[1:]:
        fields = getattr(base, "__pydantic_fields__", None)
        if isinstance(fields, dict) and name in fields:
            return fields[name]
    return None


class Settings(BaseModel):
    """A frozen, validated group of settings; invalid values raise ``ValueError`` (pydantic's
    ValidationError) naming the field. A boolean is not taken for a number (``limit: true`` is not 1), nor in a
    list or mapping of numbers.

    A subclass gives an inherited field another default with :func:`inherited`; a field redeclared otherwise
    (its type, constraints or description changed) is refused as the class is made."""

    model_config = ConfigDict(frozen=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Runs as the class is made, before pydantic collects its fields from the class's attributes: each
        # `inherited(value)` becomes the field the class inherits with that default.
        super().__init_subclass__(**kwargs)
        for name, value in list(vars(cls).items()):
            if not isinstance(value, _Inherited):
                continue
            field = _inherited_field(cls, name)
            if field is None:
                raise TypeError(f"{cls.__name__}.{name}: inherited() of a field {cls.__name__} does not inherit")
            if field.default == value.default:
                raise TypeError(f"{cls.__name__}.{name}: {value.default!r} is already its default: one place each")
            setattr(cls, name, FieldInfo.merge_field_infos(field, default=value.default))

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for name in vars(cls).get("__annotations__", {}):
            field, before = cls.model_fields.get(name), _inherited_field(cls, name)
            if field is None or before is None:
                continue
            kept = (field.annotation, field.metadata, field.description, field.json_schema_extra)
            if kept != (before.annotation, before.metadata, before.description, before.json_schema_extra):
                raise TypeError(
                    f"{cls.__name__}.{name} redeclares an inherited field with another type, constraints or "
                    f"description: to give it another default, `{name}: TYPE = inherited(VALUE)`"
                )

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if _bool_as_number(value, annotation):
            raise ValueError("a boolean (true/false) where a number goes: give the number")
        return value

    def values_of(self, model: type[BaseModel]) -> dict[str, Any]:
        """This object's values of ``model``'s fields (a part of a composed model, e.g. the SFT settings
        of an Expert Iteration config)."""
        return {name: getattr(self, name) for name in model.model_fields if name in type(self).model_fields}


def _kinds(annotation: Any) -> set[Any]:
    """The types a field's annotation admits at its top level (through unions, Optional and Annotated)."""
    if get_origin(annotation) in (Union, UnionType, Annotated):
        args = get_args(annotation)[:1] if get_origin(annotation) is Annotated else get_args(annotation)
        return set().union(*map(_kinds, args))
    return {annotation}


def _bool_as_number(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is (or, in a list or a mapping's values, holds) a bool where ``annotation`` admits
    numbers (int, float) and no bool."""
    kinds = _kinds(annotation)
    if isinstance(value, bool):
        return bool(kinds & {int, float}) and bool not in kinds
    for kind in kinds:
        items = get_args(kind)
        if get_origin(kind) in (list, tuple, set) and isinstance(value, (list, tuple, set)) and items:
            return any(_bool_as_number(item, items[0]) for item in value)
        if get_origin(kind) is dict and isinstance(value, dict) and len(items) == 2:
            return any(_bool_as_number(item, items[1]) for item in value.values())
    return False


def describe(error: ValidationError) -> str:
    """A ValidationError in one line: each problem as ``field 'value': message`` (a check across fields:
    its message alone), joined by "; "."""
    problems = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        problems.append(
            f"{'.'.join(map(str, problem['loc']))} {problem.get('input')!r}: {message}" if problem["loc"] else message
        )
    return "; ".join(problems)


# ------------------------------------------------------------------------------------ the groups


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


# The engines' own sampling defaults (a5core.engines.SamplingSettings): the settings that pass a value straight
# to an engine take their default from here, so the two cannot disagree.
ENGINE_SAMPLING = SamplingSettings()


class SamplingFields(Settings):
    """How responses are sampled (the stop strings come with the prompt template)."""

    temperature: float = Field(
        ENGINE_SAMPLING.temperature, ge=0, allow_inf_nan=False, description="sampling temperature (0: greedy)"
    )
    max_tokens: int = Field(ENGINE_SAMPLING.max_tokens, ge=1, description="response cap")

    def sampling(self, stop: Sequence[str], **overrides: Any) -> SamplingSettings:
        """These settings as SamplingSettings, with the prompt template's ``stop`` strings (and ``n``, ``seed``
        and the like from ``overrides``); ``min_tokens`` where the settings have it, else 0."""
        return SamplingSettings(
            temperature=self.temperature,
            min_tokens=getattr(self, "min_tokens", 0),
            max_tokens=self.max_tokens,
            stop=tuple(stop),
            **overrides,
        )


class RolloutSamplingFields(SamplingFields):
    """Sampling for training rollouts, which may not stop before ``min_tokens``."""

    min_tokens: int = Field(4, ge=0, description="minimum response tokens (no stop before)")

    @model_validator(mode="after")
    def _min_within_max(self) -> "RolloutSamplingFields":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


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
        """The seed of step ``step``'s draws (its questions, its sampling): distinct for every (seed, step)
        pair with step < 1,000,003, so two runs with different seeds never share a step's draws."""
        return self.seed * 1_000_003 + step
