"""Where each save of one structure spends its control plane, save by save, in bench_ranks' store cell.

Two thread-ranks (``bench_ranks.store_cell``: a RAM and a local tier, DTensors ``Shard(0)``), ``--saves``
saves of one structure. Thread CPU of each save around the store's own steps (wrapped in this process
only; a step a tree lacks is left out, so the script runs on older trees too):

- the trainer's ``save()`` (``~trainer save``) and in it the fingerprint, the plan's reuse, the vote
  and the copy (``RamTier.stage``);
- the RAM commit (``~ram commit``: the CPU of the rank's background threads from the save's start
  until its RAM future resolves, as bench_ranks counts it) and in it the checksums
  (``RamTier.hash``, ``RamTier.checksums`` before it), the chunk table (``RamTier.snapshot``) and the
  document (``RamTier.commit``);
- the cyclic collector's passes from the third save on, by thread and generation, and where each
  full (generation 2) pass began.

    PYTHONPATH=<tree> python benchmarks/micro_save_parts.py [--tensors 10000] [--saves 8]

Rank 1's figures are printed per save; the first is the save that plans, the second the first into
the other slot.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_ranks as br  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import collective  # noqa: E402
from ckptstore.engine import pipeline  # noqa: E402
from ckptstore.tiers import ram  # noqa: E402

TIMES: dict[tuple[Any, str], list[float]] = {}
PASSES: dict[tuple[Any, str, int], list[float]] = {}
FULL: list[tuple[Any, list[str]]] = []
WINDOW = [False]  # from the third save to the restore: the collector's passes counted
_local = threading.local()


def _rank() -> Any:
    return getattr(threading.current_thread(), "_bench_rank", None)


def _wrap(owner: Any, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        return
    label = label or name
    if inspect.iscoroutinefunction(fn):
        async def timed_async(*a: Any, **k: Any) -> Any:
            c = time.thread_time()
            try:
                return await fn(*a, **k)
            finally:
                TIMES.setdefault((_rank(), label), []).append(time.thread_time() - c)
        wrapped: Any = functools.wraps(fn)(timed_async)
    else:
        def timed(*a: Any, **k: Any) -> Any:
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                TIMES.setdefault((_rank(), label), []).append(time.thread_time() - c)
        wrapped = functools.wraps(fn)(timed)
    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        wrapped = staticmethod(wrapped)
    setattr(owner, name, wrapped)


def _collector(phase: str, info: dict[str, Any]) -> None:
    where = (_rank(), threading.current_thread().name[:14], info["generation"])
    if phase == "start":
        _local.start = time.thread_time()
        if info["generation"] == 2 and WINDOW[0]:
            frames = [f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-1]
                      if "ckptstore" in f.filename]
            FULL.append((where, frames[-3:]))
    elif WINDOW[0] and hasattr(_local, "start"):
        PASSES.setdefault(where, []).append(time.thread_time() - _local.start)


def install() -> None:
    for name in ("_reuse", "_vote", "_stage"):
        _wrap(pipeline.Pipeline, name)
    _wrap(pipeline._Found, "__init__", "fingerprint")
    for name in ("stage", "hash", "checksums", "snapshot", "commit"):
        _wrap(ram.RamTier, name)
    _wrap(collective.Group, "max_int64")
    real_save = pipeline.Pipeline.save

    def save(self: Any, step: int, state: Any) -> Any:
        if step == 3:
            WINDOW[0] = True
        rank, b0, c0 = _rank(), br.background_cpu(_rank()), time.thread_time()
        handle = real_save(self, step, state)
        TIMES.setdefault((rank, "~trainer save"), []).append(time.thread_time() - c0)
        future = getattr(handle, "_futures", {}).get("ram")
        if future is not None:
            future.add_done_callback(
                lambda _f: TIMES.setdefault((rank, "~ram commit"), []).append(br.background_cpu(rank) - b0))
        return handle

    pipeline.Pipeline.save = save  # type: ignore[method-assign]
    real_restore = ckptstore.CheckpointStore.restore

    def restore(self: Any, *a: Any, **k: Any) -> Any:
        WINDOW[0] = False
        return real_restore(self, *a, **k)

    ckptstore.CheckpointStore.restore = restore  # type: ignore[method-assign]
    gc.callbacks.append(_collector)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--saves", type=int, default=8)
    args = ap.parse_args()
    install()
    br.install_counters()
    with tempfile.TemporaryDirectory() as tmp:
        br.store_cell(2, args.tensors, tmp, saves=args.saves)
    print(f"load average {os.getloadavg()}, {args.tensors} tensors per rank, "
          f"thread CPU in ms, rank 1, save by save (median of the third on)")
    for (rank, label), values in sorted(TIMES.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if rank != 1 or len(values) > 2 * args.saves:
            continue
        steady = statistics.median(values[2:]) if len(values) > 2 else float("nan")
        print(f"  {label:14s} {steady * 1e3:7.2f}   " + " ".join(f"{v * 1e3:.1f}" for v in values))
    print("the collector's passes from the third save to the restore (rank, thread, generation): count, CPU ms")
    for where, values in sorted(PASSES.items(), key=str):
        print(f"  {where}: {len(values)}, {sum(values) * 1e3:.1f}")
    for where, frames in FULL:
        print(f"  full pass on {where[:2]} from {' <- '.join(reversed(frames)) or '(outside ckptstore)'}")


if __name__ == "__main__":
    main()
