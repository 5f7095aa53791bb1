"""The verdict rule, calibrated the way a5's own runs are made: pages of 23 expectations in ablations whose
expectations share a reference's runs (their errors correlated), pairs from 1-5 start models that move every run of
theirs (SD 0.04, which pairing removes), run noise of SD 0.02-0.03, and the lab's loop: 3 pairs to start, a look
after every added pair (a seed more for every row still open), each row dropped once decided, up to 18 pairs.

With no effect anywhere, the share of pages that ever show a false verdict stays within the stated 5% under the
anytime rule and goes far above it under today's fixed-sample rule read the same way (the reason for the change);
effects of 0.07 are still decided within a stated number of pairs. The simulation reads the rule with numpy, and a
test checks that reading against :func:`a5core.verdicts.decide.decide` on simulated pages turned into runs."""

import math

import numpy as np
from scipy.special import stdtr
from verdict_runs import run

from a5core.verdicts.anytime import critical
from a5core.verdicts.decide import PAIRS, START_MODELS, Rule, decide
from a5core.verdicts.expectations import parse_expectation
from a5core.verdicts.statistics import adjust

GROUPS = (4, 4, 4, 4, 4, 3)  # 23 expectations; each ablation's share its reference's runs
ROWS = sum(GROUPS)
FIRST, MOST = 3, 18  # pairs at the first look, and at the last
RULE = Rule()  # anytime, Bonferroni over 2 levels × 23 expectations
MARGIN = RULE.margin


def simulate(rng, pages, effect_of, most=MOST, interaction=0.0):
    """Differences (pages, rows, pairs), each page's start model of each seed (pages, pairs), and the true
    effects: in general (pages, rows), and each pair's, its start model's (pages, rows, pairs). A seed's runs all
    start from one of the page's 1-5 start models; every run of a start model moves by its own draw (SD 0.04, the
    same for both arms: it cancels in a pair) and, with ``interaction``, an arm's runs by one more (that SD: the
    start model's own effect on the comparison, 0 on average); each run has noise of the page's SD (0.02-0.03); an
    ablation's expectations share its reference runs."""
    models = rng.integers(1, 6, size=pages)
    model_of_seed = (rng.random((pages, most)) * models[:, None]).astype(int)
    level = rng.normal(0, 0.04, size=(pages, 5))
    noise = rng.uniform(0.02, 0.03, size=pages)[:, None, None]
    shift = np.take_along_axis(level, model_of_seed, axis=1)[:, None, :]  # (pages, 1, pairs)
    effects = effect_of(rng, (pages, ROWS))
    group_of_row = np.repeat(np.arange(len(GROUPS)), GROUPS)
    own = rng.normal(0, interaction, size=(pages, ROWS, 5)) if interaction else np.zeros((pages, ROWS, 5))
    truth = effects[:, :, None] + np.take_along_axis(own, np.repeat(model_of_seed[:, None, :], ROWS, 1), axis=2)
    reference = 0.4 + shift + rng.normal(0, 1, size=(pages, len(GROUPS), most)) * noise
    arm = 0.4 + shift + truth + rng.normal(0, 1, size=(pages, ROWS, most)) * noise
    return arm - reference[:, group_of_row, :], model_of_seed, (effects, truth)


def _criticals(level, most):
    """c_k of the confidence sequence at ``level`` for k = 0..most (inf where it is unbounded)."""
    return np.array([critical(k, level, RULE.mixture_g) if k >= 2 else math.inf for k in range(most + 1)])


def anytime_words(differences, model_of_seed, k):
    """The anytime rule's words (pages, rows) at k pairs: 0 open, +1 / −1 a difference of that sign, 2 within
    noise; the start models' test (their means, two start models or more) first, then the pairs'."""
    level = RULE.alpha / (2 * ROWS)
    crit = _criticals(level, differences.shape[2])
    d = differences[:, :, :k]
    words = _read(d.mean(-1), d.std(-1, ddof=1) / math.sqrt(k), crit[k])
    onehot = model_of_seed[:, None, :k, None] == np.arange(5)  # (pages, 1, k, models)
    counts = onehot.sum(2)  # (pages, 1, models)
    sums = (d[..., None] * onehot).sum(2)
    present = counts > 0
    means = np.where(present, sums / np.maximum(counts, 1), np.nan)
    units = present.sum(-1)  # (pages, 1)
    unit_mean = np.nanmean(means, -1)
    unit_sd = np.sqrt(np.nansum((means - unit_mean[..., None]) ** 2, -1) / np.maximum(units - 1, 1))
    general = np.where(units >= 2, _read(unit_mean, unit_sd / np.sqrt(units), crit[units]), 0)
    return np.where(general != 0, general, words), general != 0


def _read(mean, se, c):
    with np.errstate(invalid="ignore"):  # an unbounded sequence (inf) over differences all alike (se 0)
        half = np.where(np.isinf(c), np.inf, c * se)
    difference = np.abs(mean) > half
    within = np.abs(mean) + half < MARGIN
    return np.where(difference, np.sign(mean), np.where(within, 2, 0)).astype(int)


def fixed_words(differences, stopped_at):
    """Today's rule (Student's t, TOST, Holm over the page) at each row's own number of pairs."""
    pages = differences.shape[0]
    words = np.zeros((pages, ROWS), dtype=int)
    k = stopped_at
    take = np.arange(differences.shape[2]) < k[..., None]
    count = k.astype(float)
    mean = (differences * take).sum(-1) / count
    sd = np.sqrt((((differences - mean[..., None]) * take) ** 2).sum(-1) / (count - 1))
    se = sd / np.sqrt(count)
    p_diff = np.minimum(1, 2 * stdtr(count - 1, -np.abs(mean) / se))
    p_within = np.maximum(stdtr(count - 1, -(mean + MARGIN) / se), stdtr(count - 1, -(MARGIN - mean) / se))
    groups = [i for i in range(ROWS) for _ in (0, 1)]
    for page in range(pages):
        adjusted = adjust(np.column_stack([p_diff[page], p_within[page]]).ravel().tolist(), groups, "holm")
        difference = np.array(adjusted[0::2]) <= RULE.alpha
        within = np.array(adjusted[1::2]) <= RULE.alpha
        words[page] = np.where(difference, np.sign(mean[page]), np.where(within, 2, 0))
    return words


def false_words(words, effects):
    """Verdicts that contradict the true effects: a difference of the wrong sign (or any, with none), or within
    noise where the effect reaches the margin."""
    sign = np.sign(effects)
    wrong_difference = (np.abs(words) == 1) & (words != sign)
    wrong_within = (words == 2) & (np.abs(effects) >= MARGIN)
    return wrong_difference | wrong_within


def run_the_loop(differences, model_of_seed, truths, rule):
    """The lab's loop: a look at FIRST, FIRST + 1, ... pairs, each row dropped when decided. Returns whether each
    page ever showed a false verdict, and the pairs at which each row was decided (0: never). A general verdict is
    judged against the effect in general, one for its start models against theirs (its pairs' mean true effect)."""
    effects, truth = truths
    pages = differences.shape[0]
    decided_at = np.zeros((pages, ROWS), dtype=int)
    ever_false = np.zeros(pages, dtype=bool)
    for k in range(FIRST, differences.shape[2] + 1):
        if rule == "anytime":
            words, general = anytime_words(differences, model_of_seed, k)
            words = np.where(decided_at > 0, 0, words)  # a dropped row keeps the verdict it was dropped with
            against = np.where(general, effects, truth[:, :, :k].mean(-1))
            ever_false |= (false_words(words, against) & (decided_at == 0)).any(-1)
        else:  # the page is made again from every row's pairs: a dropped row's verdict can change with Holm's
            stopped_at = np.where(decided_at > 0, decided_at, k)
            words = fixed_words(differences, stopped_at)
            ever_false |= false_words(words, effects).any(-1)
        decided_at = np.where((decided_at == 0) & (words != 0), k, decided_at)
    return ever_false, decided_at


def test_the_numpy_reading_is_the_verdict_flows_rule():
    rng = np.random.default_rng(5)
    differences, model_of_seed, _ = simulate(rng, 6, lambda r, shape: r.choice([0.0, 0.09, -0.09], shape))
    for page, k in ((0, 4), (1, 9), (2, 18), (3, 12), (4, 7), (5, 18)):
        runs, asked = [], []
        for g, size in enumerate(GROUPS):
            for seed in range(k):
                origin = f"folder:m{model_of_seed[page, seed]}"
                runs.append(run("ref", 0.4, seed=seed, origin=origin, group=f"g{g}"))
            for i in range(size):
                row = sum(GROUPS[:g]) + i
                asked.append(parse_expectation(f"s{i} >= ref", experiment=f"g{g}"))
                for seed in range(k):
                    origin = f"folder:m{model_of_seed[page, seed]}"
                    value = 0.4 + float(differences[page, row, seed])
                    runs.append(run(f"s{i}", value, seed=seed, origin=origin, group=f"g{g}", arm=f"{g}-{i}"))
        decision = decide(asked, runs, RULE)
        assert decision.family == 2 * ROWS
        words, general = anytime_words(differences[page : page + 1], model_of_seed[page : page + 1], k)
        for row, v in enumerate(decision.verdicts):
            code = {"agrees": 1, "disagrees": -1, "within noise": 2, "inconclusive": 0}[v.word]
            assert words[0, row] == code, f"page {page}, {k} pairs, {v.expectation.text}: {v.word}"
            assert (v.scope == "general") == bool(general[0, row] and code), v.expectation.text
            models = v.tests.get(START_MODELS)
            assert (models is not None) == (len(set(model_of_seed[page, :k])) > 1)
            assert v.tests[PAIRS].sample.k == k


def test_no_effect_anywhere_the_lab_loop_shows_a_false_verdict_on_at_most_5_percent_of_pages():
    rng = np.random.default_rng(2026)
    differences, models, effects = simulate(rng, 2000, lambda r, shape: np.zeros(shape))
    anytime_false, _ = run_the_loop(differences, models, effects, "anytime")
    fixed_false, _ = run_the_loop(differences, models, effects, "fixed")
    anytime_rate, fixed_rate = anytime_false.mean(), fixed_false.mean()
    print(
        f"\n2,000 pages, no effect, a look after every pair (3-18): a false verdict on {anytime_rate:.1%} of pages "
        f"under the anytime rule, {fixed_rate:.1%} under the fixed-sample rule (stated: 5%)"
    )
    assert anytime_rate <= 0.05, f"anytime: {anytime_rate:.3f}"
    assert fixed_rate > 0.05 and fixed_rate > 2 * anytime_rate, f"fixed {fixed_rate:.3f}, anytime {anytime_rate:.3f}"


def test_start_models_with_effects_of_their_own_make_no_false_general_verdicts():
    # each start model moves the comparison by its own draw (SD 0.02), 0 in general: a general verdict of a
    # difference is false, one for its start models is judged against their own effect
    rng = np.random.default_rng(31)
    differences, models, truths = simulate(rng, 2000, lambda r, shape: np.zeros(shape), interaction=0.02)
    wrong, _ = run_the_loop(differences, models, truths, "anytime")
    print(f"\nstart models with effects of their own (SD 0.02): a false verdict on {wrong.mean():.1%} of pages")
    assert wrong.mean() <= 0.05, f"{wrong.mean():.3f}"


def test_effects_at_the_margin_are_seldom_called_within_noise():
    rng = np.random.default_rng(7)
    differences, models, effects = simulate(rng, 500, lambda r, shape: r.choice([-MARGIN, MARGIN], shape))
    wrong, _ = run_the_loop(differences, models, effects, "anytime")
    assert wrong.mean() <= 0.05, f"{wrong.mean():.3f} of pages call an effect of ±{MARGIN} within noise or wrong"


def test_effects_of_seven_hundredths_are_decided_within_the_stated_pairs():
    rng = np.random.default_rng(8)
    differences, models, effects = simulate(rng, 500, lambda r, shape: r.choice([-0.07, 0.07], shape), most=40)
    wrong, decided_at = run_the_loop(differences, models, effects, "anytime")
    found = np.where(decided_at > 0, decided_at, 10**6)
    median, share_by_24 = np.median(found), (found <= 24).mean()
    print(
        f"\neffects of ±0.07, run noise 0.02-0.03, 1-5 start models: half decided by {median:.0f} pairs, "
        f"{share_by_24:.0%} by 24 (the anytime rule, 23 expectations)"
    )
    assert wrong.mean() <= 0.05
    assert median <= 16 and share_by_24 >= 0.8, f"median {median}, by 24: {share_by_24:.2f}"
