"""Restore on the CPU against its floors, same state, same run: `CheckpointStore.restore` from the
RAM tier (the slot mapped in this process, and from a second process that has none of it mapped, as
a restarted process finds it) against the memcpy floor of the same bytes; the second process's
restore also against that process's own floor (the same bytes out of the freshly opened segment
into the same tensors, unverified: by ``pread`` and by a mapping); and from the local tier with
its files dropped from the page cache against one raw read of the same files into fresh memory.
Every restore is checked bitwise.

    python benchmarks/bench_restore.py [--layers 24] [--repeats 5] [--out docs/benchmarks]

The page cache is dropped per file with posix_fadvise(DONTNEED) after an fdatasync (no root
needed, and other processes' cached files stay cached); the kernel may keep a few pages. Writes
<out>/restore.json. Before and after a change, in one run: benchmarks/ab.py --before REV
"bench_restore.py".
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
import torch

from ckptstore import CheckpointStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, pyplot, report  # noqa: E402 - shared by the benchmark scripts


def plot(doc: dict[str, Any], path: str) -> None:
    """Medians of every row; with a "before" member (an earlier commit, same run) beside them."""
    plt = pyplot()
    if plt is None:
        return
    rows = list(doc["median_seconds"])
    fig, ax = plt.subplots(figsize=(9, 4))
    y = range(len(rows))
    before = doc.get("before", {}).get("median_seconds", {})
    if before:
        ax.barh([i + 0.2 for i in y], [before.get(r, 0) for r in rows], height=0.4, label="before", color="tab:gray")
    ax.barh([i - 0.2 for i in y] if before else list(y), [doc["median_seconds"][r] for r in rows],
            height=0.4 if before else 0.8, label="after" if before else None, color="tab:blue")
    ax.set_yticks(list(y), rows)
    ax.set_xlabel("seconds (median)")
    ax.set_title(f"restore of {doc['bytes'] / 2**30:.2f} GiB on the CPU")
    if before:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def flat_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The state's tensors as one flat dict (as bench_cuda.py saves them)."""
    out = {f"model/{k}": v for k, v in state["model"].items()}
    for pid, s in state["optim"]["state"].items():
        out.update({f"optim/{pid}/{k}": v for k, v in s.items() if v.dim()})
    return out


def drop_cached(paths: list[str]) -> None:
    """Evict these files (directories walked) from the page cache, without root."""
    for p in paths:
        files = [os.path.join(d, f) for d, _s, fs in os.walk(p) for f in fs] if os.path.isdir(p) else [p]
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_read(paths: list[str]) -> int:
    """One sequential read of each file into fresh memory; returns the bytes read."""
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy()).cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done : done + (64 << 20)]], done)
                if n <= 0:
                    raise OSError(f"{path}: short read at {done}")
                done += n
        finally:
            os.close(fd)
        total += size
        del view, buf
    return total


def remove_segments(job: str, ram_dir: str) -> None:
    for name in os.listdir(ram_dir):
        if name.startswith(f"ckptstore-{job}-"):
            os.unlink(os.path.join(ram_dir, name))


def segment_of(job: str, ram_dir: str, step: int) -> tuple[str, list[tuple[str, int, int]]]:
    """The RAM segment holding ``step`` of ``job`` and its entries (key, offset, bytes), from the
    segment's document."""
    for name in sorted(os.listdir(ram_dir)):
        if name.startswith(f"ckptstore-{job}-") and name.endswith(".json"):
            with open(os.path.join(ram_dir, name)) as fh:
                doc = json.load(fh)
            if doc.get("step") == step:
                # Keys are escaped JSON-pointer style ("/" in a key is "~1", "~" is "~0").
                entries = [(e["key"].replace("~1", "/").replace("~0", "~"), e["offset"], e["nbytes"])
                           for e in doc["layout"]]
                return os.path.join(ram_dir, name[: -len(".json")] + ".bin"), entries
    raise RuntimeError(f"no RAM segment of job {job} holds step {step} in {ram_dir}")


def restarted_floor(path: str, entries: list[tuple[str, int, int]], dst: dict[str, torch.Tensor],
                    pool: ThreadPoolExecutor, how: str) -> None:
    """The restarted process's floor: the same bytes from the freshly opened segment into the same
    destination tensors, unverified, on a thread per core; ``how``: one ``pread`` per tensor, or a
    mapping of the segment (``MAP_POPULATE``) and one memcpy per tensor."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if how == "pread":
            def one(entry: tuple[str, int, int]) -> None:
                key, offset, n = entry
                view = memoryview(dst[key].view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                done = 0
                while done < n:
                    got = os.preadv(fd, [view[done:]], offset + done)
                    if got <= 0:
                        raise OSError(f"{path}: short read at {offset + done}")
                    done += got

            for _ in pool.map(one, entries):
                pass
            return
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        _copy_from(mapping, entries, dst, pool)  # its views of the mapping gone on return
    finally:
        mapping.close()


def _copy_from(mapping: mmap.mmap, entries: list[tuple[str, int, int]], dst: dict[str, torch.Tensor],
               pool: ThreadPoolExecutor) -> None:
    src = numpy.frombuffer(mapping, numpy.uint8)

    def copy(entry: tuple[str, int, int]) -> None:
        key, offset, n = entry
        numpy.copyto(dst[key].view(-1).view(torch.uint8).numpy(), src[offset : offset + n])

    for _ in pool.map(copy, entries):
        pass


def fresh_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t`` on pages never touched: an anonymous mapping of its own (the
    allocator may hand out memory it got back from earlier tensors, already faulted in)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return torch.empty_like(t)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=t.dtype).view(t.shape)


def restarted_worker(job: str, local: str, ram_dir: str, layers: int) -> None:
    """A second process, as a restarted one finds the RAM tier: the committed slot is in ram_dir
    and nothing of it is mapped here. Each line on stdin names one timed run, checked bitwise:
    ``restore`` (the store's restore; the process's first one is reported as such), or one of the
    floors of this process (``pread``, ``map``: see :func:`restarted_floor`); followed by ``fresh``:
    into tensors on never-touched pages (:func:`fresh_like`). Wall and CPU seconds
    go to stdout. (A second store in the benchmark's own process would find the slot mapped by the
    first and copy from that mapping.) The destination tensors are the same in every run, touched
    by the first: the restore and the floors write into the same memory."""
    flat = flat_tensors(make_state(layers))
    dst = {k: torch.empty_like(v) for k, v in flat.items()}
    store = CheckpointStore(job, local=local, keep_local=1, ram_dir=ram_dir)
    path, entries = segment_of(job, ram_dir, 1)
    entries = [e for e in entries if e[0] in dst]
    assert sorted(k for k, _o, _n in entries) == sorted(dst), "the segment's layout is not the state's"
    pool = ThreadPoolExecutor(os.cpu_count() or 2)
    try:
        for line in sys.stdin:
            what, _, memory = line.strip().partition(" ")
            # "fresh": into tensors of never-touched pages (anonymous mappings of their own, gone
            # after the run), as a restarted process's first restore may find its destination.
            into = {k: fresh_like(v) for k, v in flat.items()} if memory == "fresh" else dst
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            if what == "restore":
                assert store.restore(into) == 1
            else:
                restarted_floor(path, entries, into, pool, what)
            took, cpu = time.perf_counter() - t, time.process_time() - c
            for k, v in flat.items():
                assert torch.equal(into[k], v), k
                if into is dst:
                    dst[k].zero_()
            del into
            print(took, cpu, flush=True)
    finally:
        pool.shutdown()
        store.close(keep_ram=True)


def main() -> None:
    if sys.argv[1:2] == ["--restarted-worker"]:
        job, local, ram_dir, layers = sys.argv[2:6]
        restarted_worker(job, local, ram_dir, int(layers))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ram-dir", default="/dev/shm")
    ap.add_argument("--dir", default=None, help="where the local tier goes (default: a temporary directory)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    flat = flat_tensors(make_state(args.layers))
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    dst = {k: torch.empty_like(v) for k, v in flat.items()}
    work = tempfile.mkdtemp(prefix="bench-restore-", dir=args.dir)
    local = os.path.join(work, "local")
    job = f"bench-restore-{uuid.uuid4().hex[:8]}"
    results: dict[str, list[float]] = {}
    # CPU seconds of the process per row (threads included): a load-independent measure of the
    # work, where the wall-clock time on shared cores is not.
    cpu: dict[str, list[float]] = {}
    stores: list[CheckpointStore] = []
    worker: subprocess.Popen | None = None
    pool = ThreadPoolExecutor(os.cpu_count() or 2)

    def check() -> None:
        for k, v in flat.items():
            assert torch.equal(dst[k], v), k
            dst[k].zero_()

    def timed(name: str, fn: Callable[[], Any], before: Callable[[], None] | None = None) -> None:
        if before is not None:
            before()
        gc.collect()
        t, c = time.perf_counter(), time.process_time()
        fn()
        results.setdefault(name, []).append(time.perf_counter() - t)
        cpu.setdefault(name, []).append(time.process_time() - c)

    try:
        store = CheckpointStore(job, local=local, keep_local=1, ram_dir=args.ram_dir)
        stores.append(store)
        store.save(1, flat).wait("local")
        data_files = sorted(os.path.join(d, f) for d, _s, fs in os.walk(local) for f in fs if f.endswith(".bin"))
        worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--restarted-worker", job, local,
                                   args.ram_dir, str(args.layers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)

        def floor() -> None:
            for k, v in flat.items():
                dst[k].copy_(v)

        pairs = [(dst[k].view(-1).view(torch.uint8).numpy(), v.view(-1).view(torch.uint8).numpy())
                 for k, v in flat.items()]

        def floor_threads() -> None:
            # The same copies, one single-threaded memcpy per tensor on a thread per core: the
            # restore's copies are of this kind (torch's copy_ splits each over its intra-op threads).
            for _ in pool.map(lambda p: numpy.copyto(*p), pairs):
                pass

        def ram() -> None:
            assert store.restore(dst) == 1

        def in_worker(what: str) -> tuple[float, float]:
            assert worker is not None and worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(what + "\n")
            worker.stdin.flush()
            took, spent = worker.stdout.readline().split()
            return float(took), float(spent)

        for fn in (floor, floor_threads, ram):  # warm-up: destinations and caches touched once
            fn()
        check()
        # The worker's first restore (its destinations fresh, its control plane cold), once per run.
        took, spent = in_worker("restore")
        results["restore_ram_restarted_first"] = [took]
        cpu["restore_ram_restarted_first"] = [spent]
        for what in ("pread", "map"):
            in_worker(what)
        # Rows timed in the worker, each checked there: its restores, and its own floors.
        restarted = {"restore_ram_restarted": "restore", "restarted_floor_pread": "pread",
                     "restarted_floor_map": "map", "restore_ram_restarted_fresh": "restore fresh",
                     "restarted_floor_pread_fresh": "pread fresh"}
        for r in range(args.repeats):
            rows: list[tuple[str, Callable[[], Any] | None]] = [
                ("memcpy_floor", floor), ("memcpy_floor_threads", floor_threads), ("restore_ram", ram),
                ("restarted_floor_pread", None), ("restore_ram_restarted", None), ("restarted_floor_map", None),
                ("restarted_floor_pread_fresh", None), ("restore_ram_restarted_fresh", None)]
            for name, run in rows if r % 2 == 0 else list(reversed(rows)):
                if run is None:
                    took, spent = in_worker(restarted[name])
                    results.setdefault(name, []).append(took)
                    cpu.setdefault(name, []).append(spent)
                    continue
                timed(name, run)
                if name == "restore_ram":
                    check()
        worker.stdin.close()  # type: ignore[union-attr]
        worker.wait(timeout=120)
        # From disk: a store with no RAM copy left (the segments removed), files out of the cache.
        for s in stores:
            s.close(keep_ram=True)
        stores.clear()
        remove_segments(job, args.ram_dir)
        disk = CheckpointStore(job, local=local, keep_local=1, ram_dir=args.ram_dir)
        stores.append(disk)

        def local_cold() -> None:
            assert disk.restore(dst) == 1

        disk_bytes = sum(os.path.getsize(f) for f in data_files)
        for r in range(args.repeats):
            order = [("raw_read_cold", lambda: raw_read(data_files)), ("restore_local_cold", local_cold)]
            for name, fn in order if r % 2 == 0 else list(reversed(order)):
                timed(name, fn, before=lambda: drop_cached([local]))
                if name == "restore_local_cold":
                    check()
    finally:
        if worker is not None:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            for pipe in (worker.stdin, worker.stdout):
                if pipe is not None:
                    pipe.close()
        pool.shutdown()
        for s in stores:
            s.close(keep_ram=True)
        remove_segments(job, args.ram_dir)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    ratios = {
        "restore_ram_vs_memcpy_floor": med["restore_ram"] / med["memcpy_floor"],
        "restore_ram_vs_memcpy_floor_threads": med["restore_ram"] / med["memcpy_floor_threads"],
        "restore_ram_restarted_vs_memcpy_floor": med["restore_ram_restarted"] / med["memcpy_floor"],
        # Against the floor of its own process: the same bytes out of the freshly opened segment
        # into the same tensors, unverified, the faster of pread and a mapping.
        "restore_ram_restarted_vs_restarted_floor": med["restore_ram_restarted"] / min(
            med["restarted_floor_pread"], med["restarted_floor_map"]),
        # Both into never-touched pages: what the first touch of a fresh destination costs either.
        "restore_ram_restarted_fresh_vs_restarted_floor_fresh": med["restore_ram_restarted_fresh"]
        / med["restarted_floor_pread_fresh"],
        # Throughput of the restore over that of the raw read (at least 0.9 is the target).
        "restore_local_cold_speed_vs_raw_read": med["raw_read_cold"] / med["restore_local_cold"],
    }
    cpu_med = {k: sorted(v)[len(v) // 2] for k, v in cpu.items()}
    for k, v in cpu_med.items():
        print(f"  cpu {k:36s} {v:8.3f} s")
    doc = report("restore", nbytes, args.repeats, results, ratios, args.out, data_file_bytes=disk_bytes,
                 cache_drop="fadvise_dontneed", tensors=len(flat), cpu_seconds=cpu, median_cpu_seconds=cpu_med)
    plot(doc, os.path.join(args.out, "restore.png"))


if __name__ == "__main__":
    main()
