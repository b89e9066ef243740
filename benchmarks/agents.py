"""Finding the node agents a benchmark run's stores started (no torch import: the crash loop's
supervisor calls it between its timed events)."""

from __future__ import annotations

import os


def agent_pids(under: str) -> list[int]:
    """Node agents whose command line names ``under`` or a path beneath it: the agents the stores of
    a benchmark run started detached, which the run waits for or ends itself."""
    mine = under.rstrip("/").encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"agent" in argv and any(a == mine or a.startswith(mine + b"/") for a in argv):
            found.append(int(pid))
    return found
