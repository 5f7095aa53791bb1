"""The SFT loop on tiny Qwen2 models with the tiny BPE vocabulary (tests/tiny_lm.py), on CPU.

It learns (loss falls, held-out format reward rises from 0), its gradient accumulation and schedule are
the intended ones, it resumes exactly (after an exception and after a real ``kill -9``), and it refuses
what it must: another run's checkpoint, a NaN loss, bad settings.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from kill9 import kill_when_frozen
from sft_kill_target import CHECKPOINT_EVERY, build_run
from tiny_loops import Recorder, assert_same_params, make_model, params_of, short_examples

from a5core.data.files import Trace
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.grading.grader import r1_zero_reward_fn
from a5core.loops.sft import SFTConfig, lr_multiplier, token_lengths, train_sft
from a5core.policy.causal_lm import get_response_log_probs, tokenize_prompt_and_output
from a5core.runtime.checkpoint import CheckpointMismatchError, NonFiniteLossError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ learning


def test_sft_learns_the_r1_format_on_held_out_prompts(tokenizer):
    """Loss falls and greedy format reward on unseen questions goes from 0 to (nearly) 1."""
    template = load_prompt("r1_zero")

    def trace(a: int, b: int) -> Trace:
        response = f" {a} + {b} = {a + b} </think> <answer> {a + b} </answer>"
        return Trace(template.format(f"What is {a} + {b}?"), response, str(a + b))

    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(0).shuffle(pairs)
    train, held_out = [trace(a, b) for a, b in pairs[:80]], [trace(a, b) for a, b in pairs[80:]]
    model = make_model(tokenizer, hidden=128, layers=2)

    def format_reward(model, step=None) -> dict[str, float]:
        engine = HFEngine(model, tokenizer, batch_size=32)  # wraps the training model itself: no copy
        groups = engine.generate([t.prompt for t in held_out], SamplingSettings(temperature=0, max_tokens=40))
        rewards = r1_zero_reward_fn.batch([g[0].text for g in groups], [t.ground_truth for t in held_out])
        return {"eval/format_reward": sum(r["format_reward"] for r in rewards) / len(rewards)}

    before = format_reward(model)["eval/format_reward"]
    log = Recorder()
    config = SFTConfig(learning_rate=5e-3, warmup_steps=5, batch_size=16, microbatch_size=16, epochs=10, eval_every=25)
    final = train_sft(model, tokenizer, train, config, evaluate=format_reward, log=log)

    assert log.steps == list(range(0, 51))  # the starting model, then 80 examples / 16 per step × 10 epochs
    assert log.calls[0] == (0, {"eval/format_reward": before})  # step 0: the model before training
    losses = [m["loss"] for _, m in log.calls[1:]]
    assert losses[-1] < 0.2 * losses[0]  # per-sequence summed NLL: ~166 (uniform over 1024 tokens) → ~12
    assert before == 0.0
    assert [s for s, m in log.calls if "eval/format_reward" in m] == [0, 25, 50]
    assert final["eval/format_reward"] >= 0.8
    assert final["step"] == 50 and final["loss"] == losses[-1]
    assert not model.training  # HFEngine put it in eval mode; train_sft restores the mode it was given


# ------------------------------------------------------------------------- gradient accumulation


def reference_step(model, tokenizer, examples, normalize_constant: float) -> tuple[float, float]:
    """(loss, grad norm) of the batch mean of −(summed response log-prob / constant), in one pass."""
    model = copy.deepcopy(model).train()
    batch = tokenize_prompt_and_output([t.prompt for t in examples], [t.response for t in examples], tokenizer)
    log_probs = get_response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"]
    loss = -((log_probs * batch["response_mask"]).sum(-1) / normalize_constant).mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


def make_llama(tokenizer, seed: int = 0):
    """A tiny Llama: no attention biases. (Qwen2's key bias has a true gradient of exactly 0, whose
    rounding noise Adam's first step, lr·g/(|g| + 1e-8), would turn into an update of ±lr.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


@pytest.mark.parametrize("n_examples", [8, 6])  # 6: one incomplete batch, micro-batches of unequal size
def test_gradient_accumulation_equals_one_big_batch(tokenizer, n_examples):
    """One step of batch 8 as 1×8, 2×4, 4×2, 8×1 micro-batches (and 4×2 with gradient checkpointing)
    logs the reference loss and gradient norm, and leaves the same parameters."""
    examples = short_examples(n_examples)
    base = make_llama(tokenizer)
    # normalize_constant 1e-3 scales every gradient far above Adam's eps, so that the first update,
    # ≈ lr·sign(g), does not amplify rounding differences of near-zero gradient entries.
    ref_loss, ref_norm = reference_step(base, tokenizer, examples, normalize_constant=1e-3)
    results = {}
    for micro, checkpointing in [(8, False), (4, False), (2, False), (1, False), (2, True)]:
        model, log = copy.deepcopy(base), Recorder()
        config = SFTConfig(
            learning_rate=1e-3,
            batch_size=8,
            microbatch_size=micro,
            epochs=1,
            normalize_constant=1e-3,
            grad_clip=0.0,
            gradient_checkpointing=checkpointing,
        )
        train_sft(model, tokenizer, examples, config, log=log)
        ((step, metrics),) = log.calls
        assert step == 1
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        results[micro, checkpointing] = params_of(model)
    assert any(not torch.equal(a, b) for a, b in zip(results[8, False].values(), params_of(base).values(), strict=True))
    for params in results.values():
        assert_same_params(params, results[8, False], atol=1e-6)  # the update itself is ±1e-3


def test_max_seq_len_cuts_the_response_end(tokenizer):
    examples = short_examples(8)
    log = Recorder()
    train_sft(
        make_model(tokenizer),
        tokenizer,
        examples,
        SFTConfig(batch_size=8, microbatch_size=4, epochs=1, max_seq_len=14),
        log=log,
    )
    prompt_lens = [len(tokenizer(t.prompt, add_special_tokens=False)["input_ids"]) for t in examples]
    response_lens = [len(tokenizer(t.response, add_special_tokens=False)["input_ids"]) for t in examples]
    kept = [max(0, min(p + r, 14) - p) for p, r in zip(prompt_lens, response_lens, strict=True)]
    ((_, metrics),) = log.calls
    assert metrics["tokens"] == sum(kept) < sum(response_lens)
    assert metrics["truncated"] == sum(k < r for k, r in zip(kept, response_lens, strict=True)) > 0


def test_append_eos_trains_each_response_to_end_with_eos(tokenizer):
    """One more response token an example (its EOS), counted alike by the lengths that decide cuts and budgets
    and by the step; off by default."""
    examples = short_examples(8)
    prompts, responses = token_lengths(examples, tokenizer)
    assert token_lengths(examples, tokenizer, append_eos=True) == (prompts, [r + 1 for r in responses])
    tokens = {}
    for append_eos in (False, True):
        log = Recorder()
        config = SFTConfig(batch_size=8, microbatch_size=4, epochs=1, append_eos=append_eos)
        train_sft(make_model(tokenizer), tokenizer, examples, config, log=log)
        ((_, metrics),) = log.calls
        tokens[append_eos] = metrics["tokens"]
    assert tokens[False] == sum(responses) and tokens[True] == sum(responses) + len(examples)
    assert SFTConfig().append_eos is False


# --------------------------------------------------------------------------- schedule and data order


def test_lr_multiplier_values():
    # warmup 2 of 6 steps, then cosine to 0 at step 6 (just past the last step, index 5)
    cosine = [lr_multiplier(t, 2, 6, "cosine") for t in range(7)]
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0]
    assert cosine == pytest.approx(expected, abs=1e-12)
    assert [lr_multiplier(t, 3, 6, "constant") for t in range(6)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1, 1])
    no_warmup = [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 - math.cos(math.pi / 4))]
    assert [lr_multiplier(t, 0, 4, "cosine") for t in range(4)] == pytest.approx(no_warmup)


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_logged_learning_rates_follow_the_schedule(tokenizer, schedule):
    """The lr each step used, as logged: warmup over 2 steps, then cosine or constant, 6 steps."""
    log = Recorder()
    config = SFTConfig(
        learning_rate=1e-3, lr_schedule=schedule, warmup_steps=2, batch_size=2, microbatch_size=2, max_steps=6
    )
    train_sft(make_model(tokenizer), tokenizer, short_examples(20), config, log=log)
    decay = [1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    expected = [0.5, 1.0] + (decay if schedule == "cosine" else [1.0] * 4)
    assert [m["lr"] for _, m in log.calls] == pytest.approx([1e-3 * x for x in expected], rel=1e-9)


class SpyTokenizer:
    """Delegates to a tokenizer and records every prompt it is asked to tokenise."""

    def __init__(self, tokenizer):
        self._tokenizer, self.prompts = tokenizer, []

    def __call__(self, texts, **kwargs):
        if all(t.startswith("What is") for t in texts):
            self.prompts.extend(texts)
        return self._tokenizer(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_each_epoch_is_a_seeded_permutation_with_the_remainder_kept(tokenizer):
    """10 examples, batch 4: 3 steps per epoch (4 + 4 + 2); every example once per epoch, a new order
    each epoch, the same orders for the same seed and other orders for another seed."""

    def orders(seed: int) -> tuple[list[list[str]], Recorder]:
        spy, log = SpyTokenizer(tokenizer), Recorder()
        config = SFTConfig(batch_size=4, microbatch_size=2, epochs=3, seed=seed)
        train_sft(make_model(tokenizer), spy, examples, config, log=log)
        return [spy.prompts[i : i + 10] for i in range(0, 30, 10)], log

    examples = short_examples(10)
    epochs, log = orders(seed=3)
    assert log.steps == list(range(1, 10))
    assert [m["epoch"] for _, m in log.calls] == pytest.approx([s / 3 for s in range(1, 10)])
    assert all(sorted(e) == sorted(t.prompt for t in examples) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert orders(seed=3)[0] == epochs
    assert orders(seed=4)[0] != epochs


# ---------------------------------------------------------------------------------------- resuming


def rng_probe(model, step) -> dict[str, float]:
    """An evaluate callback that draws from every global RNG: equal draws mean equal RNG states."""
    assert not model.training
    return {"eval/torch": torch.rand(()).item(), "eval/python": random.random(), "eval/numpy": float(np.random.rand())}


def run_config(**kwargs) -> SFTConfig:
    return SFTConfig(
        learning_rate=3e-3,
        warmup_steps=1,
        batch_size=4,
        microbatch_size=2,
        epochs=2,
        seed=7,
        eval_every=3,
        checkpoint_every=2,
        **kwargs,
    )


def optimizer_state(checkpoint_dir: Path) -> dict:
    return torch.load(checkpoint_dir / "latest" / "optimizer.pt", weights_only=True)


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["scheduler"] == b["scheduler"]
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for i, state in a["optimizer"]["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, b["optimizer"]["state"][i][key]), (i, key)


def test_resume_after_a_crash_is_exact_and_a_finished_run_is_not_repeated(tokenizer, tmp_path):
    """6 steps straight vs a run that dies in step 3 (checkpoint at 2) and is resumed by a second call:
    same logged metrics (RNG draws included) from step 3 on, same weights, same optimizer state."""
    examples = short_examples(10)  # 3 steps per epoch: the resume starts mid-epoch and crosses an epoch
    straight_model, straight = make_model(tokenizer), Recorder()
    straight_final = train_sft(
        straight_model,
        tokenizer,
        examples,
        run_config(),
        checkpoint_dir=tmp_path / "straight",
        evaluate=rng_probe,
        log=straight,
    )
    assert straight.steps == [0, 1, 2, 3, 4, 5, 6]  # step 0: the starting model's evaluation

    config, crashed = run_config(), tmp_path / "crashed"
    with pytest.raises(KeyboardInterrupt):
        train_sft(
            make_model(tokenizer),
            tokenizer,
            examples,
            config,
            checkpoint_dir=crashed,
            evaluate=rng_probe,
            log=Recorder(crash_at=3),
        )
    assert json.loads((tmp_path / "crashed" / "latest" / "state.json").read_text())["step"] == 2

    torch.manual_seed(1234), random.seed(1234), np.random.seed(1234)  # the RNGs must come from the checkpoint
    resumed_model, resumed = make_model(tokenizer, seed=99), Recorder()  # and the weights too
    resumed_final = train_sft(
        resumed_model, tokenizer, examples, config, checkpoint_dir=crashed, evaluate=rng_probe, log=resumed
    )
    assert resumed.steps == [3, 4, 5, 6]
    assert resumed.calls == straight.calls[3:]  # exact: losses, lrs, grad norms, eval RNG draws
    assert resumed_final == straight_final
    assert_same_params(params_of(resumed_model), params_of(straight_model))
    assert_same_optimizer_state(optimizer_state(tmp_path / "crashed"), optimizer_state(tmp_path / "straight"))

    # Finished: no training, no logging; the final weights are loaded into the model given.
    again_model, again = make_model(tokenizer, seed=5), Recorder()
    assert (
        train_sft(again_model, tokenizer, examples, config, checkpoint_dir=crashed, evaluate=rng_probe, log=again)
        == straight_final
    )
    assert again.calls == []
    assert_same_params(params_of(again_model), params_of(straight_model))


@pytest.fixture(scope="module")
def uninterrupted_kill_run(tiny_lm_dir) -> dict[str, torch.Tensor]:
    """The final weights of sft_kill_target's run, trained in this process without interruption."""
    model, tokenizer, examples, kwargs = build_run(tiny_lm_dir)
    train_sft(model, tokenizer, examples, SFTConfig(**kwargs))
    return params_of(model)


@pytest.mark.parametrize("mode", ["between_steps", "mid_write"])
def test_resume_after_kill_9(tiny_lm_dir, tmp_path, uninterrupted_kill_run, mode):
    """SIGKILL a training process once its first checkpoint exists (during step 3, or half-way through
    writing checkpoint 4); a new run resumes from step 2 and ends with the uninterrupted run's weights."""
    checkpoint_dir, marker = tmp_path / "ckpt", tmp_path / "frozen"
    kill_when_frozen("sft_kill_target.py", str(tiny_lm_dir), str(checkpoint_dir), str(marker), mode, marker=marker)

    assert json.loads((checkpoint_dir / "latest" / "state.json").read_text())["step"] == CHECKPOINT_EVERY
    assert (checkpoint_dir / ".latest.partial").exists() == (mode == "mid_write")

    model, tokenizer, examples, kwargs = build_run(tiny_lm_dir)
    log = Recorder()
    config = SFTConfig(**kwargs, checkpoint_every=CHECKPOINT_EVERY)
    train_sft(model, tokenizer, examples, config, checkpoint_dir=checkpoint_dir, log=log)
    assert log.steps == [3, 4, 5, 6]
    assert_same_params(params_of(model), uninterrupted_kill_run)
    assert not (checkpoint_dir / ".latest.partial").exists()
    assert json.loads((checkpoint_dir / "latest" / "state.json").read_text())["finished"] is True


# ---------------------------------------------------------------------------------------- refusals


def test_a_checkpoint_of_another_run_is_refused(tokenizer, tmp_path):
    examples = short_examples(8)
    config, ckpt = SFTConfig(learning_rate=1e-5, batch_size=4, microbatch_size=2, epochs=1), tmp_path / "ckpt"
    first = train_sft(make_model(tokenizer), tokenizer, examples, config, checkpoint_dir=ckpt)

    with pytest.raises(CheckpointMismatchError, match=r"learning_rate: 1e-05 in the checkpoint, 0\.0001 now"):
        train_sft(
            make_model(tokenizer),
            tokenizer,
            examples,
            SFTConfig(**{**vars(config), "learning_rate": 1e-4}),
            checkpoint_dir=ckpt,
        )
    with pytest.raises(CheckpointMismatchError, match="examples: 8 in the checkpoint, 7 now"):
        train_sft(make_model(tokenizer), tokenizer, examples[:7], config, checkpoint_dir=ckpt)
    changed = [*examples[:-1], Trace(examples[-1].prompt, examples[-1].response + "!", examples[-1].ground_truth)]
    with pytest.raises(CheckpointMismatchError, match="different contents or order"):
        train_sft(make_model(tokenizer), tokenizer, changed, config, checkpoint_dir=ckpt)
    # How often checkpoints and evaluations happen is not part of the run's identity.
    elsewhere = SFTConfig(**{**vars(config), "checkpoint_every": 1, "eval_every": 1})
    assert train_sft(make_model(tokenizer), tokenizer, examples, elsewhere, checkpoint_dir=ckpt) == first


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tokenizer, tmp_path):
    model = make_model(tokenizer)
    forwards = []

    def poison(module, inputs, output):  # from step 3 on (2 micro-batches per step), hidden states are NaN
        forwards.append(1)
        return output * float("nan") if len(forwards) > 4 else output

    model.model.norm.register_forward_hook(poison)
    config = SFTConfig(batch_size=4, microbatch_size=2, epochs=3, checkpoint_every=1)
    log = Recorder()
    with pytest.raises(NonFiniteLossError, match=r"step 3 of 6: loss nan"):
        train_sft(model, tokenizer, short_examples(8), config, checkpoint_dir=tmp_path / "ckpt", log=log)
    assert log.steps == [1, 2]
    latest = tmp_path / "ckpt" / "latest"
    assert json.loads((latest / "state.json").read_text())["step"] == 2
    saved = torch.load(latest / "model.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert_same_params(saved, params_of(model))  # the NaN step applied no update
    assert not (tmp_path / "ckpt" / ".latest.partial").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", 0.0),
        ("learning_rate", -1e-5),
        ("learning_rate", float("nan")),
        ("lr_schedule", "linear"),
        ("warmup_steps", -1),
        ("batch_size", 0),
        ("microbatch_size", 0),
        ("batch_size", 6),
        ("epochs", 0),
        ("max_steps", 0),
        ("weight_decay", -0.1),
        ("beta2", 1.0),
        ("beta1", -0.5),
        ("grad_clip", -1.0),
        ("normalize_constant", 0.0),
        ("max_seq_len", 1),
        ("seed", -1),
        ("eval_every", -1),
        ("checkpoint_every", 2.5),
        ("gradient_checkpointing", "yes"),
    ],
)
def test_bad_settings_raise_naming_the_field(field, value):
    with pytest.raises(
        ValueError, match=rf"(\n(\w+\.)?{field}\n|Value error, {field} must be)"
    ):  # pydantic's (the setting in its group), or a cross-field check
        SFTConfig(**{"microbatch_size": 4, field: value})


def test_no_examples_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="at least one example"):
        train_sft(make_model(tokenizer), tokenizer, [], SFTConfig())
