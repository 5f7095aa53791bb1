"""Progress for the long loops: tqdm bars and a one-line status per step, the same everywhere in a5core.

- :func:`bar` wraps ``tqdm`` (on stderr). Bars show only when stderr is a terminal; ``A5_PROGRESS=0``
  turns them off, ``A5_PROGRESS=1`` forces them on (e.g. under a pager that is not a TTY).
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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ENV = "A5_PROGRESS"


def enabled() -> bool:
    """Whether bars are drawn: ``A5_PROGRESS`` if set (0/false/no/off or 1/true/yes/on), else stderr is a TTY."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    initial: int = 0,
    leave: bool = False,
) -> Any:
    """A tqdm bar on stderr (a no-op one when :func:`enabled` is false). Inner bars (generation,
    grading) vanish when done (``leave=False``); a training loop's bar stays (``leave=True``)."""
    from tqdm import tqdm

    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        initial=initial,
        leave=leave,
        file=sys.stderr,
        disable=not enabled(),
        dynamic_ncols=True,
    )


def status_line(what: str, step: int, total: int, metrics: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``what step/total: key value, ...`` for the ``keys`` present in ``metrics`` (finite numbers), then
    ``(wall_seconds s)`` if present."""
    parts = [
        f"{key} {metrics[key]:.4g}"
        for key in keys
        if isinstance(metrics.get(key), (int, float)) and math.isfinite(metrics[key])
    ]
    line = f"{what} {step}/{total}: {', '.join(parts) or '-'}"
    if isinstance(metrics.get("wall_seconds"), (int, float)):
        line += f" ({metrics['wall_seconds']:.1f} s)"
    return line


def log_step(
    logger: logging.Logger, what: str, step: int, total: int, metrics: Mapping[str, Any], keys: Sequence[str]
) -> None:
    """Log :func:`status_line` at INFO."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", status_line(what, step, total, metrics, keys))
