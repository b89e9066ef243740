"""Where a save goes: from the trainer's call into a RAM slot, through the background stages, into
every tier.

On the trainer's thread (:meth:`Pipeline.save`), the only part the training loop pays for:

1. *collect*: walk the state, decide which boxes this rank writes (frozen ones first, then the
   rest, then what only the replica check reads), and vote with every rank on the step, on
   failures (this rank's, and background ones not yet raised) and on a free slot: one all-reduce
   of a few integers while nothing differs, every rank's record gathered only when something does;
2. *stage*: wait until the next RAM slot is free, copy the state into it (``RamTier.stage``);
3. hand the step, a :class:`StepJob`, to the background loop and return a :class:`SaveHandle`.

On the background loop, one step after another (the *fast* lane):

4. *hash*: checksums of the staged copy, which every later copy of these bytes is checked against;
5. *RAM commit*: agree that every rank staged the step (one all-reduce), commit each rank's own
   part in its RAM tier and agree on that (a flag): from here on a crash leaves this step
   restorable from RAM (with the replica check on, every rank's part is gathered and each RAM
   document holds the step's whole manifest);
6. *local*: write each rank's bytes and node part to the local directory and agree that every
   write landed (in a single-node job the directory's owner then commits the whole manifest, and
   the ranks agree once more), apply retention.

A steady save's agreements (after the first save of a structure) are all-reduces of a few int64s
whose size does not depend on the number of ranks; only the durable coordinator receives every
rank's part summary (docs/architecture.md, "The control plane at scale").

Then, each in a lane of its own (a lane keeps one order of collectives on every rank, and neither
holds up the next step's RAM and local commits):

7. *peer*: replicate to ranks on other nodes (every ``peer_every``-th save), from the RAM commit on,
   beside the local write;
8. *durable*: promote to the durable URL (every ``durable_every``-th save, and the last one on
   close), reading the step's local files rather than its slot, then apply retention. A queued
   promotion that every rank has queued a newer one behind is dropped (an object store slower
   than the saves would otherwise fall further behind at every save).

A failure in a stage fails the step there and in the stages after it, reaches every rank's trainer
at its next ``save``, ``wait`` or ``close`` with its original class, and never touches the steps
committed before it. A failed replication only switches replication off for the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import logging
import secrets
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import torch

from .._aio import LoopThread
from .._faults import crashpoint
from .._gc import gc_paused, paused
from ..checkpoint.materialize import encode_value
from ..checkpoint.sharded import (
    BLOCK_SIZE,
    Collected,
    PerRank,
    Structure,
    agree_structure,
    box_alias,
    build_manifest,
    collect,
    merge_structures,
    my_writes,
    part_summary,
    parted_manifest,
    structure_digest,
)
from ..collective import Group, StoreGroups, agree_async, concur_async, concur_max_async, failure_record, settle
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RankFailure,
    StorageError,
    background_error,
    collective_error,
)
from ..format.container import align_up
from ..format.manifest import Manifest
from ..goodput.tracker import GoodputTracker
from ..planning.flatten import fingerprint
from ..storage import s3
from ..tiers.base import NodePart, Snapshot, Tier, shared_of_parts
from ..tiers.directory import DirectoryTier
from ..tiers.peer import PeerTier
from ..tiers.ram import Layout, RamTier, node_extra
from ..train_state import TrainState
from .job import StepJob
from .options import StoreOptions
from .replicas import ReplicaCheck
from .retention import Retention

log = logging.getLogger("ckptstore")
TIERS = ("ram", "local", "peer", "durable")


class SaveHandle:
    """The background progress of one save: wait for a tier, or ask whether it is done.

    ``step``; ``skipped`` (True when ``policy="skip"`` dropped this save); ``waited_s``, how long
    ``save`` waited for a free RAM slot (the snapshots before it were still persisting); and
    ``staged_s``, how long the copy into RAM took: together, what the training loop paid.
    """

    def __init__(self, step: int, futures: dict[str, concurrent.futures.Future | None], skipped: bool = False,
                 waited_s: float = 0.0, staged_s: float = 0.0) -> None:
        self.step, self.skipped, self._futures = step, skipped, futures
        self.waited_s, self.staged_s = waited_s, staged_s

    def done(self, tier: str = "local") -> bool:
        """Whether the snapshot reached ``tier`` (or failed); True when it never goes there (for a
        step the local tier skips, ``"local"`` answers for its RAM commit, as :meth:`wait` does)."""
        f = self._future(tier)
        return f is None or f.done()

    def wait(self, tier: str = "local", timeout: float | None = None) -> None:
        """Block until the snapshot is committed at ``tier``; re-raises a background failure.
        Returns at once for a durable or peer tier this step does not go to (or for a skipped
        save); for a step the local tier skips (``local_every``), once it is committed in RAM. A
        promotion a newer step's overtook in the durable queue (the object store slower than the
        saves) is dropped: ``wait("durable")`` then returns once that newer step is committed
        there, or raises its failure; either way the durable tier holds this step or a newer one."""
        f = self._future(tier)
        if f is not None:
            f.result(timeout)

    def _future(self, tier: str) -> concurrent.futures.Future | None:
        if tier not in TIERS:
            raise InvalidArgumentError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        f = self._futures.get(tier)
        if f is None and tier == "local":
            # wait("local"), the default, is how a loop learns its snapshot is safe and its
            # background failures: a step the local tier skips answers for its RAM commit.
            return self._futures.get("ram")
        return f

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ", ".join(f"{t}={'done' if self.done(t) else 'pending'}" for t in TIERS)
        return f"SaveHandle(step={self.step}, {state})"


Place = tuple["concurrent.futures.Future[None] | None", "concurrent.futures.Future[None]"]


class Lane:
    """Work of one kind, one step after another: the collectives of a lane's group then keep one
    order on every rank. A step takes its place with :meth:`reserve` (in step order) and runs its
    work once the step before it in the lane is done."""

    def __init__(self, name: str, group: Group) -> None:
        self.name, self.group = name, group
        self._tail: concurrent.futures.Future[None] | None = None

    def reserve(self) -> Place:
        prev, mine = self._tail, concurrent.futures.Future[None]()
        self._tail = mine
        return prev, mine

    @staticmethod
    async def run(place: Place, work: Callable[[], Awaitable[None]]) -> None:
        prev, mine = place
        try:
            if prev is not None:
                await asyncio.wrap_future(prev)
            await work()
        finally:
            _resolve(mine, None)


class BackgroundErrors:
    """Background failures not yet raised to the trainer, by step; each is raised once."""

    def __init__(self) -> None:
        self._errors: list[tuple[int, BaseException]] = []
        self._reported = -1  # steps up to this one were raised

    def add(self, step: int, exc: BaseException) -> None:
        self._errors.append((step, exc))

    def pending(self) -> tuple[int, BaseException] | None:
        fresh = [(step, exc) for step, exc in self._errors if step > self._reported]
        return fresh[0] if fresh else None

    def raise_pending(self, pending: tuple[int, BaseException] | None) -> None:
        """Raise the oldest background failure once: later copies of it (another rank's report of
        the same failed step arriving late) are dropped."""
        if pending is None:
            return
        step, exc = pending
        self._reported = max(self._reported, step)
        self._errors = [(s, e) for s, e in self._errors if s > self._reported]
        raise background_error(step, exc)


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What a save plans from the structure of its state, kept for the next save of the same
    structure: its fingerprint ``key``, the ranks' agreed ``structure`` it was planned under, the
    slot's entry ``names`` with the index of each one's tensor among the fingerprint's tensors
    (``order``) and, where an entry is a part of that tensor (a DTensor's local box of a strided
    layout), its ``views`` (shape, strides, storage offset from the tensor's own), and what the
    step's job carries (digest, slot layout, tree and tensor table, boxes). None of it depends on
    the tensors' values, so staging new values into it is exact."""

    key: list[Any]
    structure: Structure
    digest: str
    names: list[str]
    order: list[int]
    views: list[tuple[tuple[int, ...], tuple[int, ...], int] | None] | None
    frozen_count: int
    breaks: frozenset[int]
    layout: Layout
    shared: dict[str, Any]
    header: dict[str, Any]
    boxes: dict[str, tuple[int, ...]]
    # Every staged tensor is a contiguous CPU tensor of a real dtype: what the fingerprint holds of
    # them (dtype, shape, strides, device; the views' geometry is the plan's) keeps them so while the
    # key is equal. Complex ones are left out: a conjugate or negative view bit is not in the key.
    plain: bool = False
    # ``order`` is every tensor of the fingerprint in its order (no entry is a view, none left out).
    whole: bool = False
    # The replica check's share of the plan (sdc on): the replicated boxes and their groups, the
    # entries staged only to be compared, and the host-memory replicas hashed in place, each found
    # again as (key, index among the fingerprint's tensors, view or None).
    replicated: dict[str, tuple] | None = None
    check: frozenset[str] = frozenset()
    live: list[tuple[str, int, tuple[tuple[int, ...], tuple[int, ...], int] | None]] = dataclasses.field(default_factory=list)


class Pipeline:
    """Saves of one store: the trainer's part in :meth:`save`, the background stages on ``loop``."""

    def __init__(self, options: StoreOptions, groups: StoreGroups, *, ram: RamTier, local: DirectoryTier | None,
                 peer: PeerTier, durable: DirectoryTier | None, local_owner: bool, check: ReplicaCheck,
                 tracker: GoodputTracker, loop: LoopThread, local_single: bool = False) -> None:
        self.options, self.groups, self.check, self.tracker, self.loop = options, groups, check, tracker, loop
        self.ram, self.local, self.peer, self.durable = ram, local, peer, durable
        # Every rank shares the one local directory (a single-node job): its owner assembles the
        # whole manifest there, so the directory loads on its own (load_sharded, the CLI).
        self.local_single, self.local_owner = local_single, local_owner
        self.rank, self.world = groups.rank, groups.world
        self.fast, self.peer_lane, self.durable_lane = (Lane("fast", groups.fast), Lane("peer", groups.peer),
                                                        Lane("durable", groups.durable))
        self.local_retention = Retention(local, options.keep_local, owner=local_owner) if local else None
        self.durable_retention = Retention(durable, options.durable.keep, owner=self.rank == 0) if durable else None
        self.errors = BackgroundErrors()
        self.peer_off = False  # set when a peer did not answer in time: replication stops for this run
        self.skipped = 0
        self.last_step: int | None = None  # the newest step saved or restored (steps only grow)
        self._busy: dict[int, concurrent.futures.Future] = {}  # slot -> the step that still reads it
        self._last_ram: concurrent.futures.Future | None = None  # the RAM commit of the newest save
        self._outstanding: set[concurrent.futures.Future] = set()
        tracker.in_flight = self._in_flight  # the interval plan counts the steps a save slows
        self._last: StepJob | None = None  # the newest step committed in RAM (close promotes it)
        self._promoted: set[int] = set()
        # The newest step due in the durable tier that is not there yet: local retention keeps it
        # until a promotion of it or of a later step succeeds (retention tied to promotion).
        self._owed: int | None = None
        # Promotions queue in the durable lane when the object store is slower than the saves. The
        # newest step this rank queued there, and the oldest such step over the ranks as the last
        # durable commit agreed it (its flag carries it): a queued promotion older than that is
        # overtaken on every rank and dropped, so the uploads never fall further behind the
        # saves and the durable tier gets the newest step soonest.
        self._queued: int = -1
        self._overtaken_below: int = -1
        # The durable futures of dropped promotions: each takes the outcome of the next promotion
        # that runs (the one that overtook it), so a wait("durable") that returns still means the
        # durable tier holds that step or a newer one, and resolves to the newer step.
        self._overtaken: list[concurrent.futures.Future] = []
        # The newest step replicated to peers, and those on their way there: the local tier keeps
        # its copy of them beyond keep_local, so that a node loss, which takes the lost node's
        # replicas of the others' parts, still finds every part of that step on the nodes left.
        self._replicated: int | None = None
        self._replicating: set[int] = set()
        # A restarted process did not replicate anything yet, but the replicas its node holds say
        # which step the peers have: their replication was committed by every rank together, so
        # this rank's part of that step is what a loss of another node needs from this one. Read
        # once, at the first retention (off the save's path).
        self._inherited = options.peer.replicas == 0
        # Saves since the newest promoted, replicated and locally written one. They travel in every
        # step's manifest (meta.cadence), so a restarted process counts on from its newest step instead
        # of from zero: a job that crashes every few saves still promotes every durable_every-th.
        self.since = {"durable": 0, "peer": 0, "local": 0}
        self._slots_set = False
        # The structure the ranks last agreed on (pipeline stages, experts: ranks hold different keys),
        # by the vector of every rank's digest; a save assumes it and the vote confirms it.
        self._structures: dict[str, Structure] = {}
        self._structure: tuple[list[str], Structure] | None = None
        self._local: Collected | None = None  # this save's collected state, between collect and the vote
        # What a save of an unchanged structure reuses (see _Planned); the tree and the tensors of
        # this save, for collecting it after all when the vote finds another rank's structure changed.
        self._planned: _Planned | None = None
        self._found: _Found | None = None
        self._hashed: tuple[list[str], int] | None = None  # the agreed digests and their hash (_vote)
        self._handoff = _Handoff(loop)

    # ------------------------------------------------------------------------------ the trainer's part

    def save(self, step: int, state: Any) -> SaveHandle:
        """Stage ``state`` as ``step`` and hand it to the background stages (see the module docstring)."""
        t_enter = time.perf_counter()
        job = StepJob(step)
        plan = self.tracker.inputs() if self.rank == 0 else None
        pending = self.errors.pending()
        if self.world == 1:
            self.errors.raise_pending(pending)
        error: BaseException | None = None
        busy = False
        items: list[tuple[str, Any]] = []
        frozen_count = 0
        breaks: frozenset[int] = frozenset()
        try:
            items, frozen_count, breaks = self._collect(job, state)
            # The slot as things stand (the number of slots is known now): with the previous save's
            # RAM commit still out, that is its slot, busy; the slot staged into is chosen after it.
            busy = not self._slot_free(self.ram.next_slot)
        except Exception as exc:  # noqa: BLE001 - in a group every rank must reach the vote first
            error = exc
        busy, plan, digests = self._vote(step, error, busy, plan, pending, job.digest)
        if self._structure is None or self._structure[0] != digests:
            # The first save, or the ranks' structures changed: agree on their union, then plan again.
            if self._local is None:  # this rank's own structure held, and it took the reuse path
                assert self._found is not None
                self._local = self._found.collect(self.rank)
            structure = agree_structure(self.groups.trainer, self._local, digests, self._structures)
            self._structure = (digests, structure)
            try:
                items, frozen_count, breaks = self._plan(job, self._local, structure)
            except Exception as exc:  # noqa: BLE001 - the step fails on every rank through the fast lane
                job.error = exc
        self._local = None
        self._found = None
        self.tracker.planned(step, plan)
        if busy and self.options.policy == "skip":
            self.skipped += 1
            log.warning("ckptstore: step %d skipped: the previous snapshots are still being persisted", step)
            self.tracker.event("skip", step=step)
            return SaveHandle(step, {}, skipped=True)
        slot, waited = self._wait_for_slot()
        if job.error is None:
            self._stage(job, slot, items, frozen_count, breaks)
        elif self.world == 1:
            raise job.error
        self.last_step = step
        job.promote = self.durable is not None and self.since["durable"] + 1 >= self.options.durable.every
        job.replicate = (self.options.peer.replicas > 0 and not self.peer_off
                         and self.since["peer"] + 1 >= self.options.peer.every)
        # A promoted step is written locally too: its promotion reads the local files, and the
        # node agent finishes an owed promotion from them after a crash. So is a replicated one:
        # a node loss is recovered from the lost node's replicas and the survivors' own parts of
        # the same step, which the local tier keeps (a RAM slot is restaged two saves later).
        job.to_local = self.local is not None and (job.promote or job.replicate
                                                   or self.since["local"] + 1 >= self.options.local_every)
        self.since = {"durable": 0 if job.promote else self.since["durable"] + 1,
                      "peer": 0 if job.replicate else self.since["peer"] + 1,
                      "local": 0 if job.to_local else self.since["local"] + 1}
        job.cadence = dict(self.since)
        job.futures = {
            "ram": concurrent.futures.Future(),
            "local": concurrent.futures.Future() if job.to_local else None,
            "peer": concurrent.futures.Future() if job.replicate else None,
            "durable": concurrent.futures.Future() if job.promote else None,
        }
        self._last_ram = job.futures["ram"]
        done = self._handoff.submit(self._run(job, self.fast.reserve()))
        self._outstanding = {f for f in self._outstanding if not f.done()} | {done}
        if job.staged is not None:
            self._busy[job.staged.slot] = job.slot_free
        if job.error is not None:
            # The background run tells the other ranks of this failure through collectives on
            # the store's groups; raising before they are over would let a caller that catches the
            # error and tears its process group down destroy a group under them.
            concurrent.futures.wait([done])
            raise job.error
        handle = SaveHandle(step, job.futures, waited_s=waited, staged_s=job.staged.seconds if job.staged else 0.0)
        staged = job.staged
        self.tracker.saved(step, time.perf_counter() - t_enter, handle.waited_s, handle.staged_s,
                           staged.layout.total if staged else 0, staged.copied_bytes if staged else 0)
        return handle

    def _collect(self, job: StepJob, state: Any) -> tuple[list[tuple[str, Any]], int, frozenset[int]]:
        """What this rank stages: its boxes in slot order (frozen first), and where the slot is cut."""
        step = job.step
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, not {step!r}")
        if self.last_step is not None and step <= self.last_step:
            raise InvalidArgumentError(
                f"step {step} is not after the last saved step {self.last_step} (the newest step this store saved, "
                "restored, or found in its tiers when it started): steps only grow and a committed step is never "
                "saved again; restore first and continue after it, or give a new run its own job name and directories"
            )
        tree = state.state_dict() if isinstance(state, TrainState) else state
        self._found = _Found(tree)
        reused = self._reuse(job, self._found.fingerprint)
        if reused is not None:
            return reused
        local = self._found.collect(self.rank)
        job.digest = structure_digest(local)
        self._local = local
        if self._structure is None:
            return [], 0, frozenset()  # the first save plans after the vote, once the ranks' structures are known
        return self._plan(job, local, self._structure[1])  # the last save's structure: the vote confirms it

    def _plan(self, job: StepJob, local: Collected, structure: Structure) -> tuple[list[tuple[str, Any]], int, frozenset[int]]:
        mine = my_writes(local, self.world, self.rank, same=structure.same, skip=structure.skip)
        is_frozen = self.options.frozen or (lambda key: False)
        # Per-rank values are encoded afresh at every save (never frozen), and go last: their
        # lengths may change while the structure holds, and only the slot's tail moves then.
        own = [m for m in mine if "#rank" in m.key]
        mine = [m for m in mine if "#rank" not in m.key]
        frozen = [m for m in mine if is_frozen(m.key)]
        rest = [m for m in mine if not is_frozen(m.key)] + own
        names = [box_alias(m.key, n) for m, n in zip(frozen + rest, _box_numbers(frozen + rest))]
        items = [(name, local.items[(m.key, m.offsets, m.sizes)]) for name, m in zip(names, frozen + rest)]
        breaks = frozenset({len(frozen), len(items)})  # where the frozen and the replica-check entries end
        tail = len(items) - len(own) if own else None
        written = {(m.key, m.offsets, m.sizes): name for name, m in zip(names, frozen + rest)}
        checked = self.check.items(local, written, job, structure.same, structure.plain)
        items += checked
        job.header = {"tree": local.tree, "tensors": local.tensors, "layouts": local.layouts}
        job.shared = job.header if structure.representative else {}
        job.boxes = {name: m.offsets for name, m in zip(names, frozen + rest)}
        self._size_slots(items, breaks, tail, len(checked))
        job.layout = Layout.of(items, breaks, tail, len(checked))
        self._planned = self._remember(job, local, items, len(frozen), breaks, structure)
        return items, len(frozen), breaks

    def _remember(self, job: StepJob, local: Collected, items: list[tuple[str, Any]], frozen_count: int,
                  breaks: frozenset[int], structure: Structure) -> _Planned | None:
        """What the next save reuses while its fingerprint equals this one's; None when the state
        has no fingerprint (see planning.flatten.fingerprint) or a staged entry cannot be found
        again among its tensors."""
        found = self._found
        if found is None or found.fingerprint is None or job.layout is None:
            return None
        leaves = found.fingerprint[0]
        where = {id(t): i for i, t in enumerate(leaves)}
        # A per-rank value is encoded afresh at every save: collect staged its own copy of the
        # bytes the fingerprint encoded, the k-th of one being the k-th of the other (one walk order).
        mine = [t for (k, _, _), t in local.items.items() if "#rank" in k]
        if len(mine) != len(found.blobs) or not all(torch.equal(a, b) for a, b in zip(mine, found.blobs)):
            return None
        for a, b in zip(mine, found.blobs):
            where[id(a)] = where[id(b)]
        storages: dict[tuple[str, int], list[int]] = {}

        def locate(t: torch.Tensor) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...], int] | None] | None:
            i = where.get(id(t))
            if i is not None:
                return i, None
            # A DTensor's box: a view of its local tensor, which the fingerprint holds.
            if not storages:
                for j, leaf in enumerate(leaves):
                    storages.setdefault(_storage_of(leaf), []).append(j)
            held = {id(leaves[j]): j for j in storages.get(_storage_of(t), [])}
            if len(held) != 1:
                return None
            i = next(iter(held.values()))
            leaf = leaves[i]
            geometry = (tuple(t.shape), tuple(t.stride()), t.storage_offset() - leaf.storage_offset())
            return i, (geometry if geometry != (tuple(leaf.shape), tuple(leaf.stride()), 0) else None)

        order: list[int] = []
        views: list[tuple[tuple[int, ...], tuple[int, ...], int] | None] = []
        for _, t in items:
            got = locate(t)
            if got is None:
                return None
            order.append(got[0])
            views.append(got[1])
        live = []
        for key, t in job.live.items():
            got = locate(t)
            if got is None:
                return None
            live.append((key, *got))
        return _Planned(key=found.fingerprint[1], structure=structure, digest=job.digest,
                        names=[name for name, _ in items], order=order,
                        views=views if any(v is not None for v in views) else None, frozen_count=frozen_count,
                        breaks=breaks, layout=job.layout, shared=job.shared, header=job.header, boxes=job.boxes,
                        whole=order == list(range(len(leaves))) and not any(v is not None for v in views),
                        plain=all(t.device.type == "cpu" and t.is_contiguous() and not t.is_complex() for _, t in items),
                        replicated=job.replicated if self.check.on else None, check=frozenset(job.check),
                        live=live)

    def _reuse(self, job: StepJob, found: tuple[list[Any], list[Any]] | None) -> tuple[list[tuple[str, Any]], int, frozenset[int]] | None:
        """The last save's plan with this save's tensors in it, when nothing structural changed:
        the same fingerprint (keys, containers, leaves' values, tensors' dtypes, shapes, strides and
        devices, DTensors' placements and meshes, per-rank values' lengths) under the same agreed
        structure of the ranks. None otherwise."""
        planned = self._planned
        if (found is None or planned is None or self._structure is None
                or planned.structure is not self._structure[1] or found[1] != planned.key):
            return None
        leaves = found[0]

        def source(i: int, v: tuple[tuple[int, ...], tuple[int, ...], int] | None) -> torch.Tensor:
            return leaves[i] if v is None else leaves[i].as_strided(v[0], v[1], leaves[i].storage_offset() + v[2])

        if planned.whole:  # the fingerprint's tensors are the sources, in the slot's order
            items = list(zip(planned.names, leaves))
        elif planned.views is None:
            # zip and map, not a comprehension: no bytecode per tensor.
            items = list(zip(planned.names, map(leaves.__getitem__, planned.order)))
        else:
            items = list(zip(planned.names, map(source, planned.order, planned.views)))
        layout = planned.layout
        if layout.tail is not None:
            tail = items[layout.tail:]
            if any(t.numel() * t.element_size() != e.nbytes for (_, t), e in zip(tail, layout.entries[layout.tail:])):
                # A per-rank value's encoding changed length (an RNG state's numbers, a loader's
                # position): the same plan, with the slot's tail and those entries' shapes anew
                # (the replica check's entries, behind them, only move).
                moved = layout.with_tail(tail)
                if moved is None:
                    return None
                header = planned.header
                if header:
                    grown = tail[: len(tail) - layout.fixed]
                    tensors = dict(header["tensors"])
                    tensors.update((name, ("uint8", (t.numel(),))) for name, t in grown if name in tensors)
                    header = {**header, "tensors": tensors}
                planned = self._planned = dataclasses.replace(planned, layout=moved, header=header,
                                                              shared=header if planned.shared else {})
        job.digest, job.shared, job.boxes, job.layout = planned.digest, planned.shared, planned.boxes, planned.layout
        job.header, job.plain = planned.header, planned.plain
        if planned.replicated is not None:
            job.replicated, job.check = planned.replicated, set(planned.check)
            job.live = {key: source(i, v) for key, i, v in planned.live}
        return items, planned.frozen_count, planned.breaks

    def _vote(self, step: int, error: BaseException | None, busy: bool, plan: Any,
              pending: tuple[int, BaseException] | None, digest: str) -> tuple[bool, Any, list[str]]:
        """One vote per save keeps the ranks together: on the step, on this save's failures, on a
        background failure one rank has already seen (the others may learn of it a moment later:
        it is raised on all of them), on a busy slot and on the plan. Raises what must be raised.

        The vote is one all-reduce (MAX) of a few int64s, whatever the number of ranks: the step
        and its negation, the flags, whether this rank's structure left the agreed one, and a hash
        of the ranks' agreed digests (each rank's memory of them). Only when something differs (a
        failure, a pending error, a changed structure, different steps) do the ranks gather every
        rank's vote, as :meth:`_full_vote`, to learn what and raise it."""
        if self.world == 1:
            if error is not None:
                raise error
            return busy, plan, [digest]
        agreed = self._structure
        changed = agreed is None or agreed[0][self.rank] != digest
        agreed_hash = self._agreed_hash() if agreed is not None else 0
        plan_fields, plan_ok = _encode_plan(plan)
        odd = (error is not None or pending is not None or changed or not plan_ok or not 0 <= step < _STEP_LIMIT)
        flat = step if 0 <= step < _STEP_LIMIT else 0
        votes = self.groups.trainer.max_int64(
            [int(odd), flat, -flat, int(busy), int(self.peer_off), agreed_hash, -agreed_hash, *plan_fields])
        if votes[0] or votes[1] != -votes[2] or votes[5] != -votes[6]:
            return self._full_vote(step, error, busy, plan, pending, digest)
        assert agreed is not None
        self.peer_off = bool(votes[4])
        return bool(votes[3]), _decode_plan(votes[7:]), agreed[0]

    def _agreed_hash(self) -> int:
        """63 bits of a hash of the agreed digests of every rank, computed once per agreement."""
        assert self._structure is not None
        digests = self._structure[0]
        if self._hashed is None or self._hashed[0] is not digests:
            text = "|".join(digests).encode()
            self._hashed = (digests, int(hashlib.sha256(text).hexdigest()[:16], 16) >> 1)
        return self._hashed[1]

    def _full_vote(self, step: int, error: BaseException | None, busy: bool, plan: Any,
                   pending: tuple[int, BaseException] | None, digest: str) -> tuple[bool, Any, list[str]]:
        """The vote with every rank's whole record: what a save falls back to when the all-reduce
        shows something differs, and the first save of a structure."""
        mine = {"step": step, "busy": busy, "peer_off": self.peer_off, "plan": plan, "digest": digest,
                "ok": error is None, "failure": None if error is None else failure_record(self.rank, error),
                "pending": None if pending is None else (pending[0], failure_record(self.rank, pending[1]))}
        votes = self.groups.trainer.all_gather(mine)
        reports = sorted((v["pending"] for v in votes if v["pending"]), key=lambda p: p[0])
        if reports:
            first_step, record = reports[0]
            if pending is None or pending[0] != first_step:
                failure = RankFailure(**record)
                pending = (first_step, collective_error(failure.message, {failure.rank: failure}))
            self.errors.raise_pending(pending)
        settle(f"save of step {step}", votes, self.rank, error, own_error_first=True)
        if len({v["step"] for v in votes}) > 1:
            raise InvalidArgumentError(
                f"ranks passed different steps to save: {[v['step'] for v in votes]}; every rank saves the same step"
            )
        self.peer_off = any(v["peer_off"] for v in votes)
        return any(v["busy"] for v in votes), votes[0]["plan"], [v["digest"] for v in votes]

    def _size_slots(self, items: list[tuple[str, Any]], breaks: frozenset[int], tail: int | None = None,
                    fixed: int = 0) -> None:
        """Fix the number of staging slots at the first save, from ram_budget_bytes."""
        if self._slots_set:
            return
        size = Layout.of(items, breaks, tail, fixed).total
        budget = self.options.ram_budget_bytes
        if budget is not None:
            slots = budget // size
            if slots < 1:
                raise InvalidArgumentError(
                    f"ram_budget_bytes={budget} is smaller than one snapshot of this state "
                    f"({size} bytes on rank {self.rank}); raise it to at least {size} ({2 * size} lets one snapshot "
                    "persist while the next is taken)"
                )
            self.ram.set_slots(slots)
        self._slots_set = True

    def _slot_free(self, slot: int) -> bool:
        reader = self._busy.get(slot)
        return reader is None or reader.done()

    def _wait_for_slot(self) -> tuple[int, float]:
        """The slot this save stages into, once it is free, and the seconds waited. Restaging a
        slot destroys the snapshot in it, so a crash while staging must leave the newest committed
        snapshot behind: the previous save's RAM commit is waited for first, and only then is the
        slot chosen (the RAM tier passes over the one holding the newest committed snapshot, which
        that commit may have just become: chosen before it, the slot of two saves called back to
        back was the first one's, overwritten as soon as it was committed, while the slot of the
        step before it stayed untouched); then the step that last used the chosen slot must be done
        with it (written to the other tiers, or promoted from it after a restart)."""
        t0 = time.perf_counter()
        if self._last_ram is not None:
            concurrent.futures.wait([self._last_ram])
        slot = self.ram.next_slot
        reader = self._busy.get(slot)
        if reader is not None:
            concurrent.futures.wait([reader])
        return slot, time.perf_counter() - t0

    def _stage(self, job: StepJob, slot: int, items: list[tuple[str, Any]], frozen_count: int,
               breaks: frozenset[int]) -> None:
        may_skip = frozenset(k for k, _ in items[:frozen_count])
        try:
            job.staged = self.ram.stage(job.step, items, may_skip=may_skip, breaks=breaks, slot=slot,
                                        refresh_every=self.options.refresh_every, layout=job.layout, plain=job.plain)
        except BaseException as exc:
            job.error = exc  # the pipeline still runs, so the other ranks learn of it and nobody hangs
            if self.world == 1:
                raise
        self.check.hash_live(job)
        if job.staged is not None and frozen_count:
            e = job.staged.layout.entries[frozen_count - 1]
            job.frozen_end = align_up(e.offset + e.nbytes)

    # ------------------------------------------------------------------------------ the background stages

    async def _run(self, job: StepJob, place: Any) -> None:
        lanes: list[tuple[Any, Callable[[StepJob], Awaitable[None]], str]] = []
        prev, mine = place
        try:
            try:
                if prev is not None:
                    await asyncio.wrap_future(prev)
                await self._fast_stages(job)
                # Places in the other lanes are taken before the next step may leave the fast lane,
                # so every lane runs its steps in step order (the peer lane's, at the RAM commit).
                if job.promote:
                    # A promotion reads the step's local files when there are some, not the slot: a slow
                    # or stuck object store then never holds a RAM slot, so it never blocks the next saves.
                    job.durable_data = self._local_view(job)
                    lanes.append((self.durable_lane.reserve(), self._promote, "durable"))
                    self._queued = max(self._queued, job.step)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
                self._failed(job, exc)
        finally:
            _resolve(mine, None)
        try:
            tasks = [asyncio.ensure_future(self._in_lane(p, work, job, name)) for p, work, name in lanes]
            # The slot is free once nothing reads it: the replication, and a promotion without local files.
            readers = [t for t in tasks if job.durable_data is None]
            if job.replication is not None:
                readers.append(job.replication)
            await asyncio.gather(*readers)
            _resolve(job.slot_free, None)
            await asyncio.gather(*tasks)
        finally:
            _resolve(job.slot_free, None)

    def _start_replication(self, job: StepJob) -> None:
        """Start the step's replication to peers as soon as it is committed in RAM, beside its local
        write rather than after it: a node loss finds the newest step whole on the other nodes a
        local write sooner, and the step's slot is free once the longer of the two is done, not
        once both are, one after the other."""
        if job.replicate:
            self._replicating.add(job.step)
            job.replication = asyncio.ensure_future(self._in_lane(self.peer_lane.reserve(), self._replicate, job,
                                                                  "peer"))

    async def _in_lane(self, place: Any, work: Callable[[StepJob], Awaitable[None]], job: StepJob, lane: str) -> None:
        async def guarded() -> None:
            try:
                await work(job)
                if not job.overtaken:
                    _resolve(job.futures.get(lane), job.step)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
                if lane == "peer":
                    self._replication_failed(job, exc)
                else:
                    self._failed(job, exc)

        await Lane.run(place, guarded)

    async def _fast_stages(self, job: StepJob) -> None:
        """Checksums, the RAM commit and the local tier."""
        fast = self.groups.fast

        async def stage_part() -> dict[str, Any]:
            if job.error is not None:
                raise job.error
            assert job.staged is not None
            crashpoint("ram.staged", str(job.step))
            t_hash = time.perf_counter()
            # Both make an object or two per tensor, which the next save's still hold: with the
            # collector on, their allocations set off collections that walk every live object (the
            # trainer's state too), tens of milliseconds each at 10,000 tensors. It is paused
            # around them as around a save, never across a collective.
            await asyncio.to_thread(gc_paused(self.ram.hash), job.staged, BLOCK_SIZE)
            with paused():
                job.snap = self.ram.snapshot(job.staged, self.world, job.boxes, job.frozen_end)
            self._stage_timings(job, time.perf_counter() - t_hash)
            part = await self.ram.put(job.snap)
            part.update(step=job.step, digest=job.digest)
            return part

        # Each rank proposes a save id and the largest wins: every rank's RAM document of this
        # save names it alike, so a node agent and a restore tell this save from any other of
        # the step without comparing chunk tables. The step and its negation ride the same
        # all-reduce: ranks that staged different steps learn it there.
        nonce = secrets.randbits(63)
        flat = job.step if 0 <= job.step < _STEP_LIMIT else 0  # the vote compared the others already
        part, agreed = await concur_max_async(fast, f"staging step {job.step}", stage_part, [flat, -flat, nonce])
        if agreed[0] != -agreed[1]:
            raise CheckpointError(
                f"ranks staged different steps for step {job.step}: every rank must save the same step"
            )
        job.save_id = f"{agreed[2]:016x}"
        meta = {"step": job.step, "job": self.options.job, "cadence": job.cadence, "world_size": self.world,
                "save_id": job.save_id}
        if self.check.on:
            # After the staging agreement, not inside it: a rank whose plan or staging failed does
            # not know its replica groups, and its neighbours would wait for its message. One more
            # flag (recursive doubling: log2(ranks) steps) says whether any neighbours differed.
            async def swap() -> int:
                job.suspect = await asyncio.to_thread(self.check.neighbours, fast, job)
                return job.suspect

            _, differed = await concur_max_async(fast, f"comparing the replicas of step {job.step}", swap,
                                                 lambda: [job.suspect])
            job.sdc = (await self.check.compare(job, lambda what, fn: agree_async(fast, what, _threaded(fn)))
                       if differed[0] else [])
            meta["sdc"] = {"policy": self.check.mode, "mismatches": job.sdc}
        job.own = node_extra(part, meta, job.header)
        crashpoint("ram.before_commit", str(job.step))
        own = job.own
        await concur_async(fast, f"committing step {job.step} in RAM",
                           lambda: self.ram.commit(job.step, save_id=job.save_id, own=own))
        crashpoint("ram.committed", str(job.step))
        self._last = job
        _resolve(job.futures["ram"], job.step)
        self._start_replication(job)
        if self.local is not None and job.to_local:
            await self._to_local_tier(job)
            _resolve(job.futures["local"], job.step)
        if job.sdc and self.check.mode == "raise":
            self._promoted.add(job.step)  # close() must not promote it to durable either
        self.check.verdict(job, self.tracker.event)

    async def _to_local_tier(self, job: StepJob) -> None:
        """Write the step to the local tier and apply the tier's retention (in the fast lane)."""
        assert self.local is not None and self.local_retention is not None
        job.local_part = await self._to_tier(self.local, job, self.groups.fast)
        if job.promote:
            self._owed = job.step
        if not self._inherited:
            self._inherited = True
            held = await asyncio.to_thread(self.peer.node_steps)
            self._replicated = max([*held, *([self._replicated] if self._replicated is not None else [])],
                                   default=None)
        keep = {s for s in (self._owed, self._replicated) if s is not None} | self._replicating
        await self.local_retention.apply(frozenset(keep))

    async def _replicate(self, job: StepJob) -> None:
        """Send this rank's staged bytes to its holders and take in the replicas it holds, over the
        peer group; the replicas are committed with the step's manifest, as in RAM."""
        assert job.snap is not None
        try:
            part = await self._to_tier(self.peer, job, self.groups.peer)
            self._replicated = max(job.step, self._replicated or job.step)
        finally:
            self._replicating.discard(job.step)
        job.snap.meta.setdefault("timings", {})["replicate_s"] = part["timings"].get("replicate_s", 0.0)

    def _replication_failed(self, job: StepJob, exc: BaseException) -> None:
        # A peer that does not answer within peer_timeout_s leaves the peer group in an unknown state:
        # replication stops for this run (the ranks agree on the next save) rather than risk a
        # collective that never returns. A missed replica costs a fallback at restore, never the run.
        self.peer_off = True
        log.error("ckptstore: replicating step %d to peers failed, replication is off for the rest of this run "
                  "(the local and durable tiers go on): %s", job.step, exc)
        f = job.futures.get("peer")
        if f is not None and not f.done():
            f.set_exception(exc)

    async def _promote(self, job: StepJob, *, may_drop: bool = True) -> None:
        assert self.durable is not None and job.snap is not None
        if may_drop and job.step < self._overtaken_below:
            # Every rank agreed (at the last durable commit) that it had queued a newer promotion:
            # the same decision everywhere, with no collective of its own. The step stays in the
            # tiers it reached; its durable future waits for the promotion that overtook it.
            job.durable_data = None
            job.overtaken = True
            f = job.futures.get("durable")
            if f is not None:
                self._overtaken.append(f)
            log.info("ckptstore: step %d is not promoted: step %d or newer is queued for the durable tier on "
                     "every rank (the object store is slower than the saves)", job.step, self._overtaken_below)
            self.tracker.event("overtaken", step=job.step, by=self._overtaken_below)
            return
        try:
            await self._upload(job)
        except BaseException as exc:
            self._settle_overtaken(exc)  # nothing left to settle when it failed after its commit
            raise

    def _settle_overtaken(self, outcome: int | BaseException) -> None:
        """Give the dropped promotions the outcome of the one that overtook them: the step it
        committed, or its failure (then the durable tier holds neither)."""
        pending, self._overtaken = self._overtaken, []
        for f in pending:
            if f.done():
                continue
            if isinstance(outcome, BaseException):
                f.set_exception(outcome)
            else:
                f.set_result(outcome)

    async def _upload(self, job: StepJob) -> None:
        # The deadline bounds the whole promotion, retries included (one retry layer, botocore's,
        # bounded per request: storage/s3.py); past it the step fails in the durable tier only.
        deadline = time.monotonic() + self.options.durable.timeout_s
        snap = job.snap if job.durable_data is None else dataclasses.replace(job.snap, data=job.durable_data)
        try:
            await self._to_tier(self.durable, job, self.groups.durable, deadline, snap)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - the HTTP stack's own errors, named for the caller
            raise StorageError(
                f"promoting step {job.step} to {self.durable.display(job.step)} failed: {type(exc).__name__}: {exc}; "
                "the step stays in the RAM and local tiers and later steps are promoted as usual"
            ) from exc
        finally:
            job.durable_data = None  # unmaps the local files
        self._promoted.add(job.step)
        self._settle_overtaken(job.step)
        if self._owed is not None and self._owed <= job.step:
            self._owed = None
        assert self.durable_retention is not None
        await self.durable_retention.apply()

    async def _to_tier(self, tier: Tier, job: StepJob, group: Group, deadline: float | None = None,
                       snap: Snapshot | None = None) -> dict[str, Any]:
        """Write the step to ``tier`` (from ``snap``, by default the staged slot's) and commit it on
        every rank; returns this rank's part.

        Each node's copy of a step in a node tier holds its own rank's part, the step's meta and
        the rank's header, and the commits agree through flags: the local tier through
        :meth:`_to_local` (node parts; a single-node job's owner assembles the whole manifest from
        them), a peer replica with its source's part sent beside its bytes. The durable tier has
        one copy, whose format 2.0 manifest its coordinator (rank 0) writes from every rank's part
        summary (file, size, checksum; the representatives' headers); the other ranks learn of
        success through one all-reduce of a flag (every rank's failure still reaches every rank)."""
        assert job.snap is not None
        source = snap or job.snap
        what = f"durable_timeout_s={self.options.durable.timeout_s:g}"
        try:
            with s3.deadline(deadline, what):
                writing = f"writing step {job.step} to the {tier.name} tier"
                committing = f"committing step {job.step} in the {tier.name} tier"
                if tier is self.durable:
                    part = await concur_async(group, writing, lambda: self._put(tier, source, job))
                    summaries = await asyncio.to_thread(_summaries, group, _with_header(
                        part_summary(part, _shapes(job)), job))

                    async def commit() -> None:
                        if group.rank == 0:
                            assert self.durable is not None
                            shared = _headers(summaries, job.step)
                            body = await asyncio.to_thread(self._parted, job, summaries, shared)
                            await self.durable.commit_document(job.step, body)

                    # The commit's flag also carries the oldest newest-queued step over the ranks.
                    _none, (neg,) = await concur_max_async(group, committing, commit, lambda: [-self._queued])
                    self._overtaken_below = max(self._overtaken_below, -neg)
                    return part
                if tier is self.local and job.own is not None:
                    return await self._to_local(job, group, source)
                if tier is self.peer and job.own is not None:
                    # A replica is a byte copy of its source's slot: its document carries what the
                    # source's RAM document does (part, meta, header), sent with the bytes.
                    self.peer.outgoing = job.own
                    part = await concur_async(group, writing, lambda: self._put(tier, source, job))
                    await concur_async(group, committing, lambda: tier.commit(job.step, None))
                    return part
                async def put() -> dict[str, Any]:
                    return _with_header(await self._put(tier, source, job), job)

                parts = await agree_async(group, writing, put)
                shared = _headers(parts, job.step)
                manifest = self._manifest(job, parts, shared)
                await concur_async(group, committing, lambda: tier.commit(job.step, manifest))
        except BaseException:
            # Every rank is past its writes (the agreement said so): each removes the files it
            # created for the failed step, so a full disk is not kept full by the attempt that
            # found it full (and another writer's files of the same step are left alone).
            try:
                await tier.discard(job.step)
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot remove what the failed save of step %d left in %s: %s", job.step,
                            tier.display(job.step), exc)
            raise
        return parts[group.rank]

    async def _to_local(self, job: StepJob, group: Group, source: Snapshot) -> dict[str, Any]:
        """The local tier by flags: each rank writes its files and commits its own part on this
        node (its node part: its local part, the step's meta, its header); in a single-node job the
        directory's owner then assembles the whole manifest from the node parts on its disk."""
        local = self.local
        assert local is not None and job.own is not None
        own = job.own

        async def write() -> dict[str, Any]:
            part = await self._put(local, source, job)
            mine = {**part, "step": job.step, "digest": job.digest}
            # The collector is paused around the per-tensor work of the local commit as around the
            # RAM commit's (never across an await): at 10,000 tensors its allocations set off full
            # collections that walk every live object, the trainer's state too, holding the GIL.
            with paused():
                # A local file that is the slot written whole is a byte copy of it: the node part
                # then joins the slot's layout, and a restore reads either copy with one chunk table.
                mine["layout"] = "staged" if same_table(part["chunks"], own["part"]["chunks"]) else "local"
                extra = node_extra(mine, own["meta"], job.header)
            await local.put_node_part(job.step, self.rank, extra)
            return part

        part = await concur_async(group, f"writing step {job.step} to the local tier", write)
        if not self.local_single:
            # Each rank's node part, written above, is its commit on its node, and the agreement
            # said every one landed: a second agreement around a commit nobody makes would be one
            # more ring all-reduce per save (2 x (ranks - 1) message steps) that decides nothing.
            return part

        async def commit() -> None:
            if self.local_owner:
                held = await asyncio.to_thread(gc_paused(local.node_parts), job.step)
                body = await asyncio.to_thread(gc_paused(local_manifest), held, local.display(job.step),
                                               job=self.options.job, step=job.step, cadence=job.cadence)
                await local.commit_document(job.step, body)

        await concur_async(group, f"committing step {job.step} in the local tier", commit)
        return part

    async def _put(self, tier: Tier, snap: Snapshot, job: StepJob) -> dict[str, Any]:
        """Write this rank's part to ``tier`` and record the step's stage timings in it. The durable
        manifest waits (at most peer_timeout_s) for this step's replication, so it records that too."""
        part = await tier.put(snap)
        timings = snap.meta.setdefault("timings", {})
        if tier is self.local:
            timings["local_s"] = part.get("timings", {}).get("write_s", 0.0)
        elif tier is self.durable:
            timings["promote_s"] = part.get("timings", {}).get("write_s", 0.0)
            peer = job.futures.get("peer")
            if peer is not None:
                await asyncio.to_thread(concurrent.futures.wait, [peer], self.options.peer.timeout_s)
        part["timings"] = {**part.get("timings", {}), **timings}
        return part

    def _manifest(self, job: StepJob, parts: list[dict[str, Any]], shared: dict[str, Any]) -> Manifest:
        sdc = None if job.sdc is None else {"policy": self.check.mode, "mismatches": job.sdc}
        return step_manifest(shared, parts, self.world, job=self.options.job, step=job.step,
                             cadence=job.cadence, sdc=sdc)

    def _parted(self, job: StepJob, summaries: list[dict[str, Any]], shared: dict[str, Any]) -> bytes:
        """The durable tier's manifest of the step (format 2.0) from every rank's part summary."""
        sdc = None if job.sdc is None else {"policy": self.check.mode, "mismatches": job.sdc}
        return parted_step_manifest(shared, summaries, self.world, job=self.options.job, step=job.step,
                                    cadence=job.cadence, sdc=sdc)

    def _stage_timings(self, job: StepJob, hash_s: float) -> None:
        """Note the hashing time, and drop the entries staged only for the replica check from what the
        tiers receive (they sit after every written entry, so the data is cut where those begin)."""
        assert job.snap is not None and job.staged is not None
        job.snap.meta.setdefault("timings", {})["hash_s"] = round(hash_s, 6)
        if job.check:
            for key in job.check:
                job.snap.chunks.pop(key, None)
            end = max((align_up(e.offset + e.nbytes) for e in job.staged.layout.entries if e.key not in job.check),
                      default=0)
            job.snap.data = job.snap.data.narrow(0, 0, max(min(end, job.snap.nbytes), 4096))

    def _local_view(self, job: StepJob) -> Any:
        """This rank's committed local files of the step, mapped now, right after the local commit:
        a mapping keeps the bytes readable even when retention removes the files before a queued
        promotion gets to them. None when there are none: the promotion reads the slot."""
        if self.local is None or job.local_part is None or job.snap is None:
            return None
        return self.local.mapped(job.step, job.local_part, job.snap)

    def _failed(self, job: StepJob, exc: BaseException) -> None:
        log.error("ckptstore: background save of step %d failed: %s", job.step, exc)
        self.errors.add(job.step, exc)
        for tier, f in job.futures.items():
            # A replication under way (it began at the RAM commit) answers for itself.
            if f is not None and not f.done() and not (tier == "peer" and job.replication is not None):
                f.set_exception(exc)

    # ------------------------------------------------------------------------------ draining, closing

    def resume(self, meta: dict[str, Any], *, durable_holds_it: bool) -> None:
        """Count on from a committed step (its manifest's ``meta``): the newest one the tiers hold at
        start-up, or the one a restore loaded. Older manifests, without ``meta.cadence``, count from 0."""
        cadence: dict[str, Any] = meta["cadence"] if isinstance(meta.get("cadence"), dict) else {}
        since = {}
        for lane in ("durable", "peer", "local"):
            count = cadence.get(lane)
            since[lane] = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
        if durable_holds_it:
            since["durable"] = 0
        self.since = since
        # The steps counted from here may be lower than the ones queued before (a restore that
        # dropped a dead branch): promotions of them must not look overtaken by the old numbers.
        self._queued = self._overtaken_below = -1

    def promote_restored(self, step: int, meta: dict[str, Any]) -> concurrent.futures.Future | None:
        """After a restart, promote the step a restore loaded when the durable tier lacks it: a job
        that crashes before its next promotion would otherwise never reach the durable tier. Each
        rank promotes its part of the step from this node's local files (or, without a local tier,
        its RAM slot), in the durable lane; when some rank has no such copy (its node was replaced)
        the promotion waits for the next regular one. Collective; returns the promotion's future."""
        snap, source = self._restored_part(step)
        # One all-reduced flag (does any rank lack its part?), not a gather of every rank's answer:
        # the same decision everywhere, at a fixed size whatever the number of ranks.
        if self.groups.trainer.max_int64([int(snap is None)])[0]:
            log.warning("ckptstore: step %d is not in the durable tier, and not every rank holds its part on this "
                        "node: it is promoted with the next save that goes to the durable tier", step)
            return None
        assert snap is not None and source is not None
        promoted: concurrent.futures.Future = concurrent.futures.Future()
        job = StepJob(step, futures={"durable": promoted}, snap=snap, promote=True)
        if isinstance(source, NodePart):
            # Every rank's own header, with its structure's digest: the coordinator keeps the
            # lowest rank's of each structure, as a save's representatives are.
            job.shared, job.digest = dict(source.header or {}), str(source.part.get("digest", ""))
        else:
            job.shared = shared_of(source) if self.rank == 0 else {}  # the whole header, on the coordinator
        cadence: dict[str, Any] = meta["cadence"] if isinstance(meta.get("cadence"), dict) else {}
        job.cadence = {"durable": 0, "peer": cadence.get("peer", 0), "local": cadence.get("local", 0)}
        self.since["durable"] = 0
        self._owed = max(step, self._owed or step)
        place = self.durable_lane.reserve()
        if "slot" in snap.meta:  # read from a RAM slot: the next save into it waits for the promotion
            self._busy[snap.meta["slot"]] = promoted

        async def run() -> None:
            try:
                await Lane.run(place, lambda: self._promote(job, may_drop=False))
                _resolve(job.futures["durable"], step)
            except CheckpointError as exc:
                # Another writer committed the step meanwhile (the node agent persisting what the
                # killed run left, typically): the step is durable, which is all this promotion
                # was for; failing the next save over it would stop a healthy job.
                assert self.durable is not None
                try:
                    durable_now = step in await self.durable.steps()
                except Exception:  # noqa: BLE001 - the listing failing too: report the promotion's error
                    durable_now = False
                if not durable_now:
                    self._failed(job, exc)
                    return
                log.info("ckptstore: step %d was committed in %s by another writer while this restore promoted it; "
                         "that copy stands", step, self.durable.display(step))
                self._promoted.add(step)
                if self._owed is not None and self._owed <= step:
                    self._owed = None
                _resolve(job.futures["durable"], step)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
                self._failed(job, exc)

        done = self.loop.submit(run())
        self._outstanding = {f for f in self._outstanding if not f.done()} | {done}
        return job.futures["durable"]

    def _restored_part(self, step: int) -> tuple[Snapshot | None, Manifest | NodePart | None]:
        """This rank's part of ``step`` from a copy on this node, and what that copy holds of the
        step: its whole manifest, or this rank's part with the step's meta and its header."""
        try:
            if self.local is not None and step in self.local.node_steps():
                snap = self.local.snapshot_of(step, self.rank)
                if snap is not None:
                    return snap, self.local.node_part(step, self.rank) or self.local.manifest_sync(step)
            if step in self.ram.steps_sync():
                got = self.ram.snapshot_of(step)
                if got is not None:
                    return got
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: cannot read this rank's part of step %d on this node: %s", step, exc)
        return None, None

    def _in_flight(self) -> bool:
        return any(not f.done() for f in self._outstanding)

    def drain(self) -> None:
        """Wait until every step handed to the background is done (committed or failed)."""
        concurrent.futures.wait(list(self._outstanding))

    def close(self, *, agree: bool = True) -> None:
        """Drain, promote the last snapshot if it was not; the caller stops the loop. Without
        ``agree`` (this rank alone is leaving on an exception) no collective runs and nothing is
        promoted."""
        try:
            self.drain()
            self._handoff.close()
            last = self._last
            ok = agree and last is not None and self.errors.pending() is None
            promote = ok and self.durable is not None and last is not None and last.step not in self._promoted
            # With local_every > 1 the last snapshot may have reached no disk: it goes to the local tier
            # too, so that a closed store leaves its newest step on the node's disk, not in RAM alone.
            local = ok and self.local is not None and last is not None and not last.to_local
            if not agree:
                return
            if self.world > 1:
                # Every rank must want each: one all-reduce (the MAX of "this rank does not"), whatever
                # the world, not a gather of every rank's answer.
                refused = self.groups.trainer.max_int64([int(not promote), int(not local)])
                promote, local = not refused[0], not refused[1]
            if local:
                assert last is not None
                self.loop.submit(self._close_local(last)).result()
            if promote:
                assert last is not None
                self.loop.submit(self._close_promote(last)).result()
        finally:
            # The newest queued promotion is never dropped, so one always ran after a dropped one:
            # this only keeps a wait("durable") from hanging should that ever not hold.
            self._settle_overtaken(StorageError("the promotion that overtook this step's never ran; the step is in "
                                                "the RAM and local tiers only"))

    async def _close_local(self, job: StepJob) -> None:
        try:
            job.to_local = True
            await Lane.run(self.fast.reserve(), lambda: self._to_local_tier(job))
        except BaseException as exc:  # noqa: BLE001 - surfaced by close()
            log.error("ckptstore: writing step %d to the local tier on close failed: %s", job.step, exc)
            self.errors.add(job.step, exc)

    async def _close_promote(self, job: StepJob) -> None:
        try:
            await Lane.run(self.durable_lane.reserve(), lambda: self._promote(job, may_drop=False))
        except BaseException as exc:  # noqa: BLE001 - surfaced by close()
            log.error("ckptstore: promoting step %d on close failed: %s", job.step, exc)
            self.errors.add(job.step, exc)


def step_manifest(shared: dict[str, Any], parts: list[dict[str, Any]], world: int, *, job: str, step: int,
                  cadence: dict[str, Any], sdc: dict[str, Any] | None = None) -> Manifest:
    """The manifest of one step of a store, in every tier (the node agent builds it here too, from
    the parts it finds): ``shared`` holds the tree, the tensor table and the saved layouts."""
    manifest = build_manifest(shared["tree"], shared["tensors"], parts, world, layouts=shared.get("layouts"))
    manifest.meta.update({"step": step, "job": job, "cadence": cadence})
    if sdc is not None:
        manifest.meta["sdc"] = sdc
    return manifest


def parted_step_manifest(shared: dict[str, Any], summaries: list[dict[str, Any]], world: int, *, job: str, step: int,
                         cadence: dict[str, Any], sdc: dict[str, Any] | None = None) -> bytes:
    """:func:`step_manifest` in format 2.0, from the ranks' part summaries
    (checkpoint.sharded.part_summary): the bytes the durable tier commits."""
    meta: dict[str, Any] = {"step": step, "job": job, "cadence": cadence}
    if sdc is not None:
        meta["sdc"] = sdc
    return parted_manifest(shared["tree"], shared["tensors"], summaries, world, layouts=shared.get("layouts"),
                           meta=meta)


def local_manifest(parts: list[NodePart], where: str, *, job: str, step: int, cadence: dict[str, Any]) -> bytes:
    """The local tier's manifest of a step (format 2.0, as the durable tier's) from the node parts
    of every rank on this node's disk: each part's summary names its part file, and the chunks of
    the tensors a rank wrote whole are listed in their entries, so a rank loading a replicated
    tensor reads no part but its own."""
    by_rank, world, meta, shared = shared_of_parts(parts, where)
    try:
        shapes = {k: v[1] for k, v in shared["tensors"].items()}
        summaries = [part_summary(p.part, shapes) for p in by_rank.values()]
        sdc = meta.get("sdc") if isinstance(meta.get("sdc"), dict) else None  # the replica check's verdict
        return parted_step_manifest(shared, summaries, world, job=job, step=step, cadence=cadence, sdc=sdc)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptCheckpointError(f"{where}: the parts of the step do not make a manifest: {exc}",
                                     location=where) from None


def _shapes(job: StepJob) -> dict[str, Any]:
    """Key -> global shape of this rank's tensors (its structure's header), for its part summary."""
    header = job.header or job.shared
    return {k: v[1] for k, v in header.get("tensors", {}).items()}


def _summaries(group: Group, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's part summary on the coordinator (rank 0; an empty list elsewhere), point to point.
    Not a gather: an object gather pads every rank's message to the largest one, and the largest is
    a representative's (its header: tree and tensor table) or rank 0's own (the origin of every
    sharded tensor), so the coordinator would receive ranks x tensors. Each rank's message is its
    own size here, and rank 0's never travels."""
    got = group.from_senders(summary, list(range(group.world)))
    return [got[r] for r in range(group.world)] if group.rank == 0 else []


def shared_of(manifest: Manifest) -> dict[str, Any]:
    """What :func:`step_manifest` needs of a committed copy of the step: its tree, tensor table and layouts."""
    return {"tree": manifest.tree, "tensors": {k: (e.dtype, e.shape) for k, e in manifest.tensors.items()},
            "layouts": manifest.meta.get("layouts") or {}}


# The vote's int64 fields: steps at or past this limit take the gathered vote (they do not fit
# negated), and a field no rank sets is the smallest int64, which MAX passes over.
_STEP_LIMIT = 1 << 62
_NONE = -(1 << 63)
# What the interval plan carries (goodput/tracker.py ``inputs``): rank 0's values travel in the
# vote as the bits of float64s, the other ranks add nothing.
_PLAN_KEYS = ("cost_s", "mtbf_s", "step_s")


def _encode_plan(plan: Any) -> tuple[list[int], bool]:
    """The vote's plan fields of ``plan`` (rank 0's interval inputs, None elsewhere), and whether it
    fits them: present, then each value's bits (or the MAX identity for None)."""
    if plan is None:
        return [0] + [_NONE] * len(_PLAN_KEYS), True
    if not isinstance(plan, dict) or tuple(plan) != _PLAN_KEYS or not all(
            v is None or (isinstance(v, float) and v == v) for v in plan.values()):
        return [0] + [_NONE] * len(_PLAN_KEYS), False
    bits = [_NONE if v is None else struct.unpack("<q", struct.pack("<d", v))[0] for v in plan.values()]
    # A value whose bits are the smallest int64 (-0.0) could not be told from None: gather instead.
    return [1, *bits], all(v is None or b != _NONE for v, b in zip(plan.values(), bits))


def _decode_plan(fields: list[int]) -> dict[str, Any] | None:
    if not fields[0]:
        return None
    return {k: None if b == _NONE else struct.unpack("<d", struct.pack("<q", b))[0]
            for k, b in zip(_PLAN_KEYS, fields[1:])}


def same_table(a: dict[str, list[dict[str, Any]]], b: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether two chunk tables address the same bytes alike (files, offsets, lengths, checksums)."""
    def table(t: dict[str, list[dict[str, Any]]]) -> dict[str, list[tuple[Any, ...]]]:
        return {k: [(c["file"], c["offset"], c["length"], c["codec"], c["checksum"]) for c in cs] for k, cs in t.items()}

    return table(a) == table(b)


def _with_header(part: dict[str, Any], job: StepJob) -> dict[str, Any]:
    """``part`` as it travels to whoever builds the whole manifest: with its structure's header
    (and digest) when this rank carries one (a save's representatives)."""
    return {**part, "shared": job.shared, "shared_digest": job.digest} if job.shared else part


def _headers(parts: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """The headers taken out of gathered ``parts`` (in place), the lowest rank's of each
    structure, merged in rank order."""
    chosen: dict[str, tuple[int, dict[str, Any]]] = {}
    for r, p in enumerate(parts):
        if "shared" in p:
            header, digest = p.pop("shared"), p.pop("shared_digest", None)
            chosen.setdefault(f"#{r}" if digest is None else str(digest), (r, header))
    return merge_structures(sorted(chosen.values(), key=lambda c: c[0]), f"step {step}")


def _resolve(f: concurrent.futures.Future | None, value: Any) -> None:
    if f is not None and not f.done():
        f.set_result(value)


def _threaded(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    return lambda: asyncio.to_thread(fn)


def _box_numbers(metas: list[Any]) -> list[int]:
    """Which box of its key each entry is on this rank (0, 1, ...): the later ones get names of their own."""
    seen: dict[str, int] = {}
    out = []
    for m in metas:
        out.append(seen.get(m.key, 0))
        seen[m.key] = out[-1] + 1
    return out


def _storage_of(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


class _Handoff:
    """Hands each save's background run to the loop from a thread of its own.

    Waking the loop's thread writes to its self-pipe, a system call that releases the GIL: the
    trainer's thread then waited for the woken loop (and the checksum worker it starts) to hand the
    GIL back, a switch interval (5 ms) or more inside ``save`` at every save, about a tenth of the
    blocking time of a 64 MiB state. Releasing a lock wakes a waiting thread without releasing the
    GIL, so the trainer's thread only puts the run in a queue and returns; the hand-off thread wakes
    the loop once it gets the GIL, when the trainer next releases it. One thread, so runs start in
    the order of their saves."""

    def __init__(self, loop: LoopThread) -> None:
        self._loop = loop
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, coro: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        """Run ``coro`` on the loop; its future resolves as the run ends, like ``LoopThread.submit``'s."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckptstore-handoff")

        def start() -> None:
            try:
                running = self._loop.submit(coro)
            except BaseException as exc:  # noqa: BLE001 - a stopped loop: the save's waiters learn of it
                coro.close()
                done.set_exception(exc)
                return
            running.add_done_callback(lambda f: _copy_outcome(f, done))

        self._pool.submit(start)
        return done

    def close(self) -> None:
        """Stop the hand-off thread (every run handed to it has been handed on by then)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copy_outcome(src: concurrent.futures.Future[None], dst: concurrent.futures.Future[None]) -> None:
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class _Found:
    """A save's state as its fingerprint sees it: the tree, the fingerprint (None when the state
    has none), and the per-rank values' bytes, encoded once for both the fingerprint and a collect
    of the same save."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.blobs: list[torch.Tensor] = []
        self._encoded: list[bytes] = []
        # A process that never imported torch.distributed.tensor holds no DTensor, and importing
        # it here would cost the first save seconds (it pulls in sympy).
        module = sys.modules.get("torch.distributed.tensor")
        dtensor = getattr(module, "DTensor", None) if module is not None else None
        # Without grad, DTensor.to_local() (the public path, where torch lacks the private
        # attributes) is the local tensor itself, not an autograd view (tens of microseconds each).
        with torch.no_grad():
            self.fingerprint: tuple[list[Any], list[Any]] | None = fingerprint(tree, self._per_rank, dtensor)
        if self.fingerprint is None:
            self._encoded = []

    def _per_rank(self, obj: Any) -> tuple[torch.Tensor, Any] | None:
        if type(obj) is PerRank:
            data = encode_value(obj.value)
            self._encoded.append(data)
            blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.blobs.append(blob)
            return blob, PerRank  # its length moves only the slot's tail (Pipeline._reuse); its bytes are values
        return None

    def collect(self, rank: int) -> Collected:
        """The full walk of the state, for planning; per-rank values get the bytes the fingerprint saw."""
        encoded = iter(self._encoded)
        with torch.no_grad():
            return collect(self.tree, rank, lambda value: next(encoded, None) or encode_value(value))
