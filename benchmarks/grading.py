"""Grading throughput: 5,000 MATH validation responses graded with all cores. Target: ≤ 10 s.

Sets of 5,000 r1_zero responses, graded in this order by one worker pool, as in a real run:
  correct    — each validation solution's own boxed answer (mostly settled by the string match);
               this first set includes the pool's start-up;
  rewritten  — correct answers in another form (\\dfrac, a/b, spacing, x = …), many reaching sympy;
  shuffled A — each problem answered with another problem's answer (all wrong: a third reach sympy);
               math-verify's ANTLR parser is still cold here (its DFA cache fills as it parses);
  shuffled B — another shuffle, on the now warm pool: the steady state of a long run.

    python benchmarks/grading.py [--data ../shared/data/math/validation.jsonl]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from _report import report

from a5core.data.files import load_math
from a5core.grading.grader import SymbolicGrader, r1_zero_reward_fn

TARGET_S = 10.0


def rewrite(answer: str, rng: random.Random) -> str:
    """An equivalent spelling of a MATH answer, as a model might write it."""
    options = [
        answer.replace("\\frac", "\\dfrac"),
        f"x = {answer}",
        f" {answer} ".replace(",", ", "),
        f"\\left({answer}\\right)" if answer.startswith("(") else answer,
    ]
    if answer.lstrip("-").isdigit():
        options += [f"{answer}.0", f"\\frac{{{2 * int(answer)}}}{{2}}"]
    return rng.choice(options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/math/validation.jsonl")
    )
    args = parser.parse_args()
    problems = load_math(args.data)
    truths = [p.answer for p in problems]
    rng = random.Random(0)
    shuffled = truths[:]
    rng.shuffle(shuffled)
    shuffled_again = truths[:]
    rng.shuffle(shuffled_again)
    sets = {
        "correct (cold start)": truths,
        "rewritten (equivalent forms)": [rewrite(a, rng) for a in truths],
        "shuffled A (all wrong, parser cold)": shuffled,
        "shuffled B (all wrong, warm)": shuffled_again,
    }
    rows = []
    grader = SymbolicGrader()
    for name, answers in sets.items():
        responses = [f"Reasoning. </think> <answer> {a} </answer>" for a in answers]
        start = time.perf_counter()
        rewards = r1_zero_reward_fn.batch(responses, truths, grader)
        seconds = time.perf_counter() - start
        accuracy = sum(r["reward"] for r in rewards) / len(rewards)
        rows.append(
            [
                name,
                len(responses),
                grader.max_workers,
                f"{seconds:.2f}",
                f"{len(responses) / seconds:,.0f}",
                f"{accuracy:.3f}",
                "yes" if seconds <= TARGET_S else "NO",
            ]
        )
    grader.close()
    report(
        "Grading: 5,000 MATH validation responses (r1_zero_reward_fn.batch)",
        f"target ≤ {TARGET_S:.0f} s per set, one pool for all sets",
        ["set", "responses", "workers", "seconds", "responses/s", "accuracy", "≤ 10 s"],
        rows,
    )


if __name__ == "__main__":
    main()
