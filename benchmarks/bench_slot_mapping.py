"""What mapping a new RAM-tier segment costs the training thread beside it.

A store maps its staging slots, and a peer holder its replica buffers, on background threads while
the job trains (a first start's slots made ahead, a restarted or replaced node's first slots and
replicas). Each mapping prefaults every page of a fresh /dev/shm segment (hundreds of MiB), and two
things can stop the training thread meanwhile: the GIL, if the prefault holds it, and the
process's address-space lock (mmap_lock), which the prefault holds for reading while any mmap()
of the process (malloc maps every large block: a step's activations) waits to write.

For each way of mapping, a background thread maps a new segment of ``--mib`` MiB, ``--repeat``
times, while the main thread runs a stand-in for training: a loop of Python work and 1 MiB
anonymous mmap/munmap pairs (what malloc does for a large tensor). Reported per way: the mapping's
wall time, and the longest the main thread waited between two iterations (its stall), against
the floor: the same loop with no mapping beside it. Ways:

- ``map_populate``: mmap(MAP_POPULATE) through Python's mmap module (sessions 1-12): holds the GIL
  through the call, and the lock through the populate;
- ``madvise_whole``: a plain mmap, then one madvise(MADV_POPULATE_WRITE) over the segment through
  ctypes (the GIL is let go; the lock is not);
- ``ckptstore``: the RAM tier's own ``_map_segment`` (madvise per 4 MiB through ctypes).

    python benchmarks/bench_slot_mapping.py [--mib 512] [--repeat 5] [--out docs/benchmarks/slot_mapping.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptstore.tiers import ram  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_RW, _ANON_PRIVATE = 0x3, 0x22


def _fresh(path: str, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)  # as the RAM tier reserves a segment, before it maps it
    return fd


def map_populate(path: str, size: int) -> mmap.mmap:
    fd = _fresh(path, size)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def madvise_whole(path: str, size: int) -> mmap.mmap:
    fd = _fresh(path, size)
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    _libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(m)), size, 23)
    return m


def ckptstore_way(path: str, size: int) -> mmap.mmap:
    return ram._map_segment(path, size)[0]


WAYS: dict[str, Callable[[str, int], mmap.mmap]] = {"map_populate": map_populate, "madvise_whole": madvise_whole,
                                                    "ckptstore": ckptstore_way}


def _trainer(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        sum(range(2000))  # Python work: needs the GIL
        p = _libc.mmap(None, 1 << 20, _PROT_RW, _ANON_PRIVATE, -1, 0)  # a large malloc: needs mmap_lock
        _libc.munmap(p, 1 << 20)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def trial(way: str | None, size: int) -> dict[str, float]:
    path = f"/dev/shm/ckptstore-bench-slot-{uuid.uuid4().hex[:8]}"
    gaps: list[float] = []
    stop, done = threading.Event(), threading.Event()
    took: list[float] = []

    def mapper() -> None:
        t = time.perf_counter()
        if way is None:
            time.sleep(0.3)
        else:
            m = WAYS[way](path, size)
            took.append(time.perf_counter() - t)
            stop.set()
            done.wait()  # the unmapping is not the mapping's cost (a slot stays mapped)
            m.close()
        stop.set()

    worker = threading.Thread(target=mapper)
    worker.start()
    _trainer(stop, gaps)
    done.set()
    worker.join()
    if os.path.exists(path):
        os.unlink(path)
    return {"map_s": took[0] if took else 0.0, "max_stall_s": max(gaps), "iterations": len(gaps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    size = args.mib << 20
    rows: dict[str, dict[str, float]] = {}
    for way in [None, *WAYS]:
        runs = [trial(way, size) for _ in range(args.repeat)]
        name = way or "floor (no mapping)"
        rows[name] = {k: round(statistics.median(r[k] for r in runs), 4) for k in ("map_s", "max_stall_s")}
        rows[name]["max_stall_s_worst"] = round(max(r["max_stall_s"] for r in runs), 4)
        print(f"{name:20s} map {rows[name]['map_s']:.3f} s   training thread's longest stall: median "
              f"{rows[name]['max_stall_s']:.4f} s, worst {rows[name]['max_stall_s_worst']:.4f} s", flush=True)
    floor = rows["floor (no mapping)"]["max_stall_s"]
    for row in rows.values():
        row["stall_over_floor"] = round(row["max_stall_s"] / floor, 1) if floor else None
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"benchmark": "slot_mapping", "mib": args.mib, "repeat": args.repeat,
                       "command": " ".join(["python", *sys.argv]), "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
