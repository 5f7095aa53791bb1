"""What the loops' tests share: models over the tiny tokenizer's vocabulary, toy problems, a toy reward, engines
that record their calls (one of them cutting responses to many lengths), small settings, and the warm-started
policy of the learning tests."""

from __future__ import annotations

import copy

import torch

from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Problem, Trace
from a5core.data.prompts import load_prompt
from a5core.engines.hf import HFEngine
from a5core.loops.grpo import GRPOConfig
from a5core.loops.sft import SFTConfig, train_sft


def make_model(tokenizer, hidden: int = 32, layers: int = 1, seed: int = 0):
    """A freshly initialised Qwen2 over the tiny vocabulary (fp32, CPU)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def short_examples(n: int) -> list[Trace]:
    """Short pairs whose responses differ in length (so micro-batches pad differently)."""
    return [
        Trace(
            f"What is {i} + {i % 3}?", f" {i} + {i % 3} = {i + i % 3}" + " ok" * (i % 5) + " </answer>", str(i + i % 3)
        )
        for i in range(n)
    ]


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_params(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if atol:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


class Recorder:
    """A ``log`` callback that keeps ``(step, metrics)`` and can raise at a chosen step."""

    def __init__(self, crash_at: int | None = None):
        self.calls: list[tuple[int, dict]] = []
        self.crash_at = crash_at

    def __call__(self, metrics: dict, step: int) -> None:
        if step == self.crash_at:
            raise KeyboardInterrupt(f"simulated crash at step {step}")
        self.calls.append((step, dict(metrics)))

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.calls]


TEMPLATE = load_prompt("r1_zero")
PROBLEMS = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1)) for i in range(8)]


def parity_reward(response: str, ground_truth: str) -> dict[str, float]:
    """A verifiable toy reward that varies within groups even for a random model."""
    reward = float(len(response) % 2 == 0)
    return {"reward": reward, "format_reward": reward, "answer_reward": reward}


class RecordingEngine:
    """An HFEngine on its own copy of the model that keeps every generate call's prompts and outputs."""

    def __init__(self, model, tokenizer):
        self.inner = HFEngine(copy.deepcopy(model), tokenizer)
        self.calls = []

    def generate(self, prompts, sampling):
        out = self.inner.generate(prompts, sampling)
        self.calls.append((list(prompts), out, sampling))
        return out

    def load_weights(self, model):
        self.inner.load_weights(model)

    def release_memory(self):
        return self.inner.release_memory()


class VariedLengthEngine(RecordingEngine):
    """Cuts rollout j of each call to 2 + 5j mod 11 tokens (a random tiny model rarely stops by itself):
    responses of many lengths, the full-length ones cut at max_tokens (finish_reason "length")."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling):
        groups, j = self.inner.generate(prompts, sampling), 0
        varied = []
        for group in groups:
            cut = []
            for c in group:
                n = min(len(c.token_ids), 2 + (5 * j) % 11)
                j += 1
                ids = c.token_ids[:n]
                reason = "length" if n == sampling.max_tokens else "stop"
                cut.append(c.__class__(self.tokenizer.decode(ids), ids, reason, c.log_probs and c.log_probs[:n]))
            varied.append(cut)
        self.calls.append((list(prompts), varied, sampling))
        return varied


def small_config(**overrides) -> GRPOConfig:
    settings = dict(
        n_grpo_steps=1,
        learning_rate=1e-3,
        rollout_batch_size=8,
        group_size=4,
        train_batch_size=8,
        gradient_accumulation_steps=4,
        temperature=1.0,
        min_tokens=2,
        max_tokens=12,
        eval_every=0,
        checkpoint_every=1,
    )
    return GRPOConfig(**{**settings, **overrides})


TRAIN = arithmetic_problems(60, digits=1, operations="+", split="train", seed=0)


def warm_start(tokenizer):
    """A policy that has the format but gets only some sums right: brief SFT on the 60 questions."""
    model = make_model(tokenizer, hidden=128, layers=2)
    traces = [
        Trace(
            TEMPLATE.format(p.problem),
            f" {p.problem[9:-2]} = {p.answer} </think> <answer> {p.answer} </answer>",
            p.answer,
        )
        for p in TRAIN
    ]
    train_sft(
        model,
        tokenizer,
        traces,
        SFTConfig(learning_rate=5e-3, warmup_steps=5, batch_size=10, microbatch_size=10, epochs=12),
    )
    return model
