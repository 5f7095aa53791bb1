"""The symbolic grader's worker processes under hostile conditions: a parent killed with SIGKILL while a
worker spins inside sympy, workers started from short-lived threads, and threads grading at once."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from a5core.grading import grader as grading
from a5core.grading.grader import SymbolicGrader

ROOT = Path(__file__).resolve().parents[3]
HOSTILE = "9^{9^{9^{9}}}"  # sympy spins on it for ever, holding the GIL

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int, cmdline_mark: str = "_symbolic_worker") -> bool:
    """Is ``pid`` a running (not zombie) process whose command line contains ``cmdline_mark``?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X") and cmdline_mark in cmdline


def _wait_until(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _read_line(stream, timeout_s: float) -> str:
    """One line from ``stream``, or "" if none comes within ``timeout_s`` (read in a thread: no hang)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""


PARENT = textwrap.dedent(
    """
    import sys, threading
    from a5core.grading import grader as grading

    send = grading._Worker.send

    def send_and_tell(self, *args):
        send(self, *args)
        print(self.proc.pid, flush=True)  # the worker now has the hostile answer

    grading._Worker.send = send_and_tell
    grader = grading.SymbolicGrader(workers=1, deadline_s=600)  # the parent will not kill it: its death must
    caller = threading.Thread(target=grader.equal, args=([(sys.argv[1], "3")],))  # a caller thread, as in Prefect
    caller.start()
    caller.join()
    """
)


@linux_only
def test_worker_dies_when_its_parent_is_killed_mid_comparison(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen(
        [sys.executable, str(script), HOSTILE],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    worker = None
    try:
        line = _read_line(parent.stdout, 180)
        assert line.strip().isdigit(), f"the parent did not report its worker (exit code {parent.poll()})"
        worker = int(line)
        assert _alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # The worker had the hostile answer before its parent died: it is inside sympy, not reading stdin.
        assert _wait_until(lambda: not _alive(worker), 20), "the worker outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)  # only on failure: do not leave it spinning


@linux_only
def test_workers_started_from_a_thread_outlive_that_thread():
    """For PR_SET_PDEATHSIG the parent is the forking *thread*: workers must not die with a caller thread."""
    grader = SymbolicGrader(workers=1, deadline_s=30)
    try:
        results = []
        caller = threading.Thread(target=lambda: results.append(grader.equal([("2\\sqrt{2}", "\\sqrt{8}")])))
        caller.start()
        caller.join()
        assert results == [[True]]
        pids = {w.proc.pid for w in grader._workers}
        assert len(pids) == 1
        # Waiting only gives a wrongly killed worker time to die; a correct one lives on regardless.
        assert not _wait_until(lambda: not all(_alive(pid) for pid in pids), 3)
        assert grader.equal([("\\sqrt{18}", "3\\sqrt{2}")]) == [True]
        assert {w.proc.pid for w in grader._workers} == pids  # the same worker graded again
    finally:
        grader.close()


def test_worker_whose_parent_is_already_gone_exits_at_once():
    """Orphaned before it could ask to die with its parent: it must notice, not load sympy and serve."""
    orphan_of = 2**22 + 7  # above the largest pid Linux can give (2**22): not the parent of anything
    worker = subprocess.run(
        [sys.executable, "-u", str(grading._WORKER_SCRIPT), str(orphan_of), "8"],
        input="",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 0 and worker.stdout == ""  # never said "ready"


@linux_only
def test_worker_caps_its_own_cpu_per_comparison():
    """The second line of defence: with no parent to kill it, a worker stops itself after its CPU budget."""
    worker = subprocess.Popen(
        [sys.executable, "-u", str(grading._WORKER_SCRIPT), str(os.getpid()), "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert _read_line(worker.stdout, 180) == "ready\n"
        worker.stdin.write(f'["{HOSTILE}", "3"]\n')
        worker.stdin.flush()
        # 1 s of CPU plus under 2 s of rounding; waiting much longer keeps a loaded machine from failing it.
        assert worker.wait(timeout=120) == -signal.SIGXCPU
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_slow_call_does_not_block_another_threads_call(monkeypatch):
    sending_hostile = threading.Event()
    send = grading._Worker.send

    def send_and_tell(self, index, pair, deadline):
        send(self, index, pair, deadline)
        if pair[0] == HOSTILE:
            sending_hostile.set()

    monkeypatch.setattr(grading._Worker, "send", send_and_tell)
    grader = SymbolicGrader(workers=2, deadline_s=600)  # the hostile comparison outlasts the test
    slow_result, cheap_result = [], []
    slow = threading.Thread(target=lambda: slow_result.append(grader.equal([(HOSTILE, "3")])))
    cheap = threading.Thread(
        target=lambda: cheap_result.append(
            grader.equal([("2\\sqrt{2}", "\\sqrt{8}"), ("\\frac{\\pi}{2}", "\\pi/2"), ("x^2", "x^3")])
        )
    )
    try:
        slow.start()
        assert sending_hostile.wait(180), "the slow call never started its comparison"
        cheap.start()
        cheap.join(timeout=120)  # one worker start and three small comparisons
        assert not cheap.is_alive(), "the cheap call waited for the slow one"
        assert cheap_result == [[True, True, False]]
        assert slow.is_alive()  # the hostile comparison still runs (600 s deadline)
    finally:
        grader.close()  # kills the spinning worker: the slow call returns
        slow.join(120)
        cheap.join(120)
    assert not slow.is_alive() and slow_result == [[False]]


CASES = [  # (prediction, ground truth, equal?), all decided by sympy
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\sqrt{18}", "3\\sqrt{2}", True),
    ("x^2", "x^3", False),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("(x+1)^2", "x^2+2x+1", True),
    ("\\sqrt{3}", "1.732", False),
    ("[1, 2)", "[1,2)", True),
    ("x > 2", "(2, \\infty)", True),
    ("\\frac{1}{3}", "0.3", False),
    ("2^{10}", "1024", True),
    ("\\{1, 2\\}", "\\{2, 1\\}", True),
    ("\\sin^2 x + \\cos^2 x", "1", True),
]


def test_eight_threads_share_the_pool_and_grade_correctly():
    grader = SymbolicGrader(workers=2, deadline_s=60)
    start = threading.Barrier(8)
    got, errors = {}, []

    def work(i):
        try:
            cases = CASES[i:] + CASES[:i]  # each thread its own order
            start.wait(timeout=120)
            got[i] = (grader.equal([(p, t) for p, t, _ in cases]), [e for *_, e in cases])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert errors == [] and sorted(got) == list(range(8))
        for results, expected in got.values():
            assert results == expected
        assert len(grader._workers) <= 2  # the cap holds across threads
    finally:
        grader.close()
