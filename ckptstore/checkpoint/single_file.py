"""Write and read the single-file container (format/container.py) from a plan / into buffers."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import mmap as _mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from .._buffers import byte_view
from .._version import __version__
from ..errors import CorruptCheckpointError, InvalidArgumentError, NotACheckpointError
from ..format import codecs, container
from ..format.checksum import checksum, verify
from ..format.dtypes import dtype_from_name, dtype_name, element_size
from ..format.manifest import Chunk, Manifest, TensorEntry, check_manifest_size, parse_manifest
from ..planning.flatten import Plan
from ..storage.targets import READ_PIECE, ShortRead, Sink, Source, scatter, storage_error
from .memory import alloc_bytes

_pool: ThreadPoolExecutor | None = None
T = TypeVar("T")
U = TypeVar("U")
WRITE_WINDOW = 256 << 20
# Threads mostly wait on the disk (or on page faults), so more than the core count helps: with 2
# cores, 4 readers of 32 MiB pieces read an uncached file at ~2.6 GB/s against ~1.7 GB/s with 2.
IO_THREADS = max(4, min(8, 2 * (os.cpu_count() or 2)))


def io_pool() -> ThreadPoolExecutor:
    """Threads for parallel reads and chunk encoding; file I/O, hashing and zstd release the GIL."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="ckptstore-io")
    return _pool


def map_all(fn: Callable[[T], U], items: list[T]) -> Iterator[U]:
    """``io_pool().map``, except that an error (or the caller leaving early) returns only once
    no call is left running: Executor.map cancels what has not started but leaves the rest
    writing into buffers, caller tensors or file descriptors that the caller reuses or closes
    next (seen: a restore that fell back to an older step got a tensor of the damaged step)."""
    futures = [io_pool().submit(fn, item) for item in items]
    try:
        for f in futures:
            yield f.result()
    finally:
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)


def run_all(fn: Callable[[T], None], items: list[T]) -> None:
    """Call ``fn`` on every item: on the calling thread and up to ``IO_THREADS - 1`` pool threads,
    each taking the next item as it finishes one. Returns once no call is left running; raises the
    error of the earliest item that failed (no item is started after a failure).

    Against :func:`map_all`, a future per item: a restore of 144 tensors from RAM submitted 73
    tasks, and the pool threads, woken one by one while the caller held the GIL submitting the
    rest, started their first copy 1.5-3.6 ms after the first (a quiet copy floor of that state is
    0.12 s). Here a few are submitted at once and the caller copies from the start."""
    if len(items) <= 1:
        for item in items:
            fn(item)
        return
    lock = threading.Lock()
    pending = iter(enumerate(items))
    failed: list[tuple[int, BaseException]] = []
    stop = [False]

    def loop() -> None:
        while True:
            with lock:
                taken = None if stop[0] else next(pending, None)
            if taken is None:
                return
            try:
                fn(taken[1])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                with lock:
                    failed.append((taken[0], exc))
                    stop[0] = True
                return

    helpers = [io_pool().submit(loop) for _ in range(min(IO_THREADS, len(items)) - 1)]
    try:
        loop()
    finally:
        with lock:
            stop[0] = True  # also when the caller itself was interrupted: nothing new starts
        # A helper still queued has nothing left to take: cancelled, it is not waited for (no
        # thread may be free to run it when the pool's own threads are the callers, waiting).
        concurrent.futures.wait([f for f in helpers if not f.cancel()])
    if failed:
        raise min(failed, key=lambda f: f[0])[1]


def write_container(plan: Plan, sink: Sink) -> Manifest:
    started = time.perf_counter()
    pad = bytes(container.ALIGN)
    sink.write(container.pack_header(0, plan.minor))
    sink.write(pad[: container.DATA_START - sink.tell()])
    if sink.positional and all(item.codec == "raw" for item in plan.items):
        tensors = _write_raw_parallel(plan, sink)
    else:
        tensors = {}
        for item in plan.items:
            raw = item.raw_bytes()
            es = element_size(item.dtype)
            entry = TensorEntry(dtype=dtype_name(item.dtype) or "uint8", shape=item.shape)
            for (offsets, sizes, _start, _length), stored in _encoded(item.codec, raw, es, item.slabs()):
                offset = sink.tell()
                sink.write(stored)
                entry.chunks.append(Chunk(offsets, sizes, None, offset, len(stored), item.codec, checksum(stored)))
                sink.write(pad[: container.align_up(sink.tell()) - sink.tell()])
            tensors[item.key] = entry
    manifest = Manifest(
        format_version=f"{container.FORMAT_MAJOR}.{plan.minor}",
        kind="file",
        tensors=tensors,
        tree=plan.tree,
        pickled=plan.pickled,
        meta={
            "created_unix": round(time.time(), 3),
            "torch_version": torch.__version__,
            "ckptstore_version": __version__,
            "total_bytes": plan.total_bytes,
            "write_seconds": round(time.perf_counter() - started, 6),
        },
    )
    body = manifest.to_json_bytes()
    manifest_offset = sink.tell()
    sink.write(body)
    sink.write(container.pack_footer(manifest_offset, body))
    sink.commit(container.pack_header(sink.tell(), plan.minor))
    return manifest


@dataclass(frozen=True)
class Written:
    offset: int
    length: int
    checksum: str
    block_checksums: tuple[str, ...] | None  # per block_size piece, for ranged reads that verify


# Tensors under SMALL_BYTES are packed SMALL_ALIGN apart into batches of up to BATCH_BYTES, each
# written in one aligned write (constants in format/container.py): one job per tensor cost ~0.15 ms
# of thread hand-offs, which at 100,000 small tensors made ckptstore.save 6x slower than torch.save
# (and at 1,000 tensors of 64 KiB, 0.74x torch.save's speed with a 64 KiB bound; 1.33x with 1 MiB).
SMALL_BYTES, SMALL_ALIGN, BATCH_BYTES = container.SMALL_BYTES, container.SMALL_ALIGN, container.BATCH_BYTES


def write_raw_parallel(
    sink: Sink, raws: list[Callable[[], torch.Tensor]], *, block_size: int | None = None, hash_bytes: bool = True
) -> list[Written]:
    """Write raw byte tensors (produced lazily by ``raws``) in parallel from the sink's position and
    return where each went with its checksums: large ones each at a 4 KiB-aligned offset, small
    ones packed 64 bytes apart into batches that start 4 KiB-aligned.

    Raw chunks have sizes known in advance, so every one gets its offset up front and pieces are
    written by several threads at once (O_DIRECT through the bounce buffers on local disks).
    Copies made for non-contiguous or device tensors stay bounded by WRITE_WINDOW bytes in flight.
    """
    pool = io_pool()
    written: list[Written | None] = [None] * len(raws)
    pending: collections.deque = collections.deque()
    in_flight = 0
    pos = sink.tell()
    all_futures: list = []
    batch: list[tuple[int, int, torch.Tensor]] = []  # (index, offset within the batch, raw)
    batch_len = 0

    def hashes(view: memoryview) -> tuple[str, tuple[str, ...] | None]:
        if not hash_bytes:
            return "", None
        if block_size is None or len(view) <= block_size:
            return checksum(view), None
        return checksum(view), tuple(checksum(view[b : b + block_size]) for b in range(0, len(view), block_size))

    def write_batch(start: int, members: list[tuple[int, int, torch.Tensor]], size: int) -> list[tuple[int, Written]]:
        buf = bytearray(container.align_up(size))
        out = []
        for index, at, raw in members:
            view = byte_view(raw)
            buf[at : at + len(view)] = view
            whole, _ = hashes(view)
            out.append((index, Written(start + at, len(view), whole, None)))
        sink.write_at(start, memoryview(buf))
        return out

    def flush_batch() -> None:
        nonlocal pos, batch, batch_len, in_flight
        if not batch:
            return
        future = pool.submit(write_batch, pos, batch, batch_len)
        all_futures.append(future)
        pending.append((None, 0, batch_len, future, (), batch))
        pos = container.align_up(pos + batch_len)
        in_flight += batch_len
        batch, batch_len = [], 0

    def finish_oldest() -> int:
        index, offset, length, hash_future, futures, _keepalive = pending.popleft()
        for f in futures:
            f.result()
        if index is None:
            for i, w in hash_future.result():
                written[i] = w
            return length
        whole, blocks = hash_future.result()
        written[index] = Written(offset, length, whole, blocks)
        return length

    try:
        for index, make_raw in enumerate(raws):
            raw = make_raw()
            view = byte_view(raw)
            length = len(view)
            if 0 < length < SMALL_BYTES:
                at = -(-batch_len // SMALL_ALIGN) * SMALL_ALIGN
                if at + length > BATCH_BYTES:
                    flush_batch()
                    at = 0
                batch.append((index, at, raw))
                batch_len = at + length
            else:
                flush_batch()
                futures = [pool.submit(sink.write_at, pos + p, view[p : p + READ_PIECE]) for p in range(0, length, READ_PIECE)]
                hash_future = pool.submit(hashes, view)
                all_futures.extend(futures)
                all_futures.append(hash_future)
                pending.append((index, pos, length, hash_future, futures, raw))
                pos = container.align_up(pos + length)
                in_flight += length
            while in_flight > WRITE_WINDOW and len(pending) > 1:
                in_flight -= finish_oldest()
        flush_batch()
        while pending:
            finish_oldest()
    except BaseException:
        # The sink is about to be aborted (its fd closed): no thread may still be writing to it.
        for f in all_futures:
            f.cancel()
        concurrent.futures.wait(all_futures)
        raise
    sink.skip_to(pos)
    return [w for w in written if w is not None]


def write_raw(
    sink: Sink, raws: list[Callable[[], torch.Tensor]], *, block_size: int | None = None, hash_bytes: bool = True
) -> list[Written]:
    """:func:`write_raw_parallel` where the sink allows it, else the same layout written in order.
    ``hash_bytes=False`` skips the checksums (empty in the result) when the caller has them already."""
    if sink.positional:
        return write_raw_parallel(sink, raws, block_size=block_size, hash_bytes=hash_bytes)
    pad = bytes(container.ALIGN)
    out = []
    for make_raw in raws:
        view = byte_view(make_raw())
        offset = sink.tell()
        sink.write(view)
        sink.write(pad[: container.align_up(sink.tell()) - sink.tell()])
        blocks = None
        if hash_bytes and block_size is not None and len(view) > block_size:
            blocks = tuple(checksum(view[b : b + block_size]) for b in range(0, len(view), block_size))
        out.append(Written(offset, len(view), checksum(view) if hash_bytes else "", blocks))
    return out


def _write_raw_parallel(plan: Plan, sink: Sink) -> dict[str, TensorEntry]:
    done = write_raw_parallel(sink, [item.raw_bytes for item in plan.items])
    return {
        item.key: TensorEntry(
            dtype=dtype_name(item.dtype) or "uint8",
            shape=item.shape,
            chunks=[Chunk((0,) * len(item.shape), item.shape, None, w.offset, w.length, "raw", w.checksum)],
        )
        for item, w in zip(plan.items, done)
    }


def _encoded(
    codec: str, raw: torch.Tensor, es: int, slabs: list[tuple[tuple[int, ...], tuple[int, ...], int, int]]
) -> Iterator[tuple[tuple[tuple[int, ...], tuple[int, ...], int, int], memoryview]]:
    if codec == "raw" or len(slabs) == 1:
        for slab in slabs:
            yield slab, codecs.encode(codec, raw[slab[2] : slab[2] + slab[3]], es)
        return
    # Compress slabs in parallel, a bounded window ahead of the writer so memory stays flat.
    pool = io_pool()
    window = 2 * (os.cpu_count() or 2)
    pending: collections.deque = collections.deque()
    for slab in slabs:
        pending.append((slab, pool.submit(codecs.encode, codec, raw[slab[2] : slab[2] + slab[3]], es)))
        if len(pending) > window:
            done, fut = pending.popleft()
            yield done, fut.result()
    while pending:
        done, fut = pending.popleft()
        yield done, fut.result()


@dataclass
class OpenContainer:
    source: Source
    manifest: Manifest
    end: int  # container length
    data_end: int  # where the manifest begins: no chunk may reach past it


def open_container(source: Source) -> OpenContainer:
    where = source.display
    try:
        head = source.read(0, min(container.HEADER.size, source.size))
        header = container.unpack_header(head, where=where)
        length = header.length or source.size
        if length > source.size or length < container.DATA_START + container.FOOTER.size:
            expected = f"the header says {header.length} bytes" if header.length else "a container needs more"
            raise CorruptCheckpointError(
                f"{where}: file is truncated: {expected}, the file has {source.size}", location=where
            )
        footer = container.unpack_footer(source.read(length - container.FOOTER.size, container.FOOTER.size), length, where=where)
        check_manifest_size(footer.manifest_length, where=where)  # before reading it into memory
        body = source.read(footer.manifest_offset, footer.manifest_length)
    except ShortRead as exc:
        raise CorruptCheckpointError(f"{where}: file is truncated ({exc})", location=where) from None
    container.check_manifest_bytes(body, footer, where=where)
    manifest = parse_manifest(body, where=where)
    if int(manifest.format_version.split(".")[0]) != header.major:
        raise CorruptCheckpointError(
            f"{where}: header says format {header.major}.x but the manifest says {manifest.format_version}",
            location=where,
        )
    if manifest.kind != "file":
        raise NotACheckpointError(f"{where}: manifest kind {manifest.kind!r} is not a single-file checkpoint")
    for key, entry in manifest.tensors.items():
        for c in entry.chunks:
            if c.file is not None or c.offset < container.DATA_START or c.offset + c.length > footer.manifest_offset:
                raise CorruptCheckpointError(
                    f"{where}: tensor {key!r} points at bytes [{c.offset}, {c.offset + c.length}) outside the data region",
                    location=where,
                    key=key,
                )
    return OpenContainer(source, manifest, length, footer.manifest_offset)


def _mappable(entry: TensorEntry) -> bool:
    return len(entry.chunks) <= 1 and all(c.codec == "raw" for c in entry.chunks)


def slab_range(entry: TensorEntry, c: Chunk, es: int) -> tuple[int, int] | None:
    """Byte range of chunk ``c`` inside the entry's contiguous buffer, if the box is contiguous there."""
    if not entry.shape:
        return 0, es
    if c.sizes[1:] != entry.shape[1:] or any(c.offsets[1:]):
        return None
    row = math.prod(entry.shape[1:]) * es
    return c.offsets[0] * row, c.sizes[0] * row


def read_entries(
    opened: OpenContainer,
    keys: list[str],
    *,
    verify_checksums: bool = True,
    use_mmap: bool = False,
    shared: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read entries into flat uint8 buffers (one per entry), verifying every chunk's checksum.

    ``use_mmap``: raw entries are views of a mapping of the file, private (writes stay in this
    process, torch.load's default) or with ``shared`` a MAP_SHARED one whose writes reach the file
    (as torch.serialization.set_default_mmap_options(mmap.MAP_SHARED) makes torch.load's)."""
    source, manifest = opened.source, opened.manifest
    where = source.display
    mapped = None
    if use_mmap:
        assert source.local_path is not None
        if shared:
            unmappable = [k for k in keys if not _mappable(manifest.tensors[k])]
            if unmappable:
                # Those entries would be decoded into memory: writes to them would silently not reach the file.
                raise InvalidArgumentError(
                    f"{where}: mmap=True with MAP_SHARED (torch.serialization.set_default_mmap_options) maps raw "
                    f"tensors only, and {', '.join(repr(k) for k in unmappable[:5])} are compressed, so writes to "
                    "them could not reach the file. Load without MAP_SHARED, or save the file without compression"
                )
        if opened.end > 0:
            try:
                fd = os.open(source.local_path, os.O_RDWR if shared else os.O_RDONLY)
            except OSError as exc:
                raise storage_error(exc, "map" if not shared else "map (MAP_SHARED, for writing)", where) from None
            try:
                # Private and writable by default, as torch.load(mmap=True): writes never reach the file.
                flags = _mmap.MAP_SHARED if shared else _mmap.MAP_PRIVATE
                mapped = _mmap.mmap(fd, 0, flags=flags, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
            finally:
                os.close(fd)
    out: dict[str, torch.Tensor] = {}
    pieces: list[tuple[int, memoryview]] = []  # (file offset, destination) raw reads
    small: list[tuple[int, memoryview]] = []  # the same for chunks under SMALL_BYTES, read in groups
    checks: list[tuple[str, Chunk, torch.Tensor]] = []
    decodes: list[tuple[str, Chunk, torch.Tensor, int]] = []  # compressed or non-contiguous chunks
    for key in keys:
        entry = manifest.tensors[key]
        es = element_size(dtype_from_name(entry.dtype, where=where))
        nbytes = entry.numel * es
        if mapped is not None and _mappable(entry) and nbytes:
            c = entry.chunks[0]
            out[key] = torch.frombuffer(mapped, dtype=torch.uint8, count=c.length, offset=c.offset)
            if verify_checksums:
                checks.append((key, c, out[key]))
            continue
        buf = alloc_bytes(nbytes)
        out[key] = buf
        for c in entry.chunks:
            rng = slab_range(entry, c, es)
            if c.codec == "raw" and rng is not None:
                dest = buf[rng[0] : rng[0] + rng[1]]
                view = byte_view(dest)
                if 0 < c.length < SMALL_BYTES:
                    small.append((c.offset, view))
                else:
                    for p in range(0, c.length, READ_PIECE):
                        pieces.append((c.offset + p, view[p : p + READ_PIECE]))
                if verify_checksums:
                    checks.append((key, c, dest))
            else:
                decodes.append((key, c, buf, es))

    # (file offset, the buffers that consecutive bytes from there fill, chunk bytes among them):
    # a group of small chunks is one scatter read straight into their tensors, its gaps (alignment
    # padding) into a scratch buffer that nothing reads.
    reads: list[tuple[int, list[memoryview], int]] = [(o, [v], len(v)) for o, v in pieces]
    groups = _group_small(small)
    junk = memoryview(bytearray(max((gap for g in groups for gap in _gaps(g)), default=0)))
    for start, _end, members in groups:
        bufs: list[memoryview] = []
        cursor = 0
        for at, into in members:
            if at > cursor:
                bufs.append(junk[: at - cursor])
            bufs.append(into)
            cursor = at + len(into)
        reads.append((start, bufs, sum(len(m) for _, m in members)))

    def read_piece(piece: tuple[int, list[memoryview], int]) -> int:
        if len(piece[1]) == 1:
            source.readinto(piece[0], piece[1][0])
        else:
            source.readv_into(piece[0], piece[1])
        return piece[2]

    try:
        if source.parallel and len(reads) > 1 and source.local_path is not None:
            for n in map_all(read_piece, reads):
                if progress:
                    progress(n)
        elif len(reads) > 1 and source.local_path is None and source.parallel:
            datas = source.read_many([(o, sum(len(v) for v in bufs)) for o, bufs, _ in reads])
            for (_, bufs, n), data in zip(reads, datas):
                scatter(data, bufs)
                if progress:
                    progress(n)
        else:
            for piece in reads:
                n = read_piece(piece)
                if progress:
                    progress(n)
        for key, c, buf, es in decodes:
            stored = source.read(c.offset, c.length)
            if verify_checksums:
                verify(stored, c.checksum, location=where, key=key)
            _place(manifest.tensors[key], c, stored, buf, es, where=f"{where}: tensor {key!r}")
            if progress:
                progress(c.length)
    except ShortRead as exc:
        raise CorruptCheckpointError(f"{where}: file is truncated ({exc})", location=where) from None
    # Serially, after all reads. Measured on 1.13 GiB in a fresh process: hashing inside the read
    # jobs, or in the thread pool afterwards, took 0.39-0.41 s against 0.32 s like this (xxhash holds
    # the GIL, so threads only add hand-offs while other threads fault pages in).
    for key, c, dest in checks:
        verify(byte_view(dest), c.checksum, location=where, key=key)
    return out


def _place(entry: TensorEntry, c: Chunk, stored: bytes, buf: torch.Tensor, es: int, *, where: str) -> None:
    rng = slab_range(entry, c, es)
    if rng is not None:
        codecs.decode_into(c.codec, stored, buf[rng[0] : rng[0] + rng[1]], es, where=where)
        return
    tmp = torch.empty(c.numel * es, dtype=torch.uint8)
    codecs.decode_into(c.codec, stored, tmp, es, where=where)
    dtype = dtype_from_name(entry.dtype, where=where)
    region = buf.view(dtype).view(entry.shape)
    for d, (o, s) in enumerate(zip(c.offsets, c.sizes)):
        region = region.narrow(d, o, s)
    region.copy_(tmp.view(dtype).view(c.sizes))


def _group_small(small: list[tuple[int, memoryview]]) -> list[tuple[int, int, list[tuple[int, memoryview]]]]:
    """Cover small chunks with few reads: runs of chunks in file order whose gaps are under
    SMALL_BYTES, each run at most BATCH_BYTES long, as (start, end, [(offset in the run, destination)]).
    One read per small tensor cost more in thread hand-offs than the bytes (written packed, they
    sit next to each other)."""
    groups: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
    start = end = -1
    members: list[tuple[int, memoryview]] = []
    for offset, dest in sorted(small, key=lambda x: x[0]):
        stop = offset + len(dest)
        if members and offset >= end and offset - end < SMALL_BYTES and stop - start <= BATCH_BYTES:
            end = max(end, stop)
        else:
            if members:
                groups.append((start, end, members))
            start, end, members = offset, stop, []
        members.append((offset - start, dest))
    if members:
        groups.append((start, end, members))
    return groups


def _gaps(group: tuple[int, int, list[tuple[int, memoryview]]]) -> Iterator[int]:
    cursor = 0
    for at, dest in group[2]:
        yield at - cursor
        cursor = at + len(dest)
