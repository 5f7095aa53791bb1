"""GRPO (Algorithm 3) on CPU with tiny models: exact update, settings, extras, learning, resume."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from tiny_loops import (
    PROBLEMS,
    TEMPLATE,
    TRAIN,
    Recorder,
    RecordingEngine,
    assert_same_params,
    make_model,
    params_of,
    parity_reward,
    small_config,
    warm_start,
)

from a5core.engines.hf import HFEngine
from a5core.loops.grpo import GRPOConfig, grpo
from a5core.runtime.checkpoint import CheckpointMismatchError, NonFiniteLossError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("compile_layers", [False, True])
def test_one_step_update_equals_the_hand_computed_one(tokenizer, compile_layers):
    """Rewards → group-normalised advantages → masked-mean REINFORCE loss over the batch → clipped
    gradient → one AdamW step, all written out here from the rollouts the engine returned; the same
    with the decoder layers compiled."""
    model = make_model(tokenizer)
    start = copy.deepcopy(model)
    engine = RecordingEngine(model, tokenizer)
    config = small_config(grad_clip=0.05, compile_layers=compile_layers)
    history = grpo(model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config)

    ((prompts, groups, sampling),) = engine.calls
    assert len(prompts) == 2 and sampling.n == 4 and sampling.seed is not None
    completions = [c for group in groups for c in group]
    rewards = torch.tensor([parity_reward(c.text, None)["reward"] for c in completions]).view(2, 4)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    assert advantages.abs().sum() > 0, "the test needs groups with different rewards"

    loss = torch.zeros(())
    for i, completion in enumerate(completions):
        prompt = tokenizer(prompts[i // 4], add_special_tokens=False)["input_ids"]
        sequence = torch.tensor([prompt + list(completion.token_ids)])
        log_probs = torch.log_softmax(start(sequence).logits[0, :-1].float(), dim=-1)
        token_log_probs = log_probs[torch.arange(sequence.shape[1] - 1), sequence[0, 1:]][len(prompt) - 1 :]
        loss = loss - advantages[i] * token_log_probs.mean()
    loss = loss / len(completions)
    loss.backward()
    grads = {name: p.grad for name, p in start.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    scale = min(1.0, 0.05 / (norm.item() + 1e-6))
    assert scale < 1  # clipping is part of what is checked
    expected = {}
    for name, p in start.named_parameters():
        g = grads[name] * scale
        m_hat, v_hat = g, g * g  # Adam's first step: bias-corrected moments are g and g²
        expected[name] = p.detach() - 1e-3 * m_hat / (v_hat.sqrt() + 1e-8)
    actual = dict(model.named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(actual[name].detach(), value, atol=2e-6, rtol=0, msg=name)
    assert history[-1]["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert history[-1]["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------ settings


def test_too_few_problems():
    with pytest.raises(ValueError, match="samples 2 questions per step but got 1 problems"):
        grpo(torch.nn.Linear(1, 1), None, None, PROBLEMS[:1], TEMPLATE, parity_reward, small_config())


# ------------------------------------------------------------------------------------ loop variants


def test_off_policy_grpo_clip_logs_ratios_and_clipping(tokenizer):
    """Two epochs of two optimizer steps per rollout batch: the first step's ratios are exactly 1 (old
    log-probs are the same policy's), later ones move; clip fraction and ratio statistics are logged."""
    model = make_model(tokenizer)
    config = small_config(
        n_grpo_steps=2,
        loss_type="grpo_clip",
        epochs_per_rollout_batch=2,
        train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        cliprange=0.05,
        cliprange_high=0.1,
    )
    history = grpo(model, tokenizer, RecordingEngine(model, tokenizer), PROBLEMS, TEMPLATE, parity_reward, config)
    assert [h["optimizer_steps"] for h in history] == [4.0, 4.0]
    assert all(h["ratio_max"] > 1.0 and 0 <= h["clip_fraction"] <= 1 for h in history)
    assert any(h["clip_fraction"] > 0 for h in history)
    assert {
        "time_old_log_probs",
        "time_generate",
        "time_grade",
        "time_train",
        "time_weight_sync",
        "token_entropy",
        "response_tokens_mean",
        "advantage_std",
        "generate_tokens_per_s",
        "train_tokens_per_s",
    } <= set(history[0])


def test_drop_uniform_groups(tokenizer):
    model = make_model(tokenizer)
    constant = lambda response, truth: {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}  # noqa: E731
    before = params_of(model)
    history = grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        constant,
        small_config(drop_uniform_groups=True, loss_type="no_baseline"),
    )
    assert history[0]["dropped_groups"] == 2 and history[0]["optimizer_steps"] == 0
    assert_same_params(params_of(model), before)  # nothing left to train on
    # Without dropping, no_baseline still pushes up every (rewarded) rollout.
    grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        constant,
        small_config(loss_type="no_baseline"),
    )
    assert any(not torch.equal(before[k], v) for k, v in params_of(model).items())


class ShiftedLogProbEngine(RecordingEngine):
    """Reports each sampled token's log-prob as the policy's plus ``shift``: a sampler that is off by a
    known factor exp(-shift), so the truncated importance weight is min(exp(-shift), cap)."""

    def __init__(self, model, tokenizer, shift):
        super().__init__(model, tokenizer)
        self.shift = shift

    def generate(self, prompts, sampling):
        groups = super().generate(prompts, sampling)
        return [
            [
                c.__class__(c.text, c.token_ids, c.finish_reason, tuple(lp + self.shift for lp in c.log_probs))
                for c in group
            ]
            for group in groups
        ]


@pytest.mark.parametrize("cap, factor", [(10.0, 0.5), (0.25, 0.25)])
def test_truncated_importance_sampling_scales_the_gradient(tokenizer, cap, factor):
    """The engine claims twice the policy's probability for every token: weights min(1/2, cap)."""
    norms = {}
    for name, engine_cls, extra in [("plain", RecordingEngine, {}), ("tis", ShiftedLogProbEngine, {"tis_cap": cap})]:
        model = make_model(tokenizer)
        engine = engine_cls(model, tokenizer, math.log(2.0)) if name == "tis" else engine_cls(model, tokenizer)
        history = grpo(
            model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, small_config(grad_clip=0.0, **extra)
        )
        norms[name] = history[0]["grad_norm"]
    assert norms["tis"] == pytest.approx(factor * norms["plain"], rel=1e-4)


def test_nan_loss_stops_before_the_update_with_the_checkpoint_intact(tokenizer, tmp_path):
    model = make_model(tokenizer)
    config = small_config(n_grpo_steps=3)
    calls = []

    def reward_turning_nan(response, truth):  # a reward model that breaks during step 2
        calls.append(1)
        value = math.nan if len(calls) > 8 else parity_reward(response, truth)["reward"]
        return {"reward": value, "format_reward": 1.0, "answer_reward": value}

    with pytest.raises(NonFiniteLossError, match=r"GRPO step 2 of 3 .*loss nan"):
        grpo(
            model,
            tokenizer,
            RecordingEngine(model, tokenizer),
            PROBLEMS,
            TEMPLATE,
            reward_turning_nan,
            config,
            checkpoint_dir=tmp_path / "ckpt",
        )
    state = json.loads((tmp_path / "ckpt/latest/state.json").read_text())
    assert state["step"] == 1 and not state["finished"]


# ------------------------------------------------------------------------------------------- resume


def test_resume_after_a_crash_equals_the_uninterrupted_run(tokenizer, tmp_path):
    config, ckpt = small_config(n_grpo_steps=3, eval_every=1), tmp_path / "ckpt"
    reference = make_model(tokenizer)
    evaluate = lambda model, step: {"val_probe": float(step)}  # noqa: E731
    expected = grpo(
        reference,
        tokenizer,
        RecordingEngine(reference, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        small_config(n_grpo_steps=3, eval_every=1),
        evaluate=evaluate,
    )

    crashed = make_model(tokenizer)
    with pytest.raises(KeyboardInterrupt):
        grpo(
            crashed,
            tokenizer,
            RecordingEngine(crashed, tokenizer),
            PROBLEMS,
            TEMPLATE,
            parity_reward,
            config,
            checkpoint_dir=ckpt,
            evaluate=evaluate,
            log=Recorder(crash_at=3),
        )
    resumed = make_model(tokenizer, seed=1)  # other starting weights: the checkpoint must replace them
    recorder = Recorder()
    history = grpo(
        resumed,
        tokenizer,
        RecordingEngine(resumed, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        config,
        checkpoint_dir=ckpt,
        evaluate=evaluate,
        log=recorder,
    )
    assert recorder.steps == [3]  # steps 0-2 came from the checkpoint
    assert_same_params(params_of(resumed), params_of(reference), atol=1e-6)
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert [h["reward_mean"] for h in history[1:]] == [h["reward_mean"] for h in expected[1:]]
    assert history[-1]["wall_seconds"] >= history[-2]["wall_seconds"]
    # A finished run is not trained again; another configuration is refused.
    assert grpo(resumed, tokenizer, None, PROBLEMS, TEMPLATE, parity_reward, config, checkpoint_dir=ckpt) == history
    with pytest.raises(CheckpointMismatchError, match="learning_rate: 0.001 in the checkpoint, 0.01 now"):
        grpo(
            resumed,
            tokenizer,
            None,
            PROBLEMS,
            TEMPLATE,
            parity_reward,
            small_config(n_grpo_steps=3, learning_rate=1e-2),
            checkpoint_dir=ckpt,
        )


def test_wall_clock_after_a_resume_includes_the_killed_attempts_time(tokenizer, tmp_path):
    """A run killed in step 4 (checkpoint at step 2) replays step 3: its wall_seconds, and every later
    one, come after the killed attempt's step 3, which took long (a slow evaluation)."""
    import time

    config, ckpt = small_config(n_grpo_steps=4, checkpoint_every=2, eval_every=1), tmp_path / "ckpt"

    def slow_step_3(model, step):
        if step == 3:
            time.sleep(1.0)
        return {}

    killed, killed_log = make_model(tokenizer), Recorder(crash_at=4)
    with pytest.raises(KeyboardInterrupt):
        grpo(
            killed,
            tokenizer,
            RecordingEngine(killed, tokenizer),
            PROBLEMS,
            TEMPLATE,
            parity_reward,
            config,
            checkpoint_dir=ckpt,
            evaluate=slow_step_3,
            log=killed_log,
        )
    last_killed = max(m["wall_seconds"] for step, m in killed_log.calls if step == 3)
    resumed, resumed_log = make_model(tokenizer), Recorder()
    grpo(
        resumed,
        tokenizer,
        RecordingEngine(resumed, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        config,
        checkpoint_dir=ckpt,
        evaluate=lambda model, step: {},
        log=resumed_log,
    )
    assert resumed_log.steps == [3, 4]
    assert all(m["wall_seconds"] > last_killed for _, m in resumed_log.calls), (last_killed, resumed_log.calls)


# ------------------------------------------------------------------------------------------ learning


def brevity_reward(response: str, ground_truth: str) -> dict[str, float]:
    """A toy verifiable task with a constant part: 5 points for any answer that closes ``</answer>``,
    1 more if the whole response is under 40 characters. The baseline removes the constant; without
    one, it multiplies every sampled response's gradient and drowns the 1-point signal."""
    formatted = float("</answer>" in response)
    short = float(formatted and len(response) < 40)
    return {"reward": 5 * formatted + short, "format_reward": formatted, "answer_reward": short}


@pytest.fixture(scope="module")
def formatted_policy(tokenizer):
    """A tiny policy that writes the r1 format (brief SFT); about 2% of its samples are short."""
    return warm_start(tokenizer)


def run_toy_grpo(policy, tokenizer, loss_type: str, seed: int = 0) -> list[float]:
    """Eight GRPO steps on the brevity task; each step's mean short-answer rate."""
    model = copy.deepcopy(policy)
    config = GRPOConfig(
        n_grpo_steps=8,
        learning_rate=3e-4,
        rollout_batch_size=64,
        group_size=8,
        train_batch_size=64,
        gradient_accumulation_steps=2,
        loss_type=loss_type,
        seed=seed,
        temperature=1.0,
        min_tokens=4,
        max_tokens=32,
        eval_every=0,
    )
    history = grpo(model, tokenizer, HFEngine(model, tokenizer), TRAIN, TEMPLATE, brevity_reward, config)
    return [h["answer_reward_mean"] for h in history]


def test_grpo_raises_reward(formatted_policy, tokenizer):
    # Three seeds, the comparison of means: a single run can stall. Whether the baseline helps is not asserted
    # here: on this task, at these seeds, the final rate with a baseline minus without was -0.11, +0.09 and
    # +0.55 (mean 0.18, s.e. 0.19): within noise, as two or three runs of any setting are. The baseline's
    # arithmetic is pinned against the handout's formula (test_losses, test_grpo_objective).
    with_baseline = [run_toy_grpo(formatted_policy, tokenizer, "reinforce_with_baseline", seed) for seed in range(3)]
    assert all(curve[0] < 0.1 for curve in with_baseline), with_baseline
    assert sum(curve[-1] for curve in with_baseline) / 3 > 0.6, with_baseline


def test_should_stop_ends_the_run_early_with_a_resumable_checkpoint(tokenizer, tmp_path):
    model = make_model(tokenizer)
    config = small_config(n_grpo_steps=4, checkpoint_every=0)
    history = grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        config,
        checkpoint_dir=tmp_path / "ckpt",
        should_stop=lambda step: step >= 2,
    )
    assert [h["step"] for h in history] == [1, 2]
    state = json.loads((tmp_path / "ckpt/latest/state.json").read_text())
    assert state["step"] == 2 and not state["finished"]
    resumed = grpo(
        model,
        tokenizer,
        RecordingEngine(model, tokenizer),
        PROBLEMS,
        TEMPLATE,
        parity_reward,
        config,
        checkpoint_dir=tmp_path / "ckpt",
    )
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
