"""Worker functions of tests/test_coop_read.py: resharded loads read cooperatively by real gloo
processes, their bytes counted where chunk files are opened."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import _mesh, _placements, reference

import ckptstore
from ckptstore.checkpoint import coop
from ckptstore.checkpoint import sharded as _sharded
from ckptstore.checkpoint.sharded import GlobalBox

ROWWISE = {"big": [("shard", 0)], "w": [("shard", 0)], "odd": [("shard", 0)], "bf": [("shard", 0)]}


class Counted:
    """A chunk file's Source that counts what is read through it, by file."""

    def __init__(self, real: Any, name: str, counts: dict[str, int]) -> None:
        self._real, self._name, self._counts = real, name, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _add(self, n: int) -> None:
        self._counts[self._name] = self._counts.get(self._name, 0) + n

    def memory(self) -> None:
        return None  # read through readinto, which is counted

    def readinto(self, offset: int, out: memoryview) -> None:
        self._add(len(out))
        self._real.readinto(offset, out)

    def read(self, offset: int, length: int) -> bytes:
        self._add(length)
        return self._real.read(offset, length)

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        self._add(sum(len(b) for b in bufs))
        self._real.readv_into(offset, bufs)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        self._add(sum(n for _, n in ranges))
        return self._real.read_many(ranges)


COUNTS: dict[str, int] = {}
PLANS: list[Any] = []


def _count_reads() -> None:
    """Count every byte a load reads from a chunk file (read_targets is the one read path), and keep
    the cooperative plans made (the code before this change has none)."""
    real = _sharded.read_targets

    def read_targets(where: str, open_file: Any, *args: Any, **kwargs: Any) -> Any:
        return real(where, lambda rel: Counted(open_file(rel), rel or "", COUNTS), *args, **kwargs)

    _sharded.read_targets = read_targets
    real_plan = getattr(coop, "plan", None) if hasattr(coop, "plan") else None
    if real_plan is not None:
        def plan(*args: Any, **kwargs: Any) -> Any:
            out = real_plan(*args, **kwargs)
            PLANS.append(out)
            return out

        coop.plan = plan


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
        state[name] = full.clone() if name == "plain" else distribute_tensor(full, mesh, _placements(placements, 2))
    return state


def _check_dtensors(state: dict[str, Any], case: str, rank: int) -> None:
    for name, ref in reference().items():
        got = state[name]
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert _equal(full, ref), f"rank {rank}: {case}: {name} is not bitwise equal to what was saved"


def resharded_job(rank: int, world: int, url: str) -> None:
    """Save rows (Shard(0)) on every rank, then load into other layouts; each load is bitwise equal
    to the reference and reads at most 1.05x the checkpoint across all ranks."""
    _count_reads()
    state = _dtensors((world,), [("shard", 0)], zeros=False)
    state["step"] = 7
    ckptstore.save_sharded(state, url)
    data = sum(t.numel() * t.element_size() for t in reference().values())
    cases: dict[str, Any] = {
        "Shard(1)": lambda: _dtensors((world,), [("shard", 1)]),
        "Replicate": lambda: _dtensors((world,), [("replicate",)]),
    }
    if world >= 4 and world % 2 == 0:
        cases["2-D mesh Shard(0),Shard(1)"] = lambda: _dtensors((2, world // 2), [("shard", 0), ("shard", 1)])

    def uneven() -> dict[str, Any]:
        # Rows cut as a world of one rank less cuts them: a rank needs parts of two saved row slabs.
        out: dict[str, Any] = {}
        for name, ref in reference().items():
            start, n = _rows(ref.shape[0], world - 1, rank) if rank < world - 1 else (0, 0)
            piece = torch.zeros((n,) + tuple(ref.shape[1:]), dtype=ref.dtype) if n else None
            out[name] = GlobalBox(piece, (start,) + (0,) * (ref.dim() - 1), tuple(ref.shape), ref.dtype)
        return out

    cases["uneven Shard(0)"] = uneven
    for buffer_bytes in (256 << 20, 1 << 20):
        for case, make in cases.items():
            t0 = time.perf_counter()
            target = make()
            target["step"] = 0
            COUNTS.clear()
            PLANS.clear()
            ckptstore.load_sharded(target, url, buffer_bytes=buffer_bytes)
            assert target["step"] == 7
            if case == "uneven Shard(0)":
                for name, ref in reference().items():
                    box = target[name]
                    if box.tensor is not None:
                        want = ref.narrow(0, box.offsets[0], box.tensor.shape[0])
                        assert _equal(box.tensor, want), f"rank {rank}: {case}: {name} is not bitwise equal"
            else:
                _check_dtensors(target, case, rank)
            read = _total(sum(COUNTS.values()))
            if rank == 0 and os.environ.get("COOP_TIMES"):
                print(f"{world} ranks {case} budget {buffer_bytes}: {time.perf_counter() - t0:.2f} s", flush=True)
            if buffer_bytes == 256 << 20:
                # Every stored byte once across the job (the odd bytes: rounding to 4 MiB checksum blocks).
                assert read <= 1.05 * data, f"{case}: {read} bytes read across {world} ranks for {data} ({read / data:.2f}x)"
            else:
                # A budget of 1 MiB: many rounds, and what any rank holds of them stays within it.
                if world == 2 and case == "uneven Shard(0)":
                    continue  # rank 0 loads everything: nothing to share
                assert PLANS and PLANS[-1].rounds, f"{case}: the load did not read through the exchange"
                assert len(PLANS[-1].rounds) > 1 or case == "uneven Shard(0)", f"{case}: expected several rounds"
                assert max(PLANS[-1].peak_bytes) <= buffer_bytes, (case, PLANS[-1].peak_bytes)


def damaged_job(rank: int, world: int, url: str, damaged_by: int) -> None:
    """A chunk damaged on disk, needed by every rank: its owner alone reads it, and every rank
    raises CorruptCheckpointError naming the file."""
    _count_reads()
    state = _dtensors((world,), [("shard", 0)], zeros=False)
    ckptstore.save_sharded(state, url)
    dist.barrier()
    rel = f"data/rank-{damaged_by:05d}.bin"
    if rank == 0:
        manifest = _sharded.read_manifest(_sharded.Directory(url, None))
        chunk = next(c for c in manifest.tensors["big"].chunks if c.file == rel)
        with open(os.path.join(url, rel), "r+b") as fh:
            fh.seek(chunk.offset + 12345)
            byte = fh.read(1)
            fh.seek(chunk.offset + 12345)
            fh.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    target = _dtensors((world,), [("shard", 1)])
    COUNTS.clear()
    try:
        ckptstore.load_sharded(target, url)
    except ckptstore.CorruptCheckpointError as exc:
        assert rel in str(exc) and exc.key == "big" and rel in (exc.location or ""), (str(exc), exc.location, exc.key)
    else:
        raise AssertionError(f"rank {rank}: a damaged chunk every rank needs did not fail the load")
    readers = _total(1 if COUNTS.get(rel) else 0)
    assert readers == 1, f"{readers} ranks read {rel}; its owner alone should have"


def restore_job(rank: int, world: int, tmp: str) -> None:
    """A store saves rows; the local copy of one chunk is damaged; a restore into columns reads
    through the exchange, finds the damage at the chunk's owner, and falls back to the durable copy,
    bitwise."""
    _count_reads()
    job = f"coop-{os.path.basename(tmp)}"
    local, durable = os.path.join(tmp, "local"), os.path.join(tmp, "durable")
    with ckptstore.CheckpointStore(job, local=local, durable=durable, durable_every=1) as store:
        handle = store.save(1, _dtensors((world,), [("shard", 0)], zeros=False))
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
    target = _dtensors((world,), [("shard", 1)])
    COUNTS.clear()
    PLANS.clear()
    with ckptstore.CheckpointStore(job, local=local, durable=durable) as store:
        step = store.restore(target)
    assert step == 1, step
    _check_dtensors(target, "restore into Shard(1)", rank)
    assert PLANS and PLANS[-1].rounds, "the restore did not read through the exchange"
