"""The shipped params.yaml: every section of every profile builds its flow's parameters (a typo in a
profile, or a setting a flow no longer has, would otherwise surface only when someone runs that profile,
e.g. on a rented GPU)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from flows.cli import parse_params, read_config
from flows.params import (
    BaselineEvalParams,
    DifficultyParams,
    EIParams,
    GRPOParams,
    LeaderboardParams,
    SFTExperimentParams,
)
from flows.report import ReportParams
from flows.sft_data import SftDataParams

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
DOCUMENT = read_config(PARAMS)
FLOW_SECTIONS = {
    "baseline_eval": BaselineEvalParams,
    "sft_experiment": SFTExperimentParams,
    "expert_iteration": EIParams,
    "difficulty": DifficultyParams,
    "grpo": GRPOParams,
    "leaderboard": LeaderboardParams,
    "report": ReportParams,
}


def test_every_section_of_params_yaml_is_a_known_one():
    known = {"data", "profile", "profiles", "sft_data", *FLOW_SECTIONS}
    assert set(DOCUMENT) <= known
    for name, profile in DOCUMENT["profiles"].items():
        assert set(profile) <= known, name


@pytest.mark.parametrize("profile", sorted(DOCUMENT["profiles"]))
def test_every_profile_builds_every_flows_parameters(profile, monkeypatch):
    monkeypatch.chdir(PARAMS.parent)
    for section, model in FLOW_SECTIONS.items():
        params = parse_params(model, section, ["--config", str(PARAMS), "--profile", profile])
        overrides = DOCUMENT["profiles"][profile].get(section, {})
        for key, value in overrides.items():
            if not isinstance(value, dict):
                assert getattr(params, key) == value or str(getattr(params, key)) == str(value), (profile, section, key)
    sft_data = DOCUMENT["profiles"][profile].get("sft_data")
    if sft_data is not None:
        from flows.cli import section_settings

        SftDataParams(**section_settings(DOCUMENT, "sft_data", profile, PARAMS))


@pytest.mark.parametrize("section", [*FLOW_SECTIONS, "sft_data", "sft_data.distill"])
def test_each_section_lists_every_setting_its_flow_computes_with(section):
    """params.yaml's promise (its header): a section holds every field of its flow but where outputs go, where
    engines run and how fast a step runs (flows.params.PLACEMENT_FIELDS)."""
    from flows.params import PLACEMENT_FIELDS, DistillParams

    models = {**FLOW_SECTIONS, "sft_data": SftDataParams, "sft_data.distill": DistillParams}
    values = DOCUMENT
    for key in section.split("."):
        values = values[key]
    assert set(values) == set(models[section].model_fields) - PLACEMENT_FIELDS


def test_the_header_names_every_setting_it_leaves_out_but_where_outputs_go():
    """The header's list of where-and-how-fast settings left out of the sections is PLACEMENT_FIELDS less the
    output and tracking fields (named as a group): a new such setting must be named there."""
    from flows.params import PLACEMENT_FIELDS, MLflowLogging, Outputs

    lines = PARAMS.read_text().splitlines()
    header = " ".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    named = PLACEMENT_FIELDS - set(Outputs.model_fields) - set(MLflowLogging.model_fields)
    assert {f for f in named if f not in header and not (f.startswith("ray_") and "ray_*" in header)} == set()


@pytest.mark.parametrize("section", ["sft_experiment", "expert_iteration", "grpo", "leaderboard"])
def test_the_gpu_small_experiments_pin_their_micro_batch_budget(section, monkeypatch):
    """The experiment profile's runs are a function of start weights, settings, seed and code: under ``auto`` the
    budget follows the memory free when a run starts (other runs on the GPU), and runs cut into other
    micro-batches end apart."""
    monkeypatch.chdir(PARAMS.parent)
    params = parse_params(FLOW_SECTIONS[section], section, ["--config", str(PARAMS), "--profile", "gpu-small"])
    assert isinstance(params.max_tokens_per_microbatch, int)
