"""The read, verify and copy pipeline of every load: bytes from a source into the caller's tensors,
each piece verified before anything uses it.

Host destinations are filled in sub-pieces of ``SUB_BYTES``, each hashed right after it is copied,
while it is still in the cache: one pass over memory instead of a copy and a second full read for
the checksum. Bytes a source already holds in this process's memory (a RAM-tier slot,
``Source.memory``) are copied from there, without a read system call.

Device destinations (CUDA tensors) go through a ``CopyEngine``: a piece is taken as host bytes (a
view of the page-locked RAM-tier slot, or read into one of a few page-locked staging buffers),
verified on the reader threads, and only then queued for the host-to-device copy on a side stream,
with an event after it; a staging buffer is reused once its copy's event has completed. So the
next pieces are read and verified while the earlier ones are in flight, a damaged piece is never
copied, and each byte is copied once. The engine is chosen from the destinations
(:func:`engine_for`); tests install one of their own (:func:`use_engine`) whose "device" copy is a
CPU copy, so the pipeline's ordering and error paths run on machines without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from .._buffers import byte_view
from ..errors import CorruptCheckpointError
from ..format.checksum import hasher, verify, verify_digest
from ..format.container import BATCH_BYTES, SMALL_BYTES
from ..storage.base import ShortRead, Source
from .memory import alloc_bytes
from .single_file import map_all

# Host copies are hashed in pieces of this size, small enough to be in the cache when they are
# hashed, large enough that the per-piece Python work stays a few percent of the copy.
SUB_BYTES = 1 << 20
# Device pieces: verified and then queued for the copy one at a time; several are in flight.
PIECE_BYTES = 16 << 20
STAGING_BYTES = 128 << 20  # page-locked staging per load (at least two pieces, or one largest task)

# (start, length, expected checksum) within a piece's bytes; the ranges of a piece tile it.
Check = tuple[int, int, str]


class CopyEngine:
    """Copies verified host bytes into device tensors, asynchronously.

    ``claims_device(d)``: whether tensors on device ``d`` are destinations of this engine (their
    bytes arrive through :meth:`copy`); ``host(n)``: host memory for staging (page-locked for CUDA); ``begin(tensors)``:
    called before the first copy into them; ``copy(dst, src)``: queue ``dst.copy_(src)``;
    ``record()``: a token for every copy this thread queued so far; ``wait(token)``: return once
    those copies have read their sources; ``finish()``: return once every queued copy is complete.
    """

    def claims(self, t: torch.Tensor) -> bool:
        return self.claims_device(t.device)

    def claims_device(self, device: torch.device) -> bool:
        raise NotImplementedError

    def host(self, nbytes: int) -> torch.Tensor:
        return alloc_bytes(nbytes)

    def begin(self, tensors: list[torch.Tensor]) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        raise NotImplementedError

    def record(self) -> Any:
        return None

    def wait(self, token: Any) -> None:
        pass

    def finish(self) -> None:
        pass


class CudaEngine(CopyEngine):
    """Host-to-device copies on a side stream per device, from page-locked memory, so they run as
    DMA without blocking the host threads that read and verify the next pieces; they first wait
    for the work already queued on the caller's stream (kernels may still read the tensors being
    overwritten), and :meth:`finish` synchronizes, so a load returns with its tensors in place."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def claims_device(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def begin(self, tensors: list[torch.Tensor]) -> None:
        for device in {t.device for t in tensors if self.claims(t)}:
            if device not in self.streams:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
                stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.streams[dst.device]):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        events = []
        for stream in self.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def wait(self, token: Any) -> None:
        for event in token or ():
            event.synchronize()

    def finish(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


_override: list[CopyEngine] = []


@contextlib.contextmanager
def use_engine(engine: CopyEngine) -> Iterator[CopyEngine]:
    """Load through ``engine`` while the block runs (tests: a "device" copy that is a CPU copy)."""
    _override.append(engine)
    try:
        yield engine
    finally:
        _override.remove(engine)


def engine_for(devices: Iterable[torch.device]) -> CopyEngine | None:
    """The engine for a load into tensors on ``devices``: the installed one, or CUDA's when some
    are CUDA devices and CUDA is available; None when every destination is filled on the host."""
    devices = set(devices)
    if _override:
        engine = _override[-1]
        return engine if any(engine.claims_device(d) for d in devices) else None
    if any(d.type == "cuda" for d in devices) and torch.cuda.is_available():
        return CudaEngine()
    return None


def checks_of(length: int, checksum: str, blocks: list[tuple[int, str]], block_size: int) -> list[Check]:
    """The checksum ranges of ``length`` bytes read from a chunk: its blocks, or the whole."""
    if not blocks:
        return [(0, length, checksum)]
    return [(off, min(block_size, length - off), expected) for off, expected in blocks]


def _fail_short(exc: ShortRead, location: str, key: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{location} is truncated ({exc}) for tensor {key!r}", location=location, key=key)


def fill_verified(source: Source, offset: int, out: torch.Tensor, checks: list[Check], *, location: str,
                  key: str, memory: torch.Tensor | None = None) -> None:
    """Fill host bytes ``out`` from ``source`` at ``offset``, verifying every checksum range.

    From a local file or from memory, in sub-pieces each hashed right after its copy (one pass
    over memory); from a remote source, in one read (a request per sub-piece would multiply the
    round trips), then hashed."""
    view = byte_view(out)
    if memory is None and source.local_path is None:
        try:
            source.readinto(offset, view)
        except ShortRead as exc:
            raise _fail_short(exc, location, key) from None
        for start, length, expected in checks:
            verify(view[start : start + length], expected, location=location, key=key)
        return
    if memory is not None:
        end = offset + max((start + length for start, length, _ in checks), default=0)
        if end > memory.numel():
            raise CorruptCheckpointError(f"{location} is truncated (bytes up to {end} of {memory.numel()} wanted) for "
                                         f"tensor {key!r}", location=location, key=key)
        src, dst = numpy.frombuffer(byte_view(memory), numpy.uint8), numpy.frombuffer(view, numpy.uint8)
    for start, length, expected in checks:
        h = hasher()
        for pos in range(start, start + length, SUB_BYTES):
            n = min(SUB_BYTES, start + length - pos)
            if memory is not None:
                # One thread's memcpy (numpy's, without the GIL), not torch's copy_: that splits a
                # piece over the intra-op threads, leaving half of it in another core's cache for
                # the hash below, and every reader thread starts a team of its own on the same cores.
                numpy.copyto(dst[pos : pos + n], src[offset + pos : offset + pos + n])
            else:
                try:
                    source.readinto(offset + pos, view[pos : pos + n])
                except ShortRead as exc:
                    raise _fail_short(exc, location, key) from None
            h.update(view[pos : pos + n])
        verify_digest(h.hexdigest(), expected, location=location, key=key)


def verify_in_place(data: torch.Tensor, checks: list[Check], *, location: str, key: str) -> None:
    view = byte_view(data)
    for start, length, expected in checks:
        verify(view[start : start + length], expected, location=location, key=key)


# ------------------------------------------------------------------------------------ the device path


@dataclass
class Piece:
    """Bytes ``[offset, offset + length)`` of ``source`` for a device destination: verified by
    ``checks`` (relative to the piece), then ``place(host bytes)`` gives the (device destination,
    host source) pairs to copy (decoding on the host first where the chunk is compressed)."""

    source: Source
    offset: int
    length: int
    checks: list[Check]
    place: Callable[[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]
    location: str
    key: str


def flat_pieces(source: Source, offset: int, length: int, checks: list[Check], dst: torch.Tensor, skip: int,
                *, location: str, key: str) -> list[Piece]:
    """Pieces of a read whose bytes ``[skip, skip + dst's bytes)`` are ``dst``'s bytes in order
    (``dst`` a contiguous 1-D uint8 view of the destination): cut at checksum ranges, about
    ``PIECE_BYTES`` each, so a piece is verified whole before any of it is copied."""
    out: list[Piece] = []
    piece_bytes = PIECE_BYTES
    useful = dst.numel()
    group: list[Check] = []

    def emit() -> None:
        lo, hi = group[0][0], group[-1][0] + group[-1][1]
        a, b = max(lo, skip), min(hi, skip + useful)

        def place(host: torch.Tensor, lo: int = lo, a: int = a, b: int = b) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(dst[a - skip : b - skip], host[a - lo : b - lo])] if b > a else []

        out.append(Piece(source, offset + lo, hi - lo, [(s - lo, n, e) for s, n, e in group], place, location, key))

    for check in checks:
        if group and check[0] + check[1] - group[0][0] > piece_bytes:
            emit()
            group = []
        group.append(check)
    if group:
        emit()
    return out


@dataclass
class _Staging:
    """Host buffers that tasks take turns on; one is handed out again only once the copies that
    read it have completed (their engine token)."""

    engine: CopyEngine
    slot: int
    count: int
    free: list[torch.Tensor] = field(default_factory=list)
    in_flight: collections.deque = field(default_factory=collections.deque)
    lock: threading.Condition = field(default_factory=threading.Condition)
    made: int = 0

    def acquire(self) -> torch.Tensor:
        with self.lock:
            while True:
                if self.free:
                    return self.free.pop()
                if self.made < max(1, self.count):  # one at least, whatever was counted up front
                    self.made += 1
                    break
                if self.in_flight:
                    token, buf = self.in_flight.popleft()
                    self.lock.release()
                    try:
                        self.engine.wait(token)
                    finally:
                        self.lock.acquire()
                    return buf
                self.lock.wait()
        return self.engine.host(self.slot)

    def release(self, buf: torch.Tensor, token: Any) -> None:
        with self.lock:
            self.in_flight.append((token, buf))
            self.lock.notify()


def _tasks(pieces: list[Piece]) -> list[list[Piece]]:
    """Small pieces run in batches (one staging buffer, one thread task each) of up to BATCH_BYTES."""
    out: list[list[Piece]] = []
    small: list[Piece] = []
    size = 0
    for p in pieces:
        if p.length >= SMALL_BYTES:
            out.append([p])
            continue
        if small and size + _align(p.length) > BATCH_BYTES:
            out.append(small)
            small, size = [], 0
        small.append(p)
        size += _align(p.length)
    if small:
        out.append(small)
    return out


def _align(n: int) -> int:
    return -(-n // 64) * 64  # staged pieces start 64-byte aligned: a piece may be viewed as its dtype


def run_device(pieces: list[Piece], engine: CopyEngine, *, host_work: list[Callable[[], None]] | None = None,
               parallel: bool = True) -> None:
    """Carry out ``pieces`` through ``engine`` (and ``host_work``, other jobs of the same load, on
    the same threads; ``parallel=False``: one after another, for sources that read sequentially);
    returns once every copy is complete, also when one failed."""
    tasks = _tasks(pieces)
    sizes = [sum(_align(p.length) for p in t if p.source.memory() is None) for t in tasks]
    slot = max(sizes, default=0)
    count = max(2, STAGING_BYTES // slot) if slot else 0
    staging = _Staging(engine, slot, min(count, sum(1 for s in sizes if s)))

    def run(task: list[Piece]) -> None:
        buf: torch.Tensor | None = None
        queued = False
        try:
            pos = 0
            for p in task:
                memory = p.source.memory()
                if memory is not None:
                    host = memory[p.offset : p.offset + p.length]
                    verify_in_place(host, p.checks, location=p.location, key=p.key)
                else:
                    if buf is None:
                        buf = staging.acquire()
                    host = buf[pos : pos + p.length]
                    pos += _align(p.length)
                    fill_verified(p.source, p.offset, host, p.checks, location=p.location, key=p.key)
                for dst, src in p.place(host):
                    engine.copy(dst, src)
                    queued = True
        finally:
            if buf is not None:
                staging.release(buf, engine.record() if queued else None)

    work: list[Callable[[], None]] = [functools.partial(run, t) for t in tasks] + list(host_work or [])
    try:
        if parallel and len(work) > 1:
            for _ in map_all(lambda f: f(), work):
                pass
        else:
            for f in work:
                f()
    finally:
        engine.finish()

