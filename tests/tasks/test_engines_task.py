"""The engine a run beside its policy gets (tasks.engines): the backend auto picks, and vLLM's arguments on CUDA and
on the CPU."""

from __future__ import annotations

import pytest
import torch

from a5core.engines.colocate import GIB
from flows.params import BaselineEvalParams, EIParams, GRPOParams
from tasks.engines import colocated_backend, colocated_vllm_kwargs, rollouts_at_once


def test_flows_arguments_on_cuda_and_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert colocated_vllm_kwargs(None, lambda: 0, 1000) == {}
    assert colocated_vllm_kwargs(0.3, lambda: 0, 1000) == {"gpu_memory_utilization": 0.3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (120 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: 1.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 0)
    assert colocated_vllm_kwargs(None, lambda: 50 * GIB, 1000) == {
        "sleep_when_idle": True,
        "kv_cache_tokens": 1000,
        "gpu_memory_utilization": pytest.approx(70 / 140),
    }
    # a run bounded to half the GPU (gpu_memory_fraction), 10 GiB of it already held: 60 GiB of its 70 left
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda: 0.5)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 10 * GIB)
    assert colocated_vllm_kwargs(None, lambda: 50 * GIB, 1000)["gpu_memory_utilization"] == pytest.approx(10 / 140)
    # a fraction given keeps vLLM's own KV sizing (all of its share), and the engine still sleeps
    assert colocated_vllm_kwargs(0.3, lambda: 50 * GIB, 1000) == {
        "sleep_when_idle": True,
        "gpu_memory_utilization": 0.3,
    }


def test_auto_beside_the_policy_is_hf_on_a_gpu(monkeypatch):
    import tasks.engines

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert colocated_backend("auto") == "hf"
    assert colocated_backend("vllm") == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tasks.engines, "vllm_available", lambda: True)
    assert colocated_backend("auto") == "vllm"
    monkeypatch.setattr(tasks.engines, "vllm_available", lambda: False)
    assert colocated_backend("auto") == "hf"


def test_the_sequences_a_run_samples_at_once_come_from_its_own_settings():
    assert rollouts_at_once(GRPOParams(rollout_batch_size=512)) == 512
    assert rollouts_at_once(EIParams(questions_per_step=32, rollouts_per_question=4)) == 128
    assert rollouts_at_once(BaselineEvalParams()) is None
