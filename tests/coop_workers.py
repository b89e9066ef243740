"""Worker functions of tests/test_coop_read.py: resharded loads read cooperatively by real gloo
processes, their bytes counted where chunk files are opened."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import _mesh, _placements
from dist_workers import reference as _reference

import ckptstore
from ckptstore.checkpoint import sharded as _sharded
from ckptstore.checkpoint.sharded import GlobalBox

ROWWISE = {"big": [("shard", 0)], "w": [("shard", 0)], "odd": [("shard", 0)], "bf": [("shard", 0)]}


class Counted:
    """A chunk file's Source that counts what is read through it, by file."""

    def __init__(self, real: Any, name: str, counts: dict[str, int]) -> None:
        self._real, self._name, self._counts = real, name, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _add(self, n: int, offset: int = -1) -> None:
        self._counts[self._name] = self._counts.get(self._name, 0) + n
        RANGES.append((self._name, offset, n))

    def memory(self) -> None:
        return None  # read through readinto, which is counted

    def readinto(self, offset: int, out: memoryview) -> None:
        self._add(len(out), offset)
        self._real.readinto(offset, out)

    def read(self, offset: int, length: int) -> bytes:
        self._add(length, offset)
        return self._real.read(offset, length)

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        self._add(sum(len(b) for b in bufs), offset)
        self._real.readv_into(offset, bufs)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        self._add(sum(n for _, n in ranges))
        return self._real.read_many(ranges)


_REF: dict[str, torch.Tensor] = {}


def reference() -> dict[str, torch.Tensor]:
    if not _REF:
        _REF.update(_reference())
    return _REF


COUNTS: dict[str, int] = {}
RANGES: list[tuple[str, int, int]] = []
PLANS: list[Any] = []


def _count_reads() -> None:
    """Count every byte a load reads from a chunk file (read_targets is the one read path), and keep
    this rank's part of each cooperative plan (the code before this change has none); once per process."""
    if getattr(_count_reads, "done", False):
        return
    _count_reads.done = True  # type: ignore[attr-defined]
    real = _sharded.read_targets

    def read_targets(where: str, open_file: Any, *args: Any, **kwargs: Any) -> Any:
        return real(where, lambda rel: Counted(open_file(rel), rel or "", COUNTS), *args, **kwargs)

    _sharded.read_targets = read_targets
    try:
        from ckptstore.checkpoint import coop
    except ImportError:  # the code before cooperative reads: the byte counts tell
        return
    # Each rank makes only its own part of the plan (coop.read returns it): its rounds and peak.
    real_read = coop.read

    def read(*args: Any, **kwargs: Any) -> Any:
        out = real_read(*args, **kwargs)
        if out is not None:
            PLANS.append(out)
        return out

    coop.read = read


def _total(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype == torch.bfloat16:
        got, want = got.view(torch.int16), want.view(torch.int16)
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _rows(n: int, parts: int, i: int) -> tuple[int, int]:
    size = -(-n // parts)
    start = min(n, size * i)
    return start, max(0, min(n, start + size) - start)


def _dtensors(mesh_shape: tuple[int, ...], placements: list[tuple], zeros: bool = True) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh(mesh_shape)
    state: dict[str, Any] = {}
    for name, ref in reference().items():
        full = torch.zeros_like(ref) if zeros else ref
        # Every rank holds the full reference: each takes its own shard, without a scatter.
        state[name] = full.clone() if name == "plain" else distribute_tensor(
            full, mesh, _placements(placements, 2), src_data_rank=None)
    return state


def all_job(rank: int, world: int, tmp: str) -> None:
    """Every case in one world of processes (each spawn costs seconds)."""
    t0 = time.perf_counter()
    resharded_job(rank, world, os.path.join(tmp, "resharded"), small_budget=("Shard(1)",))
    t1 = time.perf_counter()
    damaged_job(rank, world, os.path.join(tmp, "damaged"), damaged_by=world - 1)
    t2 = time.perf_counter()
    restore_job(rank, world, os.path.join(tmp, "store"))
    if rank == 0 and os.environ.get("COOP_TIMES"):
        print(f"resharded {t1 - t0:.2f} s, damaged {t2 - t1:.2f} s, restore {time.perf_counter() - t2:.2f} s")


def _boxes(cuts: dict[int, tuple[int, int]], zeros: bool = True) -> dict[str, Any]:
    """Each tensor as the box this rank holds (GlobalBox, no DTensor: a world of processes starts
    in a fraction of the time): ``cuts`` maps a dimension to (parts, this rank's part), cut as
    torch.chunk cuts; the replicated ``plain`` stays a plain tensor."""
    out: dict[str, Any] = {}
    for name, ref in reference().items():
        if name == "plain":
            out[name] = torch.zeros_like(ref) if zeros else ref.clone()
            continue
        offsets, sizes = [], []
        for d, n in enumerate(ref.shape):
            start, length = _rows(n, *cuts[d]) if d in cuts else (0, n)
            offsets.append(start)
            sizes.append(length)
        piece = ref[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        held = (torch.zeros_like(piece) if zeros else piece.clone()) if piece.numel() else None
        out[name] = GlobalBox(held, tuple(offsets), tuple(ref.shape), ref.dtype)
    return out


def _check(state: dict[str, Any], case: str, rank: int) -> None:
    for name, ref in reference().items():
        got = state[name]
        if isinstance(got, GlobalBox):
            if got.tensor is None:
                continue
            want = ref[tuple(slice(o, o + n) for o, n in zip(got.offsets, got.tensor.shape))]
            got = got.tensor
        else:
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            want = ref
        assert _equal(got, want), f"rank {rank}: {case}: {name} is not bitwise equal to what was saved"


def resharded_job(rank: int, world: int, url: str, small_budget: tuple[str, ...] | None = None,
                  dtensors: bool = False) -> None:
    """Save rows on every rank, then load into other layouts; each load is bitwise equal to the
    reference and reads at most 1.05x the checkpoint across all ranks. ``dtensors``: the states
    are DTensors on device meshes (else the same boxes as GlobalBox leaves)."""
    _count_reads()
    t0 = time.perf_counter()
    state = _dtensors((world,), [("shard", 0)], zeros=False) if dtensors else _boxes({0: (world, rank)}, zeros=False)
    state["step"] = 7
    t1 = time.perf_counter()
    ckptstore.save_sharded(state, url)
    if rank == 0 and os.environ.get("COOP_TIMES"):
        print(f"state {t1 - t0:.2f} s, save {time.perf_counter() - t1:.2f} s", flush=True)
    data = sum(t.numel() * t.element_size() for t in reference().values())
    cases: dict[str, Any] = {
        "Shard(1)": (lambda: _dtensors((world,), [("shard", 1)])) if dtensors else (lambda: _boxes({1: (world, rank)})),
        "Replicate": (lambda: _dtensors((world,), [("replicate",)])) if dtensors else (lambda: _boxes({})),
    }
    if world >= 4 and world % 2 == 0:
        cases["2-D mesh Shard(0),Shard(1)"] = (
            (lambda: _dtensors((2, world // 2), [("shard", 0), ("shard", 1)])) if dtensors
            else (lambda: _boxes({0: (2, rank // (world // 2)), 1: (world // 2, rank % (world // 2))})))
    # Rows cut as a world of one rank less cuts them: a rank needs parts of two saved row slabs.
    cases["uneven Shard(0)"] = lambda: _boxes({0: (world - 1, rank)} if rank < world - 1 else {0: (world, world)})
    for buffer_bytes in (256 << 20, 1 << 20):
        for case, make in cases.items():
            if buffer_bytes == 1 << 20 and small_budget is not None and case not in small_budget:
                continue
            t0 = time.perf_counter()
            target = make()
            target["step"] = 0
            COUNTS.clear()
            PLANS.clear()
            ckptstore.load_sharded(target, url, buffer_bytes=buffer_bytes)
            assert target["step"] == 7
            _check(target, case, rank)
            read = _total(sum(COUNTS.values()))
            if rank == 0 and os.environ.get("COOP_TIMES"):
                print(f"{world} ranks {case} budget {buffer_bytes}: {time.perf_counter() - t0:.2f} s", flush=True)
            if buffer_bytes == 256 << 20:
                # Every stored byte once across the job (the odd bytes: rounding to 4 MiB checksum blocks).
                assert read <= 1.05 * data, f"{case}: {read} bytes read across {world} ranks for {data} ({read / data:.2f}x)"
            else:
                if world == 2 and case == "uneven Shard(0)":
                    continue  # rank 0 loads everything: nothing to share
                # A budget of 1 MiB: many rounds, and what any rank holds of them stays within it.
                assert PLANS and PLANS[-1].rounds, f"{case}: the load did not read through the exchange"
                assert len(PLANS[-1].rounds) > 1 or case == "uneven Shard(0)", f"{case}: expected several rounds"
                assert max(PLANS[-1].peak_bytes) <= buffer_bytes, (case, PLANS[-1].peak_bytes)


def damaged_job(rank: int, world: int, url: str, damaged_by: int) -> None:
    """A chunk damaged on disk, needed by every rank: its owner alone reads it, and every rank
    raises CorruptCheckpointError naming the file."""
    _count_reads()
    ckptstore.save_sharded(_boxes({0: (world, rank)}, zeros=False), url)
    dist.barrier()
    rel = f"data/rank-{damaged_by:05d}.bin"
    manifest = _sharded.read_manifest(_sharded.Directory(url, None))
    chunk = next(c for c in manifest.tensors["big"].chunks if c.file == rel)
    at = chunk.offset + 12345
    if rank == 0:
        with open(os.path.join(url, rel), "r+b") as fh:
            fh.seek(at)
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    target = _boxes({1: (world, rank)})
    RANGES.clear()
    try:
        ckptstore.load_sharded(target, url)
    except ckptstore.CorruptCheckpointError as exc:
        assert rel in str(exc) and exc.key == "big" and rel in (exc.location or ""), (str(exc), exc.location, exc.key)
    else:
        raise AssertionError(f"rank {rank}: a damaged chunk every rank needs did not fail the load")
    readers = _total(1 if any(f == rel and o <= at < o + n for f, o, n in RANGES) else 0)
    assert readers == 1, f"{readers} ranks read the damaged byte of {rel}; the chunk's owner alone should have"


def restore_job(rank: int, world: int, tmp: str) -> None:
    """A store saves rows; the local copy of one chunk is damaged; a restore into columns reads
    through the exchange, finds the damage at the chunk's owner, and falls back to the durable copy,
    bitwise."""
    _count_reads()
    job = f"coop-{os.path.basename(tmp)}"
    local, durable = os.path.join(tmp, "local"), os.path.join(tmp, "durable")
    with ckptstore.CheckpointStore(job, local=local, durable=durable, durable_every=1) as store:
        handle = store.save(1, _boxes({0: (world, rank)}, zeros=False))
        handle.wait("local")
        handle.wait("durable")
    dist.barrier()
    if rank == 0:
        step_dir = os.path.join(local, "step-000000000001")
        manifest = _sharded.read_manifest(_sharded.Directory(step_dir, None))
        chunk = manifest.tensors["big"].chunks[-1]
        with open(os.path.join(step_dir, chunk.file), "r+b") as fh:
            fh.seek(chunk.offset + 999)
            byte = fh.read(1)
            fh.seek(chunk.offset + 999)
            fh.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    target = _boxes({1: (world, rank)})
    COUNTS.clear()
    PLANS.clear()
    with ckptstore.CheckpointStore(job, local=local, durable=durable) as store:
        step = store.restore(target)
    assert step == 1, step
    _check(target, "restore into Shard(1)", rank)
    assert PLANS and PLANS[-1].rounds, "the restore did not read through the exchange"


def _slab(key: int, rows: int, lo: int, n: int, cols: int) -> torch.Tensor:
    """Rows [lo, lo + n) of tensor ``key`` of a job: values exact in float32, distinct per tensor."""
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 10_000 * key
    return full[lo:lo + n].clone()


def control_plane_job(rank: int, world: int, url: str, out: str, tensors: int = 200, plain: int = 20) -> None:
    """What a rank receives through ckptstore's collectives in save_sharded, and in a load_sharded
    resharded so that pairs of ranks share the rows of a saved slab, with ``plain`` replicated
    tensors every rank loads whole: what each rank loads does not change with the (even) world, so
    neither may what it receives. Writes ``<out>/rank-<r>.json``."""
    import json

    from ckptstore import collective

    rows_per, cols = 2, 8
    rows = rows_per * world
    state: dict[str, Any] = {
        f"t{j}": GlobalBox(_slab(j, rows, rank * rows_per, rows_per, cols), (rank * rows_per, 0), (rows, cols),
                           torch.float32) for j in range(tensors)}
    state.update({f"p{j}": _slab(tensors + j, 4, 0, 4, 4) for j in range(plain)})
    state["step"] = 3
    with collective.counting() as traffic:
        ckptstore.save_sharded(state, url)
    saved = traffic.received
    dist.barrier()
    # Ranks 2k and 2k + 1 cut their two saved slabs at the middle of the second: the even rank loads
    # a slab and a half, the odd one half a slab, whatever the world (an even one), so every rank
    # loads at 4 ranks what a rank loads at 2.
    pair = rank // 2 * 2 * rows_per
    lo, n = (pair, rows_per + rows_per // 2) if rank % 2 == 0 else (pair + rows_per + rows_per // 2, rows_per // 2)
    target: dict[str, Any] = {f"t{j}": GlobalBox(torch.zeros(n, cols), (lo, 0), (rows, cols), torch.float32)
                              for j in range(tensors)}
    target.update({f"p{j}": torch.zeros(4, 4) for j in range(plain)})
    target["step"] = 0
    PLANS.clear()
    with collective.counting() as traffic:
        ckptstore.load_sharded(target, url)
    loaded = traffic.received
    assert target["step"] == 3
    for j in range(tensors):
        assert _equal(target[f"t{j}"].tensor, _slab(j, rows, lo, n, cols)), f"rank {rank}: t{j} differs"
    for j in range(plain):
        assert _equal(target[f"p{j}"], _slab(tensors + j, 4, 0, 4, 4)), f"rank {rank}: p{j} differs"
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
        json.dump({"save": saved, "load": loaded}, fh)


def index_reads_job(rank: int, world: int, url: str) -> None:
    """Issue 19: a resharded load reads no rank's whole table. Rows saved by every rank load as
    columns, an uneven cut of rows and replicated; each rank reads the step's manifest (a 2.0
    manifest, the index) once and, of the part files, only its own (writer ``w`` is read by rank
    ``w % world``), never every rank's; the tensors are bitwise equal to what was saved. Before,
    every rank of a resharded load read every part file (the whole chunk table)."""
    ckptstore.save_sharded(_boxes({0: (world, rank)}, zeros=False), url)
    dist.barrier()
    reads: list[str] = []
    real = _sharded.Directory.read_small

    def read_small(self: Any, rel: str) -> bytes:
        reads.append(rel)
        return real(self, rel)

    _sharded.Directory.read_small = read_small  # type: ignore[method-assign]
    try:
        cases = {
            "Shard(1)": lambda: _boxes({1: (world, rank)}),
            "Replicate": lambda: _boxes({}),
            "uneven Shard(0)": lambda: _boxes({0: (world - 1, rank)} if rank < world - 1 else {0: (world, world)}),
        }
        for case, make in cases.items():
            target = make()
            reads.clear()
            ckptstore.load_sharded(target, url)
            _check(target, case, rank)
            parts = sorted(r for r in reads if r.startswith("parts/"))
            assert parts == [f"parts/rank-{rank:05d}.json"], f"rank {rank}: {case}: read {parts}"
            assert reads.count("manifest.json") <= 1, f"rank {rank}: {case}: read {reads}"
    finally:
        _sharded.Directory.read_small = real  # type: ignore[method-assign]


def plan_bytes_job(rank: int, world: int, url: str, out: str, tensors: int = 1000) -> None:
    """What a rank of a resharded load_sharded reads to plan it (benchmarks/bench_coop_bytes.py
    --plan): ``tensors`` row-sharded tensors (2 rows of 8 float32 per rank) saved by every rank,
    loaded with the rows cut as a world of one rank less cuts them (each rank needs two saved
    slabs of every tensor). Writes the bytes this rank read through Directory.read_small (the
    manifest, index and part files), the CPU time of its load_plan and of its whole load."""
    import json as _json

    from ckptstore.checkpoint import index as _index

    def state(parts: int, me: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i in range(tensors):
            rows = 2 * world
            lo, n = _rows(rows, parts, me) if me < parts else (rows, 0)
            data = torch.arange(lo * 8, (lo + n) * 8, dtype=torch.float32).reshape(n, 8) + i
            out[f"t{i}"] = GlobalBox(data if n else None, (lo, 0), (rows, 8), torch.float32)
        return out

    ckptstore.save_sharded(state(world, rank), url)
    dist.barrier()
    reads: dict[str, int] = {}
    real = _sharded.Directory.read_small

    def read_small(self: Any, rel: str) -> bytes:
        data = real(self, rel)
        reads[rel] = reads.get(rel, 0) + len(data)
        return data

    plan_cpu = [0.0]
    real_plan = _index.load_plan

    def load_plan(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()
        try:
            return real_plan(*args, **kwargs)
        finally:
            plan_cpu[0] += time.thread_time() - t

    _sharded.Directory.read_small = read_small  # type: ignore[method-assign]
    _index.load_plan = load_plan
    try:
        target = state(world - 1, rank)
        t = time.thread_time()
        ckptstore.load_sharded(target, url)
        load_cpu = time.thread_time() - t
    finally:
        _sharded.Directory.read_small = real  # type: ignore[method-assign]
        _index.load_plan = real_plan
    for i in (0, tensors - 1):
        box = target[f"t{i}"]
        if box.tensor is not None:
            lo = box.offsets[0]
            want = torch.arange(lo * 8, (lo + box.tensor.shape[0]) * 8, dtype=torch.float32).reshape(-1, 8) + i
            assert torch.equal(box.tensor, want), (rank, i)
    parts = sum(n for rel, n in reads.items() if rel.startswith("parts/"))
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
        _json.dump({"read": sum(reads.values()), "parts": parts, "files": len(reads),
                    "plan_cpu": plan_cpu[0], "load_cpu": load_cpu}, fh)
