"""A flow started as a command (``python -m flows.grpo``) runs as module ``__main__``: its runs record the module
by the name it is imported by, and flows.reproduce resolves records that name ``__main__`` where it can."""

import sys
import types
from importlib.machinery import ModuleSpec

import pytest


def main_module(monkeypatch, spec=None, file=None):
    """``sys.modules["__main__"]`` as a command leaves it: ``__spec__`` set by ``python -m``, ``__file__`` by a
    script run by its path."""
    main = types.ModuleType("__main__")
    main.__spec__ = spec
    if file is not None:
        main.__file__ = str(file)
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_a_flow_module_run_with_python_m_is_named_by_its_module(monkeypatch):
    from tasks.prefect_run import importable_module

    main_module(monkeypatch, spec=ModuleSpec("flows.grpo", None))
    assert importable_module("__main__") == "flows.grpo"
    assert importable_module("flows.sft_experiment") == "flows.sft_experiment"  # an imported module: itself


def test_a_script_run_by_its_path_is_named_by_that_path_inside_the_project(monkeypatch, tmp_path):
    from tasks.git_checkout import PROJECT_ROOT
    from tasks.prefect_run import importable_module

    main_module(monkeypatch, file=PROJECT_ROOT / "flows" / "grpo.py")
    assert importable_module("__main__") == "flows.grpo"
    main_module(monkeypatch, file=tmp_path / "my_flow.py")  # outside the project: nothing to name it by
    assert importable_module("__main__") == "__main__"
    main_module(monkeypatch)  # an interactive session
    assert importable_module("__main__") == "__main__"


def test_reproduce_finds_the_flow_module_of_a_record_naming_main():
    from flows.grpo import grpo_flow, grpo_lr_sweep
    from flows.params import GRPOParams
    from flows.reproduce import flow_of

    assert flow_of({"flow": {"name": "grpo", "entrypoint": "__main__:grpo_flow"}}, False) == (grpo_flow, GRPOParams)
    assert (
        flow_of({"flow": {"name": "grpo_lr_sweep", "entrypoint": "__main__:grpo_lr_sweep"}}, False)[0] is grpo_lr_sweep
    )
    assert flow_of({"flow": {"name": "grpo", "entrypoint": "flows.grpo:grpo_flow"}}, False)[0] is grpo_flow


def test_a_child_run_is_re_run_alone_by_the_flow_of_its_parameters():
    """A child of an ablation or a sweep (its record names the flow that fanned it out, or, from Ray, the fan-out's
    sub-flow) is one run of its flow; a fan-out record without a parameter model says why it cannot be re-run."""
    from flows.expert_iteration import expert_iteration_flow
    from flows.grpo import grpo_flow
    from flows.reproduce import flow_of

    fanned = {"name": "children_on_ray", "entrypoint": "flows.fanout:fan_out"}
    assert flow_of({"flow": fanned, "params_model": "flows.params.GRPOParams"}, True)[0] is grpo_flow
    assert flow_of({"flow": fanned, "params_model": "flows.params.EIParams"}, True)[0] is expert_iteration_flow
    ablation = {"name": "grpo_lr_sweep", "entrypoint": "flows.grpo:grpo_lr_sweep"}
    assert flow_of({"flow": ablation, "params_model": "flows.params.GRPOParams"}, True)[0] is grpo_flow
    with pytest.raises(ValueError, match="a child of a sweep run on Ray, and its record names no parameter model"):
        flow_of({"flow": fanned}, True)


@pytest.mark.parametrize(
    "flow",
    [
        {"name": "my_flow", "entrypoint": "__main__:my_flow"},  # a script's own flow
        {"name": "other", "entrypoint": "__main__:grpo_flow"},  # a function of that name, but another flow
    ],
)
def test_a_record_naming_main_that_no_flow_module_has_says_what_to_do(flow):
    from flows.reproduce import flow_of

    with pytest.raises(ValueError) as raised:
        flow_of({"flow": flow}, False)
    message = str(raised.value)
    assert f"the run was made by flow {flow['entrypoint']}" in message
    assert f"no module of the flows package here has a flow {flow['entrypoint'][9:]} named {flow['name']}" in message
    assert "python -m flows.<module>" in message
