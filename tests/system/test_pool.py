"""lab/pool.py: a device call's entries are the product's commands over seeds; the pool plans them (references and
the models they start from first), leaves out the seeds finished on another machine, and waits for vLLM where an
entry asks for it."""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pool_module(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("lab_pool", ROOT / "lab" / "pool.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lab_pool"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVRUN", tmp_path / "devrun")
    yield module
    del sys.modules["lab_pool"]


def bare_pool(module, origin="startmodel12"):
    pool = object.__new__(module.Pool)  # no card to read: planning and commands only
    pool.args = argparse.Namespace(plan=True)
    pool.deadline, pool.tag = time.time() + 600, "call1"
    pool.ended, pool.made, pool.origin = {}, {}, origin
    pool.log = lambda msg: None
    return pool


def queue(tmp_path, text):
    path = tmp_path / "queue.txt"
    path.write_text(text)
    return path


def test_an_entry_is_the_products_command_over_its_seeds_less_those_finished_elsewhere(pool_module, tmp_path):
    (entry,) = pool_module.parse_queue(
        queue(
            tmp_path,
            "# one comparison\ntm ref=g flows.grpo --config params.yaml --ablation grpo_dapo_ablation "
            '--ablation-only [grpo,token_mean] --seeds [22,23,24] --decide "token_mean >= grpo";\n',
        )
    )
    assert entry.seeds == [22, 23, 24] and entry.refs == ["g"] and entry.needs == "start"
    assert entry.words[-2:] == ["--decide", "token_mean >= grpo"]  # a quoted argument is one word
    done = [{"name": "tm", "rc": "124", "origin": "x", "call": "c0", "seeds": "22"}]
    command = bare_pool(pool_module).command(entry, done, own=True)
    assert command[command.index("--seeds") + 1] == "[23,24]"
    folder = pool_module.DEVRUN / "tm"
    assert command[-6:] == [
        "--tracking-uri",
        f"sqlite:///{folder}/mlflow.db",
        "--output-dir",
        f"{folder}/out",
        "--metrics-path",
        f"{folder}/metrics.json",
    ]
    assert not pool_module.complete(entry, done)
    assert pool_module.complete(entry, [*done, {"name": "tm", "rc": "0", "origin": "x", "seeds": "23,24"}])


@pytest.mark.parametrize("vllm_here", [False, True])
def test_a_vllm_entry_waits_for_vllm(pool_module, tmp_path, monkeypatch, vllm_here):
    hf, vllm = pool_module.parse_queue(
        queue(
            tmp_path,
            "bph flows.grpo --config params.yaml --profile gpu-small --backend hf --seeds [17,18];\n"
            "bpv ref=bph flows.grpo --config params.yaml --profile gpu-small --backend vllm --seeds [17,18];\n",
        )
    )
    monkeypatch.setattr(pool_module, "vllm_installed", lambda: vllm_here)
    assert pool_module.engine_here(hf) and pool_module.engine_here(vllm) is vllm_here
    assert [e.name for e in bare_pool(pool_module).plan([hf, vllm], done=[])] == ["bph", "bpv"]


def test_runs_from_another_entrys_model_come_after_it_and_name_it_as_their_origin(pool_module, tmp_path):
    entries = pool_module.parse_queue(
        queue(
            tmp_path,
            "sft_both flows.sft_experiment --config params.yaml --profile gpu-small --sizes [1024] --append-eos true;\n"
            "pf_r1 from=sft_both flows.grpo --ablation grpo_prompt_ablation --ablation-only [r1_zero] --seeds [1];\n"
            "pf_qo ref=pf_r1 from=sft_both flows.grpo --ablation grpo_prompt_ablation --ablation-only "
            "[question_only] --seeds [1];\n",
        )
    )
    sft, r1, qo = entries
    assert (sft.needs, r1.needs, r1.source, qo.refs) == ("base", "entry", "sft_both", ["pf_r1"])
    pool = bare_pool(pool_module)
    # its model was made on another machine (the state says sft_both ended): it is made again here first
    done = [{"name": "sft_both", "rc": "0", "origin": "base", "call": "earlier"}]
    assert [e.name for e in pool.plan(entries, done)] == ["sft_both", "pf_r1", "pf_qo"]
    model = pool_module.saved_model("sft_both")
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    pool.made, pool.ended = {}, {"sft_both": 0}
    digest = pool_module.folder_hash(model)[:12]
    assert pool.origin_of(qo) == digest and pool.origin_of(sft) == "base"
    assert pool.command(qo, done, own=False)[-2:] == ["--model", str(model)]
    # the next call on this machine finds the model unchanged and plans nothing anew for it
    pool.made, pool.ended = {}, {}
    ended = [{"name": n, "rc": "0", "origin": digest, "call": "call1"} for n in ("pf_r1", "pf_qo")]
    assert pool.plan(entries, done + ended) == []
    (model / "model.safetensors").write_bytes(b"changed")
    pool.made = {}
    assert pool.model_of("sft_both") is None
