"""lab/pool.py: which runs a device call starts near its deadline."""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool_module():
    spec = importlib.util.spec_from_file_location("lab_pool", ROOT / "lab" / "pool.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lab_pool"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["lab_pool"]


def pool_with(module, seconds_left: float, fill_tail: bool):
    pool = object.__new__(module.Pool)  # no card to read: only the timing rule is under test
    pool.args = argparse.Namespace(fill_tail=fill_tail)
    pool.deadline = time.time() + seconds_left
    return pool


def entry(module, folder: Path, name: str, line: str):
    queue = folder / "queue.txt"
    queue.write_text(f"# a queue of one\n{name} {line};\n")
    (found,) = module.parse_queue(queue)
    return found


@pytest.mark.parametrize(
    ("left", "fill_tail", "kind_line", "starts"),
    [
        (400, False, "flows.grpo --ablation grpo_dapo_ablation --ablation-only [grpo] --seed 9", True),  # ends in time
        (150, False, "flows.grpo --ablation grpo_dapo_ablation --ablation-only [grpo] --seed 9", False),
        (150, True, "flows.grpo --ablation grpo_dapo_ablation --ablation-only [grpo] --seed 9", True),  # resumes next
        (60, True, "flows.grpo --ablation grpo_dapo_ablation --ablation-only [grpo] --seed 9", False),  # no checkpoint
        (150, True, "flows.expert_iteration --seed 9", False),  # Expert Iteration does not resume: never a tail run
    ],
)
def test_a_run_that_cannot_end_in_the_call_starts_only_to_resume_in_the_next(
    pool_module, tmp_path, left, fill_tail, kind_line, starts
):
    pool = pool_with(pool_module, left, fill_tail)
    run = entry(pool_module, tmp_path, "r", kind_line)
    # about 197 s for GRPO and 250 for Expert Iteration at 7 at once (gpu-small's walls, lab/pool.py KINDS)
    assert pool.in_time(run, 7) is starts


@pytest.mark.parametrize("vllm_here", [False, True])
def test_a_vllm_run_waits_for_vllm_while_its_hf_reference_runs(pool_module, tmp_path, monkeypatch, vllm_here):
    queue = tmp_path / "queue.txt"
    queue.write_text(
        "bph_s17 flows.grpo --config params.yaml --profile gpu-small --backend hf --seed 17;\n"
        "bpv_s17 ref=bph_s17 flows.grpo --config params.yaml --profile gpu-small --backend vllm --seed 17;\n"
    )
    hf, vllm = pool_module.parse_queue(queue)
    assert (hf.kind, vllm.kind, vllm.refs) == ("grpo", "vllm", ["bph_s17"])
    monkeypatch.setattr(pool_module, "vllm_installed", lambda: vllm_here)
    pool = pool_with(pool_module, 600, False)
    pool.running, pool.ended, pool.at_once, pool.budget = {}, {}, 8, 100.0
    pool.origin, pool.pre, pool.diff = "startmodel12", None, None
    started = []

    def start(run, own=True):  # no process: the runs it would start, in order
        started.append(run.name)
        pool.running[run.name] = (None, time.time(), run, 200.0)

    pool.start = start
    todo = pool.plan([hf, vllm], done=[])
    assert [e.name for e in todo] == ["bph_s17", "bpv_s17"]
    pool.start_ready(todo)
    assert started == (["bph_s17", "bpv_s17"] if vllm_here else ["bph_s17"])


def test_runs_from_another_entrys_model_wait_for_it_and_name_it_as_their_origin(pool_module, tmp_path, monkeypatch):
    monkeypatch.setattr(pool_module, "DEVRUN", tmp_path / "devrun")
    queue = tmp_path / "queue.txt"
    queue.write_text(
        "sft_both flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --append-eos true;\n"
        "pf_r1_s1 from=sft_both flows.grpo --ablation grpo_prompt_ablation --ablation-only [r1_zero] --seed 1;\n"
        "pf_qo_s1 ref=pf_r1_s1 from=sft_both flows.grpo --ablation grpo_prompt_ablation --ablation-only "
        "[question_only] --seed 1;\n"
    )
    sft, r1, qo = entries = pool_module.parse_queue(queue)
    assert (sft.needs, r1.needs, r1.source, qo.refs, qo.source) == (
        "base",
        "entry",
        "sft_both",
        ["pf_r1_s1"],
        "sft_both",
    )
    pool = pool_with(pool_module, 2000, False)
    pool.running, pool.ended, pool.at_once, pool.budget, pool.made = {}, {}, 8, 100.0, {}
    pool.origin, pool.pre, pool.diff, pool.tag = "startmodel12", None, None, "call1"
    pool.log = lambda msg: None
    commands = {}

    def start(run, own=True):  # no process: the command it would run
        commands[run.name] = run.words + (["--model", str(pool_module.saved_model(run.source))] if run.source else [])
        pool.running[run.name] = (None, time.time(), run, 200.0)

    pool.start = start
    # its model was made on another machine (the state says sft_both ended): it is made again here first
    done = [{"name": "sft_both", "rc": "0", "origin": "base", "call": "earlier"}]
    todo = pool.plan(entries, done)
    assert [e.name for e in todo] == ["sft_both", "pf_r1_s1", "pf_qo_s1"]
    assert pool.start_ready(todo) is True  # the arms wait for the model that is being made
    assert list(commands) == ["sft_both"]
    model = pool_module.saved_model("sft_both")
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    del pool.running["sft_both"]
    pool.ended["sft_both"] = 0
    pool.start_ready(todo)
    assert list(commands) == ["sft_both", "pf_r1_s1", "pf_qo_s1"]
    assert commands["pf_qo_s1"][-2:] == ["--model", str(model)]
    digest = pool_module.folder_hash(model)[:12]
    assert pool.origin_of(qo) == digest and pool.origin_of(sft) == "base"
    # the next call on this machine finds the model unchanged and plans nothing anew for it
    pool.made, pool.ended = {}, {}
    ended = [{"name": n, "rc": "0", "origin": digest, "call": "call1"} for n in ("pf_r1_s1", "pf_qo_s1")]
    assert pool.plan(entries, done + ended) == []
    (model / "model.safetensors").write_bytes(b"changed")
    pool.made = {}
    assert pool.model_of("sft_both") is None
