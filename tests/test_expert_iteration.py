"""Expert Iteration on a toy verifiable task (1-digit addition) with a tiny model, on CPU."""

import json

import pytest
import torch

from a5core.arithmetic import arithmetic_problems
from a5core.data import Trace
from a5core.expert_iteration import EIConfig, expert_iteration
from a5core.grading import r1_zero_reward_fn
from a5core.prompts import load_prompt
from a5core.rollout import SamplingSettings
from a5core.rollout.hf import HFEngine
from a5core.sft import SFTConfig, train_sft
from test_sft import make_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


TEMPLATE = load_prompt("r1_zero")
TRAIN = arithmetic_problems(60, digits=1, operations="+", split="train", seed=0)
HELD_OUT = arithmetic_problems(16, digits=1, operations="+", split="validation", seed=0)


def greedy_reward(model, tokenizer, problems) -> float:
    engine = HFEngine(model, tokenizer, batch_size=64)
    groups = engine.generate([TEMPLATE.format(p.problem) for p in problems], SamplingSettings(temperature=0, max_tokens=32))
    rewards = r1_zero_reward_fn.batch([g[0].text for g in groups], [p.answer for p in problems])
    return sum(r["reward"] for r in rewards) / len(rewards)


def warm_start(tokenizer):
    """A policy that has the format but gets only some sums right: brief SFT on the 60 questions."""
    model = make_model(tokenizer, hidden=128, layers=2)
    traces = [Trace(TEMPLATE.format(p.problem), f" {p.problem[9:-2]} = {p.answer} </think> <answer> {p.answer} </answer>", p.answer)
              for p in TRAIN]
    train_sft(model, tokenizer, traces, SFTConfig(learning_rate=5e-3, warmup_steps=5, batch_size=10, microbatch_size=10, epochs=12))
    return model


def ei_config(tmp_path, n_ei_steps=3):
    return EIConfig(
        n_ei_steps=n_ei_steps, questions_per_step=60, rollouts_per_question=8, seed=0, entropy_sample=8,
        checkpoint_dir=str(tmp_path / "ei") if tmp_path else None,
        sampling=SamplingSettings(temperature=1.0, min_tokens=4, max_tokens=32),
        sft=SFTConfig(learning_rate=5e-4, batch_size=10, microbatch_size=10, epochs=4, lr_schedule="constant"),
    )


def test_expert_iteration_raises_reward_over_its_starting_policy(tokenizer, tmp_path):
    """Round k's kept fraction is the sampled reward of the policy after k EI updates (round 0: the start)."""
    model = warm_start(tokenizer)
    logged = []
    history = expert_iteration(model, tokenizer, HFEngine(model, tokenizer), TRAIN, TEMPLATE, r1_zero_reward_fn,
                               ei_config(tmp_path), log=lambda m, s: logged.append((s, m)))
    rewards = [h["kept_fraction"] for h in history]
    assert len(history) == 3 and 0 < rewards[0] < 0.5
    assert rewards[-1] >= 1.2 * rewards[0], rewards
    assert {"kept_fraction", "rollout_mean_token_entropy", "rollout_mean_response_tokens_correct", "sft_loss"} <= set(history[0])
    assert any(k.startswith("sft/") for _, m in logged for k in m)  # the inner SFT steps are logged too
    # Each round's kept set is saved and holds only correct traces.
    kept = [json.loads(line) for line in (tmp_path / "ei/round-0/kept.jsonl").read_text().splitlines()]
    assert len(kept) == history[0]["kept"] and all(r1_zero_reward_fn(k["response"], k["ground_truth"])["reward"] == 1 for k in kept)


def test_a_finished_run_is_not_repeated_and_a_resumed_one_continues(tokenizer, tmp_path):
    model = warm_start(tokenizer)
    first = expert_iteration(model, tokenizer, HFEngine(model, tokenizer), TRAIN, TEMPLATE, r1_zero_reward_fn, ei_config(tmp_path, 1))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # Asking for two rounds resumes after round 0 from the saved weights, even in a fresh model object.
    fresh = warm_start(tokenizer)
    calls = []
    second = expert_iteration(fresh, tokenizer, HFEngine(fresh, tokenizer), TRAIN, TEMPLATE, r1_zero_reward_fn,
                              ei_config(tmp_path, 2), log=lambda m, s: calls.append(s))
    assert second[0] == first[0] and len(second) == 2
    assert set(calls) == {1}  # only round 1 ran
    rerun = expert_iteration(fresh, tokenizer, HFEngine(fresh, tokenizer), TRAIN, TEMPLATE, r1_zero_reward_fn, ei_config(tmp_path, 2))
    assert rerun == second
    assert any(not torch.equal(weights[k], v) for k, v in fresh.state_dict().items())  # round 1 trained


def test_bad_settings():
    with pytest.raises(ValueError, match="rollouts_per_question"):
        EIConfig(rollouts_per_question=0)
