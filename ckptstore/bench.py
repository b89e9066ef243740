"""``ckptstore bench``: what each tier of this machine sustains, next to the hardware's own ceiling.

For every target the same bytes go through two paths in interleaved rounds (the VMs this runs on
return freed memory to the host and page out idle memory, so buffers are allocated once, touched
before the first timed round, and the compared variants alternate which goes first):

- RAM: a ``copy_`` into preallocated buffers (the memcpy floor) against staging into a reused
  RAM-tier slot, which is what ``CheckpointStore.save`` blocks on;
- a local directory: one sequential write + fsync (O_DIRECT where the filesystem allows it) and a
  cold read of that file, against the local tier persisting the staged snapshot and ``load_sharded``
  reading it back (checksums verified), with the page cache dropped before every read;
- a durable fsspec URL: on s3://, boto3's transfer manager uploading the same bytes with the
  promotion's part size and parts in flight, and ranged GETs of the ranges a restore reads with its
  concurrency (elsewhere a raw put/get through the same filesystem), against promoting the snapshot
  to a durable tier and reading it back.

A sweep over write chunk size and writes in flight (local) and part size and parts in flight (S3)
picks the settings that ``CheckpointStore(..., tuning=FILE)`` applies; the checkpoint cost of a
given state size, extrapolated from the measured rates, is what ``ckptstore plan`` takes.

The store reads the file this writes with :func:`ckptstore.storage.tuning.load_tuning` and never
imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._units import format_bytes
from .errors import InvalidArgumentError
from .names import segment_prefix
from .storage.targets import WriteTuning

SCHEMA = "ckptstore-bench/1"
_ALIGN = 4096
_PIECE = 64 << 20  # the state is cut into tensors of this size (a model's largest weights are of this order)
_RAW_IO = 64 << 20  # bytes per call of the raw ceiling's reads and writes
LOCAL_CHUNKS = (1 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20)
LOCAL_CONCURRENCY = (1, 2, 4)
DURABLE_PARTS = (5 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)
DURABLE_CONCURRENCY = (1, 2, 4, 8)
_TIE = 0.03  # settings within 3% of the fastest count as equal: the one using fewer resources wins


# ---------------------------------------------------------------------------------------- measuring

@dataclass
class BenchConfig:
    size: int = 1 << 30
    ram: bool = False
    local: str | None = None
    durable: str | None = None
    storage_options: dict[str, Any] | None = None
    peer: bool = False
    repeats: int = 3
    sweep: bool = True
    sweep_size: int | None = None  # default: min(size, 256 MiB)
    state_size: int | None = None  # default: size
    ram_dir: str = "/dev/shm"
    local_chunks: tuple[int, ...] = LOCAL_CHUNKS
    local_concurrency: tuple[int, ...] = LOCAL_CONCURRENCY
    durable_parts: tuple[int, ...] = DURABLE_PARTS
    durable_concurrency: tuple[int, ...] = DURABLE_CONCURRENCY
    progress: bool | None = None  # None: a bar when stderr is a terminal
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True))


def _aligned_buffer(nbytes: int) -> tuple[mmap.mmap, Any]:
    """Page-aligned anonymous memory (O_DIRECT needs it) as a uint8 tensor, every page touched."""
    import torch

    buf = mmap.mmap(-1, max(nbytes, _ALIGN))
    t = torch.frombuffer(buf, dtype=torch.uint8)[:nbytes]
    t.fill_(0)
    return buf, t


def _pieces(flat: Any, nbytes: int) -> dict[str, Any]:
    return {f"t{i // _PIECE:05d}": flat[i : i + _PIECE] for i in range(0, nbytes, _PIECE)}


def drop_cache(paths: list[str]) -> str:
    """Evict ``paths`` (files, or directories walked) from the page cache; returns how:
    "drop_caches" (root: the whole cache, after a sync) or "fadvise_dontneed" (per file; the kernel
    may keep dirty or mapped pages)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files.extend(os.path.join(d, f) for d, _s, fs in os.walk(p) for f in fs)
        elif os.path.exists(p):
            files.append(p)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def _raw_write(path: str, data: memoryview) -> bool:
    """Sequential write + fsync of ``data`` to a new file; O_DIRECT where allowed. Returns whether
    O_DIRECT was used."""
    direct = hasattr(os, "O_DIRECT")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    fd = -1
    if direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:
            direct = False
    if fd < 0:
        fd = os.open(path, flags, 0o644)
    try:
        n = len(data)
        body = n - n % _ALIGN if direct else n
        pos = 0
        try:
            while pos < body:
                pos += os.pwrite(fd, data[pos : min(body, pos + _RAW_IO)], pos)
        except OSError:
            if not direct:
                raise
            direct = False  # the filesystem takes O_DIRECT opens but not writes (see storage/direct.py)
        if pos < n:
            with open(path, "r+b", buffering=0) as fh:
                fh.seek(pos)
                fh.write(data[pos:])
                os.fsync(fh.fileno())
        os.fsync(fd)
    finally:
        os.close(fd)
    return direct


def _raw_read(path: str, out: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pos = 0
        while pos < len(out):
            n = os.preadv(fd, [out[pos : pos + _RAW_IO]], pos)
            if n == 0:
                raise OSError(f"{path} is shorter than expected")
            pos += n
    finally:
        os.close(fd)


def _entry(name: str, nbytes: int, seconds: list[float]) -> dict[str, Any]:
    med = statistics.median(seconds)
    return {"name": name, "seconds": seconds, "median_s": med, "min_s": min(seconds), "max_s": max(seconds),
            "GB_per_s": nbytes / med / 1e9 if med > 0 else None}


def _op(nbytes: int, raw: tuple[str, list[float]], ours: tuple[str, list[float]],
        tuned: tuple[str, list[float]] | None = None) -> dict[str, Any]:
    """One row: the raw ceiling, ckptstore's figure, and ckptstore's throughput as a ratio of raw."""
    r, c = _entry(raw[0], nbytes, raw[1]), _entry(ours[0], nbytes, ours[1])
    doc = {"raw": r, "ckptstore": c, "ratio": r["median_s"] / c["median_s"] if c["median_s"] > 0 else None}
    if tuned is not None and tuned[1]:
        t = _entry(tuned[0], nbytes, tuned[1])
        doc["ckptstore_tuned"] = t
        doc["ratio_tuned"] = r["median_s"] / t["median_s"] if t["median_s"] > 0 else None
    return doc


class _Bar:
    def __init__(self, total: int, enabled: bool | None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="bench", unit="op", file=sys.stderr, disable=None if enabled is None
                        else not enabled, leave=False)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.bar.set_postfix_str(what, refresh=False)
        yield
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _Staged:
    """A state of ``nbytes`` staged once in a RAM tier, as the store's pipeline hands it to a tier."""

    def __init__(self, job: str, state: dict[str, Any], ram_dir: str) -> None:
        from .checkpoint.materialize import encode_value
        from .checkpoint.sharded import BLOCK_SIZE, collect
        from .tiers.ram import RamTier

        self.local = collect(state, 0, encode_value)
        self.items = [(key, t) for (key, _o, _s), t in self.local.items.items()]
        self.tier = RamTier(job, ram_dir=ram_dir, slots=2)
        self.step = 0
        self.restage()  # both slots touched before anything is timed
        self.restage()
        self.checksum_s = _timed(lambda: self.tier.checksums(self.staged, block_size=BLOCK_SIZE))
        self.snap = self.tier.snapshot(self.staged, 1, {})
        self.targets: dict[tuple[str, Any], Any] = {}
        self.persisted = 0

    def restage(self) -> None:
        self.step += 1
        self.staged = self.tier.stage(self.step, self.items)

    def persist(self, root: str, storage_options: dict[str, Any] | None, tuning: WriteTuning | None) -> str:
        """What the store's pipeline does per tier and step: this rank's files, then the manifest.
        Each call writes the next step under ``root`` through one tier per root and tuning, as a
        store's tiers live across its steps (a tier per call would time building an S3 client)."""
        from .checkpoint.sharded import build_manifest
        from .tiers.directory import DirectoryTier

        target = self.targets.get((root, tuning))
        if target is None:
            target = self.targets[(root, tuning)] = DirectoryTier("bench", root, storage_options=storage_options,
                                                                  tuning=tuning)
        self.persisted += 1
        snap = dataclasses.replace(self.snap, step=self.persisted)
        part = target.put_sync(snap)
        target.commit_sync(snap.step, build_manifest(self.local.tree, self.local.tensors, [part], 1))
        return str(target.display(snap.step))

    def close(self) -> None:
        self.tier.close(unlink=True)


class RawS3:
    """The raw baseline of an S3 durable tier, on a boto3 client built from the s3fs filesystem's
    own settings (endpoint, credentials, botocore config): the same bytes through boto3's transfer
    manager (``upload_fileobj``) with the part size and parts in flight of ckptstore's promotion,
    and read back by ranged GETs into preallocated memory, one per range that ckptstore's restore
    requests (one per chunk) and as many at once as its reader threads.

    Shared by ``ckptstore bench --durable`` and benchmarks/bench_tiers.py."""

    def __init__(self, fs: Any, path: str, src: memoryview, dst: memoryview, upload: Any,
                 ranges: list[tuple[int, int]], read_threads: int) -> None:
        import concurrent.futures
        import io

        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.client = boto3.client("s3", aws_access_key_id=fs.key, aws_secret_access_key=fs.secret,
                                   aws_session_token=fs.token, config=Config(**(fs.config_kwargs or {})),
                                   **(fs.client_kwargs or {}))
        self.bucket, self.key, _ = fs.split_path(path)
        self.transfer = TransferConfig(multipart_threshold=upload.part_size, multipart_chunksize=upload.part_size,
                                       max_concurrency=upload.max_in_flight, use_threads=True)
        self.upload, self.ranges, self.read_threads = upload, ranges, read_threads
        self.body = io.BytesIO(src)  # one copy, made here: the rounds only rewind it
        self.dst = dst
        self.pool = concurrent.futures.ThreadPoolExecutor(read_threads, thread_name_prefix="ckptstore-bench-get")

    @property
    def read_part(self) -> int:
        """The largest ranged GET."""
        return max((n for _o, n in self.ranges), default=0)

    def describe(self) -> dict[str, Any]:
        return {"client": "boto3", "upload": "S3Transfer upload_fileobj", "upload_part_bytes": self.upload.part_size,
                "upload_concurrency": self.upload.max_in_flight, "read": "ranged get_object into preallocated memory",
                "read_requests": len(self.ranges), "read_part_bytes_max": self.read_part,
                "read_concurrency": self.read_threads}

    def put(self) -> None:
        self.body.seek(0)
        self.client.upload_fileobj(self.body, self.bucket, self.key, Config=self.transfer)

    def get(self) -> None:
        def part(rng: tuple[int, int]) -> None:
            offset, end = rng[0], rng[0] + rng[1]
            body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-{end - 1}")["Body"]
            while offset < end:
                got = body.readinto(self.dst[offset:end])
                if not got:
                    raise OSError(f"the ranged GET of s3://{self.bucket}/{self.key} ended early at byte {offset}")
                offset += got

        for _ in self.pool.map(part, self.ranges):
            pass

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def _recommend(rows: list[dict[str, Any]], size_key: str) -> dict[str, Any]:
    """The fastest settings; among those within _TIE of it, the fewest writes in flight, then the
    smallest size (less memory held, fewer threads busy)."""
    best = max(r["GB_per_s"] or 0 for r in rows)
    near = [r for r in rows if (r["GB_per_s"] or 0) >= best * (1 - _TIE)]
    pick = min(near, key=lambda r: (r["concurrency"], r[size_key]))
    return {size_key: pick[size_key], "concurrency": pick["concurrency"], "GB_per_s": pick["GB_per_s"]}


def _default_upload() -> Any:
    from .storage.s3 import S3Upload

    return S3Upload()


def _url_join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure every requested target; returns the JSON document (see docs/benchmarks.md)."""
    import torch

    from .api.sharded import load_sharded
    from .storage.targets import resolve

    if cfg.repeats < 1:
        raise InvalidArgumentError(f"--repeats must be at least 1, not {cfg.repeats}")
    n = cfg.size
    sweep_n = min(cfg.sweep_size or min(n, 256 << 20), n)
    state_bytes = cfg.state_size or n
    if not (cfg.ram or cfg.local or cfg.durable):
        if not cfg.peer:
            raise InvalidArgumentError("name at least one target: --ram, --local DIR, --durable URL or --peer")
        doc: dict[str, Any] = {"schema": SCHEMA, "bytes": n, "GiB": n / 2**30, "repeats": cfg.repeats,
                               "targets": {"peer": _run_peer(min(n, 256 << 20), cfg.repeats, cfg.log)},
                               "sweep": {}, "recommended": {}, "cache_drop": None, "o_direct": None}
        doc["checkpoint_cost"] = _cost(doc, state_bytes, 0.0)
        doc["machine"] = _machine()
        return doc
    fs = None
    durable_root = None
    if (durable := cfg.durable) is not None:
        # One filesystem object for every round, as a store's durable tier keeps one: options that
        # bypass fsspec's instance cache would build a new S3 client (about 0.5 s of CPU) in every
        # timed load_sharded call.
        cfg = dataclasses.replace(cfg, storage_options={k: v for k, v in (cfg.storage_options or {}).items()
                                                        if k != "skip_instance_cache"})
        target = resolve(durable, cfg.storage_options)
        if target.fs is None:
            raise InvalidArgumentError(
                f"--durable {durable!r} is a local path: give an fsspec URL (s3://bucket/prefix, ...), "
                "or measure a directory with --local"
            )
        fs = target.fs
        durable_root = _url_join(durable, f"ckptstore-bench-{uuid.uuid4().hex[:8]}")
    local_root = None
    if cfg.local is not None:
        os.makedirs(cfg.local, exist_ok=True)
        local_root = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=cfg.local)
    job = f"bench-{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    cfg.log(f"ckptstore bench: {n / 2**30:.3f} GiB, {cfg.repeats} interleaved rounds; allocating and touching buffers")
    src_buf, src = _aligned_buffer(n)
    src.view(-1)[: n - n % 8].view(torch.int64).copy_(torch.arange((n - n % 8) // 8, dtype=torch.int64))
    dst_buf, dst = _aligned_buffer(n)
    state = _pieces(src, n)
    dest = _pieces(dst, n)
    staged = _Staged(job, state, cfg.ram_dir)
    sweep_staged: _Staged | None = None
    raw_s3: RawS3 | None = None
    doc = {"schema": SCHEMA, "bytes": n, "GiB": n / 2**30, "repeats": cfg.repeats, "targets": {}, "sweep": {},
           "recommended": {}}
    cache_drop: set[str] = set()
    o_direct: set[bool] = set()
    sweep_local = [(c, k) for c in cfg.local_chunks for k in cfg.local_concurrency] if local_root and cfg.sweep else []
    # The durable settings are S3's multipart upload's: elsewhere they would change nothing.
    from .storage.s3 import is_s3

    notes: list[str] = []
    durable_s3 = fs is not None and is_s3(fs)
    if durable_root is not None and durable_s3:
        from .checkpoint.sharded import DEFAULT_READ_BUFFER
        from .checkpoint.single_file import IO_THREADS
        from .storage.s3 import upload_settings

        try:
            # ckptstore's reads of this state: one request per chunk (_PIECE, below the read
            # buffer), IO_THREADS at once; its uploads: the multipart settings of a default store.
            piece = min(_PIECE, DEFAULT_READ_BUFFER)
            raw_s3 = RawS3(fs, str(resolve(_url_join(durable_root, "raw.bin"), cfg.storage_options).fspath),
                           memoryview(src_buf)[:n], memoryview(dst_buf)[:n], upload_settings() or _default_upload(),
                           [(o, min(piece, n - o)) for o in range(0, n, piece)], IO_THREADS)
        except ImportError:
            notes.append("the raw durable baseline is an fsspec put/get: boto3 is not installed (pip install boto3)")
    # A part size that does not cut the sweep's object in at least two parts measures a single PUT.
    parts = [p for p in cfg.durable_parts if 2 * p <= sweep_n]
    sweep_durable = ([(p, k) for p in parts for k in cfg.durable_concurrency]
                     if durable_root and cfg.sweep and durable_s3 else [])
    if durable_root and cfg.sweep and durable_s3 and not parts:
        notes.append(f"no durable sweep: --sweep-size {sweep_n} bytes is under two parts of the smallest size")
    ops_per_round = (2 if cfg.ram else 0) + (4 if local_root else 0) + (4 if durable_root else 0)
    total = cfg.repeats * (ops_per_round + len(sweep_local) + len(sweep_durable))
    bar = _Bar(total, cfg.progress)
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    try:
        if sweep_local or sweep_durable:
            take, acc = {}, 0
            for k, v in state.items():
                if acc >= sweep_n:
                    break
                take[k] = v[: sweep_n - acc]
                acc += take[k].numel()
            sweep_staged = _Staged(job + "-sweep", take, cfg.ram_dir)
        floor = [dest[k] for k in state]
        pairs = list(zip(floor, state.values()))
        def memcpy() -> None:
            for d, s in pairs:
                d.copy_(s)

        def ram_round() -> list[tuple[str, Callable[[], None]]]:
            return [("ram/memcpy", memcpy), ("ram/ckptstore_stage", staged.restage)]

        def local_round() -> list[tuple[str, Callable[[], None]]]:
            assert local_root is not None
            raw_path = os.path.join(local_root, "raw.bin")
            step_dir: list[str] = []

            def raw_write() -> None:
                o_direct.add(_raw_write(raw_path, memoryview(src_buf)[:n]))

            def raw_read() -> None:
                _raw_read(raw_path, memoryview(dst_buf)[:n])

            def persist() -> None:
                step_dir[:] = [staged.persist(os.path.join(local_root, "r"), None, None)]

            def read() -> None:
                load_sharded(dest, step_dir[0])

            return [("local/raw_write_fsync", raw_write), ("local/raw_cold_read", raw_read),
                    ("local/ckptstore_persist", persist), ("local/ckptstore_cold_read", read)]

        def durable_round() -> list[tuple[str, Callable[[], None]]]:
            assert durable_root is not None and fs is not None
            raw_key = resolve(_url_join(durable_root, "raw.bin"), cfg.storage_options).fspath
            step_dir: list[str] = []

            def raw_put() -> None:
                if raw_s3 is not None:
                    raw_s3.put()
                    return
                with fs.open(raw_key, "wb") as fh:
                    fh.write(memoryview(src_buf)[:n])

            def raw_get() -> None:
                if raw_s3 is not None:
                    raw_s3.get()
                    return
                data = fs.cat_file(raw_key)
                if len(data) != n:
                    raise OSError(f"raw get returned {len(data)} bytes, not {n}")

            def persist() -> None:
                step_dir[:] = [staged.persist(_url_join(durable_root, "r"), cfg.storage_options, None)]

            def read() -> None:
                load_sharded(dest, step_dir[0], storage_options=cfg.storage_options)

            return [("durable/raw_put", raw_put), ("durable/raw_get", raw_get),
                    ("durable/ckptstore_promote", persist), ("durable/ckptstore_read", read)]

        # Warm-up: one unmeasured pass of everything (first touches, connections, thread pools).
        rounds = ([ram_round] if cfg.ram else []) + ([local_round] if local_root else []) + (
            [durable_round] if durable_root else [])
        for make in rounds:
            for _name, fn in make():
                fn()
        for r in range(cfg.repeats):
            groups = [make() for make in rounds]
            for group in groups if r % 2 == 0 else groups[::-1]:
                # RAM: the two copies alternate. Disks and URLs: raw write, raw read, ckptstore write,
                # ckptstore read (each read right after the write it reads); odd rounds ckptstore first.
                ordered = group if r % 2 == 0 else (group[::-1] if len(group) == 2 else group[2:] + group[:2])
                for name, fn in ordered:
                    with bar.step(name):
                        is_read = name.endswith(("read", "_get"))
                        if is_read:
                            dst.zero_()  # a read that fills nothing cannot pass the check below
                            if name.startswith("local/"):
                                cache_drop.add(drop_cache([local_root] if local_root else []))
                        record(name, _timed(fn))
                        filled = "ckptstore" in name or (name == "durable/raw_get" and raw_s3 is not None)
                        if is_read and filled and not torch.equal(dst, src):
                            raise RuntimeError(f"ckptstore bench: {name} read back different bytes (a bug: please "
                                               "report it)")
            if local_root:
                for name in os.listdir(local_root):
                    if name.startswith("r"):
                        shutil.rmtree(os.path.join(local_root, name), ignore_errors=True)
            if durable_root and fs is not None:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(resolve(durable_root, cfg.storage_options).fspath, recursive=True)
            # The sweep's rounds interleave with the main ones, so slow phases of the host hit both.
            _sweep_round(cfg, r, sweep_staged, local_root, durable_root, sweep_local, sweep_durable, times, bar)
    finally:
        bar.close()
        staged.close()
        if raw_s3 is not None:
            raw_s3.close()
        if sweep_staged is not None:
            sweep_staged.close()
        if local_root:
            shutil.rmtree(local_root, ignore_errors=True)
        if durable_root and fs is not None:
            with contextlib.suppress(Exception):
                fs.rm(resolve(durable_root, cfg.storage_options).fspath, recursive=True)
    targets = doc["targets"]
    if cfg.ram:
        targets["ram"] = {"where": cfg.ram_dir, "ops": {"stage": _op(n, ("memcpy", times["ram/memcpy"]), (
            "RAM tier stage (save() blocks on it)", times["ram/ckptstore_stage"]))},
            "checksum_s": round(staged.checksum_s, 6)}
    if local_root:
        targets["local"] = {"where": cfg.local, "ops": {
            "write": _op(n, ("write+fsync" + (" (O_DIRECT)" if True in o_direct else ""), times["local/raw_write_fsync"]),
                         ("local tier persist", times["local/ckptstore_persist"])),
            "read": _op(n, ("cold read", times["local/raw_cold_read"]),
                        ("load_sharded (checksums verified)", times["local/ckptstore_cold_read"])),
        }}
    if durable_root:
        if raw_s3 is not None:
            up, get = raw_s3.upload, raw_s3
            put_name = f"boto3 upload_fileobj {up.part_size >> 20} MiB x {up.max_in_flight}"
            get_name = f"boto3 ranged GET {get.read_part >> 20} MiB x {get.read_threads}"
        else:
            put_name, get_name = "fsspec put", "fsspec get"
        targets["durable"] = {"where": cfg.durable, "ops": {
            "write": _op(n, (put_name, times["durable/raw_put"]), ("durable tier promote", times["durable/ckptstore_promote"])),
            "read": _op(n, (get_name, times["durable/raw_get"]),
                        ("load_sharded (checksums verified)", times["durable/ckptstore_read"])),
        }}
        if raw_s3 is not None:
            targets["durable"]["baseline"] = raw_s3.describe()
    if sweep_local:
        rows = [{"chunk_bytes": c, "concurrency": k, **_entry(f"chunk {c >> 20} MiB x {k}", sweep_n,
                                                              times[f"sweep/local/{c}/{k}"])} for c, k in sweep_local]
        rec = _recommend(rows, "chunk_bytes")
        doc["sweep"]["local"] = {"bytes": sweep_n, "results": rows, "recommended": rec}
        doc["recommended"]["local"] = {"chunk_bytes": rec["chunk_bytes"], "concurrency": rec["concurrency"]}
    if durable_root and cfg.sweep and not durable_s3:
        notes.append("no durable sweep: the tuning covers S3 multipart uploads, and this URL is not S3")
    if notes:
        doc["notes"] = notes
    if sweep_durable:
        rows = [{"part_bytes": p, "concurrency": k, **_entry(f"part {p >> 20} MiB x {k}", sweep_n,
                                                             times[f"sweep/durable/{p}/{k}"])} for p, k in sweep_durable]
        rec = _recommend(rows, "part_bytes")
        doc["sweep"]["durable"] = {"bytes": sweep_n, "results": rows, "recommended": rec}
        doc["recommended"]["durable"] = {"part_bytes": rec["part_bytes"], "concurrency": rec["concurrency"]}
    if cfg.peer:
        targets["peer"] = _run_peer(min(n, 256 << 20), cfg.repeats, cfg.log)
    doc["cache_drop"] = sorted(cache_drop)[0] if cache_drop else None
    doc["o_direct"] = True in o_direct if o_direct else None
    doc["checkpoint_cost"] = _cost(doc, state_bytes, staged.checksum_s * state_bytes / n)
    cost = doc["checkpoint_cost"]
    if cost["blocking_s"] is not None:
        doc["plan_hint"] = f"ckptstore plan --ckpt-cost {cost['blocking_s']:.3g}s"
    doc["machine"] = _machine()
    return doc


def _sweep_round(cfg: BenchConfig, r: int, staged: _Staged | None, local_root: str | None, durable_root: str | None,
                 sweep_local: list[tuple[int, int]], sweep_durable: list[tuple[int, int]],
                 times: dict[str, list[float]], bar: _Bar) -> None:
    if staged is None:
        return
    from .storage.targets import resolve

    jobs: list[tuple[str, Callable[[], Any]]] = []
    for c, k in sweep_local:
        assert local_root is not None
        root = os.path.join(local_root, f"s-{c}-{k}")
        tuning = WriteTuning(local_chunk_bytes=c, local_concurrency=k)
        jobs.append((f"sweep/local/{c}/{k}", functools.partial(staged.persist, root, None, tuning)))
    for p, k in sweep_durable:
        assert durable_root is not None
        root = _url_join(durable_root, f"s-{p}-{k}")
        tuning = WriteTuning(s3_part_bytes=p, s3_concurrency=k)
        jobs.append((f"sweep/durable/{p}/{k}", functools.partial(staged.persist, root, cfg.storage_options, tuning)))
    for name, fn in jobs if r % 2 == 0 else jobs[::-1]:
        with bar.step(name):
            times.setdefault(name, []).append(_timed(fn))
    if local_root:
        for name in os.listdir(local_root):
            if name.startswith("s-"):
                shutil.rmtree(os.path.join(local_root, name), ignore_errors=True)
    if durable_root and sweep_durable:
        target = resolve(durable_root, cfg.storage_options)
        with contextlib.suppress(FileNotFoundError):
            target.fs.rm(target.fspath, recursive=True)


def _rate(doc: dict[str, Any], target: str, op: str) -> float | None:
    """Bytes per second of ckptstore's path: the tuned figure from the sweep when it is faster."""
    row = doc["targets"].get(target, {}).get("ops", {}).get(op)
    if row is None:
        return None
    rates = [row["ckptstore"]["GB_per_s"]]
    rec = doc["sweep"].get(target, {}).get("recommended")
    if rec and doc["recommended"].get(target):
        rates.append(rec["GB_per_s"])
    return max(r for r in rates if r) * 1e9


def _cost(doc: dict[str, Any], state_bytes: int, checksum_s: float) -> dict[str, Any]:
    """Seconds one checkpoint of ``state_bytes`` costs, from the rates measured (linear in size)."""
    ram = _rate(doc, "ram", "stage")
    local = _rate(doc, "local", "write")
    durable = _rate(doc, "durable", "write")
    peer = _rate(doc, "peer", "replicate")
    blocking = state_bytes / ram if ram else None
    background = (blocking or 0.0) + (checksum_s if ram else 0.0)
    return {
        "state_bytes": state_bytes,
        "blocking_s": round(blocking, 4) if blocking is not None else None,
        "to_local_s": round(background + state_bytes / local, 4) if local else None,
        "to_durable_s": round(background + state_bytes / durable, 4) if durable else None,
        "to_peer_s": round(background + state_bytes / peer, 4) if peer else None,
        "basis": "extrapolated linearly from the rates measured at --size, one process on this machine; "
                 "to_local_s, to_durable_s and to_peer_s include the blocking copy and the checksums of the staged "
                 "copy (the store writes the tiers side by side); each tier's rate is the faster of its default "
                 "settings and the sweep's recommendation (measured at the sweep's size)",
    }


def _machine() -> dict[str, Any]:
    import platform

    import torch

    from ._version import __version__

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "ckptstore": __version__, "platform": platform.platform(), "loadavg": os.getloadavg()}


# ---------------------------------------------------------------------------------------- peers

PEER_TIMEOUT_S = 240


def _slowest(*values: float) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def peer_rounds(store: Any, state: Any, rank: int, ram_dir: str, job: str, repeats: int,
                step: int = 0) -> tuple[dict[str, list[float]], int, int]:
    """In each of 2 ranks on 2 nodes (torch.distributed initialized, ``store`` with peer_replicas=1):
    interleaved rounds of a raw gloo isend/irecv of the replica's size in both directions against
    ``save()`` with replication (``wait("ram")`` to ``wait("peer")``: send, verify, commit the
    replica). Times are the slowest rank's. Returns (seconds per figure, bytes per rank, last step).
    Shared by ``ckptstore bench --peer`` and benchmarks/bench_peer.py."""
    import datetime

    import torch
    import torch.distributed as dist

    other = 1 - rank
    for _ in range(2):  # warm-up: the staging slots and replica segments are allocated on first use
        step += 1
        store.save(step, state).wait("peer")
    # Exactly what was sent: the size of the replica this rank holds (the other rank's staged bytes).
    docs = [doc for _src, doc in store.peer.replicas()]
    if not docs or any(d["src"] != other for d in docs):
        raise RuntimeError(f"rank {rank} holds no replica of rank {other}: {docs}")
    nbytes = max(d["size"] for d in docs)
    raw_pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
    send = torch.empty(nbytes, dtype=torch.uint8).fill_(rank + 1)
    recv = torch.zeros(nbytes, dtype=torch.uint8)  # touched now, not in the first timed round

    def raw() -> dict[str, float]:
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.irecv(recv, group=raw_pg, group_src=other), dist.isend(send, group=raw_pg, group_dst=other)]
        for w in works:
            if w is not None:
                w.wait()
        (dt,) = _slowest(time.perf_counter() - t0)
        return {"raw_gloo_exchange": dt}

    def save() -> dict[str, float]:
        nonlocal step
        step += 1
        dist.barrier()
        t0 = time.perf_counter()
        handle = store.save(step, state)
        t1 = time.perf_counter()
        handle.wait("ram")
        t2 = time.perf_counter()
        handle.wait("peer")
        t3 = time.perf_counter()
        blocking, to_peer, replication = _slowest(t1 - t0, t3 - t0, t3 - t2)
        return {"save_blocking": blocking, "save_to_peer": to_peer, "replication": replication}

    for _ in range(2):
        raw()
    if int(recv[0]) != other + 1 or int(recv[-1]) != other + 1:
        raise RuntimeError("the raw gloo exchange delivered the wrong bytes")
    times: dict[str, list[float]] = {k: [] for k in ("raw_gloo_exchange", "replication", "save_to_peer", "save_blocking")}
    order = [raw, save]
    for r in range(repeats):
        for fn in order if r % 2 == 0 else order[::-1]:
            for k, v in fn().items():
                times[k].append(v)
    return times, nbytes, step


def _peer_rank(rank: int, init_file: str, nbytes: int, repeats: int, root: str, job: str, result: str) -> None:
    """One of the two processes of ``ckptstore bench --peer``: a node of its own (its own RAM directory)."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    from .engine.store import CheckpointStore

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S))
        try:
            ram_dir = os.path.join(root, f"node{rank}")
            os.makedirs(ram_dir, exist_ok=True)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard

            # A Shard(0) DTensor: each rank stages (and replicates) its own half; a plain tensor
            # would count as replicated and be staged by one rank only.
            rows = max(1, nbytes // 8 // 4096)
            local = torch.arange(rows * 4096, dtype=torch.int64).view(rows, 4096) + rank
            mesh = init_device_mesh("cpu", (2,))
            state = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                             shape=torch.Size((2 * rows, 4096)), stride=(4096, 1))}
            with CheckpointStore(job, ram_dir=ram_dir, peer_replicas=1, node=rank,
                                 timeout_s=PEER_TIMEOUT_S) as store:
                times, sent, _ = peer_rounds(store, state, rank, ram_dir, job, repeats)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            with open(result, "w") as fh:
                json.dump({"times": times, "bytes": sent}, fh)
    except BaseException:
        with open(f"{result}.error-{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _run_peer(nbytes: int, repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    import multiprocessing

    job = f"benchrepl-{uuid.uuid4().hex[:8]}"
    root = tempfile.mkdtemp(prefix=f"{job}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    result = os.path.join(root, "result.json")
    log(f"ckptstore bench --peer: 2 processes on 2 simulated nodes, {nbytes / 2**20:.0f} MiB per rank")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_peer_rank, args=(r, os.path.join(root, "init"), nbytes, repeats, root, job, result))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 2 * PEER_TIMEOUT_S
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(2):
            with contextlib.suppress(FileNotFoundError), open(f"{result}.error-{r}") as fh:
                errors.append(f"rank {r}:\n{fh.read()}")
        if hung or errors or not os.path.exists(result):
            raise RuntimeError(f"ckptstore bench --peer failed (hung ranks {hung}): " + "\n".join(errors))
        with open(result) as fh:
            out = json.load(fh)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
            if name.startswith(segment_prefix(job)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))
    times, sent = out["times"], out["bytes"]
    doc = {"where": "2 local processes, gloo over loopback", "bytes_per_rank": sent,
           "ops": {"replicate": _op(sent, ("gloo isend/irecv, both directions", times["raw_gloo_exchange"]),
                                    ("peer replication (RAM commit to replica)", times["replication"]))},
           "save_to_peer": _entry("save() to replica committed", sent, times["save_to_peer"]),
           "save_blocking": _entry("save() blocking", sent, times["save_blocking"])}
    return doc


# ---------------------------------------------------------------------------------------- reporting

def format_table(doc: dict[str, Any]) -> str:
    lines = [f"ckptstore bench: {format_bytes(doc['bytes'])} per operation, medians of {doc['repeats']} "
             f"(page cache: {doc.get('cache_drop') or 'not dropped'})"]
    header = f"  {'target':8s} {'op':9s} {'raw ceiling':34s} {'GB/s':>7s}   {'ckptstore':40s} {'GB/s':>7s} {'ratio':>6s}"
    lines.append(header)
    for target, body in doc["targets"].items():
        for op, row in body["ops"].items():
            r, c = row["raw"], row["ckptstore"]
            lines.append(f"  {target:8s} {op:9s} {r['name'][:34]:34s} {r['GB_per_s']:7.3g}   {c['name'][:40]:40s} "
                         f"{c['GB_per_s']:7.3g} {row['ratio']:5.2f}x")
    for target, sw in doc["sweep"].items():
        size_key = "chunk_bytes" if target == "local" else "part_bytes"
        rec = sw["recommended"]
        lines.append(f"  sweep {target} ({format_bytes(sw['bytes'])}): best {rec['GB_per_s']:.2f} GB/s with "
                     f"{size_key.split('_')[0]} {format_bytes(rec[size_key])} x {rec['concurrency']} in flight")
        sizes = sorted({row[size_key] for row in sw["results"]})
        ks = sorted({row["concurrency"] for row in sw["results"]})
        grid = {(row[size_key], row["concurrency"]): row["GB_per_s"] for row in sw["results"]}
        lines.append("    GB/s    " + "".join(f"{format_bytes(s):>10s}" for s in sizes))
        for k in ks:
            lines.append(f"    x{k:<6d} " + "".join(f"{grid[(s, k)]:10.3g}" for s in sizes))
    cost = doc["checkpoint_cost"]

    def sec(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f} s" if v >= 100 else f"{v:.3g} s"

    lines.append(f"  checkpoint of {format_bytes(cost['state_bytes'])}: blocks {sec(cost['blocking_s'])}, "
                 f"on local disk after {sec(cost['to_local_s'])}, durable after {sec(cost['to_durable_s'])}"
                 + (f", on a peer after {sec(cost['to_peer_s'])}" if cost.get("to_peer_s") is not None else ""))
    for note in doc.get("notes", []):
        lines.append(f"  note: {note}")
    if doc.get("plan_hint"):
        lines.append(f"  interval planning: {doc['plan_hint']}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> bool:
    """A PNG: GB/s of raw against ckptstore per target and op, and the sweeps. False (with a note
    on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("ckptstore bench: matplotlib is not installed, so no plot was written "
              "(pip install matplotlib)", file=sys.stderr)
        return False
    sweeps = list(doc["sweep"].items())
    fig, axes = plt.subplots(1, 1 + len(sweeps), figsize=(6 + 4.5 * len(sweeps), 4.2), squeeze=False)
    ax = axes[0][0]
    labels, raw, ours = [], [], []
    for target, body in doc["targets"].items():
        for op, row in body["ops"].items():
            labels.append(f"{target}\n{op}")
            raw.append(row["raw"]["GB_per_s"])
            ours.append(row["ckptstore"]["GB_per_s"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], raw, 0.4, label="raw ceiling")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="ckptstore")
    for i, row_ratio in enumerate(r / o if o else 0 for r, o in zip(ours, raw)):
        ax.annotate(f"{row_ratio:.2f}x", (i + 0.2, ours[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_yscale("log")
    ax.set_title(f"{format_bytes(doc['bytes'])}, medians of {doc['repeats']}")
    ax.legend(fontsize=8)
    for ax, (target, sw) in zip(axes[0][1:], sweeps):
        size_key = "chunk_bytes" if target == "local" else "part_bytes"
        for k in sorted({row["concurrency"] for row in sw["results"]}):
            rows = sorted((row for row in sw["results"] if row["concurrency"] == k), key=lambda row: row[size_key])
            ax.plot([row[size_key] >> 20 for row in rows], [row["GB_per_s"] for row in rows], marker="o",
                    label=f"{k} in flight")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{size_key.split('_')[0]} size (MiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{target} sweep ({format_bytes(sw['bytes'])})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["BenchConfig", "RawS3", "drop_cache", "format_table", "plot", "run_bench"]
