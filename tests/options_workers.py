"""Rank bodies for tests/test_options_agree.py (real processes over gloo, spawned by dist_workers.spawn)."""

from __future__ import annotations

import json
import os

import ckptstore


def mismatched_options_job(rank: int, world: int, name: str, root: str, out: str) -> None:
    """The last rank turns the replica check on and writes every second step locally; the others do
    not. Every rank must refuse at construction, with the same error, leaving nothing behind."""
    mine = {"sdc": "warn", "local_every": 2} if rank == world - 1 else {}
    local = os.path.join(root, f"local-{rank}")
    try:
        ckptstore.CheckpointStore(name, local=local, **mine)
    except ckptstore.InvalidArgumentError as exc:
        raised = str(exc)
    else:
        raised = ""
    with open(os.path.join(out, f"r{rank}.json"), "w") as fh:
        json.dump({"raised": raised, "segments": sorted(f for f in os.listdir("/dev/shm") if f"-{name}-" in f)}, fh)
