"""The RAM tier: preallocated staging slots in shared memory, reused across saves.

A slot is one file in ``ram_dir`` (a tmpfs such as /dev/shm), mode 0600, named by job, rank and
slot index, mapped into the process. Its layout is the sharded data-file layout (each tensor's
bytes at a 4 KiB-aligned offset from 0), so persisting a staged snapshot to the local tier is one
sequential write of the slot, and the checksums computed from the staged copy are the chunk
checksums the manifest needs.

Staging is a ``copy_`` into memory that was touched before (after the first save), which is what
keeps the training loop's blocking time near the memcpy floor: fresh memory would have to be
page-faulted in at 1-2.5 GB/s on every save. A committed snapshot has a JSON manifest beside its
slot (written after the checksums, by rename), so a process that crashed and restarts on the same
node finds it there and restores without touching disk.

In a store the RAM tier commits a step only once every rank's part is staged, with the step's
global manifest (the same one the local and durable tiers get), so a restarted job can load any
rank's shard from the segments of the ranks on its node.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import itertools
import json
import logging
import math
import mmap
import operator
import os
import socket
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from .._aio import lower_priority, run_sync
from .._buffers import copy_grouped
from .._gc import paused
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StorageError,
)
from ..format.checksum import ALGORITHM
from ..format.container import SMALL_ALIGN, SMALL_BYTES, align_up
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.manifest import Manifest, check_manifest_size, load_json, parse_manifest
from ..names import Segment, data_file, data_file_rank, document_temporary, parse_segment, segment, valid_job
from ..planning.flatten import check_storage, storage_problem
from ..storage import small
from ..storage.targets import LocalSource, Source, Target
from .base import Capabilities, Held, Holdings, NodePart, Snapshot, Tier, manifest_of_parts

RAM_FORMAT = "ckptstore-ram/1"
# Minor versions of RAM_FORMAT: 0 (no ``minor`` member) holds the step's whole manifest in
# ``extra.manifest``; 1 holds this rank's own part, the step's meta and the header of the rank's
# structure (``extra.part``, ``extra.meta``, ``extra.header``), so a save never gathers every
# rank's part to every rank. Readers accept both.
RAM_MINOR = 1
# What RamTier(fallback=...) and CheckpointStore(ram_fallback=...) accept: None fails a save whose
# slot ram_dir cannot hold; "private" stages in process memory instead (see RamTier).
RAM_FALLBACKS = (None, "private")
# Frozen tensors smaller than this are copied at every save: copying them costs about what checking
# them would, and nothing stale can come of a copy.
_REUSE_MIN_BYTES = 64 << 10
_SAMPLES = 16
# Staged entries smaller than this are copied by address when the caller vouches for their sources
# (Slot.copy_small); larger ones by torch, which spreads a copy over its threads.
_BY_ADDRESS = 64 << 10


@dataclass(frozen=True)
class SlotEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    entries: tuple[SlotEntry, ...]
    total: int
    # Entries from ``tail`` on (per-rank values, encoded afresh at every save) may change length
    # between saves of one structure: :meth:`with_tail` lays out only them again. None: no such tail.
    tail: int | None = None
    # The layout this one was derived from by with_tail: every entry before ``tail`` is the same.
    base: Layout | None = field(default=None, compare=False, repr=False)
    # Where the slot is cut (see :meth:`of`), and how many entries at the end keep their length
    # behind a tail that moves them (the replica check's, staged after every written entry).
    breaks: frozenset[int] = field(default=frozenset(), compare=False, repr=False)
    fixed: int = 0

    @classmethod
    def of(cls, items: list[tuple[str, torch.Tensor]], breaks: frozenset[int] = frozenset(),
           tail: int | None = None, fixed: int = 0) -> Layout:
        """Entries of 1 MiB or more start 4 KiB-aligned, smaller ones 64 bytes apart (the padding
        would otherwise be most of a state of small tensors, in RAM and in every file written from
        the slot), and so does the entry at each index in ``breaks``: the store cuts the slot there
        (frozen entries first, replica-check entries last). With a ``tail``, the slot keeps room for
        the tail's entries but the ``fixed`` last ones to grow (to twice their bytes, at least 4 KiB
        more) without a new one."""
        entries, pos = [], 0
        for i, (key, t) in enumerate(items):
            name = dtype_name(t.dtype)
            if name is None:
                raise InvalidArgumentError(f"{key}: dtype {t.dtype} cannot be staged")
            nbytes = t.numel() * t.element_size()
            pos = align_up(pos) if nbytes >= SMALL_BYTES or i in breaks else align_up(pos, SMALL_ALIGN)
            entries.append(SlotEntry(key, name, tuple(t.shape), pos, nbytes))
            pos += nbytes
        if tail is None or tail >= len(entries) - fixed:
            return cls(tuple(entries), max(align_up(pos), 4096))
        spare = max(sum(e.nbytes for e in entries[tail : len(entries) - fixed]), 4096)
        return cls(tuple(entries), max(align_up(pos + spare), 4096), tail, breaks=breaks, fixed=fixed)

    def with_tail(self, items: list[tuple[str, torch.Tensor]]) -> Layout | None:
        """This layout with its tail's entries laid out again for ``items`` (the tail's new values,
        same keys and dtypes), in the same slot size; None when they no longer fit in it."""
        assert self.tail is not None and len(items) == len(self.entries) - self.tail
        head = self.entries[: self.tail]
        pos = head[-1].offset + head[-1].nbytes if head else 0
        entries = list(head)
        for i, ((key, t), old) in enumerate(zip(items, self.entries[self.tail :]), self.tail):
            nbytes = t.numel() * t.element_size()
            pos = align_up(pos) if nbytes >= SMALL_BYTES or i in self.breaks else align_up(pos, SMALL_ALIGN)
            entries.append(SlotEntry(key, old.dtype, tuple(t.shape), pos, nbytes))
            pos += nbytes
        if align_up(pos) > self.total:
            return None
        return Layout(tuple(entries), self.total, self.tail, self.base or self, self.breaks, self.fixed)

    @functools.cached_property
    def family(self) -> str:
        """The signature of the layout this one derives from (its own when none): layouts of one
        family place every entry before the tail alike."""
        return self.base.signature if self.base is not None else self.signature

    @functools.cached_property
    def signature(self) -> str:
        # Cached: a store reuses one Layout object while the state's structure holds.
        text = json.dumps([(e.key, e.dtype, list(e.shape), e.offset) for e in self.entries])
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @functools.cached_property
    def keys(self) -> list[str]:
        return [e.key for e in self.entries]

    @functools.cached_property
    def spans(self) -> list[tuple[int, int]]:
        """Each entry's byte range in the slot."""
        return [(e.offset, e.offset + e.nbytes) for e in self.entries]

    @functools.cached_property
    def largest(self) -> int:
        return max((e.nbytes for e in self.entries), default=0)

    @functools.cached_property
    def any_empty(self) -> bool:
        return any(not e.nbytes for e in self.entries)

    @functools.cached_property
    def total_bytes(self) -> int:
        """The bytes of the entries (the slot's padding not counted)."""
        return sum(e.nbytes for e in self.entries)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes} for e in self.entries]

    @functools.cached_property
    def encoded(self) -> bytes:
        """:meth:`to_json` as a document's compact JSON: encoded once per layout, not at every commit
        (formatted here rather than through 10,000 dicts: the same text, tests/test_ram_doc.py)."""
        text = ",".join(f'{{"key":{_string(e.key)},"dtype":{_string(e.dtype)},"shape":{_ints(e.shape)},'
                        f'"offset":{e.offset},"nbytes":{e.nbytes}}}' for e in self.entries)
        return f"[{text}]".encode()


class Slot:
    """One shared-memory segment, mapped; tensors are views into it.

    The segment's memory is reserved when it is made (``posix_fallocate``), after a check of the
    space left in its directory: a tmpfs that is too small (Docker's default /dev/shm is 64 MiB)
    then fails here with a StorageError naming the size, the directory and the remedies, instead
    of killing the process with SIGBUS at the first copy into a page tmpfs cannot supply.

    ``private``: process memory (an anonymous mapping) instead of a file in ``ram_dir``, for
    ``ram_fallback="private"``; nothing of it is visible to another process."""

    def __init__(self, path: str, size: int, *, private: bool = False) -> None:
        self.path, self.size, self.private = path, size, private
        self.identity: tuple[int, int] | None = None  # the segment file's (st_dev, st_ino)
        self.made_ahead = False  # made by RamTier.prepare, nothing staged into it yet
        if private:
            self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            self.map, self.identity = _map_segment(path, size)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = _pin(self.buffer) if torch.cuda.is_available() else False
        self._views: tuple[Layout, list[torch.Tensor]] | None = None
        self._spans: tuple[Layout, list[memoryview]] | None = None
        # For one layout: which of its non-empty entries copy_small copies by address and which by
        # torch, the first ones' addresses in the slot and sizes, and views of the others.
        self._addresses: tuple[Layout, list[int], list[int], list[int], list[int], list[torch.Tensor]] | None = None
        # copy_small's gather, while its sources' addresses hold.
        self._gather: _Gather | None = None
        if self.identity is not None:
            _mapped[self.identity] = self

    def views(self, layout: Layout) -> list[torch.Tensor]:
        """A view per entry of ``layout``, kept while the slot is staged with the same layout:
        making one costs microseconds, which thousands of small tensors turn into most of a save."""
        if self._views is not None:
            held, views = self._views
            if held is layout:
                return views
            if layout.tail is not None and held.tail == layout.tail and held.family == layout.family:
                # Only the per-rank tail moved (no signature of the whole layout needed to know it):
                # the views before it stand.
                views = views[: layout.tail] + [self.view(e) for e in layout.entries[layout.tail :]]
                self._views = (layout, views)
                return views
            if held.signature == layout.signature:
                return views
        views = [self.view(e) for e in layout.entries]
        self._views = (layout, views)
        return views

    def copy_small(self, layout: Layout, srcs: list[torch.Tensor], seen: list[list[int] | None] | None = None) -> None:
        """Copy ``srcs``, the sources of ``layout``'s non-empty entries in its order, into their
        entries of this slot, the sources being contiguous CPU tensors of their entry's dtype and
        shape (the caller's word): those under 64 KiB from their address (half the per-tensor cost
        of torch's grouped copy), torch the rest (spreading a large one over torch's threads), into
        views of the large entries alone. A view costs a few microseconds to make, and the first
        save into each slot of a structure made one per entry (50 ms at 10,000 tensors) where the
        small ones need none.

        The copies from addresses are one memmove each, until the sources are found at the same
        addresses as at the last copy (``seen[0]``, which the tier's slots share, and this call
        updates): from then on the smallest of them (a state of thousands of tiny tensors: norms,
        biases, optimizer steps) are copied by one numpy gather (:class:`_Gather`), for as long as
        their addresses hold."""
        addresses = self._addresses
        if addresses is None or addresses[0] is not layout:
            base = self.buffer.data_ptr()
            filled = [e for e in layout.entries if e.nbytes]  # what dsts and srcs hold
            small = [i for i, e in enumerate(filled) if e.nbytes < _BY_ADDRESS]
            large = [i for i, e in enumerate(filled) if e.nbytes >= _BY_ADDRESS]
            addresses = self._addresses = (layout, small, large, [base + filled[i].offset for i in small],
                                           [filled[i].nbytes for i in small], [self.view(filled[i]) for i in large])
            self._gather = None
        _, small, large, targets, sizes, dsts = addresses
        assert len(small) + len(large) == len(srcs)
        sources = srcs if not large else [srcs[i] for i in small]
        pointers = list(map(_data_ptr, sources))
        # A freed storage (resize_(0), as FSDP frees parameters) keeps its tensor's shape and reads
        # from address 0: the process would die in the copy. Found here by the pointers the copy
        # needs anyway; the few large sources are checked one by one.
        if 0 in pointers or any(storage_problem(srcs[i]) for i in large):
            filled = [e for e in layout.entries if e.nbytes]
            for e, src in zip(filled, srcs):
                check_storage(src, repr(e.key))
        gather = self._gather
        if seen is None:
            seen = [None]
        if gather is None or gather.pointers != pointers:
            gather = self._gather = None
            if pointers == seen[0]:  # the same sources twice: worth an index
                gather = self._gather = _Gather.of(self.buffer, pointers, targets, sizes)
        seen[0] = pointers
        if gather is None:
            list(map(ctypes.memmove, targets, pointers, sizes))
        else:
            gather.copy()
            if gather.rest:
                list(map(ctypes.memmove, [targets[i] for i in gather.rest], [pointers[i] for i in gather.rest],
                         [sizes[i] for i in gather.rest]))
        if large:
            copy_grouped(dsts, [srcs[i] for i in large])

    def spans(self, layout: Layout) -> list[memoryview]:
        """Each entry's bytes in the slot, as views of its mapping, kept while its layout holds:
        slicing one costs more than hashing 64 bytes."""
        if self._spans is None or self._spans[0] is not layout:
            whole = memoryview(self.map)
            self._spans = (layout, [whole[a:b] for a, b in layout.spans])
            whole.release()
        return self._spans[1]

    def view(self, e: SlotEntry) -> torch.Tensor:
        dtype = dtype_from_name(e.dtype, where=self.path)
        raw = self.buffer[e.offset : e.offset + e.nbytes]
        if not e.nbytes:
            return torch.empty(e.shape, dtype=dtype)
        return raw.view(dtype).view(e.shape)

    def release(self) -> None:
        # Views handed out keep the mapping alive; dropping ours is enough.
        if self.identity is not None and _mapped.get(self.identity) is self:
            del _mapped[self.identity]
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._views = None
        self._spans = None
        self._addresses = None
        self._gather = None


_data_ptr = torch.Tensor.data_ptr
_second = operator.itemgetter(1)
# Entries up to this size are gathered by Slot.copy_small's index (8 bytes of index per 8 bytes of
# data); a memmove costs about what gathering 2 KiB does.
_GATHER_MAX = 1024


class _Gather:
    """One numpy gather for many small copies from fixed addresses into a slot: an index of every
    8-byte word to copy, into a view of the address space spanning the sources, and an index of
    where each goes in the slot. Built with numpy's vector operations, no Python per entry. The
    index is a function of the sources' addresses (``pointers``), the slot's targets and the sizes
    alone, the very arguments of the memmoves it replaces: the caller compares the addresses at
    every copy (the layout fixes the rest), so it copies what those memmoves would.
    ``rest``: the entries it does not copy (not 8-byte aligned, or larger than _GATHER_MAX)."""

    def __init__(self, pointers: list[int], src: Any, src_index: Any, dst: Any, dst_index: Any, rest: list[int]) -> None:
        self.pointers, self.rest = pointers, rest
        self._src, self._src_index, self._dst, self._dst_index = src, src_index, dst, dst_index

    @classmethod
    def of(cls, buffer: torch.Tensor, pointers: list[int], targets: list[int], sizes: list[int]) -> _Gather | None:
        if not pointers:
            return None
        ptr = np.asarray(pointers, dtype=np.int64)
        size = np.asarray(sizes, dtype=np.int64)
        base = buffer.data_ptr()
        offset = np.asarray(targets, dtype=np.int64) - base
        ok = (((ptr | size | offset) & 7) == 0) & (size <= _GATHER_MAX) & (size > 0)
        if not ok.any():
            return None
        ptr, size, offset = ptr[ok], size[ok], offset[ok]
        low = int(ptr.min())
        words = size // 8
        first = np.cumsum(words) - words  # where each entry's words start in the index
        within = np.arange(int(words.sum()), dtype=np.int64) - np.repeat(first, words)
        src_index = np.repeat((ptr - low) // 8, words) + within
        dst_index = np.repeat(offset // 8, words) + within
        span = int(src_index.max()) + 1
        # The address space from the lowest source on, as an array of words: only the indexed
        # words are ever read, and each lies in a source tensor.
        src = np.asarray(_Words(low, span))
        dst = buffer.numpy().view(np.uint64)
        return cls(pointers, src, src_index, dst, dst_index, np.flatnonzero(~ok).tolist())

    def copy(self) -> None:
        self._dst[self._dst_index] = self._src[self._src_index]


class _Words:
    """``count`` 8-byte words of this process's memory from ``address``, as numpy's array interface."""

    def __init__(self, address: int, count: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": (count,), "typestr": "<u8", "version": 3}


@dataclass
class Staged:
    step: int
    slot: int
    layout: Layout
    seconds: float
    copied_bytes: int = 0
    reused: tuple[str, ...] = ()  # keys whose bytes were already in the slot and were not copied
    # Filled by RamTier.checksums, in the layout's order: each entry's checksum, and the indices of
    # the entries with block checksums (what a document's encoding fills in per save).
    digests: list[str] | None = None
    blocked: tuple[int, ...] = ()
    # The same as the document's ``checksums`` member (see :attr:`sums`), or that member itself
    # where it was set from elsewhere than RamTier.checksums.
    checked: _Sums | None = field(default=None, repr=False)
    _sums: dict[str, Any] | None = field(default=None, repr=False)
    # The chunk table RamTier.snapshot built from its _Template: a commit whose part holds this very
    # table encodes its document from the template (RamTier._extra_text).
    chunks: dict[str, list[dict[str, Any]]] | None = None
    template: _Template | None = None

    @property
    def sums(self) -> dict[str, Any] | None:
        """Each entry's checksums by key, as the document's ``checksums`` member holds them (None
        before RamTier.checksums): made when first asked for. A steady commit writes the
        document's text from its template and the digests, and no reader of a store's save asks,
        so 10,000 entries no longer cost 10,000 dicts made, collected and freed at every save."""
        if self._sums is None and self.checked is not None:
            self._sums = self.checked.table()
        return self._sums

    @sums.setter
    def sums(self, value: dict[str, Any] | None) -> None:
        self._sums, self.checked = value, None

    def block_entry(self, i: int) -> dict[str, Any]:
        """The checksums entry of the layout's ``i``-th entry, one of :attr:`blocked`."""
        if self.checked is not None and i in self.checked.blocks:
            return self.checked.blocks[i]
        assert self.sums is not None
        return self.sums[self.layout.entries[i].key]


class _Sums:
    """A slot's checksums as RamTier.checksums computed them: ``digests`` in the layout's order and
    the entries with block checksums whole (``blocks``, by index); :meth:`table` is the
    document's ``checksums`` member, made once and only when asked for."""

    __slots__ = ("keys", "digests", "blocks", "_table")

    def __init__(self, keys: list[str], digests: list[str], blocks: dict[int, dict[str, Any]],
                 table: dict[str, Any] | None = None) -> None:
        self.keys, self.digests, self.blocks, self._table = keys, digests, blocks, table

    def table(self) -> dict[str, Any]:
        if self._table is None:
            table = dict(zip(self.keys, [{"checksum": d} for d in self.digests]))
            for i, entry in self.blocks.items():
                table[self.keys[i]] = entry
            self._table = table
        return self._table


class RamTier(Tier):
    """Two (or more) reusable staging slots for one rank of one job.

    Node-local: the slots of every rank on a node lie in the same ``ram_dir``, so a restart on the
    node restores any of those ranks' shards from RAM (``holdings``).

    ``fallback``: what to do when ``ram_dir`` cannot hold a slot. None raises the StorageError of
    :func:`shm_shortage`; ``"private"`` stages into this process's own memory from then on: the
    snapshots still go to the lower tiers, but the RAM tier publishes nothing (a private slot is
    no copy another process can read), so a crash leaves no RAM copy to restore from."""

    capabilities = Capabilities(node_local=True)

    def __init__(self, job: str, rank: int = 0, *, ram_dir: str = "/dev/shm", slots: int = 2,
                 fallback: str | None = None, lower: dict[str, str | None] | None = None) -> None:
        if not valid_job(job):
            raise InvalidArgumentError(f"job {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-'")
        if slots < 1:
            raise InvalidArgumentError("slots must be at least 1")
        if not os.path.isdir(ram_dir):
            raise InvalidArgumentError(f"ram_dir {ram_dir!r} is not a directory (use a tmpfs such as /dev/shm)")
        if fallback not in RAM_FALLBACKS:
            raise InvalidArgumentError(f"fallback must be one of {RAM_FALLBACKS}, not {fallback!r}")
        self.name = "ram"
        self.job, self.rank, self.ram_dir, self.nslots = job, rank, ram_dir, slots
        self.fallback = fallback
        # Where the store's lower tiers are ({"local": directory, "durable": URL}), recorded in every
        # committed slot's document: what `ckptstore ram` and a node agent, which have no store,
        # read to tell whether a segment's step exists elsewhere.
        self.lower = lower_record(**(lower or {}))
        # Once one slot did not fit, every later one is private too: a mix would publish some
        # snapshots and not others, which a restart could not tell from a crash.
        self.private = False
        self._by_step: dict[int, Staged] = {}  # staged, not yet committed
        self._slot_sums: dict[int, _Sums] = {}
        self._streams: dict[Any, Any] = {}
        self._slots: dict[int, Slot] = {}
        # Slots being mapped off the training thread (prepare()), each claimed by _slot(): only the
        # thread that stages touches this dict and _slots; the preparing thread fills the futures.
        self._preparing: dict[int, Future[Slot | None]] = {}
        # Whether each save prepares the other slots for the saves after it, and whether that
        # makes a slot that does not exist yet, or only maps existing ones (a store sets both).
        self.prepare_ahead = False
        self.make_ahead = False
        self.background_nice = 0  # how far below the trainer the preparing thread runs (a store's option)
        self._uses: dict[int, int] = {}  # slot -> saves staged into it by this process
        # Staging never goes into the slot holding this rank's newest committed snapshot (unless
        # there is only one slot), so a crash while staging, or a save that never commits, never
        # destroys the newest RAM copy (after a restart too).
        self._newest: tuple[int, int] | None = None  # (step, slot)
        self._find_newest()
        self._next = (self._newest[1] + 1) % slots if self._newest else 0
        # Per slot: the layout it holds and, per key, the identity of the source tensor it copied
        # (storage pointer, version counter, shape, strides, dtype) -- the basis of skipping.
        self._layout_sig: dict[int, str] = {}
        self._sources: dict[int, dict[str, tuple]] = {}
        # The sources' addresses at the last Slot.copy_small of any slot: a slot gathers from its
        # first copy on when they are the same (steady saves alternate between slots).
        self._copied_from: list[list[int] | None] = [None]
        # What the store that owns these slots does with a snapshot after RAM (its "store" member
        # in each committed document): a node agent that finds the owner dead persists exactly that.
        self.store_info: dict[str, Any] | None = None
        # What a document of the current structure reuses from the last save's (see _publish).
        self._held_template: _Template | None = None
        self._held_header: tuple[dict[str, Any], bytes] | None = None

    def _find_newest(self) -> None:
        mine = self._docs(self.rank)
        newest = max(mine, key=lambda d: d["step"]) if mine else None
        self._newest = (newest["step"], newest["slot"]) if newest else None

    def set_slots(self, slots: int) -> None:
        """Use ``slots`` staging slots (fixed at a store's first save, from its RAM budget)."""
        if slots < 1:
            raise InvalidArgumentError("slots must be at least 1")
        self.nslots, self._next = slots, self._next % slots
        for index in [i for i in self._preparing if i >= slots]:
            self._drop_prepared(index)

    def prepare(self, size: int | None = None, *, only_next: bool = False) -> None:
        """Map the slots the next saves will stage into, with their pages, on a thread of its own,
        so that no save waits for it: mapping and reserving a slot costs 0.1-0.5 s per 512 MiB
        (more where CUDA page-locks it), which the first two saves of every restarted process
        paid while the trainer waited. ``size`` None (a store's start): the segments this rank's
        previous process left, as they are, but the one holding the newest committed snapshot
        (the restore reads that one as any restarted process does, and the first save does not
        stage into it); ``size``: the slot size of the save just staged, for the slots not mapped
        at it yet (the restored snapshot's slot, which the second save takes once the first is
        committed).

        It never changes a segment's bytes or size: a segment of another size, or one not wholly
        reserved, is left to the save that stages into it (resizing the one holding the newest
        committed snapshot would destroy it before a newer one is committed). One that does not
        exist is created at ``size`` only with ``make_ahead`` (a store's, on a job's first start
        and on a crash loop's restarts, where a node agent may have released the segments), within
        the slots the store's budget allows. A failure (ram_dir full) is left for that save to raise
        or to fall back on. ``only_next``: the slot the next save takes, alone (its size a guess
        made before the slot count is known)."""
        if self.private:
            return
        todo: list[tuple[int, str, int, Future[Slot | None]]] = []
        first = self.next_slot
        order = [first] if only_next else sorted(range(self.nslots), key=lambda i: (i - first) % self.nslots)
        for index in order:
            held = self._slots.get(index)
            if index in self._preparing or (held is not None and (size is None or held.size == size)):
                continue
            path = self._name(index, "bin")
            have = _reserved_size(path)
            if size is None and (have is None or (self._newest is not None and index == self._newest[1])):
                continue
            if size is not None and (have != size if os.path.lexists(path) else not self.make_ahead):
                continue
            future: Future[Slot | None] = Future()
            self._preparing[index] = future
            todo.append((index, path, size if size is not None else have, future))  # type: ignore[arg-type]
        if todo:
            threading.Thread(target=_prepare_slots, args=(todo, self.background_nice), name="ckptstore-ram-prepare",
                             daemon=True).start()

    def _claim_prepared(self, index: int) -> Slot | None:
        """The slot prepare() mapped for ``index``: waited for when its mapping is under way,
        withdrawn (None) when it has not started."""
        future = self._preparing.pop(index, None)
        if future is None or future.cancel():
            return None
        return future.result()

    def _drop_prepared(self, index: int) -> None:
        slot = self._claim_prepared(index)
        if slot is not None:
            slot.release()

    @property
    def staged_any(self) -> bool:
        """Whether this tier has mapped a slot for a save of its own (its sizes are known here)."""
        return bool(self._slots)

    @property
    def next_slot(self) -> int:
        """The slot the next :meth:`stage` copies into: the next in turn, passing over the one that
        holds this rank's newest committed snapshot."""
        index = self._next
        if self.nslots > 1 and self._newest is not None and index == self._newest[1]:
            index = (index + 1) % self.nslots
        return index

    def _name(self, slot: int, ext: str, rank: int | None = None) -> str:
        return os.path.join(self.ram_dir, segment(self.job, self.rank if rank is None else rank, slot, ext))

    def _slot(self, index: int, size: int) -> Slot:
        prepared = self._claim_prepared(index)
        if prepared is not None:
            # Mapped before this store could hold a node agent off: an agent that released the
            # segment since (its step persisted, no process mapping it when it looked) left the
            # mapping on a file no longer in ram_dir, where nothing staged would be found again.
            there = prepared.identity == _identity(prepared.path)
            if prepared.size == size and not self.private and there:
                if index in self._slots:
                    self._slots[index].release()
                self._slots[index] = prepared
            else:
                prepared.release()
                if prepared.made_ahead and there:
                    # It never held a snapshot: gone, as if never made, so that a size this
                    # directory cannot hold leaves no segment behind (_map_segment removes only
                    # what it created).
                    remove_file(prepared.path)
        slot = self._slots.get(index)
        if slot is None or slot.size != size:
            if slot is not None:
                slot.release()
            slot = self._slots[index] = self._new_slot(index, size)
        return slot

    def _new_slot(self, index: int, size: int) -> Slot:
        path = self._name(index, "bin")
        if not self.private:
            try:
                return Slot(path, size)
            except StorageError as exc:
                if self.fallback != "private" or exc.errno not in SHORTAGE_ERRNOS:
                    raise
                self.private = True
                logging.getLogger("ckptstore").warning(
                    "ckptstore: %s; staging in private process memory instead (ram_fallback='private'): "
                    "snapshots still reach the local and durable tiers, but no RAM copy survives a crash", exc)
        return Slot(f"<private staging memory of {path}>", size, private=True)

    def _committed_slot(self, doc: dict[str, Any]) -> Slot:
        """The segment of a committed snapshot, to read: once staging went private, the cached slot
        of that index is process memory, and the committed bytes are in the file."""
        if self.private:
            return Slot(self._name(doc["slot"], "bin"), doc["size"])
        return self._slot(doc["slot"], doc["size"])

    @property
    def pinned(self) -> bool:
        """Whether every slot in use is page-locked (CUDA present and the registration granted)."""
        return bool(self._slots) and all(s.pinned for s in self._slots.values())

    def stage(
        self, step: int, items: list[tuple[str, torch.Tensor]], *, may_skip: frozenset[str] = frozenset(),
        breaks: frozenset[int] = frozenset(), slot: int | None = None, refresh_every: int | None = None,
        layout: Layout | None = None, plain: bool = False,
    ) -> Staged:
        """Copy ``items`` into the next slot; the blocking part of a save. Returns what was staged.

        Keys in ``may_skip`` (frozen weights in fine-tuning) of at least 64 KiB are not copied when
        the slot already holds the same source tensor at the same version counter and a sample of
        its elements, taken afresh at every save, still equals the slot's copy. Writes through
        ``.data``, numpy views or DLPack change a tensor without bumping its version counter: the
        sample catches a change of much of a tensor at once, and every ``refresh_every``-th use of
        each slot copies everything, which catches the rest. ``breaks``: see :meth:`Layout.of`.
        ``slot``: the slot to stage into, as :attr:`next_slot` named it to a caller that waited for
        it to be free. ``layout``: ``Layout.of(items, breaks)``, when the caller keeps it from a save
        of the same structure. ``plain``: the caller vouches that every source is a contiguous CPU tensor
        of its entry's dtype and shape, of a real dtype (the pipeline, while the state's fingerprint
        equals the one it checked this under): the small ones are then copied by address.

        The slot's previous manifest is removed first, so a crash mid-copy never leaves a
        committed-looking snapshot with half-overwritten bytes.
        """
        if layout is None:
            layout = Layout.of(items, breaks)
        index = self.next_slot if slot is None else slot
        self._next = (index + 1) % self.nslots
        if self._newest is not None and self._newest[1] == index:
            self._newest = None  # one slot only: its snapshot goes now
        remove_file(self._name(index, "json"))
        self._by_step = {s: st for s, st in self._by_step.items() if st.slot != index}
        self._uses[index] = self._uses.get(index, 0) + 1
        track = may_skip  # the keys whose source identity is kept, for the next save to skip on
        if refresh_every and self._uses[index] % refresh_every == 0:
            may_skip = frozenset()  # this slot's periodic refresh: counted per slot, so every slot gets one
        segment = self._slot(index, layout.total)
        # A layout of the same family moved only its tail, per-rank values that are never skipped:
        # what the slot holds before it stays where it was.
        if self._layout_sig.get(index) != layout.family:
            self._sources[index] = {}  # another layout (or a new segment): nothing in the slot is reusable
            self._slot_sums.pop(index, None)
        self._layout_sig[index] = layout.family
        held = self._sources.setdefault(index, {})
        copied, reused = 0, []
        t0 = time.perf_counter()
        stream = None if plain else self._side_stream(items)  # plain: every source is in host memory
        if stream is None and not may_skip and not track and not held:
            # The common case, with nothing to skip: one grouped copy, no Python work per tensor
            # beyond building the two lists.
            with torch.no_grad():  # so sources that require grad copy as they are, without a detach each
                if plain:  # by address: views of the large entries only (Slot.copy_small)
                    srcs = ([src for (_, src), e in zip(items, layout.entries) if e.nbytes] if layout.any_empty
                            else list(map(_second, items)))
                    segment.copy_small(layout, srcs, self._copied_from)
                else:
                    views = segment.views(layout)
                    if layout.any_empty:
                        pairs = [(v, src) for (_, src), v, e in zip(items, views, layout.entries) if e.nbytes]
                        dsts, srcs = [v for v, _ in pairs], [src for _, src in pairs]
                    else:
                        dsts, srcs = views, [src for _, src in items]
                    for (key, src), e in zip(items, layout.entries):
                        if e.nbytes:
                            check_storage(src, repr(key))  # a freed storage would crash the copy
                    if dsts:
                        copy_grouped(dsts, srcs)
            copied = layout.total_bytes
        else:
            views = segment.views(layout)
            sampler = torch.Generator().manual_seed(step)
            with torch.no_grad(), _on(stream):
                for (key, src), e, view in zip(items, layout.entries, views):
                    identity = (src.data_ptr(), src._version, tuple(src.shape), tuple(src.stride()), src.dtype, src.device)
                    if (key in may_skip and e.nbytes >= _REUSE_MIN_BYTES and held.get(key) == identity
                            and _sample_matches(src, view, sampler, key)):
                        reused.append(key)
                        continue
                    held.pop(key, None)  # a failed copy must not leave a stale identity behind
                    if e.nbytes:
                        check_storage(src, repr(key))
                        # Device tensors on the side stream's device copy asynchronously into the
                        # pinned slot; everything else is an ordinary synchronous copy.
                        view.copy_(src.detach(), non_blocking=stream is not None and src.device == stream.device)
                        copied += e.nbytes
                    if key in track:
                        held[key] = identity
            if stream is not None:
                stream.synchronize()  # save returns only once the snapshot is in host memory
        staged = Staged(step, index, layout, time.perf_counter() - t0, copied, tuple(reused))
        self._by_step[step] = staged
        if self.prepare_ahead and self.nslots > 1:
            self.prepare(layout.total)
        return staged

    def _side_stream(self, items: list[tuple[str, torch.Tensor]]) -> Any:
        """A CUDA stream of our own for device-to-host copies, so they overlap nothing the
        trainer queued after this point and never wait behind its kernels' later work; it first
        waits for the work already queued that produces the tensors."""
        if not torch.cuda.is_available():
            return None
        device = next((t.device for _, t in items if t.is_cuda), None)
        if device is None:
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def checksums(self, staged: Staged, block_size: int | None = None) -> dict[str, Any]:
        """xxh3 of each staged tensor's bytes (and of each block of it), computed from the staged
        copy: off the training loop's path, and valid for every later copy of these bytes."""
        self.hash(staged, block_size)
        assert staged.sums is not None
        return staged.sums

    def hash(self, staged: Staged, block_size: int | None = None) -> None:
        """:meth:`checksums` without the table by key (``staged.sums`` makes it when asked for)."""
        slot = self._slots[staged.slot]
        view = memoryview(slot.map)
        layout = staged.layout
        prefix, digest = f"{ALGORITHM}:", xxhash.xxh3_64_hexdigest
        blocked = []
        blocks: dict[int, dict[str, Any]] = {}
        table: dict[str, Any] | None = None
        if staged.reused:
            # Bytes that were not copied were not touched since this slot's last checksums.
            held = self._slot_sums.get(staged.slot)
            previous = held.table() if held is not None else {}
            reused = set(staged.reused)
            out: dict[str, Any] = {}
            digests = []
            for i, e in enumerate(layout.entries):
                entry = previous.get(e.key) if e.key in reused else None
                if entry is None:
                    entry = self._entry_sums(view, e, block_size)
                out[e.key] = entry
                digests.append(entry["checksum"])
                if "block_checksums" in entry:
                    blocked.append(i)
                    blocks[i] = entry
            table = out
        else:
            # One pass with no Python per entry: a hash and a string each, over views of the slot
            # kept per layout; the few entries large enough for block checksums get them below.
            digests = list(map(prefix.__add__, map(digest, slot.spans(layout))))
            if block_size and layout.largest > block_size:
                for i, e in enumerate(layout.entries):
                    if e.nbytes > block_size:
                        data = view[e.offset : e.offset + e.nbytes]
                        blocks[i] = {"checksum": digests[i], "block_size": block_size,
                                     "block_checksums": [prefix + digest(data[b : b + block_size])
                                                         for b in range(0, e.nbytes, block_size)]}
                        data.release()
                        blocked.append(i)
        view.release()
        checked = self._slot_sums[staged.slot] = _Sums(layout.keys, digests, blocks, table)
        staged.checked, staged._sums = checked, table
        staged.digests, staged.blocked = digests, tuple(blocked)

    @staticmethod
    def _entry_sums(view: memoryview, e: SlotEntry, block_size: int | None) -> dict[str, Any]:
        data = view[e.offset : e.offset + e.nbytes]
        entry: dict[str, Any] = {"checksum": f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"}
        if block_size and e.nbytes > block_size:
            entry["block_size"] = block_size
            entry["block_checksums"] = [
                f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data[b : b + block_size])}" for b in range(0, e.nbytes, block_size)
            ]
        return entry

    async def _publish(self, staged: Staged, checksums: dict[str, Any] | None, extra: dict[str, Any] | None,
                       save_id: str | None = None, minor: int = 0) -> None:
        """Mark the staged snapshot as complete: its manifest appears by rename, after the bytes.
        ``checksums``: None for those RamTier.checksums computed of ``staged``."""
        if self.private:
            return  # no other process can read a private slot: there is nothing to publish
        extra = extra or {}
        # The small members first, the three of a rank's size (its layout, checksums and extra, one
        # entry per tensor) after them: a listing reads the small ones alone (see _document).
        doc: dict[str, Any] = {
            "format": RAM_FORMAT,
            "job": self.job,
            "rank": self.rank,
            "step": staged.step,
            "slot": staged.slot,
            "size": staged.layout.total,
            "signature": staged.layout.signature,
            "committed_unix": round(time.time(), 3),
            "owner": owner_record(),
            "lower": self.lower,
        }
        if self.store_info is not None:
            doc["store"] = self.store_info
        if save_id is not None:
            doc["save_id"] = save_id
        # The members of a rank's size are encoded apart and spliced in: the layout once per
        # structure, the checksums and the part from this structure's _Template where the part's
        # chunk table is the one it built.
        sums_text = self._sums_text(staged, checksums)
        extra_text = self._extra_text(staged, extra)
        if minor:
            doc["minor"] = minor
            # Over the very text written: a reader re-encoding the parsed ``extra`` gets it back.
            hasher = xxhash.xxh3_64()
            for piece in extra_text:
                hasher.update(piece)
            doc["extra_checksum"] = f"{ALGORITHM}:{hasher.hexdigest()}"
            if isinstance(extra.get("meta"), dict):
                doc["meta"] = extra["meta"]
        pieces = _document(doc, [("layout", [staged.layout.encoded]), ("checksums", [sums_text]), ("extra", extra_text)])
        await write_encoded(self._name(staged.slot, "json"), pieces)
        if self._newest is None or staged.step >= self._newest[0]:
            self._newest = (staged.step, staged.slot)

    def _template(self, layout: Layout, boxes: dict[str, tuple[int, ...]]) -> _Template:
        """The _Template of ``layout`` and ``boxes``: the one of the last save while the structure holds."""
        held = self._held_template
        if held is None or held.layout is not layout or held.boxes is not boxes or held.nboxes != len(boxes):
            held = self._held_template = _Template(layout, boxes, data_file(self.rank))
        return held

    @staticmethod
    def _sums_text(staged: Staged, checksums: dict[str, Any] | None) -> bytes:
        """The JSON text of the document's ``checksums`` member (None: ``staged``'s own)."""
        template = staged.template
        own = checksums is None or checksums is staged._sums
        if template is None or not template.usable or not own or staged.digests is None:
            return _compact(staged.sums or {} if checksums is None else checksums).encode()
        return template.sums_text(staged)

    def _extra_text(self, staged: Staged, extra: dict[str, Any]) -> list[bytes]:
        """The JSON text of the document's ``extra``, in pieces: from the template when its part's
        chunk table is the one :meth:`snapshot` built for ``staged`` (a document of minor version
        1), else encoded whole."""
        template, part = staged.template, extra.get("part")
        if (template is None or not template.usable or staged.digests is None or not isinstance(part, dict)
                or part.get("chunks") is not staged.chunks or len(part["chunks"]) != len(template.bases)):
            return [_compact(extra).encode()]
        skeleton: dict[str, Any] = {}
        fills = []
        for key, value in extra.items():
            if key == "part":
                skeleton[key] = {**value, "chunks": _HOLE}
                fills.append([template.chunks_text(staged)])
            elif key == "header" and isinstance(value, dict):
                skeleton[key] = _HOLE
                fills.append([self._header_text(value)])
            else:
                skeleton[key] = value
        return _spliced(skeleton, fills) or [_compact(extra).encode()]

    def _header_text(self, header: dict[str, Any]) -> bytes:
        """The JSON text of a structure's header, encoded once per header: the pipeline keeps one
        header object per structure and makes a new one whenever anything in it changes."""
        held = self._held_header
        if held is None or held[0] is not header:
            held = self._held_header = (header, _compact(header).encode())
        return held[1]

    def commit_staged(self, staged: Staged, checksums: dict[str, Any], extra: dict[str, Any] | None = None) -> None:
        """Commit a staged snapshot outside a store (its manifest, if any, in ``extra``)."""
        run_sync(self._publish(staged, checksums, extra))

    def committed(self) -> list[dict[str, Any]]:
        """Committed snapshots of this job and rank found in ram_dir, newest step first.

        Segments of another job never match the name; a manifest whose job, rank, size or
        signature disagrees with its segment is refused (stale or foreign), not loaded.
        """
        found = []
        for index in range(self.nslots):
            path = self._name(index, "json")
            try:
                doc = read_doc(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise CorruptCheckpointError(f"{path}: unreadable RAM-tier manifest: {exc}", location=path) from None
            if doc.get("format") != RAM_FORMAT or doc.get("job") != self.job or doc.get("rank") != self.rank:
                continue
            if doc.get("slot") != index or type(doc.get("size")) is not int or type(doc.get("step")) is not int:
                raise CorruptCheckpointError(f"{path}: RAM-tier manifest names another slot, or no size/step", location=path)
            seg = self._name(index, "bin")
            if not os.path.exists(seg) or os.path.getsize(seg) != doc.get("size"):
                continue
            found.append(doc)
        return sorted(found, key=lambda d: d["step"], reverse=True)

    def read(self, doc: dict[str, Any], *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Tensors of a committed snapshot, as copies (the slot will be reused), checksums verified."""
        entries = _entries(doc)
        layout = Layout(tuple(entries), doc["size"])
        if layout.signature != doc["signature"]:
            raise CorruptCheckpointError(f"RAM snapshot of step {doc['step']}: layout does not match its signature")
        slot = self._committed_slot(doc)
        out = {}
        for e in entries:
            t = slot.view(e)
            if verify and e.nbytes:
                data = memoryview(slot.map)[e.offset : e.offset + e.nbytes]
                actual = f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"
                data.release()
                sums = doc.get("checksums")
                expected = sums.get(e.key, {}).get("checksum") if isinstance(sums, dict) else None
                if actual != expected:
                    raise CorruptCheckpointError(
                        f"RAM snapshot of step {doc['step']} in {slot.path}: checksum mismatch for {e.key!r}",
                        location=slot.path,
                        key=e.key,
                    )
            out[e.key] = t.clone()
        return out

    # ------------------------------------------------------------------ the Tier contract

    def snapshot_of(self, step: int) -> tuple[Snapshot, NodePart | Manifest] | None:
        """This rank's committed slot of ``step`` as a snapshot another tier can take (a restored
        step promoted to the durable tier), its chunks as its document lists them, with what the
        document holds of the step (this rank's part, or the whole manifest of an older
        document); None when no committed slot of this rank holds the step."""
        doc = next((d for d in self._docs(self.rank) if d["step"] == step), None)
        if doc is None:
            return None
        where = self._name(doc["slot"], "json")
        own = doc_part(doc, where)
        held: NodePart | Manifest
        if own is not None:
            chunks = {key: table for key, table in own.part["chunks"].items() if table}
            world, held = int(own.meta.get("world_size", 1)), own
        else:
            held = parse_manifest(doc["extra"]["manifest"].encode(), where=where)
            mine = data_file(self.rank)
            chunks = {key: [c.to_json() for c in entry.chunks if c.file == mine] for key, entry in held.tensors.items()}
            chunks = {key: table for key, table in chunks.items() if table}
            world = int(held.meta.get("world_size", 1))
        data = self._committed_slot(doc).buffer.narrow(0, 0, doc["size"])
        return Snapshot(step, self.rank, world, data, chunks, meta={"slot": doc["slot"]}), held

    def snapshot(self, staged: Staged, world: int, boxes: dict[str, tuple[int, ...]], frozen_end: int = 0) -> Snapshot:
        """The staged slot as every tier receives it (after :meth:`checksums`). ``boxes`` gives
        each entry's offsets in its global tensor (all zeros for whole tensors)."""
        if staged.checked is None and staged.sums is None:
            raise CheckpointError("checksums of a staged snapshot are computed before it is handed to tiers")
        slot = self._slots[staged.slot]
        if staged.digests is None:  # checksums set from elsewhere than RamTier.checksums
            sums = staged.sums
            assert sums is not None
            staged.digests = [sums[key]["checksum"] for key in staged.layout.keys]
            staged.blocked = tuple(i for i, key in enumerate(staged.layout.keys) if "block_checksums" in sums[key])
        template = staged.template = self._template(staged.layout, boxes)
        chunks = staged.chunks = template.chunks(staged)
        data = slot.buffer.narrow(0, 0, staged.layout.total)
        return Snapshot(staged.step, self.rank, world, data, chunks, frozen_end, {"timings": {"stage_s": round(staged.seconds, 6)}})

    async def put(self, snap: Snapshot) -> dict[str, Any]:
        staged = self._by_step.get(snap.step)
        if staged is None or snap.rank != self.rank:
            raise CheckpointError(f"step {snap.step} is not staged in this RAM tier (rank {self.rank})")
        return {"rank": self.rank, "world_size": snap.world, "host": socket.gethostname(), "pid": os.getpid(),
                "bytes": snap.nbytes, "written_bytes": 0, "chunks": snap.chunks, "timings": snap.meta.get("timings", {})}

    async def commit(self, step: int, manifest: Manifest | None = None, *, save_id: str | None = None,
                     own: dict[str, Any] | None = None) -> None:
        """Publish the staged ``step``: with the step's whole ``manifest`` (a document of minor
        version 0), or with ``own``, this rank's part, the step's meta and its structure's header
        (:func:`node_extra`, minor version 1). ``save_id``, when the ranks agreed one, names this
        save of the step in every rank's document alike (what a node agent matches)."""
        staged = self._by_step.pop(step, None)
        if staged is None:
            raise CheckpointError(f"step {step} is not staged in this RAM tier (rank {self.rank}), or its slot was reused")
        if manifest is not None:
            await self._publish(staged, None, {"manifest": manifest.to_json_bytes().decode()}, save_id)
        else:
            assert own is not None
            await self._publish(staged, None, own, save_id, minor=RAM_MINOR)

    def _docs(self, rank: int) -> list[dict[str, Any]]:
        """Committed snapshots of ``rank`` of this job in ram_dir (any rank on this node), whose
        documents also say they are that slot's: the slots this rank reuses and lists."""
        docs = []
        for seg, path, doc in scan(self.job, self.ram_dir):
            if seg.src is not None or seg.rank != rank:
                continue
            if doc.get("job") != self.job or doc.get("rank") != rank or doc.get("slot") != seg.slot:
                _warn_once(path, f"ckptstore: ignoring the RAM copy {path}: its manifest is not one of this job's")
                continue
            docs.append(doc)
        return docs

    async def steps(self) -> list[int]:
        return sorted({d["step"] for d in self._docs(self.rank)})

    async def manifest(self, step: int) -> Manifest:
        """The step's manifest: the whole one an older document holds, or the one this node's
        documents of the step assemble (every rank's part on this node: a single-node job)."""
        for doc in self._docs(self.rank):
            if doc["step"] == step:
                if doc_part(doc, self.display(step)) is None:
                    return parse_manifest(doc["extra"]["manifest"].encode(), where=self.display(step))
                return manifest_of_parts(self.holdings(step).parts, self.display(step))
        raise CheckpointNotFoundError(f"{self.display(step)}: no committed snapshot of this step")

    def opener(self, step: int) -> Callable[[str | None], Source]:
        def open_file(rel: str | None) -> Source:
            rank = data_file_rank(rel)
            if rank is None:
                raise CorruptCheckpointError(f"{self.display(step)}: chunk file {rel!r} is not a RAM-tier data file")
            for doc in self._docs(rank):
                if doc["step"] == step:
                    path = self._name(doc["slot"], "bin", rank)
                    return SegmentSource(path, path)
            raise CheckpointNotFoundError(f"{self.display(step)}: rank {rank}'s snapshot is not in {self.ram_dir} on this node")

        return open_file

    def holdings(self, step: int) -> Holdings:
        """Every rank's committed slot of ``step`` in this node's ram_dir."""
        return segment_holdings(self.job, self.ram_dir, step, replicas=False, rank=self.rank)

    def node_steps(self) -> set[int]:
        return {doc["step"] for seg, _path, doc in scan(self.job, self.ram_dir) if seg.src is None}

    async def remove(self, step: int) -> None:
        for doc in self._docs(self.rank):
            if doc["step"] == step:
                remove_file(self._name(doc["slot"], "json"))
        self._find_newest()

    def display(self, step: int) -> str:
        return f"RAM tier {self.ram_dir} (job {self.job}, step {step})"

    def stop_preparing(self) -> None:
        """Withdraw the mappings prepare() has not started and wait for the one under way, unmapping
        what they made: after this, no thread of this tier creates a segment (what a close that
        removes segments relies on)."""
        for index in list(self._preparing):
            self._drop_prepared(index)

    def close(self, *, unlink: bool = False) -> None:
        self.stop_preparing()
        for index, slot in self._slots.items():
            slot.release()
            if unlink:
                remove_file(self._name(index, "bin"))
                remove_file(self._name(index, "json"))
        self._slots.clear()


def owner_record() -> dict[str, Any]:
    """Who committed a segment, as a document records it: the process id with its start time (a
    pid alone may have been reused by another process since) and the host."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:  # this process's start time is read once (a fork: again)
        _own_start = (pid, process_start(pid))
    return {"pid": pid, "start": _own_start[1], "host": socket.gethostname()}


_own_start: tuple[int, int | None] | None = None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, /proc/<pid>/stat), or None when there
    is no such live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if len(fields) < 20 or fields[0] == b"Z":
        return None
    return int(fields[19])


def lower_record(local: str | os.PathLike[str] | None = None, durable: str | None = None) -> dict[str, str | None]:
    """The lower tiers of a store as a segment's document records them: the local directory as an
    absolute path, the durable URL without any user or password in it."""
    return {"local": os.path.realpath(local) if local is not None else None,
            "durable": _without_credentials(durable) if durable is not None else None}


def _without_credentials(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return os.path.abspath(url)
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{path}"


_warned: set[tuple[str, str]] = set()


def _warn_once(path: str, message: str) -> None:
    """Inventories list the segments at every save and restore: each damaged copy is named once."""
    if (path, message) not in _warned:
        _warned.add((path, message))
        logging.getLogger("ckptstore").warning("%s", message)


async def write_doc(path: str, doc: dict[str, Any]) -> None:
    """A RAM-tier document, published by rename after its bytes (tmpfs: no fsync): its small
    members first, with the head of :func:`_document`, and its members of a rank's size after."""
    small = {k: v for k, v in doc.items() if k not in _BODY}
    extra = doc.get("extra")
    if doc.get("minor") and isinstance(extra, dict) and isinstance(extra.get("meta"), dict) and "meta" not in small:
        small["meta"] = extra["meta"]
    await write_encoded(path, _document(small, [(k, [_compact(doc[k]).encode()]) for k in _BODY if k in doc]))


async def write_encoded(path: str, data: bytes | list[bytes]) -> None:
    """:func:`write_doc` of a document already encoded (compact JSON), whole or in pieces."""
    await small.write(Target(display=path, path=path), data, tmp=document_temporary(path), durable=False)


def _compact(obj: Any) -> str:
    """The JSON text of every RAM-tier document, and of each member encoded apart: compact, ASCII."""
    return json.dumps(obj, separators=(",", ":"))


# JSON's own encoding of a string (ASCII, as _compact's), and of a list of ints, for texts formatted
# without building their objects.
_string = json.encoder.encode_basestring_ascii


def _ints(values: Any) -> str:
    return "[" + ",".join(map(int.__repr__, values)) + "]"


# A hole in a document's skeleton (see _spliced): no member of a document holds a NUL character
# (job names, paths, host names and digests cannot), so its JSON text appears nowhere else.
_HOLE = "\x00ckptstore-hole\x00"
_HOLE_TEXT = _compact(_HOLE).encode()


def _spliced(skeleton: Any, fills: list[list[bytes]]) -> list[bytes] | None:
    """The compact JSON of ``skeleton`` with its holes, in the order they appear in the text, filled
    with the JSON texts ``fills`` (each in pieces), as pieces to join: the same text as encoding the
    skeleton with the fills' objects in place of its holes, without copying the fills into a string
    first. None when the text holds more or fewer holes than ``fills``."""
    pieces = _compact(skeleton).encode().split(_HOLE_TEXT)
    if len(pieces) != len(fills) + 1:
        return None
    out = [pieces[0]]
    for fill, piece in zip(fills, pieces[1:]):
        out += fill
        out.append(piece)
    return out


# A document's members of a rank's size, in the order written: each holds an entry per tensor (a
# whole manifest: an entry per tensor of the job). Every other member is small.
_BODY = ("layout", "checksums", "extra")
# A document begins with its format and then its head, ``"<H>:<N>:<xxh3>:<L>:<C>:<E>"``: H (10
# digits) the length of the text of its small members (from the opening brace, up to the comma
# before the first member of _BODY), N (12 digits) the length of the whole file, the xxh3 (16 hex
# digits) of the text from H on, and where the members of _BODY begin (12 digits each, at the comma
# before the member's name; 0 for one the document lacks). Fixed width, so the writer fills it in
# after the rest is encoded, and a reader finds any one member without parsing the others.
_HEAD_START = b'{"format":' + json.dumps(RAM_FORMAT).encode() + b',"head":"'
_HEAD_WIDTH = 10 + 1 + 12 + 1 + 16 + 13 * len(_BODY)
_HEAD_BLANK = "0" * _HEAD_WIDTH
# How much of a document a listing reads first; a longer head is read on to its end, up to the cap.
_HEAD_READ = 4096
_HEAD_MAX = 1 << 20


def _document(small: dict[str, Any], body: list[tuple[str, list[bytes]]]) -> list[bytes]:
    """The text of a RAM-tier document, in pieces: the compact JSON of ``small`` (``format`` first,
    then the head) followed by the members of ``body`` (name, JSON text in pieces; names of _BODY,
    in its order). The text is ``_compact`` of the document's object, byte for byte; only the
    head's values depend on the rest. A listing parses the small members alone, and a restore the
    one member it needs (:class:`LazyDoc`): every rank of a node lists every document of the node,
    and parsing whole documents of 10,000 tensors was most of a restore."""
    members = {"format": small.get("format"), "head": _HEAD_BLANK,
               **{k: v for k, v in small.items() if k not in ("format", "head")}}
    text = _compact(members).encode()
    names = [key for key, _fill in body]
    if not text.startswith(_HEAD_START) or not body or names != [k for k in _BODY if k in names]:
        # Not a document of this format (or nothing to leave out): no head, read whole.
        del members["head"]
        pieces = [_compact(members).encode()[:-1]]
        for i, (key, fill) in enumerate(body):
            pieces.append(("," if len(members) or i else "").encode() + _string(key).encode() + b":")
            pieces += fill
        return pieces + [b"}"]
    prefix = text[:-1]
    rest: list[bytes] = []
    at = len(prefix)
    starts = dict.fromkeys(_BODY, 0)
    for key, fill in body:
        starts[key] = at
        rest.append(b"," + _string(key).encode() + b":")
        rest += fill
        at += len(rest[-1 - len(fill)]) + sum(map(len, fill))
    rest.append(b"}")
    hasher = xxhash.xxh3_64()
    for piece in rest:
        hasher.update(piece)
    total = at + 1
    head = (f"{len(prefix):010d}:{total:012d}:{hasher.hexdigest()}" + "".join(f":{starts[k]:012d}" for k in _BODY)).encode()
    assert len(head) == _HEAD_WIDTH
    start = len(_HEAD_START)
    return [prefix[:start] + head + prefix[start + _HEAD_WIDTH :], *rest]


# The JSON text after a chunk's (or a checksums entry's) checksum when it has no block checksums.
_CHUNK_TAIL = '","block_size":null,"block_checksums":null}]'
_SUMS_TAIL = '"}'


class _Template:
    """What a rank's chunk table and document hold of one structure (its layout and boxes), built
    once: per entry, the chunk's members but its checksums (a dict that each save copies), and the
    JSON text of its chunk table and of its ``checksums`` entry up to the checksum. A save fills in
    only its checksums: no per-entry objects to encode, and the text is what encoding the objects
    would give (tests/test_ram_doc.py holds the two to each other)."""

    def __init__(self, layout: Layout, boxes: dict[str, tuple[int, ...]], file: str) -> None:
        self.layout, self.boxes, self.nboxes = layout, boxes, len(boxes)
        # Keys repeated in a layout would be one key of the table: such a layout is encoded whole.
        self.usable = len(set(layout.keys)) == len(layout.keys)
        self.bases: list[dict[str, Any] | None] = []
        self.chunk_heads: list[str] = []
        self.sums_heads: list[str] = []
        self.chunk_tails: list[str] = []
        self.empty: list[int] = []
        quoted = _string(file)
        for i, e in enumerate(layout.entries):
            key = ("," if i else "") + _string(e.key) + ":"
            self.sums_heads.append(key + '{"checksum":"')
            if not e.nbytes and e.shape:
                self.bases.append(None)
                self.chunk_heads.append(key + "[]")
                self.chunk_tails.append("")
                self.empty.append(i)
                continue
            offsets, sizes = list(boxes.get(e.key, (0,) * len(e.shape))), list(e.shape)
            self.bases.append({"offsets": offsets, "sizes": sizes, "file": file, "offset": e.offset, "length": e.nbytes,
                               "codec": "raw", "checksum": None, "block_size": None, "block_checksums": None})
            self.chunk_heads.append(f'{key}[{{"offsets":{_ints(offsets)},"sizes":{_ints(sizes)},"file":{quoted},'
                                    f'"offset":{e.offset},"length":{e.nbytes},"codec":"raw","checksum":"')
            self.chunk_tails.append(_CHUNK_TAIL)

    def chunks(self, staged: Staged) -> dict[str, list[dict[str, Any]]]:
        """The chunk table of ``staged`` (after RamTier.checksums): each entry's one chunk, or none."""
        assert staged.digests is not None
        if not self.empty:
            # Each entry's chunk, its base's copy with this save's checksum, by map: no bytecode per
            # entry (a third less than a loop at 10,000 entries). Every save gets new dicts: a
            # promotion of an earlier step may still read that step's.
            copies = list(map(dict.copy, self.bases))  # type: ignore[arg-type]
            list(map(operator.setitem, copies, itertools.repeat("checksum"), staged.digests))
            table = dict(zip(self.layout.keys, map(list, zip(copies))))
        else:
            table = {}
            for key, base, digest in zip(self.layout.keys, self.bases, staged.digests):
                if base is None:
                    table[key] = []
                else:
                    chunk = base.copy()
                    chunk["checksum"] = digest
                    table[key] = [chunk]
        for i in staged.blocked:
            key = self.layout.keys[i]
            sums = staged.block_entry(i)
            chunk = table[key][0]
            chunk["block_size"], chunk["block_checksums"] = sums["block_size"], sums["block_checksums"]
        return table

    def chunks_text(self, staged: Staged) -> bytes:
        """The JSON text of :meth:`chunks` of ``staged``."""
        tails = self.chunk_tails
        if staged.blocked:
            tails = list(tails)
            for i in staged.blocked:
                tails[i] = '",' + self._blocks(staged, i) + "}]"
        return self._filled(self.chunk_heads, staged, tails, self.empty)

    def sums_text(self, staged: Staged) -> bytes:
        """The JSON text of ``staged.sums`` (its entries in the layout's order, as RamTier.checksums made them)."""
        tails = [_SUMS_TAIL] * len(self.sums_heads)
        for i in staged.blocked:
            tails[i] = '",' + self._blocks(staged, i) + "}"
        return self._filled(self.sums_heads, staged, tails, ())

    def _blocks(self, staged: Staged, i: int) -> str:
        """The text of an entry's block members (what follows its checksum, braces cut off)."""
        sums = staged.block_entry(i)
        return _compact({"block_size": sums["block_size"], "block_checksums": sums["block_checksums"]})[1:-1]

    @staticmethod
    def _filled(heads: list[str], staged: Staged, tails: list[str], empty: Any) -> bytes:
        assert staged.digests is not None
        n = len(heads)
        if not n:
            return b"{}"
        pieces = [""] * (3 * n)
        pieces[0::3] = heads
        pieces[1::3] = staged.digests
        pieces[2::3] = tails
        for i in empty:
            pieces[3 * i + 1] = ""
        pieces[0] = "{" + pieces[0]
        pieces.append("}")
        return "".join(pieces).encode()


# Documents scan() read, by path, with the identity of the file they were read from. A document
# is published by rename (a new file) and never written in place, so a file with the same device,
# inode, size and modification time holds the same bytes; every save and restore lists the
# segments several times. Kept per directory, so that a listing prunes the documents of its own
# directory only: a process holding several nodes' directories (a test, a harness of thread-ranks)
# must not make each listing cost the documents of every node.
_parsed_docs: dict[str, dict[str, tuple[tuple[int, int, int, int], dict[str, Any]]]] = {}


def _cached_docs() -> int:
    return sum(len(docs) for docs in list(_parsed_docs.values()))


def read_doc(path: str, *, cached: bool = False) -> dict[str, Any]:
    """A RAM-tier document (own slot or peer replica): never through a symbolic link, never larger
    than the manifest cap, always a JSON object. Raises OSError or CorruptCheckpointError.
    A document with a head (:func:`_document`) whose lengths match the file is read up to the end
    of its small members: a :class:`LazyDoc`, which reads and checks the rest on first use of it.
    Any other (an older writer's, one rewritten by hand, one cut short) is parsed whole, as before.
    ``cached``: the document as read before when the file is still the one read then (the caller
    treats it as read-only)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        size = st.st_size
        identity = (st.st_dev, st.st_ino, size, st.st_mtime_ns)
        where, name = os.path.split(path)
        seen = _parsed_docs.get(where, {}).get(name) if cached else None
        if seen is not None and seen[0] == identity:
            return seen[1]
        check_manifest_size(size, where=path)
        doc: dict[str, Any] | None = _read_head(fd, size, path, identity)
        if doc is None:
            doc = _parse_whole(_read_all(fd, size, 0), path)
    finally:
        os.close(fd)
    if cached:
        _parsed_docs.setdefault(where, {})[name] = (identity, doc)
    return doc


def _read_all(fd: int, size: int, offset: int) -> bytes:
    chunks, left = [], size - offset
    while left > 0:
        piece = os.pread(fd, left, offset)
        if not piece:
            break
        chunks.append(piece)
        left -= len(piece)
        offset += len(piece)
    return b"".join(chunks)


# Bytes of RAM-tier documents handed to the JSON parser in this process (whole documents read the
# old way, and members of documents read through their head): what a restore's reading of documents
# costs, which the tests hold to the rank's own document as the node's ranks and steps grow.
parsed_bytes = 0


def _parse_whole(data: bytes, path: str) -> dict[str, Any]:
    global parsed_bytes
    parsed_bytes += len(data)
    with paused():  # its objects would set off collections that walk every live object
        doc = load_json(data, where=path, what="RAM-tier document")
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: a RAM-tier document must be a JSON object", location=path)
    return doc


def _parse_member(text: bytes, path: str) -> Any:
    """One member's value from a document whose bytes matched its head's checksum. The writer's
    text is compact JSON as json.dumps makes it: parsed by the C decoder and encoded back, it is
    the same text exactly when it holds no duplicate member names (a duplicate would be lost) and
    no NaN or Infinity (refused by the parse); a text that is not (edited by hand, or by another
    writer) is parsed with every rule of load_json, whose per-object check costs twice the parse."""
    global parsed_bytes
    parsed_bytes += len(text)
    with paused():  # its objects would set off collections that walk every live object
        try:
            value = json.loads(text, parse_constant=_refuse_constant)
            if _compact(value).encode() == text:
                return value
        except (UnicodeDecodeError, ValueError, RecursionError):
            pass
        return load_json(text, where=path, what="RAM-tier document")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _read_head(fd: int, size: int, path: str, identity: tuple[int, int, int, int]) -> LazyDoc | None:
    """The small members of the document open at ``fd`` as a :class:`LazyDoc`, when it begins with
    a head whose lengths match the file; None otherwise (the caller parses it whole)."""
    first = os.pread(fd, min(size, _HEAD_READ), 0)
    start = len(_HEAD_START)
    if not first.startswith(_HEAD_START) or first[start + _HEAD_WIDTH : start + _HEAD_WIDTH + 1] != b'"':
        return None
    raw = first[start : start + _HEAD_WIDTH]
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    fields = text.split(":")
    widths = [10, 12, 16] + [12] * len(_BODY)
    if [len(f) for f in fields] != widths or not all(f.isdigit() for i, f in enumerate(fields) if i != 2):
        return None
    if any(c not in "0123456789abcdef" for c in fields[2]):
        return None
    end, total, starts = int(fields[0]), int(fields[1]), [int(f) for f in fields[3:]]
    # A file of another length than its head says (cut short, or grown) is parsed whole, and found
    # damaged there: never taken as committed on the strength of its head.
    if total != size or not start + _HEAD_WIDTH < end < size or end > _HEAD_MAX:
        return None
    present = [(k, at) for k, at in zip(_BODY, starts) if at]
    if not present or present[0][1] != end or any(a >= b for (_k, a), (_l, b) in zip(present, present[1:])):
        return None
    if present[-1][1] >= size - 1:
        return None
    prefix = first[:end] if end <= len(first) else first + _read_all(fd, end, len(first))
    if len(prefix) != end or os.pread(fd, 2, end) != b',"':
        return None
    try:
        small = load_json(prefix + b"}", where=path, what="RAM-tier document")
    except CorruptCheckpointError:
        return None
    if not isinstance(small, dict) or small.get("head") != text or any(k in small for k in _BODY):
        return None
    spans = {k: (at, nxt) for (k, at), nxt in zip(present, [at for _k, at in present[1:]] + [size - 1])}
    return LazyDoc(small, path, identity, end, f"{ALGORITHM}:{fields[2]}", spans)


class LazyDoc(dict):  # type: ignore[type-arg]
    """A RAM-tier document of which only the small members are read (step, slot, size, owner,
    meta, ...): each member of a rank's size (``layout``, ``checksums``, ``extra``) is read, checked
    against the head's checksum and parsed on its first use, which raises CorruptCheckpointError
    when the file no longer holds the bytes its head describes (damaged, or replaced since it was
    listed). Read-only, like every document read_doc hands out; ``whole`` once every member is."""

    def __init__(self, small: dict[str, Any], path: str, identity: tuple[int, int, int, int], end: int,
                 checksum: str, spans: dict[str, tuple[int, int]]) -> None:
        super().__init__(small)
        self.path, self.identity, self.end, self.checksum, self.spans = path, identity, end, checksum, spans
        self.whole = False
        self.part: NodePart | None = None  # doc_part's, once checked

    def _body(self) -> bytes:
        """The document's bytes, as its head describes them."""
        path = self.path
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self.identity:
                raise CorruptCheckpointError(f"{path}: the RAM-tier document was replaced since it was listed",
                                             location=path)
            data = _read_all(fd, st.st_size, 0)
        finally:
            os.close(fd)
        digest = f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(memoryview(data)[self.end:])}"
        if len(data) != self.identity[2] or digest != self.checksum:
            raise CorruptCheckpointError(f"{path}: the RAM-tier document does not match its checksum (its head's)",
                                         location=path)
        return data

    def read(self, *keys: str) -> None:
        """Read and parse the members ``keys`` of _BODY (all of them: none given) not read yet."""
        todo = [k for k in (keys or _BODY) if k in self.spans and not dict.__contains__(self, k)]
        if todo:
            data = self._body()
            for key in todo:
                a, b = self.spans[key]
                name = b"," + _string(key).encode() + b":"
                if data[a : a + len(name)] != name:
                    raise CorruptCheckpointError(f"{self.path}: the RAM-tier document's member {key!r} is not where its "
                                                 "head says", location=self.path)
                dict.__setitem__(self, key, _parse_member(data[a + len(name) : b], self.path))
        self.whole = all(dict.__contains__(self, k) for k in self.spans)

    def __missing__(self, key: str) -> Any:
        if key in self.spans:
            self.read(key)
            return dict.__getitem__(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key in self.spans:
            self.read(key)
        return dict.get(self, key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.spans or dict.__contains__(self, key)

    def __bool__(self) -> bool:
        return True  # never empty: its head is read

    def __iter__(self) -> Any:
        self.read()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self.read()
        return dict.__len__(self)

    def keys(self) -> Any:
        self.read()
        return dict.keys(self)

    def items(self) -> Any:
        self.read()
        return dict.items(self)

    def values(self) -> Any:
        self.read()
        return dict.values(self)

    def copy(self) -> dict[str, Any]:
        self.read()
        return dict(dict.items(self))


def usable_doc(doc: dict[str, Any]) -> bool:
    """Whether a RAM-tier document has the members a restore relies on, of the right types (a
    document that fails this is skipped like a missing one: restore uses another copy). Both
    minor versions: the whole manifest (0), or the own part, meta and header (1)."""
    if not (doc.get("format") == RAM_FORMAT and type(doc.get("step")) is int and doc["step"] >= 0
            and type(doc.get("size")) is int and doc["size"] >= 0):
        return False
    minor = doc.get("minor", 0)
    if isinstance(doc, LazyDoc) and not dict.__contains__(doc, "extra"):
        # Its head vouches for the rest, as the writer encoded it (checked when it is read): the
        # small members are what a listing relies on.
        meta = doc.get("meta")
        return minor == 0 or (minor == RAM_MINOR and (meta is None or (
            isinstance(meta, dict) and type(meta.get("world_size")) is int and meta.get("step") == doc["step"])))
    extra = doc.get("extra")
    if not isinstance(extra, dict):
        return False
    if minor == 0:
        return isinstance(extra.get("manifest"), str)
    part, meta, header = extra.get("part"), extra.get("meta"), extra.get("header")
    return (minor == RAM_MINOR and isinstance(part, dict) and type(part.get("rank")) is int
            and isinstance(part.get("chunks"), dict) and isinstance(meta, dict)
            and type(meta.get("world_size")) is int and meta.get("step") == doc["step"]
            and (header is None or (isinstance(header, dict) and isinstance(header.get("tensors"), dict))))


def node_extra(part: dict[str, Any], meta: dict[str, Any], header: dict[str, Any] | None) -> dict[str, Any]:
    """What a document of minor version 1 carries in ``extra``: a rank's own part, the step's
    meta and the header of the rank's structure."""
    extra = {"part": part, "meta": meta}
    if header:
        extra["header"] = header
    return extra


def whole_manifest_doc(doc: dict[str, Any], manifest: Manifest) -> dict[str, Any]:
    """``doc`` as a store before minor version 1 wrote it: the step's whole ``manifest`` in
    ``extra.manifest``, no ``minor`` (what a restore must still read after an upgrade)."""
    old = {k: v for k, v in doc.items() if k not in ("minor", "head", "meta")}
    old["extra"] = {"manifest": manifest.to_json_bytes().decode()}
    return old


def extra_checksum(extra: dict[str, Any]) -> str:
    """The checksum a document of minor version 1 keeps of its ``extra`` (a whole manifest has its
    own): over its compact JSON, which a parsed document reproduces (JSON objects keep their order)."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(json.dumps(extra, separators=(',', ':')).encode())}"


# Parts already checked, by the parsed document they came from (held here, so its id is not
# reused while listed): read_doc hands back the same object while its file is unchanged, and
# callers treat it as read-only. A restore lists the RAM tier twice (its inventory, then the
# restored step's meta), and re-encoding a part to check it again cost 1.4 ms each time at 144
# tensors, on the restore's critical path.
_checked_parts: dict[int, tuple[dict[str, Any], str, NodePart]] = {}


def doc_part(doc: dict[str, Any], where: str) -> NodePart | None:
    """The part a document of minor version 1 holds (None for a whole-manifest document). Raises
    CorruptCheckpointError when it does not match its checksum."""
    if doc.get("minor", 0) == 0:
        return None
    lazy = doc if isinstance(doc, LazyDoc) else None
    if lazy is not None and lazy.part is not None and lazy.part.where == where:
        return lazy.part
    checked = _checked_parts.get(id(doc))
    if lazy is None and checked is not None and checked[0] is doc and checked[1] == where:
        return checked[2]
    extra = doc["extra"]  # a LazyDoc reads the rest here, checked against its head's checksum
    # A document read through its head matched the checksum of the very text its extra checksum
    # was computed over: re-encoding a part of 10,000 tensors to check it again would add nothing.
    if lazy is None and doc.get("extra_checksum") != extra_checksum(extra):
        raise CorruptCheckpointError(f"{where}: the part this RAM-tier document holds does not match its checksum",
                                     location=where)
    if lazy is not None and not usable_doc(doc):
        raise CorruptCheckpointError(f"{where}: this RAM-tier document lacks what a restore relies on", location=where)
    if lazy is not None and "meta" in doc and doc["meta"] != extra["meta"]:
        raise CorruptCheckpointError(f"{where}: the meta of this RAM-tier document's head differs from its part's",
                                     location=where)
    part = NodePart(extra["part"]["rank"], extra["part"], extra["meta"], extra.get("header"), where)
    if lazy is not None:
        lazy.part = part
        return part
    if len(_checked_parts) > 2 * _cached_docs() + 16:  # keep only documents still listed
        live = {id(d) for docs in list(_parsed_docs.values()) for _identity, d in list(docs.values())}
        for key in [k for k in list(_checked_parts) if k not in live]:
            _checked_parts.pop(key, None)
    _checked_parts[id(doc)] = (doc, where, part)
    return part


def scan(job: str, ram_dir: str) -> list[tuple[Segment, str, dict[str, Any]]]:
    """The committed segments of ``job`` in ``ram_dir`` (every rank's slots and replicas): each
    with its parsed name, its document's path, and the document. A document that cannot be read,
    lacks what a restore relies on, or whose segment is missing or of another size is named once
    in a warning and passed over (a restore uses another copy). Segments are always found by the
    document's own file name, never by what the document says, so a tampered slot or rank field
    can point a reader nowhere else."""
    try:
        names = sorted(os.listdir(ram_dir))
    except OSError:
        return []
    present = set(names)
    cached = _parsed_docs.get(os.path.dirname(os.path.join(ram_dir, "x")), {})  # read_doc's key for this directory
    for name in list(cached):  # a copy: other threads list segments too
        if name not in present:
            cached.pop(name, None)
    out = []
    for name in names:
        seg = parse_segment(name)
        if seg is None or seg.job != job or seg.ext != "json":
            continue
        path = os.path.join(ram_dir, name)
        try:
            doc = read_doc(path, cached=True)
        except FileNotFoundError:
            continue  # being rewritten
        except (OSError, CorruptCheckpointError) as exc:
            _warn_once(path, f"ckptstore: ignoring the RAM copy {path}: its manifest is unreadable ({exc})")
            continue
        if not usable_doc(doc):
            _warn_once(path, f"ckptstore: ignoring the RAM copy {path}: its manifest is not one of this job's")
            continue
        bin_path = path[:-5] + ".bin"
        size = os.path.getsize(bin_path) if os.path.exists(bin_path) and not os.path.islink(bin_path) else None
        if size != doc["size"]:
            why = "it is missing" if size is None else f"it holds {size} bytes, its manifest says {doc['size']}"
            _warn_once(path, f"ckptstore: ignoring the RAM copy of step {doc['step']} in {bin_path}: {why}")
            continue
        out.append((seg, path, doc))
    return out


def segment_holdings(job: str, ram_dir: str, step: int, *, replicas: bool, rank: int | None = None) -> Holdings:
    """What the segments of ``job`` in ``ram_dir`` hold of ``step``: every rank's own slots, or
    (``replicas``) the replicas ranks of this node received from other nodes.

    ``rank``: the rank asking, whose own slot's part is read and checked here (a damaged one is
    listed in ``damaged``); every other document read through its head holds a :class:`LazyPart`,
    read when a restore needs it (a rank's load needs its own part; another rank's only where its
    node lacks it, or for a resharded load), so what a listing reads grows with the rank's own
    bytes, not with the node's ranks."""
    held = Holdings()
    tier = "peer" if replicas else "ram"
    for seg, path, doc in scan(job, ram_dir):
        if (seg.src is not None) != replicas or doc["step"] != step:
            continue
        bin_path = path[:-5] + ".bin"
        if (isinstance(doc, LazyDoc) and doc.part is None and doc.get("minor", 0) == RAM_MINOR
                and (replicas or seg.rank != rank)):
            held.files.append(Held(data_file(seg.owner), bin_path, tier, _opener(bin_path), manifest=path))
            meta = doc.get("meta")
            held.parts.append(LazyPart(seg.owner, doc, path, meta if isinstance(meta, dict) else None))
            continue
        try:
            own = doc_part(doc, path)
        except CorruptCheckpointError as exc:
            logging.getLogger("ckptstore").warning("ckptstore: ignoring a damaged copy of a part: %s", exc)
            held.damaged.append(path)
            continue
        if own is not None and own.rank != seg.owner:
            _warn_once(path, f"ckptstore: ignoring the RAM copy {path}: its part is rank {own.rank}'s, its name "
                             f"says rank {seg.owner}'s")
            continue
        held.files.append(Held(data_file(seg.owner), bin_path, tier, _opener(bin_path), manifest=path))
        if own is not None:
            held.parts.append(own)
        else:
            held.manifests.append((doc["extra"]["manifest"].encode(), path))
    return held


class LazyPart(NodePart):
    """Another rank's part in a document read through its head: its rank and the step's meta (the
    head's copy) at hand, its chunk table and header read from the document on first use. Raises
    CorruptCheckpointError there when the document is damaged, replaced, or holds another rank's
    part (what a listing that parsed it whole would have found at once)."""

    _doc: LazyDoc
    _meta: dict[str, Any] | None

    def __init__(self, rank: int, doc: LazyDoc, where: str, meta: dict[str, Any] | None) -> None:
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "where", where)
        object.__setattr__(self, "_doc", doc)
        object.__setattr__(self, "_meta", meta)

    def loaded(self) -> NodePart:
        """The part as the document holds it, read and checked (once)."""
        own = doc_part(self._doc, self.where)
        if own is None or own.rank != self.rank:
            raise CorruptCheckpointError(f"{self.where}: the RAM-tier document holds no part of rank {self.rank}",
                                         location=self.where)
        return own

    @property  # type: ignore[misc]
    def part(self) -> dict[str, Any]:  # type: ignore[override]
        return self.loaded().part

    @property  # type: ignore[misc]
    def header(self) -> dict[str, Any] | None:  # type: ignore[override]
        return self.loaded().header

    @property  # type: ignore[misc]
    def meta(self) -> dict[str, Any]:  # type: ignore[override]
        return self._meta if self._meta is not None else self.loaded().meta

    def __repr__(self) -> str:
        return f"LazyPart(rank={self.rank}, where={self.where!r})"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _reserved_size(path: str) -> int | None:
    """The size of the segment at ``path`` when it is a regular file of this user with every page
    reserved (mapping it then takes no memory it does not hold already); None otherwise."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not st.st_size:
        return None
    return st.st_size if st.st_blocks * 512 >= st.st_size else None


def _prepare_slots(todo: list[tuple[int, str, int, Future[Slot | None]]], nice: int = 0) -> None:
    """prepare()'s thread: map each slot in turn, unless its save withdrew it first. Zeroing and
    mapping hundreds of MiB is background work like the rest: at ``nice`` below the trainer."""
    lower_priority(nice)
    for _index, path, size, future in todo:
        if not future.set_running_or_notify_cancel():
            continue
        try:
            made = not os.path.lexists(path)
            slot: Slot | None = Slot(path, size)
            slot.made_ahead = made  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the save that needs the slot makes it and reports
            logging.getLogger("ckptstore").debug("ckptstore: cannot prepare the RAM-tier slot %s: %s", path, exc)
            slot = None
        future.set_result(slot)


def _opener(path: str) -> Callable[[], Source]:
    return lambda: SegmentSource(path, path)


# The segments this process has mapped (its own staging slots), by file identity. A restore that
# reads one of them copies from the mapping, which is page-locked where CUDA is present, instead of
# reading the file through a buffer of its own: on a GPU that buffer and its second copy made a
# restore from RAM 22x the host-to-device floor.
_mapped: weakref.WeakValueDictionary[tuple[int, int], Slot] = weakref.WeakValueDictionary()


class SegmentSource(LocalSource):
    """A RAM-tier segment (a slot or a peer replica) opened for reading. Its bytes are read with
    ``pread`` like any file, or, when this process has the same file mapped as a staging slot
    (the identity of the open descriptor, so a segment replaced since is never mistaken for it),
    taken from that mapping (:meth:`memory`)."""

    def memory(self) -> torch.Tensor | None:
        st = os.fstat(self.fd)
        slot = _mapped.get((st.st_dev, st.st_ino))
        if slot is None or slot.size < self.size or not slot.buffer.numel():
            return None
        return slot.buffer.narrow(0, 0, self.size)


def _entries(doc: dict[str, Any]) -> list[SlotEntry]:
    """The layout of a committed slot, each entry checked to lie inside the segment."""
    where = f"RAM snapshot of step {doc.get('step')!r}"
    try:
        size = doc["size"]
        entries = [SlotEntry(e["key"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"]) for e in doc["layout"]]
        for e in entries:
            ok = all(type(v) is int and v >= 0 for v in (size, e.offset, e.nbytes, *e.shape)) and type(e.key) is str
            if not ok or e.offset + e.nbytes > size:
                raise ValueError(f"entry {e.key!r} does not lie inside the {size}-byte segment")
            if e.nbytes != math.prod(e.shape) * dtype_from_name(e.dtype, where=where).itemsize:
                raise ValueError(f"entry {e.key!r}: {e.nbytes} bytes do not hold shape {list(e.shape)} of {e.dtype}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: malformed layout: {exc}") from None
    return entries


def _sample_matches(src: torch.Tensor, held: torch.Tensor, sampler: torch.Generator, key: str) -> bool:
    """Whether ``_SAMPLES`` elements of ``src``, at positions drawn afresh for this save, equal the
    slot's copy ``held`` bit for bit. A frozen tensor changed behind the version counter's back
    (through ``.data``, numpy, DLPack) is then copied, and named once in a warning."""
    if not src.is_contiguous():
        return True  # sampling would copy it first; the slot's periodic refresh covers it
    n = src.numel()
    index = torch.randint(0, n, (min(_SAMPLES, n),), generator=sampler)
    now = src.detach().reshape(-1)[index.to(src.device)].cpu()
    then = held.reshape(-1)[index]
    if torch.equal(now.view(torch.uint8), then.view(torch.uint8)):
        return True
    _warn_once(key, f"ckptstore: {key!r} is declared frozen but changed without its version counter moving "
                    "(a write through .data, numpy or DLPack): it is copied again at every save that sees it")
    return False


def _pin(buffer: torch.Tensor) -> bool:
    """Page-lock a shared-memory slot for the GPU (cudaHostRegister), so device-to-host copies
    into it run at full DMA speed and asynchronously. A refusal (locked-memory limits) leaves the
    slot pageable: slower copies, same bytes."""
    import logging

    rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if int(rc) != 0:
        logging.getLogger("ckptstore").warning("ckptstore: cannot pin the RAM-tier slot (cudaHostRegister: %s)", rc)
        return False
    return True


# Errors of a reservation that more memory (or a smaller snapshot) would cure; anything else
# (permissions, a planted link) is reported as it is and never falls back to private memory.
SHORTAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOMEM})


def shm_shortage(path: str, size: int, free: int | None, cause: str) -> StorageError:
    """The error of a segment that cannot be reserved: what, where and what to do."""
    directory = os.path.dirname(path) or "."
    have = f"{free} bytes ({_mib(free)}) are free there" if free is not None else "the space left is unknown"
    return StorageError(
        f"cannot reserve {size} bytes ({_mib(size)}) of shared memory for the RAM-tier segment {path}: {have} "
        f"({cause}). Give the job more shared memory (Docker: docker run --shm-size=<bytes>; Kubernetes: an "
        f"emptyDir with medium: Memory mounted on /dev/shm), or point ram_dir= at a larger tmpfs, or cap staging "
        f"with ram_budget_bytes= (one snapshot's size keeps a single slot), or pass ram_fallback='private' to "
        f"stage in this process's own memory (saves still reach the local and durable tiers, but no RAM copy "
        f"survives a crash for a same-node restore). Directory: {directory}",
        errno=errno.ENOSPC,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


_MADV_POPULATE_WRITE = 23  # Linux 5.14 on; older kernels refuse it with EINVAL
_PREFAULT_BYTES = 4 << 20  # a multiple of every page size


def _libc_madvise() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise() if sys.platform.startswith("linux") else None


def _prefault(mapping: mmap.mmap, size: int) -> None:
    """Map every page of a new mapping now: the first save into it otherwise takes a page fault per 4 KiB (256 MiB: 0.4-0.5 s of blocking, against 0.08 s here),
    which a restarted process pays again on segments that already hold their pages.

    Not with MAP_POPULATE: Python's mmap() holds the GIL through the call (0.5 s per GiB on an idle
    machine, seconds on a busy one), and the slots a restarted process maps in the background (and
    a replaced node's first replica buffer) then stopped its training thread for as long: in the
    crash loop, the step after the first save following a node loss took 5.7 s instead of 0.5 s.
    A foreign call through ctypes runs without the GIL; an older kernel gets a read of each page
    through torch, which also lets the GIL go.

    And a few MiB at a time: populating holds the process's address-space lock (mmap_lock) for
    reading, and a whole slot at once queued every mmap() of the process behind it (malloc maps
    each large block: the training step's activations), 0.28 s per GiB on an idle machine, seconds
    on a busy one. Per 4 MiB the longest such wait measured 0.02 s."""
    if size == 0:
        return
    if _madvise is not None:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the export ends with the statement
        done = 0
        while done < size and _madvise(address + done, min(_PREFAULT_BYTES, size - done), _MADV_POPULATE_WRITE) == 0:
            done += _PREFAULT_BYTES
        if done >= size:
            return
    pages = torch.frombuffer(mapping, dtype=torch.uint8)[:: mmap.PAGESIZE]
    pages.sum()  # one fault per page, each taking the lock on its own
    del pages


def _map_segment(path: str, size: int) -> tuple[mmap.mmap, tuple[int, int]]:
    """Open (or create) the segment at ``path``, reserve ``size`` bytes of it and map it shared;
    returns the mapping and the file's identity (st_dev, st_ino)."""
    # ram_dir is usually /dev/shm, writable by every user: never follow a link planted under
    # our name (the staged bytes would go wherever it points), never use another user's file.
    created = not os.path.lexists(path)
    fd = small.open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise CheckpointError(
                f"{path} belongs to user {st.st_uid}, not to this process's user {os.geteuid()}; refusing to use it "
                "as a staging segment. Remove it, or choose another job name or ram_dir"
            )
        os.fchmod(fd, 0o600)  # an existing segment keeps owner-only access too
        if st.st_size > size:
            os.ftruncate(fd, size)  # shrink first: what is given back counts as free below
        try:
            _reserve(fd, path, size)
        except StorageError:
            if created:
                remove_file(path)  # a half-reserved new segment would hold on to the memory it got
            raise
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            _prefault(mapping, size)
        except BaseException:
            mapping.close()
            if created:
                remove_file(path)
            raise
        return mapping, (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def _reserve(fd: int, path: str, size: int) -> None:
    """Allocate every page of the segment now. A file sized by ftruncate alone is sparse: tmpfs
    supplies its pages at the first write into each, and one it cannot supply is a SIGBUS in the
    middle of a copy, which no handler can turn into an error."""
    if size == 0:
        return
    st = os.fstat(fd)
    held = st.st_blocks * 512  # the pages this file already has (an existing, reserved segment: all)
    free: int | None = None
    try:
        vfs = os.fstatvfs(fd)
        free = vfs.f_bavail * vfs.f_frsize
    except OSError:
        pass
    if free is not None and size - held > free:
        raise shm_shortage(path, size, free, f"{size - held} more bytes are needed")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        code = exc.errno
        if code in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            # glibc emulates fallocate where the filesystem lacks it; a refusal that remains means
            # the memory cannot be reserved here, which is the failure SIGBUS would have been.
            raise shm_shortage(path, size, free, f"this filesystem cannot reserve space: {exc.strerror}") from None
        if code in SHORTAGE_ERRNOS:
            raise shm_shortage(path, size, free, f"posix_fallocate: {exc.strerror}") from None
        raise StorageError(f"cannot reserve {size} bytes for the RAM-tier segment {path}: {exc.strerror}", errno=code) from None


class _on:
    """``torch.cuda.stream(stream)`` when there is one, else nothing."""

    def __init__(self, stream: Any) -> None:
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def remove_file(path: str) -> None:
    """Remove a segment or document; one already gone is not an error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise CheckpointError(f"cannot remove {path}: {exc}") from None
