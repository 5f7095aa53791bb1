"""RemoteEngine: an engine in its own process, fed the policy's weights over a gloo group (CPU here).

After a push the remote engine's greedy tokens and log-probs must equal the policy's own (its
``generate`` and ``get_response_log_probs``), before and after the policy's weights change, so a push
that silently does nothing fails. Closing (the fixtures' teardown) and the trainer's exit (the FSDP
test) must leave no server process. Tiny planted model: tests/tiny_lm.py. vllm tests skip only when
``import vllm`` fails. Run as a script under torchrun, this file is also the FSDP2 trainer of
``test_fsdp_rank_pushes_gathered_weights`` (see ``fsdp_main``).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_lm import plant_eos_after_stop

from a5core.engines import Completion, Engine, SamplingSettings
from a5core.engines.remote import RemoteEngine, RemoteEngineError, weight_transport
from a5core.engines.weight_sync import WeightSpec, plan_buckets
from a5core.policy.causal_lm import get_response_log_probs, load_policy

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingSettings(temperature=0, max_tokens=30, stop=(), logprobs=True)
LOG_PROB_TOL = 1e-4  # fp32 on CPU in two processes
BUCKET_BYTES = 64 << 10  # tiny model: the embedding travels alone, layer weights several to a bucket
PROMPTS = ["What is 2+2?", "Let $x$ be a real number such that $x^2 = 9$. Find the largest $x$."]


@pytest.fixture(scope="module")
def policy(tiny_lm_dir):
    return load_policy(tiny_lm_dir)


def gone(pid: int) -> bool:
    """No such process (a zombie counts as gone: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def closed_for_good(engine: RemoteEngine) -> None:
    """After ``close()``: the server process is gone, and the engine says it is closed."""
    assert gone(engine._process.pid) and engine._process not in multiprocessing.active_children()
    with pytest.raises(RemoteEngineError, match="closed"):
        engine.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def hf_remote(tiny_lm_dir):
    """Shared by the module's tests; leaving the ``with`` block (``close()``) is checked at teardown."""
    with RemoteEngine(tiny_lm_dir, "hf", threads=1, bucket_bytes=BUCKET_BYTES, batch_size=8) as engine:
        yield engine
    closed_for_good(engine)


@pytest.fixture(scope="module")
def vllm_remote(tiny_lm_dir):
    pytest.importorskip("vllm")
    with RemoteEngine(tiny_lm_dir, "vllm", bucket_bytes=BUCKET_BYTES, max_model_len=1024) as engine:
        yield engine
    closed_for_good(engine)


@pytest.fixture(params=["hf", "vllm"])
def remote(request) -> RemoteEngine:
    return request.getfixturevalue(f"{request.param}_remote")


def policy_log_probs(model, tokenizer, prompt: str, completion: Completion) -> torch.Tensor:
    """Teacher-forced log-probs of the completion's tokens under ``model``, via the training code path."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + list(completion.token_ids)])
    with torch.no_grad():
        values = get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"][0]
    return values[len(prompt_ids) - 1 :]


def follows(engine: Engine, model, tokenizer) -> list[Completion]:
    """Assert the engine's greedy tokens and log-probs are ``model``'s own; returns the completions."""
    completions = [group[0] for group in engine.generate(PROMPTS, GREEDY)]
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        reference = model.generate(
            ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
        assert completion.token_ids == tuple(reference[0, ids.shape[1] :].tolist())
        expected = policy_log_probs(model, tokenizer, prompt, completion)
        assert torch.allclose(torch.tensor(completion.log_probs), expected, atol=LOG_PROB_TOL)
    return completions


def perturb(model, tokenizer, seed: int = 0) -> None:
    """Noise on every weight, and EOS planted after </answer>: greedy output visibly changes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    plant_eos_after_stop(model, tokenizer)


# ------------------------------------------------------------------------------------- transport


def test_bucket_plan_keeps_order_dtype_runs_and_the_limit():
    specs = [
        WeightSpec("a", (4,), "float32"),
        WeightSpec("b", (4,), "float32"),
        WeightSpec("c", (2,), "int64"),
        WeightSpec("d", (100,), "int64"),
        WeightSpec("e", (1,), "int64"),
    ]
    assert plan_buckets(specs, 32) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert plan_buckets(specs, 0) == [range(i, i + 1) for i in range(5)]
    assert plan_buckets(specs, 1 << 30) == [range(0, 2), range(2, 5)]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, -1)


def test_weights_travel_gpu_to_gpu_only_between_two_gpus():
    """NCCL joins two GPUs; an engine on the CPU, or on the trainer's own GPU (one-step-off on one GPU), gets
    its weights through host memory (gloo)."""
    assert weight_transport("cuda:1", "cuda:0") == "cuda"
    assert weight_transport("cuda", "cuda:1") == "cuda"  # cuda means cuda:0
    assert weight_transport("cuda:0", "cuda:0") == weight_transport("cuda", "cuda:0") == "cpu"
    assert weight_transport("cpu", "cuda:0") == weight_transport("cuda:1", None) == "cpu"
    assert weight_transport("cpu", None) == "cpu"


# ------------------------------------------------------------------------------------ weight push


def test_push_makes_the_remote_engine_follow_the_policy(remote, policy):
    """Push the policy (its own weights), then a changed copy (no specs re-sent), then the original back."""
    model, tokenizer = policy
    assert isinstance(remote, Engine) and not remote.release_memory()  # its memory is its own process's
    remote.load_weights(model)
    before = follows(remote, model, tokenizer)
    changed = copy.deepcopy(model)
    perturb(changed, tokenizer)
    try:
        remote.load_weights(changed)
        after = follows(remote, changed, tokenizer)
        assert [c.token_ids for c in after] != [c.token_ids for c in before]
        assert after[0].token_ids[-1] == tokenizer.eos_token_id
    finally:
        remote.load_weights(model)
    assert [c.token_ids for c in follows(remote, model, tokenizer)] == [c.token_ids for c in before]


def test_push_after_an_optimizer_step(hf_remote, policy):
    """The trainer's case: a training step changes the weights; the next push carries the change."""
    model, tokenizer = policy
    trained = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=1.0)
    ids = torch.tensor([tokenizer("What is 2+2? 4", add_special_tokens=False)["input_ids"]])
    loss = -get_response_log_probs(trained, ids[:, :-1], ids[:, 1:])["log_probs"].mean()
    loss.backward()
    optimizer.step()
    trained.eval()
    try:
        hf_remote.load_weights(trained)
        completions = follows(hf_remote, trained, tokenizer)
        untrained = policy_log_probs(model, tokenizer, PROMPTS[0], completions[0])
        assert not torch.allclose(torch.tensor(completions[0].log_probs), untrained, atol=LOG_PROB_TOL)
    finally:
        hf_remote.load_weights(model)


def test_a_mismatched_policy_is_refused_and_the_engine_keeps_serving(hf_remote, policy, tiny_model):
    model, tokenizer = policy
    with pytest.raises(RemoteEngineError, match=r"remote hf engine .* load_weights .* failed: .*shape"):
        hf_remote.load_weights(tiny_model)
    hf_remote.load_weights(model)
    follows(hf_remote, model, tokenizer)


# -------------------------------------------------------------------------------------- lifetime


def test_an_engine_that_fails_to_start_raises_one_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    before = multiprocessing.active_children()
    message = r"remote hf engine for '.*no-such-model' on cpu: start failed: .*no-such-model"
    with pytest.raises(RemoteEngineError, match=message):
        RemoteEngine(missing, "hf", threads=1)
    assert [p for p in multiprocessing.active_children() if p not in before] == []  # its server is gone


def test_fsdp_rank_pushes_gathered_weights(tmp_path, tiny_lm_dir):
    """Two torchrun ranks (gloo default group) shard a changed policy with FSDP2; rank 0 owns a remote
    engine and pushes, rank 1 takes part in the gathers. Rank 0 then exits without closing the engine:
    its server must not outlive it."""
    out = tmp_path / "fsdp.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        __file__,
        str(tiny_lm_dir),
        str(out),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())  # rank 0 asserted that the engine follows the gathered policy
    assert report["changed"] and gone(report["server_pid"])


def fsdp_main(model_dir: str, out: str) -> None:
    """The torchrun target of ``test_fsdp_rank_pushes_gathered_weights``."""
    import torch.distributed as dist

    from a5core.engines.weight_sync import gather_for_push
    from a5core.runtime.distributed import init_from_env, shard

    torch.set_num_threads(1)
    rank, _ = init_from_env()
    model, tokenizer = load_policy(model_dir)
    perturb(model, tokenizer)
    reference = copy.deepcopy(model)
    shard(model)
    if rank == 0:
        engine = RemoteEngine(model_dir, "hf", threads=1, bucket_bytes=BUCKET_BYTES)
        original = [group[0].token_ids for group in engine.generate(PROMPTS, GREEDY)]
        engine.load_weights(model)
        pushed = [completion.token_ids for completion in follows(engine, reference, tokenizer)]
        Path(out).write_text(json.dumps({"changed": pushed != original, "server_pid": engine._process.pid}))
    else:
        gather_for_push(model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    fsdp_main(*sys.argv[1:])
