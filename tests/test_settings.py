"""Settings: each loop setting has one default, written once; a restated default is refused."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from a5core.expert_iteration import EIConfig
from a5core.grpo import GRPOConfig
from a5core.settings import OptimizerSettings, override_defaults
from a5core.sft import SFTConfig


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


def test_the_loops_learning_rates_are_their_own():
    assert (SFTConfig().learning_rate, EIConfig().learning_rate, GRPOConfig().learning_rate) == (2e-5, 1e-5, 1e-5)
    assert OptimizerSettings.model_fields["learning_rate"].is_required()


def test_a_default_restated_with_its_own_value_is_refused():
    with pytest.raises(TypeError, match="already has these defaults for learning_rate: one place each"):
        override_defaults(GRPOConfig, learning_rate=1e-5)
    assert override_defaults(GRPOConfig, learning_rate=3e-5)().learning_rate == 3e-5
