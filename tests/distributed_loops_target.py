"""The SFT and GRPO loops on 1 or N ranks (gloo, CPU), for tests/test_distributed_loops.py.

``python -m torch.distributed.run --nproc-per-node N tests/distributed_loops_target.py TOKENIZER_DIR OUT_DIR
MICROBATCH [CHECKPOINT]`` (or :func:`run` in-process for one rank) runs, on tiny Qwen2 models, with
micro-batches of MICROBATCH sequences (``whole``: one micro-batch per batch):

- ``sft``: two SFT optimizer steps (batches of 5 sequences: uneven shares, so a rank runs an empty
  micro-batch); ``sft_gathered`` the same with ``fsdp_reshard_after_forward=False``; then a crash in
  ``evaluate`` at step 2 after the step-1 checkpoint, a copy of that checkpoint to ``OUT_DIR/sft_crashed``
  and a resume from it with other starting weights;
- ``sft_foreign``: with CHECKPOINT (a crashed checkpoint written by another number of ranks, with
  ``whole`` micro-batches), the resume from a copy of it;
- ``grpo``: two GRPO steps (3 questions of 4 rollouts: 1 and 2 questions on 2 ranks; grpo_clip, two
  epochs of two optimizer steps) with an engine that returns fixed completions, then the same run
  stopped by rank 0's ``should_stop`` after step 1 and resumed;
- ``sft_budget``, ``grpo_budget``: the first SFT and GRPO runs with micro-batches by token budget
  (``max_tokens_per_microbatch``).

Rank 0 saves ``OUT_DIR/results.pt``: each run's final weights (whole), logged metrics and returns.
"""

from __future__ import annotations

import math
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from a5core.data.files import Problem, Trace
from a5core.data.prompts import load_prompt
from a5core.engines import Completion
from a5core.loops.grpo import GRPOConfig, grpo
from a5core.loops.sft import SFTConfig, train_sft
from a5core.runtime import distributed

EXAMPLES = [
    Trace(f"What is {i} + {i % 3}?", f" {i} + {i % 3} = {i + i % 3}" + " ok" * (i % 5) + " </answer>", "")
    for i in range(10)
]
PROBLEMS = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(6)]
# The token budget of the ``*_budget`` runs: micro-batches of one to four sequences (each padded to 64 or 256).
BUDGET = 512


def make_model(tokenizer, seed: int = 0):
    """A 2-layer Qwen2 with tied embeddings over the tiny vocabulary (fp32, CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def whole_weights(model) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict, gathered whole (a collective on several ranks)."""
    return {name: distributed.full_tensor(t.detach()).clone() for name, t in model.state_dict().items()}


class Recorder:
    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, metrics: dict, step: int) -> None:
        self.calls.append((step, dict(metrics)))


class FixedEngine:
    """Completions that depend only on (prompt, sample index): the same rollouts on any number of
    ranks. Records a checksum of every weight push (which must be whole tensors)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pushes: list[float] = []

    def load_weights(self, policy) -> None:
        from torch.distributed.tensor import DTensor

        state = policy.state_dict()
        assert not any(isinstance(t, DTensor) for t in state.values()), "the engine got shards"
        self.pushes.append(sum(float(t.double().sum()) for t in state.values()))

    def release_memory(self) -> bool:
        return False

    def generate(self, prompts, sampling):
        groups = []
        uniform = -math.log(len(self.tokenizer) - 1)  # each token's log-prob: drawn uniformly from ids 1, 2, ...
        for prompt in prompts:
            group = []
            for j in range(sampling.n):
                rng = random.Random(f"{prompt}|{j}")
                ids = tuple(rng.randrange(1, len(self.tokenizer)) for _ in range(rng.randrange(2, 9)))
                log_probs = (uniform,) * len(ids) if sampling.logprobs else None
                group.append(Completion(self.tokenizer.decode(ids), ids, "length", log_probs))
            groups.append(group)
        return groups


def parity_reward(response: str, ground_truth: str) -> dict[str, float]:
    reward = float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


def sft_config(microbatch: int | None, **overrides) -> SFTConfig:
    return SFTConfig(
        **{
            **dict(
                learning_rate=1e-2,
                warmup_steps=0,
                lr_schedule="constant",
                batch_size=5,
                microbatch_size=microbatch or 5,
                epochs=1,
                seed=3,
            ),
            **overrides,
        }
    )


def crash_at_step_2(model, step: int) -> dict[str, float]:
    if step == 2:
        raise KeyboardInterrupt("simulated crash in evaluate at step 2")
    return {"val_probe": float(step)}


def run_sft(tokenizer, out: Path, microbatch: int | None, foreign: str | None) -> dict:
    rank = distributed.rank_and_world()[0]
    results = {}
    model, log = make_model(tokenizer), Recorder()
    returned = train_sft(model, tokenizer, EXAMPLES, sft_config(microbatch), log=log)
    results["sft"] = {"weights": whole_weights(model), "log": log.calls, "returned": returned}

    gathered = make_model(tokenizer)
    train_sft(gathered, tokenizer, EXAMPLES, sft_config(microbatch, fsdp_reshard_after_forward=False))
    results["sft_gathered"] = {"weights": whole_weights(gathered)}

    crashed = make_model(tokenizer)
    config = sft_config(microbatch, checkpoint_every=1, eval_every=1)
    try:
        train_sft(crashed, tokenizer, EXAMPLES, config, checkpoint_dir=out / "sft_ckpt", evaluate=crash_at_step_2)
        raise AssertionError("the crash did not happen")
    except KeyboardInterrupt:
        pass
    if rank == 0:
        shutil.copytree(out / "sft_ckpt", out / "sft_crashed")
    if dist.is_initialized():
        dist.barrier()
    resumed, log = make_model(tokenizer, seed=1), Recorder()
    train_sft(resumed, tokenizer, EXAMPLES, config, checkpoint_dir=out / "sft_ckpt", log=log)
    results["sft_resumed"] = {"weights": whole_weights(resumed), "log": log.calls}

    budget = make_model(tokenizer)
    train_sft(budget, tokenizer, EXAMPLES, sft_config(microbatch, max_tokens_per_microbatch=BUDGET))
    results["sft_budget"] = {"weights": whole_weights(budget)}

    if foreign is not None:
        if rank == 0:
            shutil.copytree(foreign, out / "sft_foreign")
        if dist.is_initialized():
            dist.barrier()
        resumed = make_model(tokenizer, seed=2)
        train_sft(
            resumed,
            tokenizer,
            EXAMPLES,
            config.replace(microbatch_size=sft_config(None).microbatch_size),
            checkpoint_dir=out / "sft_foreign",
        )
        results["sft_foreign"] = {"weights": whole_weights(resumed)}
    return results


def grpo_config(microbatch: int | None, **overrides) -> GRPOConfig:
    return GRPOConfig(
        **{
            **dict(
                n_grpo_steps=2,
                learning_rate=1e-2,
                rollout_batch_size=12,
                group_size=4,
                train_batch_size=6,
                gradient_accumulation_steps=6 // (microbatch or 6),
                epochs_per_rollout_batch=2,
                loss_type="grpo_clip",
                cliprange=0.05,
                temperature=1.0,
                min_tokens=0,
                max_tokens=8,
                checkpoint_every=1,
            ),
            **overrides,
        }
    )


def run_grpo(tokenizer, out: Path, microbatch: int | None) -> dict:
    rank = distributed.rank_and_world()[0]
    template = load_prompt("r1_zero")
    results = {}
    model, engine, log = make_model(tokenizer), FixedEngine(tokenizer), Recorder()
    history = grpo(model, tokenizer, engine, PROBLEMS, template, parity_reward, grpo_config(microbatch), log=log)
    results["grpo"] = {"weights": whole_weights(model), "log": log.calls, "history": history, "pushes": engine.pushes}

    config, ckpt = grpo_config(microbatch), out / "grpo_ckpt"
    stopped = make_model(tokenizer)
    first = grpo(
        stopped,
        tokenizer,
        FixedEngine(tokenizer),
        PROBLEMS,
        template,
        parity_reward,
        config,
        checkpoint_dir=ckpt,
        should_stop=lambda step: rank == 0,
    )  # one rank's wish stops them all
    resumed = make_model(tokenizer, seed=1)
    history = grpo(
        resumed, tokenizer, FixedEngine(tokenizer), PROBLEMS, template, parity_reward, config, checkpoint_dir=ckpt
    )
    results["grpo_resumed"] = {"weights": whole_weights(resumed), "first": first, "history": history}

    budget = make_model(tokenizer)
    history = grpo(
        budget, tokenizer, FixedEngine(tokenizer), PROBLEMS, template, parity_reward,
        grpo_config(microbatch, max_tokens_per_microbatch=BUDGET),
    )  # fmt: skip
    results["grpo_budget"] = {"weights": whole_weights(budget), "history": history}
    return results


def run(tokenizer_dir: str, out_dir: str, microbatch: int | None, foreign: str | None = None) -> dict:
    """All runs on this process's ranks; rank 0 also saves them to ``OUT_DIR/results.pt``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = Path(out_dir)
    results = {**run_sft(tokenizer, out, microbatch, foreign), **run_grpo(tokenizer, out, microbatch)}
    if distributed.rank_and_world()[0] == 0:
        torch.save(results, out / "results.pt")
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    distributed.init_from_env()
    tokenizer_dir, out_dir, microbatch, *foreign = sys.argv[1:]
    run(tokenizer_dir, out_dir, None if microbatch == "whole" else int(microbatch), *foreign)
    if dist.is_initialized():
        dist.destroy_process_group()
