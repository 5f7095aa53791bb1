"""Settings: each loop setting has one default, written once, in a class the reader finds in its module; a
redeclared field keeps its type, constraints and description, and a restated default is refused. The models are
composed of groups, each setting taken and read by its own name."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from a5core.loops.expert_iteration import EIConfig
from a5core.loops.grpo import GRPOConfig
from a5core.loops.grpo.config import GRPOOptimizer
from a5core.loops.settings import OptimizerSettings
from a5core.loops.sft import SFTConfig
from a5core.runtime.settings import Settings, describe, group, inherited
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


def holder(model: type[Settings], name: str) -> type[Settings]:
    """The class, ``model`` or one of its groups, whose field setting ``name`` is."""
    while (field := model.leaf_groups[name]) is not None:
        model = model.group_types[field]
    return model


def classes_with_a_default(model: type[BaseModel], name: str) -> list[str]:
    """The classes of the MRO of the class holding setting ``name`` that declare it with a default (or restate
    its default)."""
    model = holder(model, name)
    return [
        cls.__qualname__
        for cls in model.__mro__
        if name in cls.__dict__.get("__annotations__", {}) and cls.model_fields[name].default is not PydanticUndefined
    ]


def classes_of(model: type[Settings]) -> set[type[Settings]]:
    """``model`` and its groups, theirs, and so on."""
    return {model}.union(*(classes_of(kind) for kind in model.group_types.values()))


@pytest.mark.parametrize("config", [SFTConfig, EIConfig, GRPOConfig])
def test_every_loop_setting_has_its_default_in_one_place(config):
    twice = {name: where for name in config.flat_fields() if len(where := classes_with_a_default(config, name)) != 1}
    assert not twice


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_each_settings_class_is_the_one_its_module_defines(model):
    """No class is made at run time: every class a settings model is built from is written in its module (a
    class made from another would repeat its name in the MRO, and not be the one the module's text shows)."""
    import sys

    for kind in classes_of(model):
        names = [cls.__qualname__ for cls in kind.__mro__]
        assert len(names) == len(set(names)), names
        for cls in kind.__mro__:
            if issubclass(cls, Settings) and cls is not Settings:
                assert getattr(sys.modules[cls.__module__], cls.__qualname__) is cls


@pytest.mark.parametrize("model", MODELS, ids=lambda model: model.__name__)
def test_settings_are_composed_of_groups_not_inherited_from_them(model):
    """Each class a loop's or a flow's settings are made of, and each class above it, has one Settings class
    above it at most: what a model is made of are its groups, fields a reader finds in its body."""
    for kind in classes_of(model):
        for cls in kind.__mro__:
            assert len([base for base in cls.__bases__ if issubclass(base, Settings)]) <= 1, (kind, cls)
    assert {"optimizer", "sampling", "speed"} <= set(GRPOConfig.group_types)
    assert {"grpo", "engine", "eval", "outputs"} <= set(GRPOParams.group_types)


def test_a_setting_is_given_and_read_by_its_own_name_wherever_its_group_is():
    params = GRPOParams(learning_rate=3e-6, max_tokens=64, output_dir="outputs/elsewhere", val_subset=8)
    assert params.grpo.optimizer.learning_rate == params.learning_rate == 3e-6
    assert (params.grpo.sampling.max_tokens, params.outputs.output_dir, params.eval.val_subset) == (
        64,
        "outputs/elsewhere",
        8,
    )
    assert params.explicit() == {"learning_rate", "max_tokens", "output_dir", "val_subset"}
    assert params.flat()["learning_rate"] == 3e-6 and len(params.flat()) == len(GRPOParams.flat_fields())
    again = params.replace(seed=4)
    assert (again.seed, again.learning_rate, again.explicit()) == (4, 3e-6, params.explicit() | {"seed"})
    # A group given whole, as a mapping or an object, is the same model.
    assert GRPOParams(grpo={"learning_rate": 3e-6, "max_tokens": 64}, output_dir="outputs/elsewhere", val_subset=8) == (
        GRPOParams(grpo=GRPOConfig(learning_rate=3e-6, max_tokens=64), output_dir="outputs/elsewhere", val_subset=8)
    )
    with pytest.raises(AttributeError):
        params.learnig_rate  # noqa: B018


def test_an_invalid_setting_is_named_by_its_own_name():
    with pytest.raises(ValidationError) as error:
        GRPOParams(learning_rate=-1.0)
    assert describe(error.value).startswith("learning_rate -1.0: Input should be greater than 0")


def test_two_settings_of_one_name_in_a_model_are_refused():
    with pytest.raises(TypeError, match="Twice: two settings named 'learning_rate'"):

        class Twice(Settings):
            grpo: GRPOConfig = group(GRPOConfig, "one")
            sft: SFTConfig = group(SFTConfig, "two")


def test_the_loops_learning_rates_are_their_own():
    assert (SFTConfig().learning_rate, EIConfig().learning_rate, GRPOConfig().learning_rate) == (2e-5, 1e-5, 1e-5)
    assert OptimizerSettings.model_fields["learning_rate"].is_required()


def test_an_inherited_field_with_another_default_keeps_its_constraints_and_description():
    class Tuned(GRPOOptimizer):
        learning_rate: float = inherited(3e-5)

    class TunedGRPO(GRPOConfig):  # a group field narrowed to a subclass of its group: other defaults
        optimizer: Tuned = group(Tuned, GRPOConfig.model_fields["optimizer"].description)

    assert Tuned().learning_rate == TunedGRPO().learning_rate == 3e-5
    declared = OptimizerSettings.model_fields["learning_rate"]
    assert Tuned.model_fields["learning_rate"].description == declared.description
    with pytest.raises(ValidationError, match="learning_rate"):
        TunedGRPO(learning_rate=-1.0)  # gt=0, the group's constraint


def test_a_default_restated_with_its_own_value_is_refused():
    with pytest.raises(TypeError, match="Restated.learning_rate: 1e-05 is already its default: one place each"):

        class Restated(GRPOOptimizer):
            learning_rate: float = inherited(1e-5)


def test_a_redeclared_field_that_would_drop_its_constraints_is_refused():
    """A plain ``learning_rate: float = 3e-5`` would make a new field, without the group's gt=0 and description;
    a group field redeclared with another class than a subclass of its group would change what it holds."""
    with pytest.raises(TypeError, match="Plain.learning_rate redeclares an inherited field"):

        class Plain(GRPOOptimizer):
            learning_rate: float = 3e-5

    with pytest.raises(TypeError, match="Swapped.optimizer redeclares an inherited field"):

        class Swapped(GRPOConfig):
            optimizer: SFTConfig = group(SFTConfig, GRPOConfig.model_fields["optimizer"].description)


def test_inherited_names_a_field_the_class_inherits():
    with pytest.raises(TypeError, match="Typo.learnig_rate: inherited"):

        class Typo(GRPOOptimizer):
            learnig_rate: float = inherited(3e-5)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_library_reads_each_setting_where_it_is_declared(tokenizer, monkeypatch):
    """Inside a5core a setting is read one way, through its group (``config.optimizer.learning_rate``); reading a
    group's setting by its own name is for users and flows. One step of each loop reads none that way."""
    import sys

    from tiny_loops import PROBLEMS, TEMPLATE, RecordingEngine, make_model, parity_reward, short_examples, small_config

    from a5core.loops.expert_iteration import expert_iteration
    from a5core.loops.grpo import grpo
    from a5core.loops.sft import train_sft

    forwarded, forward = set(), Settings.__getattr__

    def recording(self, name):
        caller = sys._getframe(1).f_code.co_filename
        if "/a5core/" in caller and (name in type(self).leaf_groups or name in type(self).member_groups):
            forwarded.add(f"{name} ({caller.rsplit('/a5core/', 1)[1]})")
        return forward(self, name)

    monkeypatch.setattr(Settings, "__getattr__", recording)
    model = make_model(tokenizer)
    train_sft(model, tokenizer, short_examples(4), SFTConfig(batch_size=4, microbatch_size=2, epochs=1, eval_every=1))
    engine = RecordingEngine(model, tokenizer)
    grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(kl_coef=0.1, tis_cap=2.0))
    ei = EIConfig(n_ei_steps=1, questions_per_step=2, rollouts_per_question=2, max_tokens=8, batch_size=2, epochs=1)
    expert_iteration(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, ei, evaluate=lambda m, s: {})
    assert not forwarded
