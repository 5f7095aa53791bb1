"""The shipped params.yaml: every section of every profile builds its flow's parameters (a typo in a
profile, or a setting a flow no longer has, would otherwise surface only when someone runs that profile,
e.g. on a rented GPU), and its base sections restate no default unchecked: each value is its flow's code
default but on the lines marked `# not the default`."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from flows.arguments import parse_params
from flows.config_file import BASE_PROFILE, read_config, section_settings
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

PARAMS = Path(__file__).resolve().parents[2] / "params.yaml"
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


def test_a_settings_file_takes_the_section_of_every_flow():
    """The sections flows/config_file.py lets a settings file hold are those its flows' command lines read (each
    flow's ``flow_main(..., SECTION, ...)``, and sft_data's and prepare_data's own): a new flow's section, left out
    of the list, would be refused as a misspelling."""
    from flows.config_file import FLOW_SECTIONS as TAKEN

    flows = PARAMS.parent / "flows"
    read = {
        match
        for path in flows.glob("*.py")
        for match in re.findall(r"flow_main\(\s*\w+,\s*\w+,\s*\"(\w+)\"", path.read_text())
    }
    assert read and set(FLOW_SECTIONS) <= read, read
    assert set(TAKEN) == read | {"sft_data", "data"}, sorted(set(TAKEN) ^ (read | {"sft_data", "data"}))


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
        from flows.config_file import section_settings

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
    assert set(values) == set(models[section].flat_fields()) - PLACEMENT_FIELDS


def test_the_header_names_every_setting_it_leaves_out_but_where_outputs_go():
    """The header's list of where-and-how-fast settings left out of the sections is PLACEMENT_FIELDS less the
    output and tracking fields (named as a group): a new such setting must be named there."""
    from flows.params import PLACEMENT_FIELDS, Outputs

    lines = PARAMS.read_text().splitlines()
    header = " ".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    named = PLACEMENT_FIELDS - set(Outputs.model_fields) - {"log_to_mlflow"}
    assert {f for f in named if f not in header and not (f.startswith("ray_") and "ray_*" in header)} == set()


@pytest.mark.parametrize("section", ["sft_experiment", "expert_iteration", "grpo", "leaderboard"])
def test_the_gpu_small_experiments_pin_their_micro_batch_budget(section, monkeypatch):
    """The experiment profile's runs are a function of start weights, settings, seed and code: under ``auto`` the
    budget follows the memory free when a run starts (other runs on the GPU), and runs cut into other
    micro-batches end apart."""
    monkeypatch.chdir(PARAMS.parent)
    params = parse_params(FLOW_SECTIONS[section], section, ["--config", str(PARAMS), "--profile", "gpu-small"])
    assert isinstance(params.max_tokens_per_microbatch, int)


# The mark of a base-section line whose value is not its flow's code default, on purpose (the comment says why).
NOT_THE_DEFAULT = "# not the default"


def marked_settings(text: str) -> set[str]:
    """The dotted keys (``section.key``, ``sft_data.distill.key``) of the lines of a YAML ``text`` of block
    mappings that carry :data:`NOT_THE_DEFAULT`."""
    path: list[tuple[int, str]] = []  # the keys above the line, with their indentation
    marked = set()
    for line in text.splitlines():
        key = re.match(r"^( *)([A-Za-z_][\w-]*):", line)
        if key is None:
            continue
        indent = len(key.group(1))
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, key.group(2)))
        if NOT_THE_DEFAULT in line:
            marked.add(".".join(name for _, name in path))
    return marked


def settings_not_at_their_default() -> dict[str, tuple[Any, Any]]:
    """Each base-section setting of params.yaml whose value (as its flow reads it) is not its flow's code
    default: ``section.key`` → (params.yaml's value, the default)."""
    from flows.params import DistillParams

    base = {section: section_settings(DOCUMENT, section, BASE_PROFILE, PARAMS) for section in FLOW_SECTIONS}
    built = {section: model(**base[section]) for section, model in FLOW_SECTIONS.items()}
    sft_data = SftDataParams(**section_settings(DOCUMENT, "sft_data", BASE_PROFILE, PARAMS))
    base["sft_data"], built["sft_data"] = {k: v for k, v in DOCUMENT["sft_data"].items() if k != "distill"}, sft_data
    base["sft_data.distill"], built["sft_data.distill"] = DOCUMENT["sft_data"]["distill"], sft_data.distill
    models = {**FLOW_SECTIONS, "sft_data": SftDataParams, "sft_data.distill": DistillParams}
    differ = {}
    for section, values in base.items():
        for key in values:
            value = getattr(built[section], key)
            default = models[section].flat_fields()[key].get_default(call_default_factory=True)
            if value != default or isinstance(value, bool) != isinstance(default, bool):  # 1 == True
                differ[f"{section}.{key}"] = (value, default)
    return differ


def test_each_base_setting_is_its_code_default_but_those_marked_not_the_default():
    """A default changed in the code (or a value in params.yaml) without the other fails here: change both, or
    mark the line ``# not the default: WHY`` where the difference is meant."""
    differ = settings_not_at_their_default()
    marked = marked_settings(PARAMS.read_text())
    assert not {key for key in marked if key.startswith("profiles.")}, "a profile's values are all its own"
    unmarked = [f"{key}: params.yaml {v!r}, code default {d!r}" for key, (v, d) in differ.items() if key not in marked]
    assert not unmarked, "change one, or mark the line `# not the default: WHY`:\n" + "\n".join(unmarked)
    assert marked - set(differ) == set(), "marked `# not the default` but at its default: remove the mark"


def test_the_check_reads_the_marks_where_they_stand():
    text = "a:\n  x: 1  # not the default: why\n  y:\n    z: 2 # not the default\n    w: 3\nb:\n  x: 4\n"
    assert marked_settings(text) == {"a.x", "a.y.z"}
