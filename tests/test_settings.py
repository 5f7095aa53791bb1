"""Settings: each loop setting has one default, written once, in a class the reader finds in its module; a
redeclared field keeps its type, constraints and description, and a restated default is refused."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from a5core.loops.expert_iteration import EIConfig
from a5core.loops.grpo import GRPOConfig
from a5core.loops.sft import SFTConfig
from a5core.runtime.settings import OptimizerSettings, Settings, inherited
from flows.compare import CompareParams
from flows.params import (
    BaselineEvalParams,
    DifficultyParams,
    DistillParams,
    EIParams,
    GRPOParams,
    LeaderboardParams,
    SFTExperimentParams,
)
from flows.report import ReportParams

MODELS = [
    SFTConfig,
    EIConfig,
    GRPOConfig,
    BaselineEvalParams,
    DifficultyParams,
    DistillParams,
    SFTExperimentParams,
    EIParams,
    GRPOParams,
    LeaderboardParams,
    ReportParams,
    CompareParams,
]


def classes_with_a_default(model: type[BaseModel], name: str) -> list[str]:
    """The classes of ``model``'s MRO that declare field ``name`` with a default (or restate its default)."""
    return [
        cls.__qualname__
        for cls in model.__mro__
        if name in cls.__dict__.get("__annotations__", {}) and cls.model_fields[name].default is not PydanticUndefined
    ]


@pytest.mark.parametrize("config", [SFTConfig, EIConfig, GRPOConfig])
def test_every_loop_setting_has_its_default_in_one_place(config):
    twice = {name: where for name in config.model_fields if len(where := classes_with_a_default(config, name)) != 1}
    assert not twice


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_each_settings_class_is_the_one_its_module_defines(model):
    """No class is made at run time: every class a settings model is built from is written in its module (a
    class made from another would repeat its name in the MRO, and not be the one the module's text shows)."""
    import sys

    names = [cls.__qualname__ for cls in model.__mro__]
    assert len(names) == len(set(names)), names
    for cls in model.__mro__:
        if issubclass(cls, Settings) and cls is not Settings:
            assert getattr(sys.modules[cls.__module__], cls.__qualname__) is cls


def test_the_loops_learning_rates_are_their_own():
    assert (SFTConfig().learning_rate, EIConfig().learning_rate, GRPOConfig().learning_rate) == (2e-5, 1e-5, 1e-5)
    assert OptimizerSettings.model_fields["learning_rate"].is_required()


def test_an_inherited_field_with_another_default_keeps_its_constraints_and_description():
    class Tuned(GRPOConfig):
        learning_rate: float = inherited(3e-5)

    assert Tuned().learning_rate == 3e-5
    group = OptimizerSettings.model_fields["learning_rate"]
    assert Tuned.model_fields["learning_rate"].description == group.description
    with pytest.raises(ValidationError, match="learning_rate"):
        Tuned(learning_rate=-1.0)  # gt=0, the group's constraint


def test_a_default_restated_with_its_own_value_is_refused():
    with pytest.raises(TypeError, match="Restated.learning_rate: 1e-05 is already its default: one place each"):

        class Restated(GRPOConfig):
            learning_rate: float = inherited(1e-5)


def test_a_redeclared_field_that_would_drop_its_constraints_is_refused():
    """A plain ``learning_rate: float = 3e-5`` would make a new field, without the group's gt=0 and description."""
    with pytest.raises(TypeError, match="Plain.learning_rate redeclares an inherited field"):

        class Plain(GRPOConfig):
            learning_rate: float = 3e-5


def test_inherited_names_a_field_the_class_inherits():
    with pytest.raises(TypeError, match="Typo.learnig_rate: inherited"):

        class Typo(GRPOConfig):
            learnig_rate: float = inherited(3e-5)
