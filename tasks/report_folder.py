"""The report's folder: built beside the old one and swapped in whole (a reader never sees half a report), and only
ever replacing a folder a report made (it holds :data:`tasks.outputs.REPORT_MARKER`) or an empty one."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tasks.outputs import REPORT_MARKER


def check_replaceable(out: Path) -> None:
    """Refuse an ``out`` that exists and is not a report folder (a file, or a folder that is neither empty nor
    marked as a report's, such as ``outputs/baseline_eval`` or a user's own report.md and figures): replacing it
    would delete it."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ValueError(
            f"--output-dir {out} exists and is not a report folder (a file); not replacing it: "
            "remove it or pick another --output-dir"
        )
    held = sorted(entry.name for entry in out.iterdir())
    if held and REPORT_MARKER not in held:
        listed = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ValueError(
            f"--output-dir {out} exists and is not a report folder (no {REPORT_MARKER}; it holds "
            f"{listed}); not replacing it: remove it or pick another --output-dir"
        )


def swap_in(built: Path, out: Path) -> None:
    """Replace folder ``out`` with the finished folder ``built`` (two renames: never half a report), when
    ``out`` is absent, empty or a report folder (:func:`check_replaceable`)."""
    check_replaceable(out)
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
        os.replace(out, old / out.name)
        os.replace(built, out)
        shutil.rmtree(old)
    else:
        os.replace(built, out)
