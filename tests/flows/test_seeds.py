"""Seeds as a dimension of a sweep: each child is the run the single-seed command makes (same settings, same folder),
the waves of ``until_decided``, and what a command over seeds refuses, in one line."""

from __future__ import annotations

import pytest

from flows.ablations import ablation_settings
from flows.fanout import label, setting_of
from flows.params import EIParams, GRPOParams, SFTExperimentParams
from flows.seeds import seed_list, waves, with_seed
from tasks.runs import run_folder, run_key
from tasks.side_by_side import Sizing

OVER_SEEDS = {"seeds": [0, 1, 2], "decide": "dapo >= grpo", "at_once": 2}


def test_a_grpo_child_is_the_single_seed_commands_run():
    ablation = {"ablation": "grpo_dapo_ablation", "ablation_only": ["grpo", "dapo"], "learning_rate": 3e-5}
    over = GRPOParams(**ablation, **OVER_SEEDS)
    child = with_seed(ablation_settings(over.ablation, over)["dapo"], 1)
    alone = ablation_settings("grpo_dapo_ablation", GRPOParams(**ablation, seed=1))["dapo"]
    assert child.flat() == alone.flat() and child.explicit() == alone.explicit()  # the same record
    assert run_folder(child, "dapo") == run_folder(alone, "dapo")  # the same folder: found finished by either
    assert run_key(over) != run_key(GRPOParams(**ablation))  # the parent over seeds is a run of its own


@pytest.mark.parametrize("model", [SFTExperimentParams, EIParams])
def test_an_sft_or_ei_child_is_the_single_seed_commands_run(model):
    child = with_seed(model(**{**OVER_SEEDS, "decide": []}), 2)
    alone = model(seed=2)
    assert child.flat() == alone.flat() and run_key(child) == run_key(alone)


def test_a_childs_label_names_its_setting_and_seed():
    assert label("E2_tb64", 3) == "E2_tb64/seed3" and setting_of("E2_tb64/seed3") == "E2_tb64"
    assert setting_of("G4_E1_Db512") == "G4_E1_Db512" and setting_of("128") == "128"


def test_until_decided_runs_the_pairs_a_verdict_needs_then_as_many_as_run_at_once():
    params = GRPOParams(decide="dapo >= grpo", until_decided=10, seed=5)
    assert seed_list(params) == list(range(5, 15))
    assert waves(params, seed_list(params), 2, Sizing(4, 1, None, "")) == [[5, 6, 7], [8, 9], [10, 11], [12, 13], [14]]
    assert waves(params, seed_list(params), 2, None) == [[5, 6, 7], *([s] for s in range(8, 15))]  # on Ray: one a wave
    assert waves(params, seed_list(params), 2, Sizing(16, 1, None, ""))[0] == list(range(5, 13))  # a full first wave
    given = GRPOParams(decide="dapo >= grpo", until_decided=4, seeds=[9, 3, 7, 1, 8])
    assert seed_list(given) == [9, 3, 7, 1]
    assert waves(GRPOParams(**OVER_SEEDS), [0, 1, 2], 2, None) == [[0, 1, 2]]  # no until_decided: one wave


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decide", "dapo >= grpo"], "decide: a verdict pairs runs of several seeds"),
        (["--seeds", "[0, 1, 1]"], "seeds: 1 given more than once"),
        (["--until-decided", "5"], "until_decided: give the expectations it decides"),
        (["--decide", "dapo >= grpo", "--until-decided", "2"], "until_decided 2: a verdict needs 3 pairs at least"),
        (["--decide", "dapo >= grpo", "--until-decided", "4", "--seeds", "[0, 1]"], "seeds names 2 seeds"),
        (["--seeds", "[0, 1]", "--decide", "dapo beats grpo"], "expectation 'dapo beats grpo': write A >= B"),
        (
            ["--ablation", "grpo_dapo_ablation", "--ablation-only", "[grpo, dapo]", "--seeds", "[0, 1]"]
            + ["--decide", "dapo >= ppo"],
            "decide 'dapo >= ppo': ppo is not a setting this command runs (grpo, dapo)",
        ),
    ],
)
def test_a_command_over_seeds_refuses_what_it_cannot_do_in_one_line(argv, message, capsys):
    from flows.grpo import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    code = stopped.value.code
    text = code if isinstance(code, str) else capsys.readouterr().err
    assert message in text and "\n" not in text.strip(), text


def test_decide_takes_the_commands_labels_their_start_and_settings():
    from flows.seeds import check_seeds

    params = GRPOParams(seeds=[0, 1, 2], decide="dapo >= dapo@start; backend=vllm ~ backend=hf")
    check_seeds(params, ["grpo", "dapo"])
    with pytest.raises(ValueError, match="decide 'gspo >= ppo': gspo and ppo are not a setting this command runs"):
        check_seeds(params.replace(decide="gspo >= ppo"), ["grpo", "dapo"])


def test_the_help_says_why_stopping_when_decided_is_valid(capsys):
    from flows.grpo import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--until-decided" in help_text and "valid because the verdicts are anytime-valid" in help_text
    assert "--seeds" in help_text and "--decide" in help_text
