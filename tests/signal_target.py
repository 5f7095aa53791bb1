"""A flow's command line, signalled at a known point for tests/system/test_signals.py:

    python tests/signal_target.py SIGNAL FILE N MODULE [FLOW FLAGS...]

runs ``python -m MODULE FLOW FLAGS...`` unchanged, except that the N-th ``torch.save`` of a file named FILE
(``model.pt``: the N-th checkpoint's weights) sends SIGNAL (INT or TERM) to the process group, as a terminal's
Ctrl-C or a scheduler's SIGTERM would, as its first bytes are written: the signal lands inside the checkpoint's
write, every time.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path


class SignalOnFirstWrite:
    """A file ``torch.save`` writes through; its first write signals the process group first."""

    def __init__(self, file, signum: int) -> None:
        self.file, self.signum, self.sent = file, signum, False

    def write(self, data) -> int:
        if not self.sent:
            self.sent = True
            os.killpg(os.getpgrp(), self.signum)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def main(signame: str, file_name: str, nth: str, module: str, *argv: str) -> None:
    import torch

    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        if Path(getattr(f, "name", str(f))).name == file_name:
            saves.append(f)
            if len(saves) == int(nth):
                f = SignalOnFirstWrite(f, getattr(signal, f"SIG{signame}"))
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
