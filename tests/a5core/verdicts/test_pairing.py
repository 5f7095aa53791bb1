"""a5core.verdicts.pairing: which runs an expectation compares, cells of re-runs, pairs by start model and seed,
and the comparisons refused as unfair."""

import pytest
from verdict_runs import run

from a5core.verdicts.expectations import parse_expectation
from a5core.verdicts.pairing import pair_arms


def dapo_like(seeds=(0, 1, 2)):
    runs = []
    for seed in seeds:
        runs.append(run("grpo", 0.40 + seed / 100, seed=seed, group="grpo_dapo_ablation"))
        runs.append(run("dapo", 0.45 + seed / 100, seed=seed, group="grpo_dapo_ablation", dynamic_sampling="True"))
    return runs


def test_arms_are_learnt_from_labels_and_pair_by_start_model_and_seed():
    arms = pair_arms(parse_expectation("dapo >= grpo", experiment="grpo_dapo_ablation"), dapo_like())
    assert arms.keys == ("dynamic_sampling",)
    assert sorted((p.a.seed, round(p.difference, 6)) for p in arms.pairs) == [("0", 0.05), ("1", 0.05), ("2", 0.05)]
    assert not arms.not_judged and not arms.missing


def test_a_reference_run_made_elsewhere_serves_the_comparison_and_re_runs_count_once_as_their_mean():
    runs = dapo_like(seeds=(0,))
    # today's GRPO again, made by another ablation's flow from the same model and seed: the same cell
    runs.append(run("reinforce_with_baseline", 0.44, group="grpo_baseline_ablation"))
    arms = pair_arms(parse_expectation("dapo >= grpo"), runs)
    (pair,) = arms.pairs
    assert (
        pair.b.values == (0.40, 0.44) and pair.b.value == pytest.approx(0.42) and pair.b.spread == pytest.approx(0.04)
    )
    assert pair.difference == pytest.approx(0.45 - 0.42)
    assert arms.runs_in_pairs == (1, 2)


def test_runs_of_other_start_models_or_seeds_or_settings_do_not_pair():
    runs = [
        run("grpo", 0.40, seed=0, origin="folder:aaaa"),
        run("dapo", 0.50, seed=0, origin="folder:bbbb", dynamic_sampling="True"),  # another start model
        run("dapo", 0.50, seed=1, dynamic_sampling="True"),  # another seed
        run("dapo", 0.50, seed=0, dynamic_sampling="True", validation_data="other"),  # scored elsewhere
    ]
    arms = pair_arms(parse_expectation("dapo >= grpo"), runs)
    assert arms.pairs == [] and arms.keys == ("dynamic_sampling",)


def test_the_scope_limits_where_labels_are_learnt():
    runs = dapo_like(seeds=(0,)) + [run("grpo", 0.9, group="other", learning_rate="1")]
    arms = pair_arms(parse_expectation("dapo >= grpo", experiment="grpo_dapo_ablation"), runs)
    assert arms.keys == ("dynamic_sampling",)  # the other group's "grpo" (another learning rate) is not learnt from
    assert pair_arms(parse_expectation("dapo >= grpo", experiment="nowhere"), runs).missing


def test_an_arm_given_by_settings():
    runs = [run("single", 0.4, backend="hf", seed=s) for s in (0, 1)] + [
        run("single", 0.5, backend="vllm", seed=s) for s in (0, 1)
    ]
    arms = pair_arms(parse_expectation("backend=vllm ~ backend=hf"), runs)
    assert arms.keys == ("backend",) and [round(p.difference, 6) for p in arms.pairs] == [0.1, 0.1]


def test_against_its_start_each_run_is_its_own_pair():
    runs = [run("G8", 0.38 + s / 100, seed=s, start=0.01, group="ei_sweep", rollouts="8") for s in range(3)]
    runs.append(run("G8", 0.5, seed=5, start=0.02, group="expert_iteration", rollouts="8"))  # same settings elsewhere
    runs.append(run("G4", 0.9, seed=0, start=0.01, group="ei_sweep", rollouts="4"))  # other settings: not G8's
    arms = pair_arms(parse_expectation("G8 >= G8@start", experiment="ei_sweep"), runs)
    assert sorted(round(p.difference, 6) for p in arms.pairs) == [0.37, 0.38, 0.39, 0.48]


def test_missing_arms_and_arms_that_differ_in_nothing_are_said():
    runs = dapo_like(seeds=(0,))
    assert "no run of token_mean" in pair_arms(parse_expectation("token_mean >= grpo"), runs).missing
    same = [run("a", 0.4), run("b", 0.5)]
    assert "differ in no setting" in pair_arms(parse_expectation("a >= b"), same).missing


def test_a_start_model_trained_with_one_arms_prompt_is_not_a_fair_comparison():
    sft = run("1024", 0.01, origin="folder:base", made="folder:sft", group="sft_experiment", prompt="r1_zero")
    arms = [
        run("r1_zero", 0.40, origin="folder:sft", seed=s, prompt="r1_zero", reward_fn="arithmetic") for s in range(3)
    ] + [
        run(
            "question_only",
            0.30,
            origin="folder:sft",
            seed=s,
            prompt="question_only",
            reward_fn="arithmetic_question_only",
        )
        for s in range(3)
    ]
    found = pair_arms(parse_expectation("question_only >= r1_zero"), [sft, *arms])
    assert found.pairs == [] and len(found.set_apart) == 3  # every pair set apart: nothing left to judge
    assert "trained with prompt=r1_zero" in found.not_judged and sft.id[:8] in found.not_judged
    assert all("trained with prompt=r1_zero" in why for _, why in found.set_apart)
    # from a start model trained for neither prompt (or one whose training is not among the runs): fair
    neutral = run("1024", 0.01, origin="folder:base", made="folder:sft", group="sft_experiment", prompt="plain")
    assert pair_arms(parse_expectation("question_only >= r1_zero"), [neutral, *arms]).not_judged == ""
    assert pair_arms(parse_expectation("question_only >= r1_zero"), arms).not_judged == ""


def prompt_arms(origin, values, seeds):
    """A run of each prompt arm per seed from ``origin``, each graded by its own prompt's arithmetic grader."""
    return [
        run(label, value, origin=origin, seed=s, prompt=label, reward_fn=grader)
        for s in seeds
        for label, grader, value in (
            ("r1_zero", "arithmetic", values[0]),
            ("question_only", "arithmetic_question_only", values[1]),
        )
    ]


def test_pairs_from_a_start_model_that_favours_an_arm_are_set_apart_and_the_fair_ones_judged():
    sft = run("1024", 0.01, origin="folder:base", made="folder:sft", group="sft_experiment", prompt="r1_zero")
    runs = [sft, *prompt_arms("folder:sft", (0.40, 0.30), range(3)), *prompt_arms("folder:base", (0.2, 0.25), (7, 8))]
    runs.append(run("r1_zero", 0.21, origin="folder:base", seed=9, prompt="r1_zero", reward_fn="arithmetic"))
    runs.append(
        run(
            "question_only",
            0.3,
            origin="folder:base",
            seed=9,
            prompt="question_only",
            reward_fn="arithmetic_question_only",
        )
    )
    # a run that recorded no start model's hash (its parent run stands for it): what it was trained with is unknown
    runs += prompt_arms("parent run 778f5e61", (0.4, 0.3), (4,))
    found = pair_arms(parse_expectation("question_only >= r1_zero"), runs)
    assert found.not_judged == ""
    assert sorted(p.a.seed for p in found.pairs) == ["7", "8", "9"]  # the base model's pairs: trained for neither
    assert sorted(p.a.seed for p, _ in found.set_apart) == ["0", "1", "2", "4"]
    assert [why for p, why in found.set_apart if p.a.seed == "4"] == [
        "its start model (parent 778f5e61) has no recorded hash: whether it favours an arm is unknown"
    ]


@pytest.mark.parametrize(
    ("recorded", "favoured"),
    [
        ({"trace_prompts": "question_only,r1_zero"}, ""),  # trained for both prompts alike: fair, judged
        ({"trace_prompts": "r1_zero"}, "prompt=r1_zero"),
        ({"trace_prompts": "question_only"}, "prompt=question_only"),
        ({}, "prompt=r1_zero"),  # a record from before trace_prompts: its prompt setting, as ever
    ],
)
def test_the_prompts_a_start_model_was_trained_for_are_those_of_its_traces_where_recorded(recorded, favoured):
    sft = run(
        "1024", 0.01, origin="folder:base", made="folder:sft", group="sft_experiment", prompt="r1_zero", **recorded
    )
    found = pair_arms(
        parse_expectation("question_only >= r1_zero"), [sft, *prompt_arms("folder:sft", (0.4, 0.3), range(3))]
    )
    if favoured:
        assert found.pairs == [] and len(found.set_apart) == 3
        assert all(f"trained with {favoured}, one arm's prompt" in why for _, why in found.set_apart)
    else:
        assert found.set_apart == [] and len(found.pairs) == 3 and found.not_judged == ""


def test_arms_that_all_scored_alike_cannot_be_judged():
    at_floor = prompt_arms("folder:base", (0.0, 0.0), range(3))
    found = pair_arms(parse_expectation("question_only >= r1_zero"), at_floor)
    assert len(found.pairs) == 3 and "every run of both arms scored 0.000" in found.not_judged
    # one run off the floor: the arms can be told apart
    moved = prompt_arms("folder:base", (0.0, 0.0), range(2)) + prompt_arms("folder:base", (0.0, 0.01), (2,))
    assert pair_arms(parse_expectation("question_only >= r1_zero"), moved).not_judged == ""


def test_a_start_model_whose_runs_all_sit_at_the_floor_is_set_apart_while_another_can_tell_the_arms_apart():
    """Pairs from a model that scores 0 under both arms carry no information about the difference: counted, they
    would pull it toward 0. Set apart, with why; the other start model's pairs are judged alone."""
    informative = prompt_arms("folder:sft", (0.40, 0.34), range(4))
    found = pair_arms(
        parse_expectation("question_only >= r1_zero"), [*prompt_arms("folder:base", (0.0, 0.0), range(3)), *informative]
    )
    assert [p.a.origin for p in found.pairs] == ["folder:sft"] * 4 and found.not_judged == ""
    assert [p.a.origin for p, _ in found.set_apart] == ["folder:base"] * 3
    assert all("from this start model scored 0.000" in why for _, why in found.set_apart)
    # a tie off the floor and ceiling is a measurement, not a floor: it stays (one pair of 0.35 and 0.35)
    tie = prompt_arms("folder:other", (0.35, 0.35), (5,))
    found = pair_arms(parse_expectation("question_only >= r1_zero"), [*tie, *informative])
    assert len(found.pairs) == 5 and found.set_apart == []


def test_arms_scored_by_different_graders_are_not_a_fair_comparison():
    runs = [run("strict", 0.3, reward_fn="r1_zero", seed=s) for s in range(3)] + [
        run("lenient", 0.6, reward_fn="arithmetic", seed=s) for s in range(3)
    ]
    assert "different graders" in pair_arms(parse_expectation("lenient >= strict"), runs).not_judged
    mismatched = [run("a", 0.3, prompt="question_only", reward_fn="arithmetic", seed=0)] + [
        run("b", 0.3, prompt="r1_zero", reward_fn="r1_zero", seed=0)
    ]
    assert "not the grader of its prompt" in pair_arms(parse_expectation("a >= b"), mismatched).not_judged
