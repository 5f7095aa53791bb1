"""Stop a process when the process that started it is gone: ``python _orphan_watch.py PARENT_PID CHILD_PID``.

Started (in its own session, so a Ctrl-C to the parent's terminal does not end it) beside a child
that must not outlive its parent, such as Prefect's temporary API server. Every half second it checks
both processes; when the child ends first it exits; when the parent is gone (killed with kill -9, say,
so nothing ran its exit handlers) it sends the child SIGTERM, then SIGKILL after 5 s. A process is
identified by its pid and its start time (``/proc/PID/stat``), so a reused pid is not mistaken for it.

A script (not ``-m tasks...``): it imports nothing of the project and starts in milliseconds.
"""

import os
import signal
import sys
import time


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


def main() -> None:
    parent, child = int(sys.argv[1]), int(sys.argv[2])
    parent_started, child_started = start_time(parent), start_time(child)
    while start_time(child) == child_started is not None:
        if start_time(parent) != parent_started:
            os.kill(child, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while start_time(child) == child_started and time.monotonic() < deadline:
                time.sleep(0.1)
            if start_time(child) == child_started:
                os.kill(child, signal.SIGKILL)
            return
        time.sleep(0.5)


if __name__ == "__main__":
    main()
