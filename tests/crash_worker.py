"""A saving process that tests/test_crash.py kills at a named commit point (``python crash_worker.py CONFIG``).

It saves steps ``1 .. last - 1`` and waits for each to reach every tier, then arms the crash
point (ckptstore._faults) and saves step ``last``. Reaching the point kills the process with
SIGKILL; if the save completes instead, it exits 3, which the test reports as a point never reached.
"""

from __future__ import annotations

import json
import sys

import torch

from ckptstore import CheckpointStore, _faults


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    # 12 MiB: three 5 MiB parts (CKPTSTORE_S3_PART_SIZE in the test) make a real multipart upload.
    return {"model": {"w": torch.randn(1536, 2048, generator=g), "b": torch.randn(7, generator=g)},
            "extra": {"step": step, "note": f"step {step}"}}


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    store = CheckpointStore(cfg["job"], local=cfg["local"], durable=cfg["durable"], durable_every=1,
                            keep_local=cfg["keep_local"], keep_durable=cfg["keep_durable"],
                            storage_options=cfg["storage_options"], durable_compression=cfg["codec"])
    last = cfg["last"]
    for step in range(1, last):
        handle = store.save(step, state(step))
        handle.wait("local")
        handle.wait("durable")
    store._drain()  # retention of the earlier steps is done too: only the armed save is in flight
    _faults.arm(cfg["point"], cfg["where"], cfg["hits"])
    handle = store.save(last, state(last))
    handle.wait("local")
    handle.wait("durable")
    store._drain()
    store.close()
    sys.exit(3)


if __name__ == "__main__":
    main()
