"""Progress for the long loops: tqdm bars on a terminal, plain status lines in a log, and a one-line status
per step, the same everywhere in a5core.

- :func:`bar` is a ``tqdm`` bar on stderr where stderr is a terminal (``A5_PROGRESS=1`` forces bars, e.g.
  under a pager that is not a TTY). Elsewhere (a log file, ``nohup``, CI, a scheduler; or ``A5_PROGRESS=0``)
  it draws nothing and instead logs a status line at INFO every ``A5_PROGRESS_INTERVAL`` seconds (30 by
  default) while it runs, e.g. ``generate: 12/32 requests, 61 s (output: 23.5 toks/s)``, and a last line
  when it ends if it logged any: work over the interval is never silent, work under it adds no line.
- :func:`engine_bar` is that bar in the form vLLM's ``use_tqdm`` takes (its requests and tokens/s).
- :func:`log_step` writes one ``logging.info`` line per training step or round, e.g.
  ``GRPO step 3/200: reward_mean 0.25, loss 0.0123, val_accuracy 0.31 (41.2 s)``. The flows' command
  lines show a5core's INFO records (flows.cli.configure_logging); a library caller decides for itself.

Used by the SFT, GRPO and Expert Iteration loops, the rollout engines' ``generate`` and batch grading.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

ENV = "A5_PROGRESS"
INTERVAL_ENV = "A5_PROGRESS_INTERVAL"
logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether bars are drawn: ``A5_PROGRESS`` if set (0/false/no/off or 1/true/yes/on), else stderr is a TTY."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def quiet_library_bars() -> None:
    """Where :func:`enabled` is false, transformers' own bars ("Loading weights", "Writing model shards") are
    off too: off a terminal they are lines of carriage returns in the log, one per model loaded or saved."""
    if not enabled():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def interval() -> float:
    """Seconds between two status lines (``A5_PROGRESS_INTERVAL``, 30 by default)."""
    value = os.environ.get(INTERVAL_ENV, "").strip()
    try:
        seconds = float(value) if value else 30.0
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={value!r}: expected a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{INTERVAL_ENV}={value!r}: expected a number of seconds > 0")
    return seconds


class _Nowhere:
    """Where a :class:`StatusLines` bar writes what tqdm would draw: nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class StatusLines(tqdm):
    """A bar that draws nothing and logs its state (``desc: n/total unit after S s (postfix)``) at INFO every
    :func:`interval` seconds from a thread of its own, and once more when it closes if it logged before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lines, self._stop = 0, threading.Event()
        super().__init__(*args, **{**kwargs, "file": _Nowhere()})
        ticker = threading.Thread(
            target=_tick, args=(weakref.ref(self), self._stop, interval()), name="a5-progress", daemon=True
        )
        ticker.start()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:  # noqa: ARG002 - tqdm's signature
        return True  # nothing drawn: the lines are logged

    def status(self) -> str:
        """``desc: n/total unit after S s (postfix)``."""
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        line = f"{self.desc}: {done} {self.unit} after {self._time() - self.start_t:.0f} s"
        return line + (f" ({self.postfix})" if self.postfix else "")

    def log_status(self, last: bool = False) -> None:
        if last and not self.lines:
            return
        self.lines += 1
        logger.info("%s%s", self.status(), "; done" if last else "")

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.log_status(last=True)
        super().close()


def _tick(ref: weakref.ref, stop: threading.Event, seconds: float) -> None:
    """Log the bar's status every ``seconds`` until it closes (or is gone: a weak reference keeps it collectable)."""
    while not stop.wait(seconds):
        lines = ref()
        if lines is None:
            return
        lines.log_status()
        del lines


def bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    initial: int = 0,
    leave: bool = False,
    postfix: str | None = None,
) -> Any:
    """A tqdm bar on stderr where :func:`enabled`, else :class:`StatusLines`. Inner bars (generation,
    grading) vanish when done (``leave=False``); a training loop's bar stays (``leave=True``)."""
    kind = tqdm if enabled() else StatusLines
    return kind(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        initial=initial,
        leave=leave,
        file=sys.stderr,
        dynamic_ncols=True,
        postfix=postfix,
    )


def engine_bar(
    iterable: Iterable[Any] | None = None, *, desc: str = "", total: int | None = None, **kwargs: Any
) -> Any:
    """:func:`bar` as vLLM's ``use_tqdm`` callable takes it: its "Processed prompts" bar (requests, with tokens/s
    as its postfix) is ``generate``."""
    generating = desc == "Processed prompts"
    return bar(
        iterable,
        desc="generate" if generating else desc,
        total=total,
        unit="requests" if generating else "it",
        postfix=kwargs.get("postfix"),
    )


def status_line(
    what: str, step: int, total: int, metrics: Mapping[str, Any], keys: Sequence[str], note: str = ""
) -> str:
    """``what step/total: key value, ...`` for the ``keys`` present in ``metrics`` (finite numbers), then
    ``; note`` if any, then ``(wall_seconds s)`` if present."""
    parts = [
        f"{key} {metrics[key]:.4g}"
        for key in keys
        if isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key])
    ]
    line = f"{what} {step}/{total}: {', '.join(parts) or '-'}" + (f"; {note}" if note else "")
    if isinstance(metrics.get("wall_seconds"), (int, float)):
        line += f" ({metrics['wall_seconds']:.1f} s)"
    return line


def log_step(
    logger: logging.Logger,
    what: str,
    step: int,
    total: int,
    metrics: Mapping[str, Any],
    keys: Sequence[str],
    note: str = "",
) -> None:
    """Log :func:`status_line` at INFO."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", status_line(what, step, total, metrics, keys, note))
