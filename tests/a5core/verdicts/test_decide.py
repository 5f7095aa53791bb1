"""a5core.verdicts.decide and .expectations: the words each kind of evidence earns, before and after the
correction, under either method; a verdict's scope (general or for its start models); endpoints, equal rollouts and
compute; what is left out and why; the rules' effects; expectations as a user writes them."""

from dataclasses import replace

import pytest
from verdict_runs import run

from a5core.verdicts.decide import PAIRS, START_MODELS, Rule, decide, rule_changes
from a5core.verdicts.expectations import expectations_from, parse_expectation
from a5core.verdicts.pairing import Compute


def arm_pair(setting, reference, differences, key="option", base=0.4, group="ablation"):
    """Runs of ``setting`` and ``reference`` from one start model, a seed each, ``setting`` ahead by each of
    ``differences``."""
    runs = []
    for seed, difference in enumerate(differences):
        runs.append(run(reference, base + seed / 100, seed=seed, group=group))
        runs.append(run(setting, base + seed / 100 + difference, seed=seed, group=group, **{key: setting}))
    return runs


def _words_page():
    runs = (
        arm_pair("better", "ref_a", [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.11, 0.09], key="a")
        + arm_pair("worse", "ref_b", [-0.10, -0.11, -0.09, -0.10, -0.12, -0.10, -0.11, -0.09], key="b")
        + arm_pair("same", "ref_c", [0.001, -0.002, 0.0, 0.002, -0.001, 0.001, 0.0, -0.001], key="c")
        + arm_pair("noisy", "ref_d", [0.2, -0.2, 0.1, -0.1, 0.0, 0.15, -0.15, 0.05], key="d")
        + arm_pair("drift", "ref_e", [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.11, 0.09], key="e")
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
    return runs, asked


WORDS = ["agrees", "disagrees", "within noise", "inconclusive", "disagrees", "too few runs", "not measured"]


@pytest.mark.parametrize("method", ["anytime", "fixed"])
def test_the_words_each_kind_of_evidence_earns(method):
    runs, asked = _words_page()
    decision = decide(asked, runs, Rule(method=method, correction="none"))
    assert [v.word for v in decision.verdicts] == WORDS
    noisy, few = decision.verdicts[3], decision.verdicts[5]
    test = noisy.tests[PAIRS]
    assert test.decidable == pytest.approx(test.half)  # no correction: the raw interval decides
    assert noisy.more_pairs is None or noisy.more_pairs > 20  # no effect seen, much noise: parity needs many pairs
    assert few.sample.mean == pytest.approx(0.11) and not few.tests and few.more_pairs >= 1
    assert decision.verdicts[0].scope == ("for this start model" if method == "anytime" else "general")


def test_the_anytime_rule_reads_every_test_at_alpha_over_the_tests_the_page_asks():
    runs, asked = _words_page()
    decision = decide(asked, runs)  # anytime, bonferroni, start models as a level
    assert decision.family == 2 * len(asked)  # fixed before any run: every expectation asked, on both levels
    better = decision.verdicts[0].tests[PAIRS]
    assert better.adjusted_difference == pytest.approx(min(1.0, decision.family * better.p_difference))
    assert decision.verdicts[0].word == "agrees"  # 8 pairs of +0.1 ± 0.01: decided even at 0.05 / 14
    assert decision.verdicts[3].word == "inconclusive"
    assert decision.general_counts() == (
        0,
        sum(v.word in ("agrees", "disagrees", "within noise") for v in decision.verdicts),
    )


@pytest.mark.parametrize(
    ("method", "effect", "noise"),
    [
        ("fixed", [0.05, 0.02, 0.08, 0.04], [0.03, -0.04, 0.01, -0.02]),
        ("anytime", [0.05, 0.02, 0.08, 0.04, 0.06, 0.01, 0.03, 0.07], [0.03, -0.04, 0.01, -0.02, 0.02, -0.01, 0, 0]),
    ],
)
def test_the_correction_turns_a_lone_raw_decision_among_many_questions_into_inconclusive(method, effect, noise):
    runs = arm_pair("x", "ref", effect, key="x")
    asked = [parse_expectation("x >= ref")]
    for i in range(9):  # nine more expectations with no effect
        runs += arm_pair(f"n{i}", f"r{i}", noise, key=f"k{i}")
        asked.append(parse_expectation(f"n{i} >= r{i}"))
    strict = decide(asked, runs, Rule(method=method))
    lone = strict.verdicts[0].tests[PAIRS]
    assert lone.p_difference < 0.05 and lone.raw == "agrees"
    assert lone.adjusted_difference > 0.05 and lone.word == "inconclusive"
    assert lone.decidable > lone.half  # the level verdicts are read at asks for a wider margin
    assert strict.verdicts[0].more_pairs is not None
    stepped, bh = ("holm", "bh") if method == "fixed" else ("bonferroni", "bh")
    first = decide(asked, runs, Rule(method=method, correction=stepped)).verdicts[0].tests[PAIRS]
    second = decide(asked, runs, Rule(method=method, correction=bh)).verdicts[0].tests[PAIRS]
    assert second.adjusted_difference <= first.adjusted_difference


def test_a_rule_refuses_a_correction_its_method_does_not_take():
    with pytest.raises(ValueError, match="holm.*anytime method: one of bonferroni, bh, none"):
        Rule(correction="holm")
    with pytest.raises(ValueError, match="bonferroni.*fixed method: one of holm, bh, none"):
        Rule(method="fixed", correction="bonferroni")


def _over_start_models(effects_by_model, key="x", noise=None):
    """Runs of ``x`` and ``ref``: for each start model, a pair a seed with ``x`` ahead by each given difference."""
    runs, seed = [], 0
    for model, differences in effects_by_model.items():
        for difference in differences:
            runs.append(run("ref", 0.4, seed=seed, origin=f"folder:{model}"))
            runs.append(run("x", 0.4 + difference, seed=seed, origin=f"folder:{model}", **{key: "x"}))
            seed += 1
    return runs


def test_a_verdict_from_one_start_model_is_said_for_that_start_model_and_not_counted_general():
    runs = _over_start_models({"m1": [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.11, 0.09]})
    (v,) = decide([parse_expectation("x >= ref")], runs).verdicts
    assert v.word == "agrees" and v.scope == "for this start model"
    assert START_MODELS not in v.tests  # one start model: no test across start models
    assert len(v.start_models) == 1 and v.spread()[1] is None


def test_start_models_that_agree_make_a_general_verdict_and_the_spreads_are_shown():
    runs = _over_start_models({f"m{i}": [0.10 + i / 1000, 0.11 - i / 1000] for i in range(8)})
    decision = decide([parse_expectation("x >= ref")], runs)
    (v,) = decision.verdicts
    assert v.tests[START_MODELS].sample.k == 8 and v.word == "agrees" and v.scope == "general"
    within, between = v.spread()
    # a start model's two differences are 0.01 − 0.002 i apart (SD that / √2); their means all 0.105
    expected = (sum((0.01 - 0.002 * i) ** 2 / 2 for i in range(8)) / 8) ** 0.5
    assert within == pytest.approx(expected, rel=1e-6) and between == pytest.approx(0.0, abs=1e-9)
    assert decision.general_counts() == (1, 0)


def test_start_models_that_disagree_leave_the_general_verdict_open():
    # each start model's pairs agree closely, but the start models' effects go both ways: for these start models
    # the pairs decide; in general nothing is decided
    effects = {f"m{i}": [e + d for d in (0.0, 0.002, -0.002, 0.001)] for i, e in enumerate([0.3, -0.1, 0.25, -0.05])}
    (v,) = decide([parse_expectation("x >= ref")], _over_start_models(effects)).verdicts
    assert v.tests[START_MODELS].word == "inconclusive"
    assert v.word == "inconclusive" or v.scope == "for these 4 start models"
    assert v.spread()[1] > 0.1


def test_an_endpoint_of_the_last_evaluations_reads_the_curve():
    runs = []
    for seed in range(6):
        curve_ref = {0: 0.1, 10: 0.30, 20: 0.32, 30: 0.31}
        curve_x = {0: 0.1, 10: 0.40, 20: 0.42, 30: 0.20 + seed / 1000}  # a last point that fell
        runs.append(replace(run("ref", 0.31, seed=seed), curves={"val_accuracy": curve_ref}))
        runs.append(replace(run("x", 0.20 + seed / 1000, seed=seed, x="x"), curves={"val_accuracy": curve_x}))
    final = decide([parse_expectation("x >= ref")], runs, Rule(correction="none")).verdicts[0]
    last3 = decide([parse_expectation("x >= ref", endpoint="mean_last_3")], runs, Rule(correction="none")).verdicts[0]
    assert final.sample.mean == pytest.approx(-0.1075, abs=1e-6)
    assert last3.sample.mean == pytest.approx((0.40 + 0.42 + 0.2025 - 0.30 - 0.32 - 0.31) / 3, abs=2e-3)
    short = decide([parse_expectation("x >= ref", endpoint="mean_last_4")], runs).verdicts[0]
    assert short.word == "not measured" and "with 4 evaluations after step 0" in short.arms.missing


def _with_rollouts(record, per_step, curve):
    """``record`` having generated ``per_step`` rollouts at each of the curve's steps, and that curve."""
    steps = sorted(s for s in curve if s > 0)
    spent = {s: per_step * s for s in steps}
    return replace(
        record,
        curves={"val_accuracy": curve},
        compute=Compute(per_step * steps[-1], per_step * steps[-1] * 100.0, float(steps[-1]), spent),
    )


def test_at_equal_rollouts_a_run_that_generated_more_is_read_where_the_other_ended():
    runs = []
    for seed in range(8):
        ref_curve = {0: 0.1, 10: 0.2, 20: 0.3 + seed / 1000}
        ds_curve = {0: 0.1, 5: 0.28 + seed / 1000, 10: 0.35, 20: 0.45}  # 4 times the rollouts a step
        runs.append(_with_rollouts(run("grpo", ref_curve[20], seed=seed), 100, ref_curve))
        runs.append(_with_rollouts(run("ds", 0.45, seed=seed, ds="on"), 400, ds_curve))
    at_steps = decide([parse_expectation("ds >= grpo")], runs).verdicts[0]
    equal = decide([parse_expectation("ds >= grpo at equal rollouts")], runs).verdicts[0]
    assert at_steps.sample.mean == pytest.approx(0.15 - 0.0035, abs=1e-3)
    # grpo ended at 2,000 rollouts; ds had generated 2,000 by step 5
    assert equal.sample.mean == pytest.approx(-0.02, abs=1e-3)
    assert all(p.rollouts == 2000 for p in equal.arms.pairs)
    compute = at_steps.compute()
    assert compute["ds"]["rollouts"] / compute["grpo"]["rollouts"] == pytest.approx(4.0)
    late = [r if r.setting == "grpo" else _with_rollouts(r, 4000, {0: 0.1, 10: 0.3, 20: 0.4}) for r in runs]
    (v,) = decide([parse_expectation("ds >= grpo at equal rollouts")], late).verdicts
    assert v.word == "not judged" and "the reference's curve ends at 2,000 rollouts" in v.arms.not_judged


def test_an_unknown_arm_is_answered_with_the_labels_there_are():
    runs = arm_pair("dapo", "grpo", [0.1, 0.1, 0.1], key="x", group="grpo_dapo_ablation")
    (v,) = decide([parse_expectation("grpoo >= dapo", experiment="grpo_dapo_ablation")], runs).verdicts
    assert v.word == "not measured"
    assert v.arms.missing.endswith("the labels in grpo_dapo_ablation: dapo, grpo")


def test_an_arm_no_run_carries_is_found_by_the_settings_that_define_it():
    runs = [run("E4", 0.3 + s / 100, seed=s, group="offpolicy", epochs="4") for s in range(8)]
    runs += [run("grpo", 0.4 + s / 100, seed=s, group="dapo_ablation", epochs="1") for s in range(8)]
    asked = [parse_expectation("E4 >= on_policy", experiment="offpolicy")]
    assert decide(asked, runs).verdicts[0].word == "not measured"

    def resolve(arm, scope, _runs):
        return {"epochs": "1"} if (arm, scope) == ("on_policy", "offpolicy") else None

    (v,) = decide(asked, runs, resolve=resolve).verdicts
    assert v.k == 8 and v.arms.keys == ("epochs",) and v.word == "disagrees"


def test_each_rule_lists_the_verdicts_it_changes():
    runs = _over_start_models({"m1": [0.10, 0.11, 0.09, 0.10, 0.12, 0.10, 0.11, 0.09]})
    asked = [parse_expectation("x >= ref")]
    changes = {text: changed for text, _, changed in rule_changes(asked, runs, Rule())}
    scoped = ["x >= ref: agrees → agrees (for this start model)"]  # without them the verdict was called general
    for text, changed in changes.items():
        expected = scoped if text.startswith(("Start models as a level", "Anytime-valid")) else []
        assert changed == expected, text


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
    assert (
        not verdict.judged
        and decide([parse_expectation("question_only >= r1_zero")], runs, Rule(method="fixed")).family == 0
    )


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
