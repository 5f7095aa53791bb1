"""A command over seeds whose children of one seed freeze at a known point, for tests/system/test_side_by_side.py
to kill:

    python tests/side_by_side_target.py SEED MARKERS MODULE [FLAGS...]

runs ``python -m MODULE FLAGS...`` unchanged, except that each child of seed SEED runs through
tests/flow_kill_target.py: once it has logged ``reward_mean`` at step 2 (its step-1 checkpoint written), it writes
``MARKERS/<child>`` (``dapo-seed2``) and sleeps until killed. The other children run as they always do.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

KILL_TARGET = Path(__file__).with_name("flow_kill_target.py")


def main(seed: str, markers: str, module: str, *argv: str) -> None:
    import flows.fanout

    real = flows.fanout.child_command

    def child_command(spec: Path) -> list[str]:
        name = json.loads(spec.read_text())["name"]
        if not name.endswith(f"/seed{seed}"):
            return real(spec)
        marker = Path(markers) / name.replace("/", "-")
        return [sys.executable, str(KILL_TARGET), "flows.fanout", str(marker), "reward_mean", "2", str(spec)]

    flows.fanout.child_command = child_command
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
