"""a5core.verdicts.decide and .expectations: the words each kind of evidence earns, before and after the
correction; what is left out and why; expectations as a user writes them."""

from dataclasses import replace

import pytest
from verdict_runs import run

from a5core.verdicts.decide import Rule, decide
from a5core.verdicts.expectations import expectations_from, parse_expectation


def arm_pair(setting, reference, differences, key="option", base=0.4, group="ablation"):
    """Runs of ``setting`` and ``reference`` from one start model, a seed each, ``setting`` ahead by each of
    ``differences``."""
    runs = []
    for seed, difference in enumerate(differences):
        runs.append(run(reference, base + seed / 100, seed=seed, group=group))
        runs.append(run(setting, base + seed / 100 + difference, seed=seed, group=group, **{key: setting}))
    return runs


def test_the_words_each_kind_of_evidence_earns():
    runs = (
        arm_pair("better", "ref_a", [0.10, 0.11, 0.09, 0.10, 0.12], key="a")
        + arm_pair("worse", "ref_b", [-0.10, -0.11, -0.09, -0.10, -0.12], key="b")
        + arm_pair("same", "ref_c", [0.001, -0.002, 0.0, 0.002, -0.001], key="c")
        + arm_pair("noisy", "ref_d", [0.2, -0.2, 0.1, -0.1, 0.0], key="d")
        + arm_pair("drift", "ref_e", [0.10, 0.11, 0.09, 0.10, 0.12], key="e")
        + arm_pair("few", "ref_f", [0.10, 0.12], key="f")
    )
    asked = [
        parse_expectation(t)
        for t in (
            "better >= ref_a",
            "worse >= ref_b",
            "same >= ref_c",
            "noisy >= ref_d",
            "drift ~ ref_e",
            "few >= ref_f",
            "absent >= ref_a",
        )
    ]
    decision = decide(asked, runs, Rule(correction="none"))
    words = [v.word for v in decision.verdicts]
    assert words == [
        "agrees",
        "disagrees",
        "within noise",
        "inconclusive",
        "disagrees",
        "too few runs",
        "not measured",
    ]
    noisy, few = decision.verdicts[3], decision.verdicts[5]
    assert noisy.decidable == pytest.approx(noisy.half)  # no correction: the raw interval decides
    assert 50 < noisy.more_pairs < 200  # no effect seen, much noise: parity needs many pairs (about 108 in all)
    assert few.sample.mean == pytest.approx(0.11) and few.p_difference is None and few.more_pairs >= 1
    assert decision.family == 5


def test_the_correction_turns_a_lone_raw_decision_among_many_questions_into_inconclusive():
    runs = arm_pair("x", "ref", [0.05, 0.02, 0.08, 0.04], key="x")
    asked = [parse_expectation("x >= ref")]
    for i in range(9):  # nine more expectations with no effect
        runs += arm_pair(f"n{i}", f"r{i}", [0.03, -0.04, 0.01, -0.02], key=f"k{i}")
        asked.append(parse_expectation(f"n{i} >= r{i}"))
    holm = decide(asked, runs, Rule(correction="holm"))
    lone = holm.verdicts[0]
    assert lone.p_difference < 0.05 and lone.raw == "agrees"
    assert lone.adjusted_difference > 0.05 and lone.word == "inconclusive"
    assert lone.decidable > lone.half  # the strictest level asks for a wider margin
    assert lone.more_pairs is not None
    bh = decide(asked, runs, Rule(correction="bh"))
    assert bh.verdicts[0].adjusted_difference <= holm.verdicts[0].adjusted_difference


def test_runs_of_a_failed_flow_and_excluded_runs_are_shown_apart():
    runs = arm_pair("x", "ref", [0.1, 0.1, 0.1], key="x")
    failed = run("x", 0.99, seed=7, flow_status="FAILED", x="x")
    stopped = run("x", 0.99, seed=8, status="RUNNING", x="x")
    unfinished = replace(run("x", 0.0, seed=9, x="x"), finals={}, status="FAILED")
    decision = decide(
        [parse_expectation("x >= ref")], [*runs, failed, stopped, unfinished], exclude={runs[0].id[:8]: "a bug"}
    )
    apart = {r.id: why for r, why in decision.left_out}
    assert apart[failed.id] == "the flow that ran it ended FAILED"
    assert apart[stopped.id] == "it ended RUNNING"
    assert apart[runs[0].id] == "a bug"
    assert unfinished.id not in apart  # no result at all: nothing to show
    assert decision.verdicts[0].k == 2  # seed 0's reference excluded: its pair is gone


def test_comparisons_that_share_a_reference_say_so():
    runs = arm_pair("x", "ref", [0.1, 0.1, 0.1], key="x") + [run("y", 0.5 + s / 100, seed=s, y="y") for s in range(3)]
    decision = decide([parse_expectation("x >= ref"), parse_expectation("y >= ref")], runs)
    assert decision.verdicts[0].shares_with == [1] and decision.verdicts[1].shares_with == [0]


def test_unfair_comparisons_are_not_judged_and_leave_the_family():
    sft = run("1024", 0.0, origin="folder:base", made="folder:aaaa", prompt="r1_zero")
    runs = [sft]
    for s in range(4):
        runs += [
            run("r1_zero", 0.4, seed=s, prompt="r1_zero"),
            run("question_only", 0.3, seed=s, prompt="question_only", reward_fn="arithmetic_question_only"),
        ]
    decision = decide([parse_expectation("question_only >= r1_zero")], runs)
    (verdict,) = decision.verdicts
    assert verdict.word == "not judged" and verdict.k == 0 and len(verdict.arms.set_apart) == 4
    assert not verdict.judged and decision.family == 0


@pytest.mark.parametrize(
    ("text", "a", "relation", "b", "metric"),
    [
        ("dapo >= grpo", "dapo", ">=", "grpo", "final_val_accuracy"),
        ("kl_0~kl_0.001", "kl_0", "~", "kl_0.001", "final_val_accuracy"),
        ("1024 <= 128 on final_val_format_rate", "1024", "<=", "128", "final_val_format_rate"),
        (
            "backend=vllm,seed=1 ~ backend=hf,seed=1",
            "backend=vllm,seed=1",
            "~",
            "backend=hf,seed=1",
            "final_val_accuracy",
        ),
        ("G8_E2_Db512 >= G8_E2_Db512@start", "G8_E2_Db512", ">=", "G8_E2_Db512@start", "final_val_accuracy"),
    ],
)
def test_expectations_as_written(text, a, relation, b, metric):
    e = parse_expectation(text)
    assert (e.a, e.relation, e.b, e.metric) == (a, relation, b, metric)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dapo > grpo", "write A >= B"),
        ("dapo >= dapo", "compared with itself"),
        ("a@start >= a", "@start goes on the right"),
        ("a >= b@start", "compare runs with their own start"),
        ("a b >= c", "write A >= B"),
    ],
)
def test_expectations_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_expectation(text)


def test_an_expectations_file_names_the_entry_at_fault():
    found, exclude = expectations_from(
        {
            "metric": "final_val_format_rate",
            "expectations": ["a >= b", {"expect": "c ~ d", "experiment": "x", "why": "because"}],
            "exclude": {"60cb": "a bug"},
        },
        "f.yaml",
    )
    assert [e.text for e in found] == ["a >= b on final_val_format_rate", "c ~ d on final_val_format_rate"]
    assert found[1].experiment == "x" and found[1].why == "because" and exclude == {"60cb": "a bug"}
    with pytest.raises(ValueError, match=r"f.yaml: expectations\[2\]: unknown keys colour"):
        expectations_from({"expectations": ["a >= b", {"expect": "c >= d", "colour": "red"}]}, "f.yaml")
    with pytest.raises(ValueError, match=r"f.yaml: expectations\[1\]: expectation 'a > b'"):
        expectations_from({"expectations": ["a > b"]}, "f.yaml")
    with pytest.raises(ValueError, match="f.yaml: expectation: Extra inputs"):
        expectations_from({"expectations": ["a >= b"], "expectation": 1}, "f.yaml")
    with pytest.raises(ValueError, match="f.yaml: expectations"):
        expectations_from({"expectations": []}, "f.yaml")
