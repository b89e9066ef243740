"""Ranks of tests/test_close_on_error.py (run by dist_workers.run)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import ckptstore


def raise_inside(rank: int, world: int, root: str, ram_root: str, out_dir: str) -> None:
    """Rank 1 raises inside its ``with CheckpointStore``; rank 0 stands for a rank held in the
    trainer's own collectives until the elastic agent takes it down: it stays inside its block
    until rank 1 is out of its own (or 45 s pass, which a rank 1 waiting for rank 0's close never
    is), and records which happened. Rank 1 records what propagated."""
    store = ckptstore.CheckpointStore("close-on-error", local=os.path.join(root, f"local{rank}"),
                                      durable=os.path.join(root, "durable"), durable_every=100,
                                      ram_dir=ram_root, timeout_s=60)
    out = os.path.join(out_dir, "rank1-out")
    try:
        with store:
            store.save(1, {"w": torch.full((64,), float(rank))}).wait("local")
            dist.barrier()  # both saved; step 1 is due for no promotion (durable_every=100)
            if rank == 1:
                raise ValueError("injected failure on rank 1")
            deadline = time.monotonic() + 45
            while not os.path.exists(out) and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(os.path.join(out_dir, "rank0-saw"), "w") as fh:
                fh.write("rank 1 out first" if os.path.exists(out) else "rank 1 still inside")
            raise RuntimeError("rank 0 taken down")
    except ValueError as exc:
        with open(out + ".tmp", "w") as fh:
            fh.write(f"{type(exc).__name__}: {exc}")
        os.rename(out + ".tmp", out)
    except RuntimeError as exc:
        assert rank == 0 and str(exc) == "rank 0 taken down", exc
    # The group may be left to the other rank's exit: both went through close without a collective.
