"""Expert Iteration on toy verifiable tasks (1-digit additions) with a tiny model, on CPU."""

import json

import pytest
import torch
from tiny_loops import TEMPLATE, TRAIN, make_model, warm_start

from a5core.data.arithmetic import arithmetic_problems
from a5core.data.files import Problem
from a5core.data.prompts import load_prompt
from a5core.engines import SamplingSettings
from a5core.engines.hf import HFEngine
from a5core.grading.grader import r1_zero_reward_fn
from a5core.loops import expert_iteration as expert_iteration_module
from a5core.loops.expert_iteration import EIConfig, expert_iteration
from a5core.loops.sft import train_sft
from a5core.runtime.checkpoint import CorruptStateError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


HELD_OUT = arithmetic_problems(16, digits=1, operations="+", split="validation", seed=0)
# Additions that all make ten. The warm-started policy writes the format but cannot read a question yet (its
# answers follow the sums it saw, whatever it is asked: measured, about 1 in 10 of its samples of these is right),
# so a learning test on other additions only measures noise around chance. Here what its correct samples have
# in common (the answer 10) is learnable in a few EI rounds, and the verifier still grades every answer.
MAKE_TEN = [Problem(f"make-ten/{a}", f"What is ${a} + {10 - a}$?", "10") for a in range(1, 10)]


def sampled_reward(model, tokenizer, problems, n: int = 16, seed: int = 1) -> float:
    """Mean r1_zero reward of ``n`` samples per problem at temperature 1 (seeded)."""
    engine = HFEngine(model, tokenizer, batch_size=64)
    groups = engine.generate(
        [TEMPLATE.format(p.problem) for p in problems], SamplingSettings(temperature=1.0, max_tokens=32, n=n, seed=seed)
    )
    rewards = r1_zero_reward_fn.batch(
        [o.text for g in groups for o in g], [p.answer for p in problems for _ in range(n)]
    )
    return sum(r["reward"] for r in rewards) / len(rewards)


def greedy_reward(model, tokenizer, problems) -> float:
    engine = HFEngine(model, tokenizer, batch_size=64)
    groups = engine.generate(
        [TEMPLATE.format(p.problem) for p in problems], SamplingSettings(temperature=0, max_tokens=32)
    )
    rewards = r1_zero_reward_fn.batch([g[0].text for g in groups], [p.answer for p in problems])
    return sum(r["reward"] for r in rewards) / len(rewards)


def ei_config(n_ei_steps=3, **overrides):
    return EIConfig(
        **{
            "n_ei_steps": n_ei_steps,
            "questions_per_step": len(MAKE_TEN),  # every question, each round
            "rollouts_per_question": 8,
            "seed": 0,
            "entropy_sample": 8,
            "temperature": 1.0,
            "min_tokens": 4,
            "max_tokens": 32,
            "learning_rate": 5e-4,
            "batch_size": 10,
            "microbatch_size": 10,
            "epochs": 4,
            **overrides,  # each round's SFT
        }
    )


def test_expert_iteration_raises_reward_over_its_starting_policy(tokenizer, tmp_path):
    """Round k's kept fraction is the sampled reward of the policy after k EI updates (round 0: the start);
    the policy after the last round is sampled once more. Measured on the make-ten task over thread counts,
    CPU kernels (ATEN_CPU_CAPABILITY avx2, default), EI seeds and warm-start seeds: start 0.04–0.18, after
    three rounds 0.88–0.99, so the bounds below hold by a wide margin wherever the float path takes the
    warm start."""
    model = warm_start(tokenizer)
    logged = []
    config = ei_config(rollouts_per_question=16, learning_rate=1e-3)
    history = expert_iteration(
        model,
        tokenizer,
        HFEngine(model, tokenizer),
        MAKE_TEN,
        TEMPLATE,
        r1_zero_reward_fn,
        config,
        checkpoint_dir=tmp_path / "ei",
        log=lambda m, s: logged.append((s, m)),
    )
    rewards = [h["kept_fraction"] for h in history] + [sampled_reward(model, tokenizer, MAKE_TEN)]
    assert len(history) == 3 and 0 < rewards[0] < 0.3, rewards
    assert rewards[-1] > 0.6 and rewards[-1] - rewards[0] > 0.4, rewards
    assert {"kept_fraction", "rollout_mean_token_entropy", "rollout_mean_response_tokens_correct", "sft_loss"} <= set(
        history[0]
    )
    assert any(k.startswith("sft/") for _, m in logged for k in m)  # the inner SFT steps are logged too
    # Each round's kept set is saved and holds only correct traces.
    kept = [json.loads(line) for line in (tmp_path / "ei/round-0/kept.jsonl").read_text().splitlines()]
    assert len(kept) == history[0]["kept"] and all(
        r1_zero_reward_fn(k["response"], k["ground_truth"])["reward"] == 1 for k in kept
    )


def test_a_finished_run_is_not_repeated_and_a_resumed_one_continues(tokenizer, tmp_path):
    model = warm_start(tokenizer)
    first = expert_iteration(
        model,
        tokenizer,
        HFEngine(model, tokenizer),
        TRAIN,
        TEMPLATE,
        r1_zero_reward_fn,
        ei_config(1),
        checkpoint_dir=tmp_path / "ei",
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # Asking for two rounds resumes after round 0 from the saved weights, even in a fresh model object.
    fresh = warm_start(tokenizer)
    calls = []
    second = expert_iteration(
        fresh,
        tokenizer,
        HFEngine(fresh, tokenizer),
        TRAIN,
        TEMPLATE,
        r1_zero_reward_fn,
        ei_config(2),
        checkpoint_dir=tmp_path / "ei",
        log=lambda m, s: calls.append(s),
    )
    assert second[0] == first[0] and len(second) == 2
    assert set(calls) == {2}  # only round 1 ran (logged at step 2: after two rounds)
    rerun = expert_iteration(
        fresh,
        tokenizer,
        HFEngine(fresh, tokenizer),
        TRAIN,
        TEMPLATE,
        r1_zero_reward_fn,
        ei_config(2),
        checkpoint_dir=tmp_path / "ei",
    )
    assert rerun == second
    assert any(not torch.equal(weights[k], v) for k, v in fresh.state_dict().items())  # round 1 trained


class Planted:
    """What a tampered checkpoint would unpickle: any import, any call (here a harmless marker)."""

    def __reduce__(self):
        return (print, ("unpickled: arbitrary code ran",))


def test_a_round_checkpoint_is_loaded_as_tensors_only(tokenizer, tmp_path, capsys, monkeypatch):
    """model.pt is read with torch.load(weights_only=True): a pickled object in it is refused, not run. Said
    explicitly, not left to torch's default: the environment variable below turns the default off."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    model = make_model(tokenizer)
    config = ei_config(2)
    root = tmp_path / "ei"
    root.mkdir()
    (root / "state.json").write_text(
        json.dumps({"rounds": [{"kept_fraction": 0.5}]})
    )  # round 0 done: resume loads model.pt
    torch.save({**model.state_dict(), "extra": Planted()}, root / "model.pt")
    with pytest.raises(CorruptStateError, match=r"model\.pt: unreadable \(Weights only load failed"):
        expert_iteration(
            model,
            tokenizer,
            HFEngine(model, tokenizer),
            TRAIN,
            TEMPLATE,
            r1_zero_reward_fn,
            config,
            checkpoint_dir=root,
        )
    assert "arbitrary code ran" not in capsys.readouterr().out


def test_bad_settings():
    with pytest.raises(ValueError, match="rollouts_per_question"):
        EIConfig(rollouts_per_question=0)
    round_sft = EIConfig(learning_rate=3e-4, epochs=2, seed=5).round_sft(3, TEMPLATE)  # E epochs, constant, per round
    assert (round_sft.learning_rate, round_sft.epochs, round_sft.lr_schedule, round_sft.seed) == (
        3e-4,
        2,
        "constant",
        8,
    )


def test_a_template_that_stops_at_eos_trains_each_kept_response_followed_by_eos(tokenizer, monkeypatch):
    """r1_zero's responses end in their stop string, kept in the text; question_only's end at EOS, which the text
    lacks: its rounds append EOS, so the model learns to stop."""
    assert not EIConfig().round_sft(0, TEMPLATE).append_eos
    assert EIConfig().round_sft(0, load_prompt("question_only")).append_eos
    seen = []

    def recording_train_sft(model, tokenizer, traces, config, **kwargs):
        seen.append(config.append_eos)
        return train_sft(model, tokenizer, traces, config, **kwargs)

    def always_right(response, answer):  # every rollout kept, so the round trains
        return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}

    monkeypatch.setattr(expert_iteration_module, "train_sft", recording_train_sft)
    model = warm_start(tokenizer)
    expert_iteration(
        model,
        tokenizer,
        HFEngine(model, tokenizer),
        MAKE_TEN,
        load_prompt("question_only"),
        always_right,
        ei_config(n_ei_steps=1, rollouts_per_question=2, max_tokens=8, epochs=1),
    )
    assert seen == [True]
