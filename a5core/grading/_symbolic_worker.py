"""Symbolic answer comparison, run as a child process of :mod:`a5core.grading.grader`.

Protocol over stdin/stdout, one JSON line each way: the parent sends ``[prediction, ground_truth]``,
the worker answers ``1`` (equivalent), ``0`` (not) or ``0`` on any error. It prints ``ready`` once
its imports are warm. The parent kills a worker that overruns its deadline, which is why this runs
in a separate process: sympy can spin forever (``9^{9^{9^9}}``) while holding the GIL.

Arguments: ``PARENT_PID CPU_BUDGET_S``. The worker must not outlive its parent, even while sympy spins
(then no Python code of the worker runs, so it cannot poll for the parent): on Linux it asks the
kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; the parent forks workers from a thread
that lives as long as the parent), and exits at once if the parent died before that request (its
parent pid is no longer ``PARENT_PID``). As a second line of defence, on any POSIX system, each
comparison may use at most ``CPU_BUDGET_S`` seconds of CPU (``RLIMIT_CPU``: the kernel kills the
process, GIL or not); the parent's deadline is shorter, so this fires only when no parent is left to
enforce it. An idle worker exits when its stdin closes.

Started as a script (not ``-m a5core...``) so it does not import torch through ``a5core/__init__``.
"""

import sys
from pathlib import Path

# Running as a script puts a5core/ first on sys.path; drop it so its modules cannot shadow others.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from functools import lru_cache  # noqa: E402

try:
    import resource
except ImportError:  # not POSIX
    resource = None

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(
                ctypes.c_int(PR_SET_PDEATHSIG),
                ctypes.c_ulong(signal.SIGKILL),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
                ctypes.c_ulong(0),
            )
        except (OSError, AttributeError):  # no usable libc: the CPU budget below still applies
            pass
    if os.getppid() != parent_pid:  # orphaned before the request took effect (or no prctl)
        os._exit(0)


def limit_cpu(budget_s: int) -> None:
    """Let the next comparison use at most ``budget_s`` more seconds of CPU before the kernel kills us."""
    if resource is None or budget_s <= 0:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + budget_s
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


if __name__ == "__main__" and len(sys.argv) > 1:  # first thing, before the slow imports
    die_with_parent(int(sys.argv[1]))
    if resource is not None:  # SIGXCPU's default action dumps core: no core files from a killed worker
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))


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
    cpu_budget_s = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    symbolic_equal("\\frac{1}{2}", "0.5")  # warm the parser before declaring ready
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        limit_cpu(cpu_budget_s)
        try:
            prediction, ground_truth = json.loads(line)
            result = symbolic_equal(prediction, ground_truth)
        except Exception:
            result = False
        out.write("1\n" if result else "0\n")
        out.flush()


if __name__ == "__main__":
    main()
