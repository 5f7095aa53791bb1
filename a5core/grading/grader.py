"""Answer extraction and equivalence: the verified rewards of the r1_zero and question_only prompts.

Grading a response is two steps:

1. *Extract* the model's answer. ``r1_zero`` needs ``</think> <answer>`` followed later by
   ``</answer>``; the answer is the text of the last ``<answer>…</answer>``, or the last
   ``\\boxed{…}`` inside it. ``question_only`` takes the last ``\\boxed{…}`` of the response.
2. *Compare* it with the ground truth: first a Hendrycks-style normalised string match (cheap, in this
   process), then symbolic equality through math-verify and sympy, in worker processes under a
   per-answer deadline. The deadline is enforced by killing the worker, so it works off the main
   thread and inside Prefect task threads (no SIGALRM), and a pathological answer such as
   ``9^{9^{9^{9}}}`` or a 100 kB string costs at most the deadline and grades 0. Threads grading at
   once share the worker pool (see SymbolicGrader), and the workers die with this process, even one
   killed with SIGKILL in the middle of a comparison (see _symbolic_worker).

Reward functions take ``(response, ground_truth)`` and return ``{"format_reward", "answer_reward",
"reward"}`` as floats in {0, 1}; ``ground_truth`` may be a string, a number, or a list of acceptable
answers. ``grade_batch`` grades many responses with all cores.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Union

from a5core.runtime import progress

GroundTruth = Union[str, int, float, Sequence[Union[str, int, float]]]
Reward = dict[str, float]

MAX_ANSWER_CHARS = 1000  # MATH's longest answer is 81 characters; longer predictions grade 0 unparsed
DEFAULT_DEADLINE_S = 3.0

# ------------------------------------------------------------------------------------ extraction


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``, or ``\\boxed 5``) in text, braces matched.

    Returns None when there is no box or its braces never close.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + len("\\boxed" if text.startswith("\\boxed", start) else "\\fbox") :]
    if rest.startswith(" "):  # \boxed 5
        return rest[1:].split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def extract_r1_zero_answer(response: str) -> tuple[bool, str | None]:
    """``(formatted, answer)`` for an r1_zero response (see the module docstring for the rules)."""
    think_end = response.find("</think> <answer>")
    close = response.rfind("</answer>")
    if think_end < 0 or close < think_end:
        return False, None
    open_ = response.rfind("<answer>", think_end, close)
    answer = response[open_ + len("<answer>") : close]
    if "\\boxed" in answer or "\\fbox" in answer:
        return True, extract_boxed(answer)
    return True, answer.strip()


def extract_question_only_answer(response: str) -> tuple[bool, str | None]:
    """``(formatted, answer)`` for a question_only response: formatted iff it has a closed box."""
    answer = extract_boxed(response)
    return answer is not None, answer


# --------------------------------------------------------------------------------- normalisation

_UNIT_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\{\s[^{}]*\}(?:\^\{?\d\}?)?\s*$")  # "5 \text{ cm}^2" (Hendrycks)
_UNIT_SPELLINGS = {
    "feet": "ft",
    "foot": "ft",
    "inch": "in",
    "inche": "in",
    "meter": "m",
    "metre": "m",
    "centimeter": "cm",
    "kilometer": "km",
    "mile": "mi",
    "yard": "yd",
    "second": "s",
    "minute": "min",
    "hour": "h",
    "hr": "h",
    "pound": "lb",
    "degree": "deg",
}
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mbox|mathrm|mathbf)\{([^{}]*)\}")
_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_FRAC_ARG = re.compile(r"\s*(\{|\\[A-Za-z]+|[^\s{}\\])")
_SLASH_FRAC = re.compile(r"^(-?)(\d+)/(\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_TRAILING_ZEROS = re.compile(r"^(-?\d+)\.(\d*?)0+$")
_CHOICE = re.compile(r"^\(?([A-Ea-e])\)?$")
_SHORT_LHS = re.compile(r"^[A-Za-z](?:_\{?\w\}?)?$")  # "x", "k", "a_1" on the left of "="
_BASE_SUFFIX = re.compile(r"_\{?(\d+)\}?$")  # 1011_2, 1011_{2}


def _brace_frac_args(s: str) -> str:
    """``\\frac \\pi4`` → ``\\frac{\\pi}{4}``, ``\\frac12`` → ``\\frac{1}{2}``: bare arguments get braces."""
    out, i = [], 0
    while (j := s.find("\\frac", i)) >= 0:
        out.append(s[i : j + 5])
        i = j + 5
        for _ in range(2):
            match = _FRAC_ARG.match(s, i)
            if match is None or match.group(1) == "{":
                break
            out.append("{" + match.group(1) + "}")
            i = match.end()
    out.append(s[i:])
    return "".join(out)


def _light_cleanup(answer: str) -> str:
    """Meaning-preserving fixes applied before both the string and the symbolic comparison."""
    s = answer.strip().rstrip(".").strip()
    s = s.replace(",\\!", "").replace("{,}", "").replace("dfrac", "frac").replace("tfrac", "frac")
    return _UNIT_TEXT.sub("", _brace_frac_args(s)).strip()


def _unit(answer: str) -> str | None:
    """The unit word of a ``5 \\text{ cm}`` answer, singular and lower-case; None without one."""
    match = _UNIT_TEXT.search(answer.strip().rstrip("."))
    if match is None:
        return None
    word = match.group(0).split("{", 1)[1].split("}")[0].strip().lower()
    word = word[:-1] if word.endswith("s") and len(word) > 2 else word
    return _UNIT_SPELLINGS.get(word, word) + match.group(0).split("}", 1)[1].strip()


def normalize_answer(answer: str) -> str:
    """Hendrycks-style canonical form of an answer string, for exact-match comparison.

    Drops ``\\left``/``\\right``, ``\\!`` and spacing, ``$``, ``\\%``, degrees, ``\\text{ unit}``
    suffixes and ``\\text{}`` wrappers; maps ``dfrac``/``tfrac`` to ``frac``, ``a/b`` to
    ``\\frac{a}{b}``, ``\\frac12`` to ``\\frac{1}{2}``, ``1,000`` to ``1000``, ``2.50`` to ``2.5``,
    ``5.0`` to ``5``, and ``(A)`` to ``A``.
    """
    s = _light_cleanup(answer).replace("\n", " ").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("\\displaystyle", "").replace("\\left", "").replace("\\right", "")
    for unit in ("^{\\circ}", "^\\circ", "\\circ", "°", "\\%", "%", "\\$", "$"):
        s = s.replace(unit, "")
    s = _UNIT_TEXT.sub("", s)
    s = _TEXT_WRAPPER.sub(r"\1", s)
    for space in ("\\,", "\\;", "\\:", "\\ ", "~", " "):
        s = s.replace(space, "")
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    s = _TRAILING_ZEROS.sub(lambda m: m.group(1) + ("." + m.group(2) if m.group(2) else ""), s)
    s = _SLASH_FRAC.sub(r"\1\\frac{\2}{\3}", s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    choice = _CHOICE.match(s)
    return choice.group(1).upper() if choice else s


_NUMBER = re.compile(r"^(-?)(?:(\d+(?:\.\d*)?|\.\d+)|\\frac\{(-?\d+)\}\{(\d+)\})$")


def _exact_number(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a plain integer, decimal or integer fraction."""
    match = _NUMBER.match(normalized)
    if match is None or len(normalized) > 40:
        return None
    sign, decimal, numerator, denominator = match.groups()
    if decimal is not None:
        value = Fraction(decimal)
    elif int(denominator) == 0:
        return None
    else:
        value = Fraction(int(numerator), int(denominator))
    return -value if sign else value


def _rhs_if_equation(normalized: str) -> str | None:
    """``3`` for ``x=3`` (a single short variable on the left); None for anything else."""
    if normalized.count("=") == 1 and _SHORT_LHS.match(normalized.split("=")[0]):
        return normalized.split("=")[1]
    return None


def _has_several_elements(normalized: str) -> bool:
    """A comma outside every brace: a tuple, interval, set or list, e.g. ``(-6,10)`` but not ``\\frac{1,0}{3}``."""
    depth = 0
    for char in normalized:
        depth += (char == "{") - (char == "}")
        if char == "," and depth == 0:
            return True
    return False


def _compare_cheaply(prediction: str, truth: str) -> bool | None:
    """Decide equivalence without sympy where that is exact; None when sympy must decide.

    Different units or number bases are unequal; equal normalised strings are equal; ``x=3``
    matches ``3`` (but ``x=3`` does not match ``y=3``); two plain numbers are compared exactly,
    so a rounded decimal does not match a repeating fraction; a plain number never equals a tuple,
    interval or list.
    """
    units = _unit(prediction), _unit(truth)
    if None not in units and units[0] != units[1]:
        return False
    a, b = normalize_answer(prediction), normalize_answer(truth)
    bases = _BASE_SUFFIX.search(a), _BASE_SUFFIX.search(b)
    if None not in bases and bases[0].group(1) != bases[1].group(1):
        return False
    if a == b:
        return True
    rhs_a, rhs_b = _rhs_if_equation(a), _rhs_if_equation(b)
    if (rhs_a is None) != (rhs_b is None):
        a, b = rhs_a or a, rhs_b or b
        if a == b:
            return True
    x, y = _exact_number(a), _exact_number(b)
    if x is not None and y is not None:
        return x == y
    if (x is not None and _has_several_elements(b)) or (y is not None and _has_several_elements(a)):
        return False
    return None


# ------------------------------------------------------------------------------ symbolic workers

_WORKER_SCRIPT = Path(__file__).with_name("_symbolic_worker.py")
_CPU_MARGIN_S = 5  # a worker's own CPU cap per comparison exceeds the deadline by this much


class _Spawner:
    """Starts the worker processes, all from one thread that lives as long as this process.

    A worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG, see _symbolic_worker),
    and for the kernel the parent is the *thread* that forked it: a worker forked by a caller's
    thread (a Prefect task thread, a short-lived grading thread) would be killed as soon as that
    thread ended. So callers hand the Popen call to this daemon thread, which never ends before the
    process does (a forked child of this process starts its own).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pid = -1

    def popen(self, args: list[str], **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._requests,), daemon=True, name="a5-grader-spawner"
                )
                self._thread.start()
                self._pid = os.getpid()
            requests = self._requests
        started: Future = Future()
        requests.put((args, kwargs, started))
        return started.result()

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while True:
            args, kwargs, started = requests.get()
            try:
                started.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:  # reported to the caller
                started.set_exception(e)


_spawner = _Spawner()


class _Worker:
    """One symbolic-comparison child process; ``ready`` once its imports are warm.

    It dies with this process (see _symbolic_worker) and caps each comparison's CPU time at the
    deadline plus a margin, in case nobody is left to enforce the deadline.
    """

    def __init__(self, deadline_s: float) -> None:
        cpu_budget_s = math.ceil(deadline_s) + _CPU_MARGIN_S
        self.proc = _spawner.popen(
            [sys.executable, "-u", str(_WORKER_SCRIPT), str(os.getpid()), str(cpu_budget_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.ready = False
        self.task: tuple[int, float] | None = None  # (pair index, deadline)

    def send(self, index: int, pair: tuple[str, str], deadline: float) -> None:
        self.proc.stdin.write(json.dumps(pair) + "\n")
        self.proc.stdin.flush()
        self.task = (index, deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:  # a write still buffered for the dead process
                pass


class SymbolicGrader:
    """A pool of symbolic-comparison worker processes with a per-comparison deadline.

    Thread-safe, and threads share the pool rather than take turns: each ``equal`` call checks out
    idle workers (starting new ones while the pool has fewer than ``workers``), drives them itself,
    and returns each one as soon as it has no more work for it. Concurrent calls therefore run in
    parallel up to ``workers`` processes in all; a call that finds every worker busy waits for one, and
    a call holding several workers hands one over after its current comparison when another call is
    waiting, so one thread's slow batch (an answer that runs to the deadline) does not stall the
    others. Results are cached, so a repeated (prediction, ground truth) pair, common among GRPO
    rollouts, is compared once.
    """

    def __init__(self, workers: int | None = None, deadline_s: float = DEFAULT_DEADLINE_S):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        self.max_workers = workers or (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
        self.deadline_s = deadline_s
        self._workers: set[_Worker] = set()  # every live worker, idle or checked out
        self._idle: list[_Worker] = []
        self._starting = 0  # workers being started (they count against max_workers)
        self._waiting = 0  # calls waiting for a worker
        self._cache: dict[tuple[str, str], bool] = {}
        self._lock = threading.Lock()
        self._available = threading.Condition(self._lock)
        atexit.register(self.close)

    def equal(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """Symbolic equality for each (prediction, ground_truth) pair; a timeout or error counts False."""
        with self._lock:
            known = {p: self._cache[p] for p in pairs if p in self._cache}
        todo = [p for p in dict.fromkeys(pairs) if p not in known]
        verdicts = dict(zip(todo, self._run(todo), strict=True))
        with self._lock:
            if len(self._cache) + len(verdicts) > 200_000:
                self._cache.clear()
            self._cache.update(verdicts)
        known.update(verdicts)
        return [known[p] for p in pairs]

    # -- the pool: check out, check in, replace

    def _checkout(self, wanted: int, wait: bool) -> list[_Worker]:
        """Up to ``wanted`` workers: idle ones first, then new ones while the pool is not full. With
        ``wait``, blocks until there is at least one; without, takes none while another call waits."""
        with self._lock:
            while True:
                if not wait and self._waiting:
                    return []
                taken = [self._idle.pop() for _ in range(min(wanted, len(self._idle)))]
                start = max(0, min(wanted - len(taken), self.max_workers - len(self._workers) - self._starting))
                self._starting += start
                if taken or start or not wait:
                    break
                self._waiting += 1
                try:
                    self._available.wait(timeout=1.0)
                finally:
                    self._waiting -= 1
        fresh: list[_Worker] = []
        try:
            for _ in range(start):
                fresh.append(_Worker(self.deadline_s))
        except BaseException:
            for worker in taken + fresh:
                self._checkin(worker)  # the fresh ones are not in the pool yet: killed
            raise
        finally:
            with self._lock:
                self._starting -= start
                self._workers.update(fresh)
                self._available.notify_all()
        return taken + fresh

    def _checkin(self, worker: _Worker) -> None:
        """Return an idle worker to the pool; one that is not in it (close() dropped it) is killed."""
        with self._lock:
            if worker in self._workers:
                self._idle.append(worker)
                self._available.notify()
                return
        worker.kill()

    def _drop(self, worker: _Worker) -> bool:
        """Kill a worker and free its slot; False if it was no longer in the pool (close() dropped it)."""
        worker.kill()
        with self._lock:
            owned = worker in self._workers
            self._workers.discard(worker)
            self._available.notify()
        return owned

    def _replace(self, worker: _Worker) -> _Worker | None:
        """Kill a worker that overran or died and start a fresh one in its slot; None after close()."""
        if not self._drop(worker):
            return None
        return (self._checkout(1, wait=False) or [None])[0]

    def _owns(self, worker: _Worker) -> bool:
        with self._lock:
            return worker in self._workers

    def _others_waiting(self) -> bool:
        with self._lock:
            return self._waiting > 0

    # -- one call's comparisons

    def _run(self, pairs: list[tuple[str, str]]) -> list[bool]:
        if not pairs:
            return []
        with (
            selectors.DefaultSelector() as selector,
            progress.bar(desc="grade (symbolic)", total=len(pairs), unit="answer") as graded,
        ):
            call = _Call(self, pairs, selector)
            try:
                while call.done < len(pairs):
                    now = call.dispatch()
                    call.read(now)
                    call.expire()
                    graded.update(call.done - graded.n)
            finally:
                call.release()
        return call.results

    def close(self) -> None:
        """Kill every worker, idle or busy (a call in flight grades its unfinished pairs False and
        cleans up the ones it holds); the grader stays usable and starts new workers when next called."""
        with self._lock:
            workers, idle = list(self._workers), set(self._idle)
            self._workers.clear()
            self._idle.clear()
            self._available.notify_all()
        for worker in workers:
            if worker in idle:
                worker.kill()
            else:  # its caller's thread reads from it: only signal it, the caller closes its pipes
                worker.proc.kill()


_default_grader: SymbolicGrader | None = None
_default_grader_lock = threading.Lock()


class _Call:
    """One :meth:`SymbolicGrader.equal` call's comparisons on the pool's workers: the pairs still pending (popped
    from the end), the workers it holds (``mine``, each watched by ``selector``), the results and how many are
    done. A pair whose worker overran its deadline or died stays False."""

    def __init__(self, grader: SymbolicGrader, pairs: list[tuple[str, str]], selector: selectors.BaseSelector):
        self.grader, self.pairs, self.selector = grader, pairs, selector
        self.results = [False] * len(pairs)
        self.pending = list(range(len(pairs)))[::-1]
        self.mine: list[_Worker] = []
        self.done = 0

    def hold(self, workers: list[_Worker]) -> None:
        for worker in workers:
            self.mine.append(worker)
            self.selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)

    def let_go(self, worker: _Worker) -> None:
        self.mine.remove(worker)
        self.selector.unregister(worker.proc.stdout)

    def retire(self, worker: _Worker) -> None:
        """Kill it; keep its replacement if there is work left, else return that to the pool."""
        self.let_go(worker)
        fresh = self.grader._replace(worker)
        if fresh is not None and self.pending:
            self.hold([fresh])
        elif fresh is not None:
            self.grader._checkin(fresh)

    def dispatch(self) -> float:
        """Take more workers while pairs outnumber free ones (waiting for one only when holding none), give
        each ready idle worker a pair, return the ones with nothing left (or that another call needs); the time."""
        free = sum(w.task is None for w in self.mine)
        if len(self.pending) > free:
            self.hold(self.grader._checkout(len(self.pending) - free, wait=not self.mine))
        now = time.monotonic()
        for worker in list(self.mine):
            if worker.task is not None:
                continue
            if not self.pending or (len(self.mine) > 1 and self.grader._others_waiting()):
                self.let_go(worker)  # nothing left for it here, or another call has no worker
                self.grader._checkin(worker)
            elif worker.ready:
                i = self.pending.pop()
                try:
                    worker.send(i, self.pairs[i], now + self.grader.deadline_s)
                except OSError:  # it died while idle
                    self.pending.append(i)
                    self.retire(worker)
        return now

    def read(self, now: float) -> None:
        """Read what the workers said, waiting at most until the nearest deadline."""
        deadlines = [w.task[1] for w in self.mine if w.task]
        wait = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self.selector.select(wait):
            self.heard(key.data, key.data.proc.stdout.readline())

    def heard(self, worker: _Worker, line: str) -> None:
        """A line from ``worker``: an answer, its start-up greeting, or (empty) its death."""
        if worker.ready and worker.task is not None and line:
            self.results[worker.task[0]] = line.strip() == "1"
            worker.task = None
            self.done += 1
        elif not worker.ready and line.strip() == "ready":
            worker.ready = True
        elif not worker.ready and (line or self.grader._owns(worker)):
            self.let_go(worker)  # died or spoke nonsense while starting: give up on symbolic grading
            self.grader._drop(worker)
            raise RuntimeError(f"symbolic grading worker failed to start ({_WORKER_SCRIPT})")
        else:  # it died: killed by close(), crashed, out of memory
            if worker.task is not None:
                worker.task = None
                self.done += 1  # result stays False
            self.retire(worker)

    def expire(self) -> None:
        """Retire the workers past their pair's deadline (the pair stays False)."""
        now = time.monotonic()
        for worker in list(self.mine):
            if worker.task is not None and worker.task[1] <= now:
                worker.task = None
                self.done += 1  # result stays False
                self.retire(worker)

    def release(self) -> None:
        """Return the idle workers this call holds; kill a busy one (interrupted mid-comparison: its answer
        would reach the worker's next user)."""
        for worker in list(self.mine):
            self.let_go(worker)
            if worker.task is None:
                self.grader._checkin(worker)
            else:
                self.grader._drop(worker)


def default_grader() -> SymbolicGrader:
    """The process-wide grader pool, started on first use with one worker per available core."""
    global _default_grader
    with _default_grader_lock:
        if _default_grader is None:
            _default_grader = SymbolicGrader()
        return _default_grader


# ---------------------------------------------------------------------------------- equivalence


def _ground_truths(ground_truth: GroundTruth) -> list[str]:
    values = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise TypeError(f"ground truth must be a string, a number or a list of them, got {value!r}")
        text = str(value)
        out.append(extract_boxed(text) or text if "box" in text else text)
    return out


def answers_equivalent_batch(
    pairs: Sequence[tuple[str | None, GroundTruth]], grader: SymbolicGrader | None = None
) -> list[bool]:
    """For each (prediction, ground truth) pair: is the prediction an acceptable answer?

    Cheap exact rules first (see _compare_cheaply); anything they cannot settle goes to symbolic
    equality (in parallel worker processes). A None, empty or over-long prediction is
    never equivalent.
    """
    results = [False] * len(pairs)
    symbolic: list[tuple[int, tuple[str, str]]] = []
    for i, (prediction, ground_truth) in enumerate(pairs):
        truths = _ground_truths(ground_truth)
        if not prediction or not prediction.strip() or len(prediction) > MAX_ANSWER_CHARS:
            continue
        verdicts = [_compare_cheaply(prediction, t) for t in truths]
        if True in verdicts:
            results[i] = True
        else:
            symbolic.extend(
                (i, (_light_cleanup(prediction), _light_cleanup(t)))
                for t, v in zip(truths, verdicts, strict=True)
                if v is None
            )
    if symbolic:
        verdicts = (grader or default_grader()).equal([pair for _, pair in symbolic])
        for (i, _), verdict in zip(symbolic, verdicts, strict=True):
            results[i] = results[i] or verdict
    return results


def answers_equivalent(prediction: str | None, ground_truth: GroundTruth) -> bool:
    """Is ``prediction`` an acceptable answer for ``ground_truth``? See answers_equivalent_batch."""
    return answers_equivalent_batch([(prediction, ground_truth)])[0]


# ------------------------------------------------------------------------------- reward functions


@dataclass(frozen=True)
class AnswerRewardFn:
    """A reward function: ``extract`` the answer from a response, then compare it with the truth.

    Call it on one response, or ``.batch`` on many (all cores). Unformatted responses get all zeros;
    formatted ones get format_reward 1 and answer_reward = reward = 1 if the answer is acceptable.
    """

    name: str
    extract: Callable[[str], tuple[bool, str | None]]

    def __call__(self, response: str, ground_truth: GroundTruth) -> Reward:
        return self.batch([response], [ground_truth])[0]

    def batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[GroundTruth],
        grader: SymbolicGrader | None = None,
    ) -> list[Reward]:
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        extracted = [self.extract(r) for r in responses]
        correct = answers_equivalent_batch(
            [(answer, truth) for (_, answer), truth in zip(extracted, ground_truths, strict=True)], grader
        )
        rewards = []
        for (formatted, _), ok in zip(extracted, correct, strict=True):
            answer_reward = float(formatted and ok)
            rewards.append({"format_reward": float(formatted), "answer_reward": answer_reward, "reward": answer_reward})
        return rewards


r1_zero_reward_fn = AnswerRewardFn("r1_zero", extract_r1_zero_answer)
question_only_reward_fn = AnswerRewardFn("question_only", extract_question_only_answer)


def grade_batch(
    reward_fn: Callable[[str, GroundTruth], Reward],
    responses: Sequence[str],
    ground_truths: Sequence[GroundTruth],
) -> list[Reward]:
    """Grade many responses: in parallel for an AnswerRewardFn, one by one for any other callable."""
    if isinstance(reward_fn, AnswerRewardFn):
        return reward_fn.batch(responses, ground_truths)  # its symbolic comparisons show a bar
    pairs = progress.bar(
        zip(responses, ground_truths, strict=True), desc="grade", total=len(responses), unit="response"
    )
    return [reward_fn(r, t) for r, t in pairs]
