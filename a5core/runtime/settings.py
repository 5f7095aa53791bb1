"""Settings: how every settings model of a5 is made: typed, validated, frozen, each setting described once.

Each loop takes one frozen settings model (:class:`a5core.loops.sft.SFTConfig`,
:class:`a5core.loops.expert_iteration.EIConfig`, :class:`a5core.loops.grpo.GRPOConfig`) made of its own
settings and groups as fields (``config.optimizer``, ``config.sampling``, ``config.speed`` ...: the groups the
loops share are in :mod:`a5core.loops.settings`; the runtime's own, how a step runs on the hardware, is
:class:`SpeedSettings` here), so that a setting two loops share (the learning rate, the sampling temperature)
has one declaration: its type, constraints and description. The flows' parameter models
(``flows/params.py``) hold a loop's config as a group beside the pipeline's own (engine, data, evaluation,
outputs), so the command lines, the Prefect UI's forms and ``params.yaml``'s validation all derive from these
declarations.

Users name a setting by its own name, wherever its group sits: ``learning_rate``, not
``grpo.optimizer.learning_rate`` (:meth:`Settings.flat`, :meth:`Settings.flat_fields`). A model is built from
such names (each is routed to its group) and answers to them (``config.learning_rate`` is
``config.optimizer.learning_rate``); a name in two groups of one model is refused as the class is made. The
library itself reads a setting one way, where it is declared: ``config.loss_type`` for a model's own,
``config.optimizer.learning_rate`` for a group's, so the reader sees where to look
(``tests/a5core/runtime/test_settings_reads.py`` holds the loops to it).

Each setting has one default. A group gives it where every loop agrees (the sampling temperature); where the
loops differ (the learning rate: 2e-5 for SFT, 1e-5 for EI and GRPO), the group gives none and each loop's
group redeclares the field with its own, ``learning_rate: float = inherited(2e-5)`` (:func:`inherited`). A
flow with a purpose of its own (the leaderboard's tuned recipe) may give a loop's setting another default the
same way, once; a restatement of the value it replaces is refused.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

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

    A field whose type is a Settings class is a group (:func:`group`): the model takes and reads the group's
    settings by their own names (see the module's docstring). A subclass gives an inherited field another
    default with :func:`inherited`, or a group field a subclass of its group; a field redeclared otherwise (its
    type, constraints or description changed) is refused as the class is made."""

    # Unknown keys are refused, never dropped: a misspelt setting (``limt``) or one given in another group than
    # its own would otherwise run with the default, silently (:meth:`_settings_to_their_groups` names it).
    model_config = ConfigDict(
        frozen=True, extra="forbid", json_schema_extra=lambda schema, cls: cls._keys_taken(schema)
    )

    # Set as each class is made: its group fields' types; for each setting by its own name the group field
    # holding it (None: a field of the class itself); for each group, property or method of a group, that group.
    group_types: ClassVar[dict[str, type["Settings"]]] = {}
    leaf_groups: ClassVar[dict[str, str | None]] = {}
    member_groups: ClassVar[dict[str, str]] = {}

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
            if field is None or before is None or _narrows_group(field, before):
                continue
            kept = (field.annotation, field.metadata, field.description, field.json_schema_extra)
            if kept != (before.annotation, before.metadata, before.description, before.json_schema_extra):
                raise TypeError(
                    f"{cls.__name__}.{name} redeclares an inherited field with another type, constraints or "
                    f"description: to give it another default, `{name}: TYPE = inherited(VALUE)`"
                )
        cls.group_types = {name: f.annotation for name, f in cls.model_fields.items() if _is_group(f)}
        cls.leaf_groups = {}
        for name in cls.model_fields:
            kind = cls.group_types.get(name)
            for leaf in kind.flat_fields() if kind else (name,):
                if leaf in cls.leaf_groups or leaf in cls.group_types:
                    raise TypeError(f"{cls.__name__}: two settings named {leaf!r} (a name must say which)")
                cls.leaf_groups[leaf] = name if kind else None
        cls.member_groups = {}
        for name, kind in cls.group_types.items():
            for member in (*kind.group_types, *kind.member_groups, *_members(kind)):
                if member not in cls.member_groups and not hasattr(cls, member):
                    cls.member_groups[member] = name
        GROUP_NAMES.update(cls.group_types)

    @classmethod
    def _keys_taken(cls, schema: dict[str, Any]) -> None:
        """The JSON schema (what the Prefect API validates a run's parameters against) refuses every key the
        model refuses: a model with groups takes its fields and its settings by their own names."""
        if cls.group_types:
            schema.pop("additionalProperties", None)
            schema["propertyNames"] = {"enum": sorted({*cls.model_fields, *cls.leaf_groups})}

    @model_validator(mode="before")
    @classmethod
    def _settings_to_their_groups(cls, data: Any) -> Any:
        # Each setting given by its own name goes to the group that holds it; a group may also be given whole
        # (a mapping, or a Settings object: what it was given). A key the model has no setting for is refused.
        if not isinstance(data, dict):
            return data
        cls._refuse_unknown(data)
        if not cls.group_types:
            return data
        routed: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for key, value in data.items():
            group = key if key in cls.group_types else cls.leaf_groups.get(key)
            if group is None:
                routed[key] = value
            elif group != key:
                parts.setdefault(group, {})[key] = value
            elif isinstance(value, (dict, Settings)):
                parts.setdefault(group, {}).update(value.explicit_values() if isinstance(value, Settings) else value)
            else:
                routed[key] = value  # not a group's settings: pydantic says so
        return {**routed, **parts}

    @classmethod
    def _refuse_unknown(cls, data: dict[Any, Any]) -> None:
        """ValueError naming each key of ``data`` that is no setting of this model (with the nearest name), and,
        in a mapping given for a field of settings (a group), each key that is none of its settings, a setting of
        another group with that group."""
        problems = [
            unknown_setting(key, cls) for key in data if key not in cls.model_fields and key not in cls.leaf_groups
        ]
        for name, field in cls.model_fields.items():
            kind, given = field.annotation, data.get(name)
            if not (isinstance(given, dict) and isinstance(kind, type) and issubclass(kind, Settings)):
                continue
            for key in given:
                if key in kind.model_fields or key in kind.leaf_groups:
                    continue
                if key in cls.leaf_groups:  # given in the wrong group
                    holder = cls.leaf_groups[key] or "the top level"
                    problems.append(f"{name}.{key}: {key} is a setting of {holder}, not of {name}")
                else:
                    problems.append(f"{name}.{key}: {unknown_setting(key, kind)}")
        if problems:
            raise ValueError("; ".join(problems))

    def __getattr__(self, name: str) -> Any:
        # A setting of a group, or a group's property or method, read by its own name (only called where
        # normal lookup found nothing).
        group = type(self).leaf_groups.get(name) or type(self).member_groups.get(name)
        if group is None:
            return super().__getattr__(name)  # type: ignore[misc]
        return getattr(getattr(self, group), name)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if _bool_as_number(value, annotation):
            raise ValueError("a boolean (true/false) where a number goes: give the number")
        return value

    @classmethod
    def flat_fields(cls) -> dict[str, FieldInfo]:
        """Every setting of the model by its own name, its groups' included, in declaration order."""
        fields: dict[str, FieldInfo] = {}
        for name, field in cls.model_fields.items():
            kind = cls.group_types.get(name)
            fields.update(kind.flat_fields() if kind else {name: field})
        return fields

    @classmethod
    def declaring_class(cls, name: str) -> type["Settings"]:
        """The class whose body gives setting ``name`` its default (in the group that holds it)."""
        group = cls.leaf_groups[name]
        if group is not None:
            return cls.group_types[group].declaring_class(name)
        return next(c for c in cls.__mro__ if name in vars(c).get("__annotations__", {}))

    def flat(self, mode: Literal["python", "json"] = "python") -> dict[str, Any]:
        """Every setting's value by its own name (``mode`` json: JSON-able values)."""
        return type(self)._flatten(self.model_dump(mode=mode))

    @classmethod
    def _flatten(cls, dumped: dict[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, value in dumped.items():
            kind = cls.group_types.get(name)
            values.update(kind._flatten(value) if kind else {name: value})
        return values

    def explicit(self) -> set[str]:
        """The settings given rather than defaulted, by their own names."""
        given: set[str] = set()
        for name in self.model_fields_set:
            given |= getattr(self, name).explicit() if name in type(self).group_types else {name}
        return given

    def explicit_values(self) -> dict[str, Any]:
        """The values of :meth:`explicit`'s settings."""
        given = self.explicit()
        return {name: value for name, value in self.flat().items() if name in given}

    def replace(self, **changes: Any) -> Any:
        """This model with ``changes`` (settings by their own names), validated again."""
        return type(self)(**{**self.explicit_values(), **changes})

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Any:
        """pydantic's copy; ``update`` only of the model's own fields (a setting of a group by its own name would
        be stored beside the group, not in it: :meth:`replace` takes those)."""
        stray = sorted(set(update or ()) - set(type(self).model_fields))
        if stray:
            raise TypeError(f"model_copy(update=...) of {', '.join(stray)}: settings of a group, use replace()")
        return super().model_copy(update=update, deep=deep)

    def values_of(self, model: type["Settings"]) -> dict[str, Any]:
        """This object's values of ``model``'s settings (a part of a composed model, e.g. the SFT settings
        of an Expert Iteration config)."""
        wanted = model.flat_fields()
        return {name: value for name, value in self.flat().items() if name in wanted}


class _Reads:
    """The mark of a setting that names what a run reads: see :data:`READS`."""

    def __repr__(self) -> str:
        return "READS"


# In a setting's type, ``Annotated[str, READS]``: the setting names a file (a model: a folder, or a hub id) the run
# reads. These are a run's inputs, and the only settings whose paths a record hashes (tasks.provenance): a setting
# naming anything else (an experiment called /usr) is never read as a path.
READS = _Reads()


def read_settings(model: type[Settings]) -> list[str]:
    """The settings of ``model`` (by their own names) that name what a run reads (:data:`READS`)."""
    return [name for name, field in model.flat_fields().items() if READS in field.metadata]


# The names of every group field of every Settings class: what an error's location drops to name a setting.
GROUP_NAMES: set[str] = set()
_Group = TypeVar("_Group", bound=Settings)


def group(kind: type[_Group], description: str) -> _Group:
    """In a class body, ``name: KIND = group(KIND, "what")``: a group of settings, ``KIND()`` by default, whose
    settings the model takes and reads by their own names. (A Settings field declared otherwise is a setting
    of its own, given as a mapping: e.g. ``sft_data``'s ``distill``.)"""
    return Field(default_factory=kind, description=description)


def unknown_setting(key: Any, model: type[Settings]) -> str:
    """``key`` named as no setting of ``model``, with the setting of the nearest name where one is close."""
    close = difflib.get_close_matches(str(key), list(model.flat_fields()), n=1)
    return f"unknown setting {str(key)[:80]!r}" + (f" (did you mean {close[0]}?)" if close else "")


def _is_group(field: FieldInfo) -> bool:
    kind = field.annotation
    return isinstance(kind, type) and issubclass(kind, Settings) and field.default_factory is kind


def _members(kind: type[Settings]) -> list[str]:
    """The public properties and methods ``kind`` has beyond every Settings model's."""
    return [name for name in dir(kind) if not name.startswith("_") and not hasattr(Settings, name)]


def _narrows_group(field: FieldInfo, before: FieldInfo) -> bool:
    """Whether ``field`` redeclares the group field ``before`` with a subclass of its group (other defaults)."""
    return (
        _is_group(field)
        and _is_group(before)
        and issubclass(field.annotation, before.annotation)
        and field.description == before.description
    )


def setting_location(loc: Sequence[Any]) -> tuple[Any, ...]:
    """A pydantic error's location less the groups it passes through: ``("learning_rate",)`` for
    ``("grpo", "optimizer", "learning_rate")``; ``()`` for a check of a whole group."""
    return tuple(part for part in loc if part not in GROUP_NAMES)


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
        message, loc = problem["msg"].removeprefix("Value error, "), setting_location(problem["loc"])
        where = ".".join(map(str, loc))
        named = not loc or message.startswith(f"{where} ")  # a check that names the setting itself
        problems.append(message if named else f"{where} {problem.get('input')!r}: {message}")
    return "; ".join(problems)


# ------------------------------------------------------------------------------------ the runtime's group


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


# The largest seed: numpy's generators take seeds below 2**32, and a step's seed (seed × 1,000,003 + step) stays
# within what torch's and the engines' generators take. A larger one failed minutes into a run, without naming it.
MAX_SEED = 2**32 - 1
