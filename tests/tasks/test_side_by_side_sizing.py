"""How many children run at once and the share of the GPU each gets, on faked cards and machines: memory per child,
children at once, each child's threads; the card as ``nvidia-smi`` reports it; the children a command starts get that
share."""

from __future__ import annotations

import subprocess

import pytest
import torch

import flows.seeds
import tasks.side_by_side as side_by_side
from flows.ablations import ablation_settings
from flows.params import GRPOParams
from tasks.side_by_side import (
    CONTEXT_BYTES,
    GIB,
    GPU_RESERVE,
    HOST_RESERVE,
    PROCESS_BYTES,
    Machine,
    Need,
    child_need,
    size_children,
)

H100 = Machine(16, 120 * GIB, "NVIDIA H100 80GB HBM3", gpu_total=80 * GIB, gpu_free=78 * GIB, mps=True)


def test_a_card_with_room_for_eight_runs_eight_at_once_each_with_its_share():
    sizing = size_children(12, H100, Need(8 * GIB, 3 * GIB))
    assert sizing.at_once == (78 * GIB - GPU_RESERVE) // (8 * GIB + CONTEXT_BYTES) == 8
    assert sizing.gpu_memory_fraction == 0.1  # 8 of 80 GiB
    assert sizing.threads == 2  # 16 cores over 8 children
    assert "bound: GPU memory" in sizing.why and "CUDA MPS on" in sizing.why and "8.0 GiB a child" in sizing.why


def test_the_cores_the_memory_the_users_limit_and_the_children_bound_it_too():
    small = Need(2 * GIB, 3 * GIB)
    assert size_children(20, H100, small).at_once == 15  # the cores, less one for the parent
    assert size_children(20, H100, small, at_most=4).at_once == 4
    assert size_children(3, H100, small).at_once == 3
    assert "bound: children" in size_children(3, H100, small).why
    tight = Machine(16, 20 * GIB, "NVIDIA H100", 80 * GIB, 78 * GIB)  # little memory beside the card
    assert size_children(20, tight, small).at_once == (20 * GIB - HOST_RESERVE) // (3 * GIB) == 6


def test_a_card_in_use_holds_fewer_and_one_that_holds_none_runs_one_with_all_of_it():
    busy = Machine(16, 120 * GIB, "NVIDIA H100", 80 * GIB, gpu_free=20 * GIB)
    assert size_children(12, busy, Need(8 * GIB, 3 * GIB)).at_once == 2
    full = Machine(16, 120 * GIB, "NVIDIA H100", 80 * GIB, gpu_free=5 * GIB)
    sizing = size_children(12, full, Need(8 * GIB, 3 * GIB))
    assert (sizing.at_once, sizing.gpu_memory_fraction) == (1, None)  # alone: the whole card, no share
    assert "the GPU memory available holds less than one child's need" in sizing.why
    unknown = size_children(12, H100, Need())
    assert (unknown.at_once, unknown.gpu_memory_fraction) == (1, None)


def test_on_the_cpu_the_cores_and_the_memory_decide():
    sizing = size_children(6, Machine(cores=2, memory_free=64 * GIB), Need(host=10 * GIB))
    assert (sizing.at_once, sizing.threads, sizing.gpu_memory_fraction) == (2, 1, None)
    assert sizing.why.startswith("6 children, 2 at once (bound: cores), 1 thread each: 2 cores, 64.0 GiB of memory")
    assert size_children(6, Machine(16, 64 * GIB), Need(host=2 * GIB)).threads == 2  # 6 at once on 16 cores
    crowded = size_children(6, Machine(cores=16, memory_free=12 * GIB), Need(host=10 * GIB))
    assert (crowded.at_once, crowded.threads) == (1, 16)  # a second would not fit: one at a time, every core
    assert "bound: memory" in crowded.why and "less than one child's need" not in crowded.why


def test_what_a_child_needs(tiny_lm_dir):
    from a5core.engines.colocate import POLICY_MARGIN, policy_reserve_bytes
    from a5core.policy.model_specs import parameter_count

    held = policy_reserve_bytes(str(tiny_lm_dir), "float32")
    cpu = Machine(cores=2, memory_free=16 * GIB)
    states = held - POLICY_MARGIN  # weights, gradients, AdamW's moments
    assert child_need(GRPOParams(model=str(tiny_lm_dir)), cpu) == Need(host=4 * states + PROCESS_BYTES)
    weights = 4 * parameter_count(str(tiny_lm_dir))
    shared = child_need(GRPOParams(model=str(tiny_lm_dir), gpu_memory_fraction=0.25), H100)
    assert shared == Need(20 * GIB, PROCESS_BYTES + weights)  # its own share of the card
    assert child_need(GRPOParams(model=str(tiny_lm_dir)), H100) == Need(2 * held, PROCESS_BYTES + weights)
    assert child_need(GRPOParams(model=str(tiny_lm_dir), kl_coef=0.01), H100).gpu > 2 * held  # a reference copy more


def test_the_card_is_read_from_nvidia_smi(monkeypatch, tmp_path):
    asked = []

    def smi(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="NVIDIA H200, 143771 MiB, 140000 MiB\n")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(side_by_side.subprocess, "run", smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    machine = side_by_side.this_machine()
    assert (machine.gpu_name, machine.gpu_total, machine.gpu_free) == ("NVIDIA H200", 143771 << 20, 140000 << 20)
    assert machine.memory_free > 0  # this machine's, read from /proc/meminfo
    assert asked[0][1] == "--id=3" and not machine.mps  # the first visible card; no MPS control pipe
    (tmp_path / "control").touch()
    assert side_by_side.this_machine().mps


def test_the_children_a_command_starts_get_the_share_of_the_card(monkeypatch, tmp_path, tiny_lm_dir):
    """On a faked H100 with room for two children of 30 GiB, the local runner is handed every child of the first
    wave with gpu_memory_fraction 30/80 and two at once; a child that ends without finishing is named."""
    started = []
    monkeypatch.setattr(flows.seeds, "this_machine", lambda: Machine(16, 120 * GIB, "NVIDIA H100", 80 * GIB, 70 * GIB))
    monkeypatch.setattr(flows.seeds, "child_need", lambda params, machine: Need(30 * GIB, 4 * GIB))
    monkeypatch.setattr(
        flows.seeds,
        "children_in_processes",
        lambda children, run, parent, sizing: started.append((children, sizing)) or {},
    )
    params = GRPOParams(
        model=str(tiny_lm_dir),
        ablation="grpo_dapo_ablation",
        ablation_only=["grpo", "dapo"],
        seeds=[0, 1],
        output_dir=str(tmp_path / "out"),
    )
    children = ablation_settings(params.ablation, params)
    with pytest.raises(
        flows.seeds.ChildrenFailedError,
        match=r"children that did not finish: grpo/seed0 \(never ended: stopped, .*/grpo/child.log\)",
    ):
        flows.seeds.run_seeded(children, None, params, flows.seeds.Parent("parent"), "grpo_dapo_ablation")
    ((handed, sizing),) = started
    assert (sizing.at_once, sizing.gpu_memory_fraction) == (2, 0.375)
    assert list(handed) == ["grpo/seed0", "dapo/seed0", "grpo/seed1", "dapo/seed1"]
    assert {child.gpu_memory_fraction for child in handed.values()} == {0.375}
    assert [child.seed for child in handed.values()] == [0, 0, 1, 1]
