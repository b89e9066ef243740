"""A trainer that tests/test_agent.py kills right after ``save`` returns (``python agent_worker.py CONFIG RANK``).

It saves steps ``1 .. last - 1`` and waits for each to reach the tiers it goes to, then arms a
crash point (``ram.committed`` of step ``last`` holds back the local write: the process dies
once the step is committed in RAM, before any byte of it reaches the local tier) and saves step
``last``. If the save completes instead, it exits 3, which the test reports as a point never
reached. With ``world`` > 1 the ranks form a gloo group over loopback; ``nodes`` gives each
rank's simulated node (its own RAM directory and local directory).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ckptstore import CheckpointStore, _faults


def state(step: int) -> dict:
    """The same on every rank (plain tensors are replicated: each is written by one rank, so every
    rank of a 4-rank job writes one of the four)."""
    g = torch.Generator().manual_seed(500 + step)
    return {
        "model": {"a": torch.randn(512, 1024, generator=g), "b": torch.randn(384, 1024, generator=g),
                  "c": torch.randint(-(2**40), 2**40, (256, 512), generator=g, dtype=torch.int64),
                  "d": torch.randn(300, 700, generator=g).to(torch.bfloat16)},
        "extra": {"step": step, "note": f"step {step}"},
    }


def agent_processes(job: str) -> int:
    """How many node agents of ``job`` run on this machine (by their command lines)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"ckptstore.cli" in argv and b"agent" in argv and job.encode() in argv:
            count += 1
    return count


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    rank, world = int(sys.argv[2]), cfg["world"]
    torch.set_num_threads(1)
    node = cfg["nodes"][rank]  # the simulated node: its own RAM and local directories (keyed by str(node) in JSON)
    if world > 1:
        dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world)
    store = CheckpointStore(cfg["job"], local=cfg["local"][str(node)], durable=cfg["durable"],
                            durable_every=cfg["durable_every"], ram_dir=cfg["ram"][str(node)], node=node,
                            storage_options=cfg["storage_options"], agent=cfg.get("agent", False))
    last = cfg["last"]
    for step in range(1, last):
        handle = store.save(step, state(step))
        handle.wait("local")
        handle.wait("durable")
    store._drain()  # retention of the earlier steps is done too: only the armed save is in flight
    if cfg.get("count_agents"):
        with open(os.path.join(cfg["out"], f"agents-{rank}"), "w") as fh:
            fh.write(str(agent_processes(cfg["job"])))
    if world > 1:
        dist.barrier()
    _faults.arm(cfg["point"], str(last))
    store.save(last, state(last))  # returns once staged; the background run dies at the point
    store._drain()
    sys.exit(3)


if __name__ == "__main__":
    main()
