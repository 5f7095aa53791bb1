"""benchmarks/vllm_engine.py rollouts: each engine measured in processes of its own, a figure their median."""

import json
import subprocess
import sys
from argparse import Namespace

from benchmarks import vllm_engine


def test_a_figure_from_several_processes_is_their_median_with_their_range():
    assert vllm_engine.spread([30_000.0, 42_000.0, 24_000.0]) == "30,000 (24,000–42,000, 3 processes)"
    assert vllm_engine.spread([1.25], "{:.2f}") == "1.25"  # one process: no range to show


def test_each_engine_runs_in_its_own_processes_and_its_rows_show_their_medians(monkeypatch, capsys):
    speeds = iter([30_000.0, 42_000.0, 24_000.0, 10_000.0, 11_000.0, 12_000.0])
    commands = []

    run = subprocess.run

    def one_process(command, **kwargs):
        if "rollout-one" not in command:  # the report naming the device
            return run(command, **kwargs)
        commands.append(command)
        fixed = next(speeds)
        found = {"label": f"engine {command[command.index('--engine') + 1]}", "description": "tiny", "first": 5.0,
                 "seconds": 1.0, "fixed": fixed, "varied_seconds": 1.0, "varied": fixed / 2, "mean": 100.0}  # fmt: skip
        return subprocess.CompletedProcess(command, 0, stdout="log line\n" + json.dumps(found) + "\n", stderr="")

    monkeypatch.setattr(vllm_engine.subprocess, "run", one_process)
    monkeypatch.setattr(sys, "argv", ["vllm_engine.py", "rollouts", "--tiny"])
    args = Namespace(engines=["vllm", "hf"], processes=3, lengths=["fixed", "varied"], batch=4, prompt=8, new=40,
                     memory_fraction=0.4, tiny=True)  # fmt: skip
    vllm_engine.rollouts(args)
    assert [c[c.index("--engine") + 1] for c in commands] == ["vllm"] * 3 + ["hf"] * 3
    assert all(c[2] == "rollout-one" for c in commands)
    table = capsys.readouterr().out
    assert "| engine vllm | fixed | 5.0 (5.0–5.0, 3 processes) |" in table
    assert "30,000 (24,000–42,000, 3 processes)" in table and "11,000 (10,000–12,000, 3 processes)" in table
    assert "15,000 (12,000–21,000, 3 processes) | 50% |" in table  # varied: half of fixed in every process
