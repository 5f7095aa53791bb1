"""``--show-config``: a flow's command prints the settings it would run with, as YAML, each followed by where
its value came from (a default and the class declaring it, the file's section, a profile, a flag, an
ablation), and exits 0 without running anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a5core.loops.grpo import GRPOConfig
from flows.arguments import parse_params
from flows.params import GRPOParams

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = """
profile: small
grpo:
  learning_rate: 2.0e-5
  seed: 1
profiles:
  small:
    grpo:
      n_grpo_steps: 3
"""


def show(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, tuple[str, str]]]:
    """The output of ``grpo``'s command with ``argv --show-config`` (which must exit 0), and its settings lines:
    name → (value as printed, where it came from)."""
    with pytest.raises(SystemExit) as exit_:
        parse_params(GRPOParams, "grpo", [*argv, "--show-config"])
    assert exit_.value.code == 0
    output = capsys.readouterr().out
    lines = {}
    for line in output.splitlines():
        if line.startswith("  ") and "  # " in line:
            setting, source = line.rsplit("  # ", 1)
            name, value = setting.strip().split(": ", 1)
            lines[name] = (value, source)
    return output, lines


def test_each_value_is_labelled_with_where_it_came_from(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(SETTINGS)
    output, lines = show(["--config", "params.yaml", "--seed", "7"], capsys)
    assert lines["advantage_eps"] == ("1.0e-06", f"default ({GRPOConfig.__module__}.GRPOConfig)")
    assert lines["val_subset"] == ("1024", "default (flows.params.GRPOValidation)")  # the flow's own default
    assert lines["learning_rate"] == ("2.0e-05", "params.yaml grpo")
    assert lines["n_grpo_steps"] == ("3", "profile small")
    assert lines["seed"] == ("7", "--seed")  # the flag over the file's 1
    # The printout is the settings a run takes, as YAML: the section, value for value.
    resolved = parse_params(GRPOParams, "grpo", ["--config", "params.yaml", "--seed", "7"])
    assert yaml.safe_load(output) == {"grpo": resolved.flat(mode="json")}


def test_an_ablation_shows_what_each_child_sets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    output, lines = show(["--ablation", "grpo_kl_ablation", "--ablation-only", "[kl_0, kl_0.01]"], capsys)
    assert lines["ablation"] == ("grpo_kl_ablation", "--ablation")
    shown = yaml.safe_load(output)["ablation grpo_kl_ablation"]
    assert shown == {"kl_0": {"kl_coef": 0.0}, "kl_0.01": {"kl_coef": 0.01}}
    assert output.count("# ablation grpo_kl_ablation") == 2


def test_the_command_prints_and_exits_without_running(tmp_path):
    """`python -m flows.grpo --config params.yaml --profile cpu --show-config`, in a folder holding only the
    settings file: exit 0, the settings printed, nothing written (no outputs, no MLflow store, no metrics)."""
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "flows.grpo", "--config", "params.yaml", "--profile", "cpu", "--show-config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["grpo"]["n_grpo_steps"] == 6  # the cpu profile's
    assert "# profile cpu" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]
