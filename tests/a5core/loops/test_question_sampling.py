"""Questions by difficulty: the sampler's modes, its refresh from rollouts, the curriculum, and the loops."""

from __future__ import annotations

import random

import pytest
from tiny_loops import TEMPLATE, RecordingEngine, make_model, parity_reward, small_config

from a5core.data.files import Problem
from a5core.loops.question_sampling import QuestionSampler, QuestionSamplingSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROBLEMS = [Problem(f"p{i}", f"What is {i} + 1?", str(i + 1), level=1 + i % 2) for i in range(8)]


def settings(**overrides) -> QuestionSamplingSettings:
    return QuestionSamplingSettings(**overrides)


def test_uniform_draws_exactly_as_random_sample():
    sampler = QuestionSampler(PROBLEMS, settings(), {"p0": 1.0})
    assert sampler.sample(random.Random(5), 4) == random.Random(5).sample(PROBLEMS, 4)


def test_learnable_keeps_questions_between_0_and_1_then_fills_with_the_rest():
    rates = {"p0": 0.0, "p1": 1.0, "p2": 0.5, "p3": 0.0, "p4": 1.0, "p5": 1.0, "p6": 0.0}  # p7 unknown
    sampler = QuestionSampler(PROBLEMS, settings(question_sampling="learnable"), rates)
    for seed in range(20):
        assert {p.unique_id for p in sampler.sample(random.Random(seed), 2)} == {"p2", "p7"}
    four = sampler.sample(random.Random(0), 4)
    assert {p.unique_id for p in four[:2]} == {"p2", "p7"} and len({p.unique_id for p in four}) == 4


def test_learnable_fills_a_short_step_at_random_so_stale_rates_are_measured_again():
    # one learnable question: the other two of each step come from the seven the table rules out, at random, so
    # that each gets drawn (and its pass rate refreshed from its rollouts); filled in problem order, every step
    # held p0 and p1 and the others were never measured again
    rates = {f"p{i}": 0.0 for i in range(8)} | {"p3": 0.5}
    sampler = QuestionSampler(PROBLEMS, settings(question_sampling="learnable"), rates)
    rng, filled = random.Random(0), set()
    for _ in range(40):
        step = sampler.sample(rng, 3)
        assert step[0].unique_id == "p3" and len({p.unique_id for p in step}) == 3
        filled |= {p.unique_id for p in step[1:]}
    assert filled == {f"p{i}" for i in range(8)} - {"p3"}


def test_weighted_favours_questions_near_one_half():
    sampler = QuestionSampler(PROBLEMS[:2], settings(question_sampling="weighted"), {"p0": 0.5, "p1": 0.0})
    rng = random.Random(0)
    picks = [sampler.sample(rng, 1)[0].unique_id for _ in range(2000)]
    assert picks.count("p0") > 1700  # weights 0.26 : 0.01, about 96 %


def test_rates_refresh_from_the_rollouts_every_n_steps_and_the_histogram_follows():
    sampler = QuestionSampler(PROBLEMS, settings(difficulty_refresh_every=2), None)
    assert sampler.metrics()["difficulty_unknown"] == 1.0
    sampler.observe(PROBLEMS[:2], [1, 1, 0, 1], step=1)  # p0: 1.0, p1: 0.5 (two rollouts each)
    assert sampler.rates == {}  # not yet: every 2 steps
    sampler.observe(PROBLEMS[2:3], [0, 0], step=2)
    assert sampler.rates == {"p0": 1.0, "p1": 0.5, "p2": 0.0}
    assert sampler.metrics() == {
        "difficulty_unsolved": 1 / 8,
        "difficulty_learnable": 1 / 8,
        "difficulty_solved": 1 / 8,
        "difficulty_unknown": 5 / 8,
    }
    copy = QuestionSampler(PROBLEMS, settings(difficulty_refresh_every=2), None)
    copy.load_state(sampler.state())
    assert copy.state() == sampler.state()


def test_curriculum_starts_at_the_lowest_level_and_moves_on_at_the_threshold():
    sampler = QuestionSampler(PROBLEMS, settings(question_sampling="curriculum", curriculum_threshold=0.75), None)
    assert {p.level for p in sampler.sample(random.Random(0), 4)} == {1}
    level_one = [p for p in PROBLEMS if p.level == 1]
    sampler.observe(level_one[:2], [1, 0, 1, 0], step=1)  # 0.5 < 0.75: stays
    assert sampler.metrics()["curriculum_level"] == 1
    sampler.observe(level_one[:2], [1, 1, 1, 0], step=2)  # 0.75: the next level joins
    assert sampler.metrics()["curriculum_level"] == 2
    assert {p.level for p in sampler.sample(random.Random(0), 8)} == {1, 2}
    six = QuestionSampler(PROBLEMS, settings(question_sampling="curriculum"), None).sample(random.Random(0), 6)
    assert [p.level for p in six[4:]] == [2, 2]  # four at level 1; the next level fills the step
    with pytest.raises(ValueError, match="curriculum needs problems with a level"):
        QuestionSampler([Problem("x", "q", "1")], settings(question_sampling="curriculum"), None)


def test_grpo_samples_only_learnable_questions_and_checkpoints_the_table(tiny_tokenizer, tmp_path):
    import json

    from a5core.loops.grpo import grpo

    tokenizer = tiny_tokenizer
    model = make_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    rates = {p.unique_id: 1.0 for p in PROBLEMS[2:]}  # all solved but p0 and p1
    config = small_config(n_grpo_steps=2, question_sampling="learnable", difficulty_refresh_every=0)
    history = grpo(
        model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config, checkpoint_dir=tmp_path, pass_rates=rates
    )
    asked = {prompt for prompts, _, _ in engine.calls for prompt in prompts}
    assert asked == {TEMPLATE.format(p.problem) for p in PROBLEMS[:2]}
    assert history[-1]["difficulty_solved"] == 6 / 8 and history[-1]["difficulty_unknown"] == 2 / 8
    state = json.loads((tmp_path / "latest/state.json").read_text())
    assert state["sampler"]["rates"] == rates and len(state["sampler"]["pending"]) == 2


def test_expert_iteration_samples_by_difficulty_and_resumes_the_table(tiny_tokenizer, tmp_path):
    import json

    from a5core.loops.expert_iteration import EIConfig, expert_iteration

    tokenizer = tiny_tokenizer
    model = make_model(tokenizer)
    engine = RecordingEngine(model, tokenizer)
    config = EIConfig(
        n_ei_steps=1, questions_per_step=2, rollouts_per_question=2, batch_size=2, microbatch_size=2,
        max_tokens=8, min_tokens=1, question_sampling="learnable", entropy_sample=0,
    )  # fmt: skip
    rates = {p.unique_id: 0.0 for p in PROBLEMS if p.unique_id not in ("p3", "p5")}
    expert_iteration(
        model, tokenizer, engine, PROBLEMS, TEMPLATE, parity_reward, config, checkpoint_dir=tmp_path, pass_rates=rates
    )
    asked = {prompt for prompts, _, _ in engine.calls for prompt in prompts}
    assert asked == {TEMPLATE.format(p.problem) for p in PROBLEMS if p.unique_id in ("p3", "p5")}
    state = json.loads((tmp_path / "state.json").read_text())
    assert set(state["sampler"]["rates"]) == set(rates) | {"p3", "p5"}  # refreshed from the round's rollouts


def test_an_arithmetic_curriculum_rises_from_one_digit_to_two(tiny_tokenizer):
    """``arithmetic:N:1-2``: N problems at each digit count, leveled; GRPO starts on the one-digit ones and
    lets the two-digit ones in once a step's one-digit rollouts reach the threshold (here: any success)."""
    from a5core.data.problem_sets import load_problem_set
    from a5core.loops.grpo import grpo

    problems = load_problem_set("arithmetic:8:1-2", "math", 0, "train")
    assert sorted(p.level for p in problems) == [1] * 8 + [2] * 8
    assert len({p.unique_id for p in problems}) == 16

    def half_right(response, truth):  # every other rollout right: 0.5 accuracy on any level
        half_right.calls += 1
        reward = float(half_right.calls % 2 == 0)
        return {"reward": reward, "format_reward": reward, "answer_reward": reward}

    half_right.calls = 0
    model = make_model(tiny_tokenizer)
    engine = RecordingEngine(model, tiny_tokenizer)
    config = small_config(n_grpo_steps=2, question_sampling="curriculum", curriculum_threshold=0.5)
    history = grpo(model, tiny_tokenizer, engine, problems, TEMPLATE, half_right, config)
    first_step = set(engine.calls[0][0])
    assert first_step <= {TEMPLATE.format(p.problem) for p in problems if p.level == 1}
    assert [h["curriculum_level"] for h in history] == [2, 2]  # raised after step 1's rollouts
