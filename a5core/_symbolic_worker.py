"""Symbolic answer comparison, run as a child process of :mod:`a5core.grading`.

Protocol over stdin/stdout, one JSON line each way: the parent sends ``[prediction, ground_truth]``,
the worker answers ``1`` (equivalent), ``0`` (not) or ``0`` on any error. It prints ``ready`` once
its imports are warm. The parent kills a worker that overruns its deadline, which is why this runs
in a separate process: sympy can spin forever (``9^{9^{9^9}}``) while holding the GIL.

Started as a script (not ``-m a5core...``) so it does not import torch through ``a5core/__init__``.
"""

import json
import logging
import sys
from functools import lru_cache
from pathlib import Path

# Running as a script puts a5core/ first on sys.path; drop it so its modules cannot shadow others.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

logging.disable(logging.WARNING)  # math-verify warns on every call that its own timeouts are off

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # noqa: E402
from math_verify.parser import NormalizationConfig  # noqa: E402

# Ground truths are clean LaTeX whose units sit in \text{} (stripped before we get here), so letters in
# them are variables: with unit removal on, "4t" would parse as 4. Predictions keep the default, which
# drops bare unit words such as "5 cm".
GOLD_CONFIG = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(basic_latex=True, units=False, malformed_operators=True, nits=True)
    ),
    ExprExtractionConfig(),
]
PREDICTION_CONFIG = [LatexExtractionConfig(), ExprExtractionConfig()]


@lru_cache(maxsize=8192)
def parsed(answer: str, is_gold: bool) -> list:
    """math-verify's parse of one answer (ground truths repeat across a batch, so it is cached)."""
    config = GOLD_CONFIG if is_gold else PREDICTION_CONFIG
    return parse(f"${answer}$", extraction_config=config, parsing_timeout=None)


def symbolic_equal(prediction: str, ground_truth: str) -> bool:
    """True if math-verify (sympy) finds the two LaTeX answers equal: values, sets, intervals, relations
    (an inequality such as x > 2 matches the interval (2, ∞))."""
    gold, pred = parsed(ground_truth, True), parsed(prediction, False)
    return bool(gold and pred and verify(gold, pred, allow_set_relation_comp=True, timeout_seconds=None))


def main() -> None:
    symbolic_equal("\\frac{1}{2}", "0.5")  # warm the parser before declaring ready
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            prediction, ground_truth = json.loads(line)
            result = symbolic_equal(prediction, ground_truth)
        except Exception:
            result = False
        out.write("1\n" if result else "0\n")
        out.flush()


if __name__ == "__main__":
    main()
