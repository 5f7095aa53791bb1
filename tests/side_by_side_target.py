"""A command over seeds one of whose children freezes at a known point, for tests/system/test_side_by_side.py to
kill:

    python tests/side_by_side_target.py CHILD MARKER MODULE [FLAGS...]

runs ``python -m MODULE FLAGS...`` unchanged, except that the child labelled CHILD (``dapo/seed2``) runs through
tests/flow_kill_target.py: once it has logged ``reward_mean`` at step 2 (its step-1 checkpoint written), it writes
MARKER and sleeps until killed. The other children run as they always do.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

KILL_TARGET = Path(__file__).with_name("flow_kill_target.py")


def main(child: str, marker: str, module: str, *argv: str) -> None:
    import flows.fanout

    real = flows.fanout.child_command

    def child_command(spec: Path) -> list[str]:
        if json.loads(spec.read_text())["name"] != child:
            return real(spec)
        return [sys.executable, str(KILL_TARGET), "flows.fanout", marker, "reward_mean", "2", str(spec)]

    flows.fanout.child_command = child_command
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
