"""The verdict rule, calibrated on simulated pages: many pages of 24 expectations, each a comparison with a
reference setting that four comparisons share (so their errors are correlated, as on the results page), start
models that move every run of a seed alike (what pairing removes), and run-to-run noise like the GPU records'
(SD 0.02–0.04). With no effect planted anywhere, the chance of a page holding any false verdict stays at the
stated 5% under the correction (and is far above it without one); with effects of ±margin planted, "within
noise" is wrongly said on at most 5% of pages; effects of 0.1 are found with enough pairs
(tests/flows/test_verdicts_flow.py reads such a page from real MLflow stores through the flow and gets the rule's
verdicts)."""

import random
from dataclasses import dataclass

import pytest
from verdict_runs import run

from a5core.verdicts.decide import Rule, decide
from a5core.verdicts.expectations import parse_expectation

ABLATIONS, ARMS = 6, 4  # 24 expectations, each ablation's four sharing its reference runs


@dataclass
class Page:
    runs: list
    asked: list
    effects: list  # the true difference of each expectation


def simulate(rng: random.Random, effect_of, pairs: int) -> Page:
    """One page: each ablation's reference and four settings, ``pairs`` seeds each from one start model; a seed's
    start model moves all its runs by one draw (SD 0.03); each run adds noise of the page's SD (0.02–0.04)."""
    noise = rng.uniform(0.02, 0.04)
    shift = [rng.gauss(0, 0.03) for _ in range(pairs)]
    runs, asked, effects = [], [], []
    for g in range(ABLATIONS):
        group = f"ablation{g}"
        for seed in range(pairs):
            runs.append(run("ref", 0.4 + shift[seed] + rng.gauss(0, noise), seed=seed, group=group, ablation=group))
        for arm in range(ARMS):
            effect = effect_of(rng)
            effects.append(effect)
            name = f"s{arm}"
            asked.append(parse_expectation(f"{name} >= ref", experiment=group))
            for seed in range(pairs):
                value = 0.4 + shift[seed] + effect + rng.gauss(0, noise)
                runs.append(run(name, value, seed=seed, group=group, ablation=group, arm=f"{group}-{name}"))
    return Page(runs, asked, effects)


def false_verdicts(page: Page, rule: Rule, raw: bool = False) -> list[str]:
    """The verdicts on ``page`` that contradict the planted effects."""
    wrong = []
    for verdict, effect in zip(decide(page.asked, page.runs, rule).verdicts, page.effects, strict=True):
        word = verdict.raw if raw else verdict.word
        if word == "agrees" and effect <= 0 or word == "disagrees" and effect >= 0:
            wrong.append(f"{verdict.expectation.text}: {word} with {effect:+.2f}")
        if word == "within noise" and abs(effect) >= rule.margin:
            wrong.append(f"{verdict.expectation.text}: within noise with {effect:+.2f}")
    return wrong


def share_of_pages_wrong(pages: int, effect_of, rule: Rule, raw: bool = False, seed: int = 0) -> float:
    rng = random.Random(seed)
    return (
        sum(bool(false_verdicts(simulate(rng, effect_of, rng.randint(3, 6)), rule, raw)) for _ in range(pages)) / pages
    )


@pytest.mark.parametrize("correction", ["holm", "bh"])
def test_no_effect_anywhere_a_page_holds_a_false_verdict_at_most_at_the_stated_rate(correction):
    # Under no effect anywhere every false verdict is a false discovery, so BH's rate bounds this chance too.
    wrong = share_of_pages_wrong(300, lambda rng: 0.0, Rule(correction=correction))
    assert wrong <= 0.05 + 0.03, f"{wrong:.3f} of pages hold a false verdict ({correction})"


def test_without_a_correction_most_pages_of_24_questions_hold_a_false_verdict():
    wrong = share_of_pages_wrong(100, lambda rng: 0.0, Rule(correction="none"), raw=True)
    assert wrong > 0.3, f"{wrong:.3f}"


def test_effects_at_the_margin_are_seldom_called_within_noise():
    wrong = share_of_pages_wrong(300, lambda rng: rng.choice([-0.05, 0.05]), Rule(), seed=1)
    assert wrong <= 0.05 + 0.03, f"{wrong:.3f} of pages call an effect of ±0.05 within noise"


def test_effects_of_a_tenth_are_found():
    rng = random.Random(2)
    found = asked = 0
    for _ in range(40):
        page = simulate(rng, lambda r: r.choice([0.0, 0.1, -0.1]), pairs=10)
        for verdict, effect in zip(decide(page.asked, page.runs).verdicts, page.effects, strict=True):
            if effect:
                asked += 1
                found += verdict.word == ("agrees" if effect > 0 else "disagrees")
    assert found / asked >= 0.8, f"{found} of {asked} effects of ±0.1 found with 10 pairs"
