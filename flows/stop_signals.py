"""A command stopped by Ctrl-C or SIGTERM: one line, exit status 128 + the signal, wherever the signal lands.

Prefect and pydantic may wrap a KeyboardInterrupt in errors of their own and catch those: :class:`StopSignals` raises it
again until the command's block ends, and records which signals came, so the error that reaches the command line is
still known for what it is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any


def stopped_line(prog: str, signum: int) -> str:
    """The one line a command a signal ended prints."""
    how = "interrupted" if signum == signal.SIGINT else f"stopped ({signal.Signals(signum).name})"
    return f"{prog}: {how}; what was written is intact (atomic writes, checkpoints): the same command resumes"


class StopSignals:
    """``with StopSignals() as signals:`` SIGINT and SIGTERM raise KeyboardInterrupt in the main thread, their
    numbers appended to ``signals.received``, so an error an interrupt turned into another on its way up (a
    serializer wraps it in its own error) is still known for what it is.

    An interrupt a library turns into its own error and then catches would be lost, and the command would run
    on (Prefect, serializing a flow's or a task's parameters, catches pydantic's error, which wraps the
    interrupt): so until the block ends, the interrupt is raised again every :attr:`AGAIN_S` seconds. A signal
    the process was started ignoring (a background job of a shell script) stays ignored. Outside the main
    thread, where handlers cannot be set: nothing."""

    AGAIN_S = 10.0

    def __init__(self) -> None:
        self.received: list[int] = []
        self.previous: dict[int, Any] = {}
        self.over = threading.Event()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {
                signum: signal.signal(signum, self.interrupt)
                for signum in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(signum) is not signal.SIG_IGN
            }
        return self

    def __exit__(self, *exc: Any) -> None:
        self.over.set()
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def interrupt(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if len(self.received) == 1:
            threading.Thread(target=self._again, args=(signum,), name="interrupt-again", daemon=True).start()
        raise KeyboardInterrupt

    def _again(self, signum: int) -> None:
        while not self.over.wait(self.AGAIN_S):
            if signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN):  # this handler, or one holding it
                signal.pthread_kill(threading.main_thread().ident, signum)  # a real signal: it ends a sleep too


def stop_signal_in(error: BaseException) -> int | None:
    """The signal an error reports, where it is a Ctrl-C (KeyboardInterrupt) or Prefect's SIGTERM of a flow
    run (TerminationSignal), itself or in its chain; else None."""
    from prefect.exceptions import TerminationSignal

    from tasks.mlflow_store import exception_chain

    for cause in exception_chain(error):
        if isinstance(cause, KeyboardInterrupt):
            return signal.SIGINT
        if isinstance(cause, TerminationSignal):
            return cause.signal
    return None


def exit_at_once_on_stop_signals(prog: str, announced: bool) -> None:
    """From now on (the command's work is over; Prefect drains its logs and stops its temporary server) a
    SIGINT or SIGTERM ends the process at once: its one line (unless ``announced`` already), exit status 128 +
    the signal, no traceback out of an exit handler. A temporary Prefect server still running is stopped by
    its watcher (:mod:`tasks.prefect_server`)."""

    def exit_now(signum: int, frame: Any) -> None:
        if not announced:
            print(stopped_line(prog, signum), file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, exit_now)
