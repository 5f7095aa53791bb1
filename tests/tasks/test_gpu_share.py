"""``gpu_memory_fraction``: a run's share of its GPU, claimed before its engine starts; Ray children of a GPU
fraction take that share; the share does not make a run another run. On the CPU, CUDA's calls replaced."""

from __future__ import annotations

import types

import pytest
import torch

import flows.fanout
import tasks.engines
from flows.params import GRPOParams
from tasks.runs import run_key


def test_the_share_is_claimed_on_cuda_only(monkeypatch):
    claimed = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction: claimed.append(fraction))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tasks.engines.claim_gpu_share(0.25)
    assert claimed == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tasks.engines.claim_gpu_share(None)
    assert claimed == []
    tasks.engines.claim_gpu_share(0.25)
    assert claimed == [0.25]


def test_the_engine_starts_within_the_share(monkeypatch, tiny_lm_dir):
    events = []
    monkeypatch.setattr(tasks.engines, "claim_gpu_share", lambda fraction: events.append(("share", fraction)))
    monkeypatch.setattr(tasks.engines, "rollout_engine", lambda model, backend, **kwargs: events.append("engine"))
    params = GRPOParams(model=str(tiny_lm_dir), backend="hf", gpu_memory_fraction=0.3)
    tasks.engines.engine_for(params)
    assert events == [("share", 0.3), "engine"]


def _children_sent_to_ray(monkeypatch, children, **runner):
    sent = {}
    monkeypatch.setattr(flows.fanout, "run_children_on_ray", lambda kids, run, **kwargs: sent.update(kids) or [])
    params = types.SimpleNamespace(
        runner="ray", ray_address=None, ray_cpus_per_child=1.0, **{"ray_gpus_per_child": 1.0, **runner}
    )
    flows.fanout.children_on_ray(children, None, params, "parent")
    return {name: child.gpu_memory_fraction for name, child in sent.items()}


def test_ray_children_of_a_gpu_fraction_take_that_share(monkeypatch):
    children = {"a": GRPOParams(), "b": GRPOParams(gpu_memory_fraction=0.5)}  # b's own share stands
    assert _children_sent_to_ray(monkeypatch, children, ray_gpus_per_child=0.2) == {"a": 0.2, "b": 0.5}
    assert _children_sent_to_ray(monkeypatch, children, ray_gpus_per_child=1.0) == {"a": None, "b": 0.5}
    assert _children_sent_to_ray(monkeypatch, children, ray_gpus_per_child=0) == {"a": None, "b": 0.5}


def test_the_share_is_not_part_of_the_run():
    assert run_key(GRPOParams(gpu_memory_fraction=0.2)) == run_key(GRPOParams())
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        GRPOParams(gpu_memory_fraction=1.5)
