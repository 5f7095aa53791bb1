"""Print a benchmark's table and append it to benchmarks/RESULTS.md."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU {platform.processor() or platform.machine()} ({cores} cores)"


def report(title: str, settings: str, header: list[str], rows: list[list[object]], record: bool = True) -> str:
    """Render a markdown table with device, date and settings, print it, append it to RESULTS.md
    (unless ``record`` is false: a check run, e.g. ``--tiny`` on a CPU)."""
    lines = [
        f"## {title}",
        "",
        f"device: {device_name()} · date: {datetime.date.today().isoformat()} · {settings}",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not record:
        return text
    with RESULTS.open("a", encoding="utf-8") as f:
        f.write(text + "\n")
    return text
