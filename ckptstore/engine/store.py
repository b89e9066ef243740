"""CheckpointStore: save returns once the snapshot is in RAM; the rest happens in the background.

``save`` copies the state into a reused RAM-tier slot (the only part the training loop pays for)
and hands the slot to one background asyncio loop per process. For each step that loop, in order:
checksums the staged copy; gathers every rank's part and commits the step in RAM with its global
manifest; writes each rank's bytes to the local directory and commits there (manifest last); and
promotes every ``durable_every``-th snapshot (and the last one, on close) to the durable URL, applying
retention after each commit. In a process group each rank's snapshot is a shard of one sharded,
layout-independent checkpoint: every tier holds ordinary ``load_sharded`` directories.

Collectives run on two gloo process groups of the store's own (one for the trainer's thread:
agreeing on each save and on the step to restore; one for the background loop), never on the
trainer's group, and the background steps run strictly one after another, so every rank issues
them in the same order.

``restore`` finds the newest step every rank can load a sound copy of, trying RAM, then local,
then durable for its own shard and falling back on any damage; all ranks agree on the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import logging
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._faults import crashpoint
from .._gc import gc_paused
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    StorageError,
)
from ..format.container import align_up
from ..format.manifest import Manifest
from ..planning.placement import node_of_ranks, replica_holders, replicas_held
from ..storage import s3
from ..tiers.base import Snapshot, Tier, _in_thread
from ..tiers.directory import DirectoryTier, step_name
from ..tiers.ram import Layout, RamTier, Staged
from .exchange import exchange, get_manifest, needed_chunks, node_inventory, node_steps
from ..checkpoint.materialize import decode_value, encode_value
from ..checkpoint.sharded import BLOCK_SIZE, MANIFEST, Group, _build_manifest, _collect, _digest, _my_writes, load_manifest

log = logging.getLogger("ckptstore")
TIERS = ("ram", "local", "peer", "durable")
_RESTORE_BUFFER = 256 << 20


class _Loop:
    """The one background event loop that owns this store's I/O."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ckptstore-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


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
        """Whether the snapshot reached ``tier`` (or failed); True when it never goes there."""
        f = self._future(tier)
        return f is None or f.done()

    def wait(self, tier: str = "local", timeout: float | None = None) -> None:
        """Block until the snapshot is committed at ``tier``; re-raises a background failure.
        Returns at once for a tier this step does not go to (or for a skipped save)."""
        f = self._future(tier)
        if f is not None:
            f.result(timeout)

    def _future(self, tier: str) -> concurrent.futures.Future | None:
        if tier not in TIERS:
            raise InvalidArgumentError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        return self._futures.get(tier)

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ", ".join(f"{t}={'done' if self.done(t) else 'pending'}" for t in TIERS)
        return f"SaveHandle(step={self.step}, {state})"


@dataclass
class _Job:
    """One step on its way through the pipeline."""

    step: int
    staged: Staged | None
    error: BaseException | None
    tree: Any = None
    tensors: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    boxes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    frozen_end: int = 0
    snap: Snapshot | None = None
    fast_done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # Done once nothing reads the staged slot any more (the next save into it waits for this).
    slot_free: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    local_part: dict[str, Any] | None = None  # this rank's part in the local tier, once committed there
    durable_data: Any = None  # the local files mapped read-only, what the promotion reads instead of the slot
    parts: list[dict[str, Any]] = field(default_factory=list)  # every rank's RAM part, after the gather
    manifest: bytes = b""
    shared: dict[str, Any] = field(default_factory=dict)  # rank 0's tree and tensor table, after the gather
    peer: concurrent.futures.Future | None = None  # this step's replication, when it replicates
    check: set[str] = field(default_factory=set)  # keys staged only to compare replicas (sdc), never written
    live: dict[str, Any] = field(default_factory=dict)  # CPU replicas another rank writes: hashed in place (sdc)
    replicated: dict[str, tuple] = field(default_factory=dict)  # key -> (offsets, sizes, kind) of replicated boxes
    sdc: list[dict[str, Any]] | None = None  # replica mismatches found at this step (None: not checked)


def _write_tuning(tuning: Any) -> Any:
    """``tuning=``: the settings ``ckptstore bench`` recommends (its JSON file, or a dict), checked
    before anything is created so a bad file fails the constructor with a clear error."""
    if tuning is None:
        return None
    from ..storage.tuning import load_tuning

    return load_tuning(tuning)


class CheckpointStore:
    """Tiered asynchronous checkpoints of one training job (see the module docstring).

    ``frozen``: an optional predicate on manifest keys naming tensors that do not change (frozen
    weights in fine-tuning). Their bytes are copied only when their storage or version counter
    moved, and at every ``refresh_every``-th save (writes through ``.data``, numpy or DLPack do not
    bump the version counter), and the tiers keep them in a file of their own that later steps
    link instead of rewriting while its checksums are unchanged.

    ``peer_replicas``: copies of each rank's snapshot kept in the RAM of ranks on other nodes
    (every ``peer_every``-th snapshot; also on their disks with ``peer_to_local``), so a restart
    after a node loss restores without the durable tier. ``node`` names this rank's node when the
    launcher's environment does not. A peer that does not answer within ``peer_timeout_s`` fails
    only that replication, and replication stops for the run. ``timeout_s`` bounds every other
    collective of the store.

    ``interval`` (seconds, a duration such as ``"20m"``, or ``"auto"`` with ``mtbf``) makes
    :meth:`should_save` answer when to checkpoint; ``"auto"`` plans Daly's optimal interval from the
    blocking cost the store measures and the MTBF, which the failure history in the event log refines.
    ``events=True`` keeps an append-only event log (saves, restores, restarts) in ``<local>/events.jsonl``
    (or ``events=PATH``) for ``ckptstore goodput``. ``sdc="warn"`` or ``"raise"`` compares the checksums of
    tensors that data-parallel replicas must hold identically, and records any mismatch in the manifest.
    ``durable_timeout_s`` bounds each promotion to the durable tier, retries included (default
    0.9 x ``timeout_s``; in a process group it must be below ``timeout_s``): past it the step fails
    in the durable tier only, with a StorageError (ETIMEDOUT) raised once to the trainer, its RAM
    and local copies stay, and the next promotion starts afresh.
    ``tuning``: bulk-write settings for the local and durable tiers (write chunk size, S3 part size,
    writes in flight) as recommended by ``ckptstore bench --json FILE``: that file's path, or a dict
    of the same shape; they win over the ``CKPTSTORE_S3_*`` environment variables.
    """

    def __init__(
        self,
        job: str,
        *,
        local: str | os.PathLike[str] | None = None,
        durable: str | None = None,
        durable_every: int = 10,
        keep_local: int | None = 3,
        keep_durable: int | None = None,
        ram_budget_bytes: int | None = None,
        ram_dir: str = "/dev/shm",
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        policy: str = "block",
        durable_compression: str | None = None,
        frozen: Callable[[str], bool] | None = None,
        refresh_every: int = 10,
        timeout_s: float = 600.0,
        peer_replicas: int = 0,
        peer_every: int = 1,
        node: Any = None,
        peer_timeout_s: float = 60.0,
        peer_to_local: bool = False,
        interval: str | float | None = None,
        mtbf: str | float | None = None,
        events: bool | str | os.PathLike[str] = False,
        sdc: str = "off",
        durable_timeout_s: float | None = None,
        tuning: str | os.PathLike[str] | dict[str, Any] | None = None,
    ) -> None:
        write_tuning = _write_tuning(tuning)
        if policy not in ("block", "skip"):
            raise InvalidArgumentError(f"policy must be 'block' or 'skip', not {policy!r}")
        for name, value in (("durable_every", durable_every), ("keep_local", keep_local), ("keep_durable", keep_durable),
                            ("refresh_every", refresh_every), ("peer_every", peer_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"{name} must be a positive int (or None where allowed), not {value!r}")
        if ram_budget_bytes is not None and (not isinstance(ram_budget_bytes, int) or ram_budget_bytes < 1):
            raise InvalidArgumentError(f"ram_budget_bytes must be a positive int or None, not {ram_budget_bytes!r}")
        if durable_compression not in (None, "zstd"):
            raise InvalidArgumentError(f"durable_compression must be None or 'zstd', not {durable_compression!r}")
        if durable_timeout_s is None:
            durable_timeout_s = 0.9 * timeout_s
        if isinstance(durable_timeout_s, bool) or not isinstance(durable_timeout_s, (int, float)) or durable_timeout_s <= 0:
            raise InvalidArgumentError(f"durable_timeout_s must be a positive number of seconds, not {durable_timeout_s!r}")
        self.durable_timeout_s = float(durable_timeout_s)
        local = os.fspath(local) if local is not None else None
        self.job, self.durable_every, self.keep_local, self.keep_durable = job, durable_every, keep_local, keep_durable
        self.policy, self.ram_budget_bytes = policy, ram_budget_bytes
        self.frozen, self.refresh_every = frozen, refresh_every
        if not isinstance(peer_replicas, int) or isinstance(peer_replicas, bool) or peer_replicas < 0:
            raise InvalidArgumentError(f"peer_replicas must be a non-negative int, not {peer_replicas!r}")
        self._fg, self._bg, self._bg_durable, self._bg_peer, self._p2p = _groups(process_group, timeout_s, peer_timeout_s)
        self.rank, self.world = self._fg.rank, self._fg.world
        if self.world > 1 and self.durable_timeout_s >= timeout_s:
            # Past timeout_s the other ranks' collective waiting on this promotion fails and breaks
            # the group; the promotion must give up first, so that every rank learns why.
            raise InvalidArgumentError(
                f"durable_timeout_s={durable_timeout_s} must be below timeout_s={timeout_s} in a process group"
            )
        # Which node each rank runs on decides where replicas go: never on the source's node.
        self.nodes = node_of_ranks(self._fg.all_gather(_node_identity(node, self.rank)))
        holders = replica_holders(self.nodes, peer_replicas)
        self._send_to, self._hold_for = holders[self.rank], replicas_held(holders, self.rank)
        self.peer_replicas, self.peer_every, self.peer_timeout_s = peer_replicas, peer_every, peer_timeout_s
        self._peer_off = False  # set when a peer did not answer in time: replication stops for this run
        if peer_to_local and local is None:
            raise InvalidArgumentError("peer_to_local=True keeps replicas in the local directory: pass local= too")
        self.peer_to_local = peer_to_local
        self.ram = RamTier(job, self.rank, ram_dir=ram_dir, slots=2)
        # Of the ranks sharing a local directory (one node), the lowest writes its manifests,
        # sweeps it and applies retention; rank 0 does so for the shared durable URL.
        where = (socket.gethostname(), os.path.realpath(local) if local else None)
        peers = self._fg.all_gather(where)
        local_writer = self.rank == min(r for r, w in enumerate(peers) if w == where)
        self.local = DirectoryTier("local", local, manifest_writer=local_writer, tuning=write_tuning) if local else None
        self.durable = (
            DirectoryTier("durable", durable, storage_options=storage_options, codec=durable_compression,
                          manifest_writer=self.rank == 0, tuning=write_tuning)
            if durable else None
        )
        if self.local is not None and local_writer:
            self.local.sweep_sync()
        if self.durable is not None and self.rank == 0:
            try:
                self.durable.sweep_sync()
            except Exception as exc:  # noqa: BLE001 - housekeeping: an unreachable store must not stop a start
                log.warning("ckptstore: cannot sweep the durable tier %s (what a crashed save left stays until the "
                            "next start): %s", self.durable.root, exc)
        self._fg.all_gather(None)  # nobody saves into a directory another rank is still sweeping
        # Stage next into a slot other than the one holding the newest committed snapshot, so a
        # crash while staging never destroys the newest RAM copy.
        mine = self.ram._docs(self.rank)
        if mine:
            self.ram._next = (max(mine, key=lambda d: d["step"])["slot"] + 1) % self.ram.nslots
        self._loop = _Loop()
        self._busy: dict[int, concurrent.futures.Future] = {}  # slot -> the pipeline using it
        # Two lanes, each first-in first-out so that its collectives keep one order on every rank:
        # RAM + local commits, and durable promotions, which are slower and must not hold up the
        # next step's RAM and local commits.
        self._fast_tail: concurrent.futures.Future | None = None  # the fast part of the last pipeline
        self._lanes: dict[str, asyncio.Future] = {}  # lane -> its last work (touched on the loop only)
        self._outstanding: set[concurrent.futures.Future] = set()
        self._last_ram: concurrent.futures.Future | None = None  # the RAM commit of the newest save
        # Background failures not yet raised to the caller, by step; steps up to _reported were.
        self._errors: list[tuple[int, BaseException]] = []
        self._reported = -1
        self._last: _Job | None = None  # the newest step committed in RAM (close promotes it)
        self._last_step: int | None = None
        self._promoted: set[int] = set()
        self._saves = 0
        self._slots_set = False
        self.skipped = 0
        self._closed = False
        self._goodput_init(interval, mtbf, events, sdc)

    # ------------------------------------------------------------------------------ saving

    def _pending(self) -> tuple[int, BaseException] | None:
        fresh = [(step, exc) for step, exc in self._errors if step > self._reported]
        return fresh[0] if fresh else None

    def _raise_pending(self, pending: tuple[int, BaseException] | None) -> None:
        """Raise the oldest background failure once: later copies of it (another rank's report of
        the same failed step arriving late) are dropped."""
        if pending is None:
            return
        step, exc = pending
        self._reported = max(self._reported, step)
        self._errors = [(s, e) for s, e in self._errors if s > self._reported]
        raise CheckpointError(f"an earlier background save (step {step}) failed: {exc}") from exc

    @gc_paused
    def save(self, step: int, state: Any) -> SaveHandle:
        """Stage ``state`` in RAM (the only blocking part) and persist it in the background.

        In a process group every rank calls ``save`` with the same step. With ``policy="skip"``
        a save that finds no free slot returns a skipped handle (counted in ``skipped``) instead
        of waiting; all ranks skip together.
        """
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed")
        t_enter = time.perf_counter()
        plan = self._plan_inputs() if self.rank == 0 else None
        pending = self._pending()
        if self.world == 1:
            self._raise_pending(pending)
        error: BaseException | None = None
        busy = False
        job = _Job(step, None, None)
        items: list[tuple[str, Any]] = []
        frozen_count = 0
        breaks: frozenset[int] = frozenset()
        try:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise InvalidArgumentError(f"step must be a non-negative int, not {step!r}")
            if self._last_step is not None and step <= self._last_step:
                raise InvalidArgumentError(f"step {step} is not after the last saved step {self._last_step}")
            local = _collect(_as_state_dict(state), self.rank, encode_value)
            mine = _my_writes(local, self.world, self.rank)
            frozen = [m for m in mine if self.frozen is not None and self.frozen(m.key)]
            rest = [m for m in mine if not (self.frozen is not None and self.frozen(m.key))]
            items = [(m.key, local.items[(m.key, m.offsets, m.sizes)]) for m in frozen + rest]
            breaks = frozenset({len(frozen), len(items)})  # where the frozen and the replica-check entries end
            items += self._sdc_items(local, mine, job)
            frozen_count = len(frozen)
            job.tree, job.tensors, job.digest = local.tree, local.tensors, _digest(local)
            job.boxes = {m.key: m.offsets for m in mine}
            self._size_slots(items, breaks)
            pipeline = self._busy.get(self.ram._next)
            busy = pipeline is not None and not pipeline.done()
        except Exception as exc:  # noqa: BLE001 - in a group every rank must reach the agreement first
            error = exc
        if self.world > 1:
            # One vote per save keeps the ranks together: a background failure that one rank has
            # already seen (the others may learn of it a moment later) is raised on all of them.
            votes = self._fg.all_gather({"step": step, "busy": busy, "error": None if error is None else str(error),
                                         "peer_off": self._peer_off, "plan": plan,
                                         "pending": None if pending is None else (pending[0], str(pending[1]))})
            reports = sorted({tuple(v["pending"]) for v in votes if v["pending"]})
            if reports:
                if pending is None or pending[0] != reports[0][0]:
                    pending = (reports[0][0], CheckpointError(reports[0][1]))
                self._raise_pending(pending)
            others = [f"rank {r}: {v['error']}" for r, v in enumerate(votes) if v["error"] and r != self.rank]
            if error is None and others:
                error = CheckpointError(f"save of step {step} failed on other ranks: " + "; ".join(others))
            if error is None and len({v["step"] for v in votes}) > 1:
                error = InvalidArgumentError(
                    f"ranks passed different steps to save: {[v['step'] for v in votes]}; every rank saves the same step"
                )
            busy = any(v["busy"] for v in votes)
            self._peer_off = any(v["peer_off"] for v in votes)
            plan = votes[0]["plan"]
        if error is not None:
            raise error
        self._set_plan(step, plan)
        if busy and self.policy == "skip":
            self.skipped += 1
            log.warning("ckptstore: step %d skipped: the previous snapshots are still being persisted", step)
            self._event("skip", step=step)
            return SaveHandle(step, {}, skipped=True)
        slot = self.ram._next
        t_wait = time.perf_counter()
        # Restaging a slot destroys the snapshot in it: first, the slot's own pipeline must be done
        # with it, and the previous snapshot must be committed in RAM (in another slot), so that a
        # crash while staging always leaves the newest committed snapshot behind. The second wait
        # matters after a restart, when the slots hold snapshots no pipeline of ours tracks.
        holders = [f for f in (self._busy.get(slot), self._last_ram) if f is not None]
        if holders:
            concurrent.futures.wait(holders)
        waited = time.perf_counter() - t_wait
        self._saves += 1
        refresh = self._saves % self.refresh_every == 0
        may_skip = frozenset() if refresh else frozenset(k for k, _ in items[:frozen_count])
        try:
            job.staged = self.ram.stage(step, items, may_skip=may_skip, breaks=breaks)
        except BaseException as exc:
            job.error = exc  # the pipeline still runs, so the other ranks learn of it and nobody hangs
            if self.world == 1:
                raise
        self._sdc_hash_live(job)
        if job.staged is not None and frozen_count:
            e = job.staged.layout.entries[frozen_count - 1]
            job.frozen_end = align_up(e.offset + e.nbytes)
        self._last_step = step
        promote = self.durable is not None and self._saves % self.durable_every == 0  # every N-th snapshot
        replicate = self.peer_replicas > 0 and self._saves % self.peer_every == 0 and not self._peer_off
        futures: dict[str, concurrent.futures.Future | None] = {
            "ram": concurrent.futures.Future(),
            "local": concurrent.futures.Future() if self.local else None,
            "peer": concurrent.futures.Future() if replicate else None,
            "durable": concurrent.futures.Future() if promote else None,
        }
        self._last_ram = futures["ram"]
        job.peer = futures["peer"]
        prev, self._fast_tail = self._fast_tail, job.fast_done
        fut = self._loop.submit(self._pipeline(prev, job, futures, promote, replicate))
        self._outstanding = {f for f in self._outstanding if not f.done()} | {fut}
        if job.staged is not None:
            self._busy[job.staged.slot] = job.slot_free
        if job.error is not None:
            raise job.error
        handle = SaveHandle(step, futures, waited_s=waited, staged_s=job.staged.seconds if job.staged else 0.0)
        self._saved(job, handle, time.perf_counter() - t_enter)
        return handle

    def _size_slots(self, items: list[tuple[str, Any]], breaks: frozenset[int]) -> None:
        """Fix the number of staging slots at the first save, from ram_budget_bytes."""
        if self._slots_set:
            return
        size = Layout.of(items, breaks).total
        if self.ram_budget_bytes is not None:
            slots = self.ram_budget_bytes // size
            if slots < 1:
                raise InvalidArgumentError(
                    f"ram_budget_bytes={self.ram_budget_bytes} is smaller than one snapshot of this state "
                    f"({size} bytes on rank {self.rank}); raise it to at least {size} ({2 * size} lets one snapshot "
                    "persist while the next is taken)"
                )
            self.ram.nslots = slots
            self.ram._next %= slots
        self._slots_set = True

    async def _agree(self, what: str, fn: Callable[[], Any], group: Group | None = None) -> list[Any]:
        """Run ``fn`` on this rank, then learn every rank's outcome: all ranks return the list of
        results, or all raise (naming the ranks that failed). Nobody is left waiting in a collective."""
        local_exc: BaseException | None = None
        try:
            status: dict[str, Any] = {"ok": True, "value": await _in_thread(fn)}
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            local_exc = exc
            status = {"ok": False, "error": f"rank {self.rank} ({socket.gethostname()}): {exc}"}
        group = group or self._bg
        statuses = await _in_thread(group.all_gather, status) if self.world > 1 else [status]
        errors = [s["error"] for s in statuses if not s["ok"]]
        if errors:
            if self.world == 1 and local_exc is not None:
                raise local_exc
            raise CheckpointError(f"{what} failed: " + "; ".join(errors)) from local_exc
        return [s["value"] for s in statuses]

    def _manifest(self, job: _Job, parts: list[dict[str, Any]]) -> Manifest:
        manifest = _build_manifest(job.shared["tree"], job.shared["tensors"], parts, self.world)
        manifest.meta.update({"step": job.step, "job": self.job})
        if job.sdc is not None:
            manifest.meta["sdc"] = {"policy": self.sdc, "mismatches": job.sdc}
        return manifest

    async def _pipeline(
        self, prev: concurrent.futures.Future | None, job: _Job, futures: dict[str, concurrent.futures.Future | None],
        promote: bool, replicate: bool,
    ) -> None:
        try:
            if prev is not None:
                await asyncio.wrap_future(prev)
            try:
                await self._fast_part(job, futures)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
                self._failed(job, futures, exc)
                return
            finally:
                job.fast_done.set_result(None)
            lanes, slot_readers = [], []
            if replicate:
                lanes.append(asyncio.ensure_future(self._in_lane("peer", job, futures, self._replicate)))
                slot_readers.append(lanes[-1])
            if promote:
                # A promotion reads the step's local files when there are some, not the slot: a slow or
                # stuck object store then never holds a RAM slot, so it never blocks the next saves.
                job.durable_data = self._local_view(job)
                lanes.append(asyncio.ensure_future(self._in_lane("durable", job, futures, self._promote)))
                if job.durable_data is None:
                    slot_readers.append(lanes[-1])
            await asyncio.gather(*slot_readers)
            _resolve(job.slot_free, None)
            await asyncio.gather(*lanes)
        finally:
            _resolve(job.slot_free, None)

    async def _in_lane(self, lane: str, job: _Job, futures: dict[str, concurrent.futures.Future | None],
                       work: Callable[[_Job], Any]) -> None:
        """Run ``work`` after the previous step's work in the same lane (one order on every rank)."""
        prev, mine = self._lanes.get(lane), asyncio.get_running_loop().create_future()
        self._lanes[lane] = mine
        try:
            if prev is not None:
                await prev
            await work(job)
            _resolve(futures[lane], job.step)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
            if lane == "peer":  # a missed replica costs a fallback at restore, never the run
                # A peer that does not answer within peer_timeout_s leaves the peer group in an
                # unknown state: replication stops for this run (the ranks agree on the next save)
                # rather than risk a collective that never returns.
                self._peer_off = True
                log.error("ckptstore: replicating step %d to peers failed, replication is off for the rest of this "
                          "run (the local and durable tiers go on): %s", job.step, exc)
                f = futures["peer"]
                if f is not None and not f.done():
                    f.set_exception(exc)
            else:
                self._failed(job, futures, exc)
        finally:
            mine.set_result(None)

    async def _replicate(self, job: _Job) -> None:
        """Send this rank's staged bytes to its holders and take in the replicas it holds, over the
        peer group, and commit each received replica in this node's RAM with the step's manifest.

        The bytes are not hashed again on receipt: the manifest carries the checksums computed from
        the staged copy, and every restore verifies every byte it reads against them and moves on
        to the next copy on a mismatch. A second pass here would cost the training node's CPU on
        every step for a check that reading does anyway (on this 2-core VM it took replication
        from 1.04x to 0.77x a raw gloo exchange)."""
        import torch.distributed as dist

        assert job.snap is not None
        data, parts, manifest = job.snap.data, job.parts, job.manifest

        def run() -> None:
            t0 = time.perf_counter()
            works, received = [], []
            for src in self._hold_for:
                size = int(parts[src]["bytes"])
                slot, buf = self.ram.replica_buffer(src, size)
                works.append(dist.irecv(buf, group=self._bg_peer.pg, group_src=src))
                received.append((src, slot, buf, size))
            for dst in self._send_to:
                works.append(dist.isend(data, group=self._bg_peer.pg, group_dst=dst))
            for work in works:
                if work is not None:
                    work.wait()
            for src, slot, buf, size in received:
                self.ram.commit_replica(src, slot, job.step, size, manifest)
                if self.peer_to_local and self.local is not None:
                    _replica_to_local(self.local.root, job.step, src, buf, manifest, self.keep_local)
            assert job.snap is not None
            job.snap.meta.setdefault("timings", {})["replicate_s"] = round(time.perf_counter() - t0, 6)

        await self._agree(f"replicating step {job.step} to peers", run, self._bg_peer)

    def _failed(self, job: _Job, futures: dict[str, concurrent.futures.Future | None], exc: BaseException) -> None:
        log.error("ckptstore: background save of step %d failed: %s", job.step, exc)
        self._errors.append((job.step, exc))
        for f in futures.values():
            if f is not None and not f.done():
                f.set_exception(exc)

    async def _fast_part(self, job: _Job, futures: dict[str, concurrent.futures.Future | None]) -> None:
        """Checksums, the RAM commit and the local tier, in step order."""
        def stage_part() -> dict[str, Any]:
            if job.error is not None:
                raise job.error
            assert job.staged is not None
            crashpoint("ram.staged", str(job.step))
            t_hash = time.perf_counter()
            self.ram.checksums(job.staged, BLOCK_SIZE)
            job.snap = self.ram.snapshot(job.staged, self.world, job.boxes, job.frozen_end)
            self._stage_timings(job, time.perf_counter() - t_hash)
            part = self.ram.put_sync(job.snap)
            part["sdc"] = self._sdc_digest(job)
            part.update(step=job.step, digest=job.digest)
            if self.rank == 0:
                part["shared"] = {"tree": job.tree, "tensors": job.tensors}
            return part

        parts = await self._agree(f"staging step {job.step}", stage_part)
        if len({p["step"] for p in parts}) > 1 or len({p["digest"] for p in parts}) > 1:
            raise CheckpointError(
                f"ranks staged different steps or different tensors (keys, dtypes or global shapes) for step "
                f"{job.step}: every rank must save the same state dict structure at the same step"
            )
        job.shared = parts[0].pop("shared")
        for p in parts[1:]:
            p.pop("shared", None)
        job.sdc = await self._sdc_compare(job, parts)
        manifest = self._manifest(job, parts)
        job.parts, job.manifest = parts, manifest.to_json_bytes()
        crashpoint("ram.before_commit", str(job.step))
        await self._agree(f"committing step {job.step} in RAM", lambda: self.ram.commit_sync(job.step, manifest))
        crashpoint("ram.committed", str(job.step))
        self._last = job
        _resolve(futures["ram"], job.step)
        if self.local is not None:
            job.local_part = (await self._to_tier(self.local, job, self._bg))[self.rank]
            _resolve(futures["local"], job.step)
            await self._retain(self.local, self.keep_local)
        self._sdc_verdict(job)

    async def _to_tier(self, tier: Tier, job: _Job, group: Group, deadline: float | None = None,
                       snap: Snapshot | None = None) -> list[dict[str, Any]]:
        """Write the step to ``tier`` (from ``snap``, by default the staged slot's) and commit it;
        returns every rank's part."""
        assert job.snap is not None
        snap = snap or job.snap
        what = f"durable_timeout_s={self.durable_timeout_s:g}"
        try:
            parts = await self._agree(f"writing step {job.step} to the {tier.name} tier",
                                      lambda: s3.run_with_deadline(deadline, what, self._put, tier, snap, job), group)
            manifest = self._manifest(job, parts)
            await self._agree(f"committing step {job.step} in the {tier.name} tier",
                              lambda: s3.run_with_deadline(deadline, what, tier.commit_sync, job.step, manifest), group)
        except BaseException:
            # Every rank is past its writes (the agreement said so): each removes the files it
            # created for the failed step, so a full disk is not kept full by the attempt that
            # found it full (and another writer's files of the same step are left alone).
            if isinstance(tier, DirectoryTier):
                try:
                    await _in_thread(tier.discard_sync, job.step)
                except (CheckpointError, OSError) as exc:
                    log.warning("ckptstore: cannot remove what the failed save of step %d left in %s: %s", job.step,
                                tier.display(job.step), exc)
            raise
        return parts

    async def _promote(self, job: _Job) -> None:
        assert self.durable is not None
        # The deadline bounds the whole promotion, retries included (one retry layer, botocore's,
        # bounded per request: storage/s3.py); past it the step fails in the durable tier only.
        deadline = time.monotonic() + self.durable_timeout_s
        assert job.snap is not None
        snap = job.snap if job.durable_data is None else dataclasses.replace(job.snap, data=job.durable_data)
        try:
            await self._to_tier(self.durable, job, self._bg_durable, deadline, snap)
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
        await self._retain(self.durable, self.keep_durable)

    def _local_view(self, job: _Job) -> Any:
        """This rank's committed local files of the step, mapped read-only and addressed like the
        slot (see _LocalFiles), or None (no local tier, or a file cannot be mapped: the slot is read).
        Mapped now, right after the local commit: a mapping keeps the bytes readable even when
        retention removes the step's files before a queued promotion gets to them."""
        part, snap = job.local_part, job.snap
        if part is None or snap is None:
            return None
        frozen = {c["file"] for k, cs in part["chunks"].items() for c in cs if snap.chunks[k] and
                  snap.chunks[k][0]["offset"] < snap.frozen_end}
        rest = {c["file"] for k, cs in part["chunks"].items() for c in cs} - frozen
        if len(frozen) > 1 or len(rest) > 1:
            return None
        try:
            assert self.local is not None
            root = os.path.join(self.local.root, step_name(job.step))
            return _LocalFiles(_map(os.path.join(root, frozen.pop())) if frozen else None,
                               _map(os.path.join(root, rest.pop())) if rest else None, snap.frozen_end, snap.nbytes)
        except (OSError, ValueError) as exc:
            log.warning("ckptstore: promoting step %d from its RAM slot (cannot map its local files: %s)", job.step, exc)
            return None

    async def _retain(self, tier: DirectoryTier, keep: int | None) -> None:
        """Delete the oldest committed steps beyond ``keep``: a step goes only once ``keep`` newer
        ones are committed in the same tier, so the newest step of a tier is never deleted."""
        if keep is None or not tier.manifest_writer:
            return
        try:
            steps = await tier.steps()
            for step in steps[:-keep]:
                await tier.remove(step)
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: retention in the %s tier failed (old steps are kept): %s", tier.name, exc)

    # ------------------------------------------------------------------------------ restoring

    @gc_paused
    def restore(self, state: Any, *, per_rank: str = "error") -> int | None:
        """Load the newest step with a sound copy into ``state`` in place; None when no tier holds
        any checkpoint of this job. Raises CorruptCheckpointError (listing what was tried) when
        checkpoints exist but no step has a sound copy for every rank.

        ``state`` is a state dict (tensors filled in place, other leaves replaced) or a
        :class:`~ckptstore.TrainState` (every part restored, the RNG states last).
        ``per_rank="skip"`` keeps the current per-rank values (RNG states, per-rank loader
        positions) when the checkpoint was saved at another world size."""
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed")
        if per_rank not in ("error", "skip"):
            raise InvalidArgumentError(f"per_rank={per_rank!r}: use 'error' or 'skip'")
        from ..train_state import TrainState

        if isinstance(state, TrainState):
            # Building the skeleton initialises a fresh optimizer's state (DCP's helpers take a
            # zero-learning-rate step); with nothing to restore, that must not stay behind, or the
            # run would differ from one that never called restore.
            fresh = state.optimizer is not None and not state.optimizer.state
            skeleton = state.skeleton()
            step: int | None = None
            try:
                step = self._restore(skeleton, per_rank)
            finally:
                if fresh and step is None and state.optimizer is not None:
                    state.optimizer.state.clear()
            if step is not None:
                state.load_skeleton(skeleton)
            return step
        return self._restore(state, per_rank)

    def _restore(self, state: Any, per_rank: str) -> int | None:
        t_restore = time.perf_counter()
        self._drain()
        local_root = self.local.root if self.local is not None else None
        seen = node_steps(self.job, self.ram.ram_dir, local_root)
        durable_steps: set[int] = set()
        if self.durable is not None:
            try:
                durable_steps = set(self.durable.steps_sync())
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot list the durable tier: %s", exc)
        seen |= durable_steps
        candidates = sorted(set().union(*map(set, self._fg.all_gather(sorted(seen)))), reverse=True)
        tried: list[str] = []
        for step in candidates:
            ok, detail = self._restore_step(state, step, step in durable_steps, per_rank)
            if ok:
                log.info("ckptstore: restored step %d from the %s tier", step, detail)
                self._last_step = max(self._last_step if self._last_step is not None else step, step)
                self._event("restore", step=step, tier=detail, seconds=round(time.perf_counter() - t_restore, 6))
                return step
            log.warning("ckptstore: step %d cannot be restored (%s); trying an older step", step, detail)
            tried.append(detail)
        if tried:
            raise CorruptCheckpointError("no sound copy of any checkpoint of this job: " + "; ".join(tried))
        self._event("restore", step=None, tier=None, seconds=round(time.perf_counter() - t_restore, 6))
        return None

    def _restore_exact(self, state: Any, step: int) -> None:
        """Load exactly ``step`` into ``state`` (collective), never another one: for the adapters
        (``ckptstore.dcp``, ``ckptstore.lightning``) that read a step's metadata first and its data
        later, which must come from the same step. Raises CheckpointNotFoundError when no tier of
        any rank holds the step, CorruptCheckpointError when no sound copy of it is left."""
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed")
        self._drain()
        local_root = self.local.root if self.local is not None else None
        held = step in node_steps(self.job, self.ram.ram_dir, local_root)
        in_durable = False
        if self.durable is not None:
            try:
                in_durable = step in self.durable.steps_sync()
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot list the durable tier: %s", exc)
        if not any(self._fg.all_gather(held or in_durable)):
            raise CheckpointNotFoundError(f"no tier holds step {step} of job {self.job}")
        ok, detail = self._restore_step(state, step, in_durable, "error")
        if not ok:
            raise CorruptCheckpointError(f"no sound copy of step {step} of job {self.job}: {detail}")
        self._last_step = max(self._last_step if self._last_step is not None else step, step)

    def _restore_step(self, state: Any, step: int, in_durable: bool, per_rank: str) -> tuple[bool, str]:
        """One collective attempt (retried with bad copies excluded) to load ``step`` on every rank."""
        local_root = self.local.root if self.local is not None else None
        durable = self.durable if in_durable else None
        display = f"step {step} of job {self.job}"
        excluded: set[str] = set()
        bad_owners: set[tuple[str, int]] = set()
        detail = ""
        for attempt in range(3):
            inv = node_inventory(self.job, self.ram.ram_dir, local_root, step)
            fatal: Exception | None = None
            retry = False
            problem = ""
            used: set[str] = set()
            manifest = get_manifest(self._fg, inv, f"{display}/{MANIFEST}")
            try:
                if manifest is None and durable is not None:
                    manifest = durable.manifest_sync(step)
                if manifest is None and inv.unsupported is not None:
                    raise inv.unsupported  # written by a newer ckptstore: say so, do not fall back silently
                if manifest is None:
                    raise CheckpointNotFoundError(f"no copy of the manifest of {display}")
                self._sdc_refuse(manifest, display)
                wanted = needed_chunks(state, manifest, display, self.rank, self.world)
            except (CorruptCheckpointError, CheckpointNotFoundError, StorageError, OSError) as exc:
                wanted, problem = [], f"{exc}"
            except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
                wanted, fatal = [], exc
            fetched, slow = exchange(self._fg, self._p2p, inv, wanted, excluded, bad_owners, display, attempt=attempt,
                                     timeout_s=self.peer_timeout_s)
            if slow:
                bad_owners |= slow
                problem = "no answer within peer_timeout_s from " + ", ".join(f"rank {o} ({n})" for n, o in sorted(slow))
                retry = True
            if not problem and fatal is None:
                assert manifest is not None

                open_file = _Opener(fetched, inv, excluded, durable.opener(step) if durable is not None else None,
                                    self._kind, display, used)
                try:
                    load_manifest(state, manifest, display, open_file, group=self._fg, strict=True, per_rank=per_rank,
                                  buffer_bytes=_RESTORE_BUFFER, decode_per_rank=decode_value)
                except CorruptCheckpointError as exc:
                    bad = self._exclude(exc, fetched, inv, excluded, bad_owners)
                    problem, retry = str(exc) + (f" (the copy read was {bad})" if bad else ""), bad is not None
                except (CheckpointNotFoundError, StorageError, OSError) as exc:
                    problem = str(exc)
                except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
                    fatal = exc
            mine: dict[str, Any] = {"fatal": None if fatal is None else f"rank {self.rank}: {fatal}", "problem": problem,
                    "retry": retry, "used": sorted(used)}
            outcomes = self._fg.all_gather(mine) if self.world > 1 else [mine]
            if any(o["fatal"] for o in outcomes):
                if fatal is not None:
                    raise fatal  # this rank's own error, as raised
                raise CheckpointError("restore failed on other ranks: " + "; ".join(o["fatal"] for o in outcomes if o["fatal"]))
            problems = [f"rank {r}: {o['problem']}" for r, o in enumerate(outcomes) if o["problem"]]
            if not problems:
                kinds = sorted({k for o in outcomes for k in o["used"]})
                return True, "+".join(kinds) if kinds else "ram"
            summary = f"step {step}: " + "; ".join(problems)
            detail = f"{detail}; then {summary}" if detail else summary
            if not any(o["retry"] for o in outcomes):
                break
            log.warning("ckptstore: %s; retrying with the damaged copies excluded", summary)
        return False, detail

    def _kind(self, where: str) -> str:
        if where.startswith(self.ram.ram_dir.rstrip("/") + "/"):
            return "peer" if re.search(r"-r\d{5}-peer\d{5}-s\d+\.bin$", where) else "ram"
        return "local"

    @staticmethod
    def _exclude(exc: CorruptCheckpointError, fetched: dict[str, Any], inv: Any, excluded: set[str],
                 bad_owners: set[tuple[str, int]]) -> str | None:
        """Mark the copy a corruption came from, so the next attempt reads another; returns it."""
        location = exc.location or str(exc)
        for rel, source in fetched.items():
            if rel in location:
                owner = int(source.display.split()[1].rstrip("'s"))
                bad_owners.add((rel, owner))
                return source.display
        for rel, copies in inv.files.items():
            if rel in location:
                for where, _ in copies:
                    if where not in excluded:
                        excluded.add(where)
                        return where
        return None

    # ------------------------------------------------------------------------------ closing

    def _drain(self) -> None:
        concurrent.futures.wait(list(self._outstanding))

    def close(self) -> None:
        """Drain the pipeline, promote the last snapshot if it was not, and stop the loop.
        Re-raises a background failure that nothing surfaced yet."""
        if self._closed:
            return
        try:
            self._drain()
            last = self._last
            promote = self.durable is not None and last is not None and last.step not in self._promoted and self._pending() is None
            if self.world > 1:
                promote = all(self._fg.all_gather(promote))
            if promote:
                assert last is not None
                self._loop.submit(self._close_promote(last)).result()
        finally:
            self._closed = True
            self._loop.close()
            self.ram.close()
            self._goodput_close()
        self._raise_pending(self._pending())

    async def _close_promote(self, job: _Job) -> None:
        try:
            await self._promote(job)
        except BaseException as exc:  # noqa: BLE001 - surfaced by close()
            log.error("ckptstore: promoting step %d on close failed: %s", job.step, exc)
            self._errors.append((job.step, exc))

    # ------------------------------------------------------------------------------ goodput

    def _goodput_init(self, interval: str | float | None, mtbf: str | float | None, events: Any, sdc: str) -> None:
        from ..goodput.events import EVENTS_FILE, EventLog, history, read_events
        from ..goodput.planner import parse_duration

        if sdc not in ("off", "warn", "raise"):
            raise InvalidArgumentError(f"sdc must be 'off', 'warn' or 'raise', not {sdc!r}")
        self.sdc = sdc
        self._interval: str | float | None = None
        if interval == "auto":
            if mtbf is None:
                raise InvalidArgumentError("interval='auto' plans from the mean time between failures: pass mtbf= "
                                           "(seconds or a duration such as '3h')")
            self._interval = "auto"
        elif interval is not None:
            self._interval = parse_duration(interval, "interval")
            if self._interval <= 0:
                raise InvalidArgumentError(f"interval must be positive, not {interval!r}")
        self._mtbf = parse_duration(mtbf, "mtbf") if mtbf is not None else None
        if self._mtbf is not None and self._mtbf <= 0:
            raise InvalidArgumentError(f"mtbf must be positive, not {mtbf!r}")
        self._costs: list[float] = []
        self._step_s: float | None = None
        self._last_call: tuple[int, float] | None = None
        self._blocked = 0.0  # what saves blocked since the last should_save (not part of the step time)
        self._next_save: int | None = None
        self._tick = 0.0
        self._started = time.time()
        self._history = (0, 0.0)  # failures and seconds run before this start (rank 0, from the event log)
        self.plan: dict[str, Any] | None = None  # the newest plan, for the curious
        self._events: Any = None
        if events is True and self.local is None:
            raise InvalidArgumentError("events=True keeps the event log in the local directory: pass local= too, "
                                       "or events=PATH")
        if events is not False and events is not None and self.rank == 0:
            path = os.path.join(self.local.root, EVENTS_FILE) if self.local is not None and events is True else os.fspath(events)
            before: list[dict[str, Any]] = []
            try:
                before = read_events(path) if os.path.exists(path) else []
            except OSError as exc:
                log.warning("ckptstore: cannot read the event log %s (the failure history starts afresh): %s", path, exc)
            self._events = EventLog(path)
            start = {"t": time.time(), "event": "start"}
            self._history = history(before + [start])
            self._event("start", job=self.job, world=self.world, host=socket.gethostname())
            if before and before[-1]["event"] != "close":
                self._event("failure", last_seen=before[-1]["t"])  # the previous run ended without close()

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint at ``step``, under ``interval``: call it once per training step.

        The answer compares ``step`` with the next save step that every rank computed at the last
        ``save`` from the same numbers (rank 0's measured step time, blocking cost and MTBF estimate,
        carried by the per-save vote), so all ranks get the same answer without a collective per step.
        The first call says yes: that checkpoint measures the cost cold, and the next two follow a step
        apart to measure it warm (a process's first save also pays one-time costs); from then on the
        plan holds, recomputed at every save."""
        if self._interval is None:
            raise InvalidArgumentError("should_save needs CheckpointStore(..., interval=SECONDS or '20m', or "
                                       "interval='auto' with mtbf=...)")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, not {step!r}")
        now = time.monotonic()
        if self._last_call is not None and step > self._last_call[0]:
            per_step = max(0.0, now - self._last_call[1] - self._blocked) / (step - self._last_call[0])
            self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        self._last_call, self._blocked = (step, now), 0.0
        # Ticks date a crash for the goodput report: once a minute, or ten times per planned interval.
        period = min(60.0, max(1.0, ((self.plan or {}).get("interval_s") or 600.0) / 10.0))
        if self._events is not None and now - self._tick >= period:
            self._tick = now
            self._event("tick", step=step)
        return self._next_save is None or step >= self._next_save

    def _event(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(kind, **fields)

    def _plan_inputs(self) -> dict[str, Any] | None:
        """Rank 0's measurements, which every rank plans from."""
        from ..goodput.planner import mtbf_posterior

        if self._interval is None:
            return None
        # The first save of a process also faults the staging slots in and pays one-time imports (often
        # ten times a warm save): it is never planned from, so auto plans start at the third save.
        costs = self._costs[1:][-5:]
        cost = sorted(costs)[len(costs) // 2] if costs else None
        mtbf = None
        if self._mtbf is not None:
            failures, ran = self._history
            mtbf = mtbf_posterior(self._mtbf, failures, ran + time.time() - self._started)
        return {"cost_s": cost, "mtbf_s": mtbf, "step_s": self._step_s}

    def _set_plan(self, step: int, inputs: dict[str, Any] | None) -> None:
        from ..goodput.planner import daly

        if inputs is None or self._interval is None:
            return
        cost, mtbf, step_s = inputs["cost_s"], inputs["mtbf_s"], inputs["step_s"]
        if step_s is None or (self._interval == "auto" and not cost):
            steps, interval = 1, None  # nothing measured yet: the next step measures
        else:
            # Daly's interval is compute time between checkpoints; a fixed interval is wall time.
            interval = daly(cost, mtbf) if self._interval == "auto" else max(float(self._interval) - (cost or 0.0), 0.0)
            steps = max(1, round(interval / step_s)) if step_s > 0 else 1
        self._next_save = step + steps
        self.plan = {"interval_s": interval, "next_step": self._next_save, **inputs}
        self._event("plan", step=step, **self.plan)

    def _saved(self, job: _Job, handle: SaveHandle, blocking: float) -> None:
        self._costs = (self._costs + [blocking])[-50:]
        self._blocked += blocking
        staged = job.staged
        self._event("save", step=job.step, blocking_s=round(blocking, 6), waited_s=round(handle.waited_s, 6),
                    staged_s=round(handle.staged_s, 6), bytes=staged.layout.total if staged else 0,
                    copied=staged.copied_bytes if staged else 0)

    def _goodput_close(self) -> None:
        if self._events is not None:
            self._event("close")
            self._events.close()
            self._events = None

    def _stage_timings(self, job: _Job, hash_s: float) -> None:
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

    def _put(self, tier: Tier, snap: Snapshot, job: _Job) -> dict[str, Any]:
        """Write this rank's part to ``tier`` and record the step's stage timings in it. The durable
        manifest waits (at most peer_timeout_s) for this step's replication, so it records that too."""
        part = tier.put_sync(snap)
        timings = snap.meta.setdefault("timings", {})
        timings["local_s" if tier is self.local else "promote_s"] = part.get("timings", {}).get("write_s", 0.0)
        if tier is self.durable and job.peer is not None:
            concurrent.futures.wait([job.peer], timeout=self.peer_timeout_s)
        part["timings"] = {**part.get("timings", {}), **timings}
        return part

    def _sdc_items(self, local: Any, mine: list[Any], job: _Job) -> list[tuple[str, Any]]:
        """With sdc on, every replica's bytes get a checksum: the replicated boxes this rank holds but
        another rank writes are hashed in place while save blocks when they sit contiguous in host memory
        (reading costs less than copying), and staged after everything written (never written) otherwise."""
        if self.sdc == "off" or self.world == 1:
            return []
        writes = {(m.key, m.offsets, m.sizes) for m in mine}
        extra = []
        for box, tensor in local.items.items():
            holders = local.holders[box]
            if holders[0] == "own" or (holders[0] == "replicas" and holders[1] < 2) or tensor.numel() == 0:
                continue
            job.replicated[box[0]] = (box[1], box[2], holders[0])
            if box in writes:
                continue
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                job.live[box[0]] = tensor
            else:
                extra.append((box[0], tensor))
        job.check = {k for k, _ in extra}
        return extra

    def _sdc_hash_live(self, job: _Job) -> None:
        """Hash the host-memory replicas this rank does not write, at the snapshot's moment (save has
        not returned, so training has not touched them)."""
        if not job.live:
            return
        from ..format.checksum import checksum
        from ..planning.flatten import contiguous_bytes

        try:
            job.live = {k: {"checksum": checksum(contiguous_bytes(t).numpy().data)} for k, t in job.live.items()}
        except Exception as exc:  # noqa: BLE001 - the pipeline reports it, so every rank learns of it
            job.live = {}
            job.error = job.error or exc

    def _sdc_digest(self, job: _Job) -> dict[str, str] | None:
        from ..goodput import sdc

        if self.sdc == "off" or self.world == 1 or job.staged is None:
            return None
        return sdc.digest(sdc.boxes(job.replicated, {**(job.staged.sums or {}), **job.live}))

    async def _sdc_compare(self, job: _Job, parts: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Round one compares the digests in the parts; only a disagreement costs round two."""
        from ..goodput import sdc

        digests = [p.pop("sdc", None) for p in parts]
        if self.sdc == "off" or self.world == 1 or any(d is None for d in digests):
            return None
        if not sdc.suspicious(digests):
            return []
        sums = {**((job.staged.sums or {}) if job.staged is not None else {}), **job.live}
        held = await self._agree(f"comparing the replicas of step {job.step}", lambda: sdc.boxes(job.replicated, sums))
        return sdc.mismatches(held, [str(p.get("host", "?")) for p in parts])

    def _sdc_verdict(self, job: _Job) -> None:
        from ..goodput import sdc

        if not job.sdc:
            return
        message = sdc.describe(job.step, job.sdc)
        self._event("sdc", step=job.step, mismatches=job.sdc)
        if self.sdc == "raise":
            self._promoted.add(job.step)  # close() must not promote it to durable either
            raise CheckpointError(message + " (the step is kept in RAM and local for inspection; restore skips it)")
        if self.rank == 0:
            log.warning("ckptstore: %s", message)

    def _sdc_refuse(self, manifest: Manifest, display: str) -> None:
        """Under sdc='raise' a step whose replicas disagreed is never restored."""
        if self.sdc == "raise" and (manifest.meta.get("sdc") or {}).get("mismatches"):
            raise CorruptCheckpointError(f"{display}: its data-parallel replicas differed when it was saved "
                                         "(silent data corruption suspected); trying an older step", location=display)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Opener:
    """Opens a chunk file for a restore: fetched from a peer, from this node, or from durable."""

    def __init__(self, fetched: dict[str, Any], inv: Any, excluded: set[str], durable: Callable[[str | None], Any] | None,
                 kind: Callable[[str], str], display: str, used: set[str]) -> None:
        self.fetched, self.inv, self.excluded, self.durable = fetched, inv, excluded, durable
        self.kind, self.display, self.used = kind, display, used

    def __call__(self, rel: str | None) -> Any:
        if rel in self.fetched:
            self.used.add("peer")
            return self.fetched[rel]
        opened = self.inv.open(rel or "", self.excluded)
        if opened is not None:
            self.used.add(self.kind(opened[0]))
            return opened[1]
        if self.durable is not None:
            self.used.add("durable")
            return self.durable(rel)
        raise CheckpointNotFoundError(f"{self.display}: no rank holds {rel} and the durable tier lacks the step")


def _node_identity(node: Any, rank: int) -> Any:
    """This rank's node: ``node=``, else the launcher's (torchrun's GROUP_RANK, NODE_RANK, or the rank
    divided by LOCAL_WORLD_SIZE), else the host name."""
    if node is not None:
        return node
    for var in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0:
        return rank // int(local)
    return socket.gethostname()


def _replica_to_local(root: str, step: int, src: int, buf: Any, manifest: bytes, keep: int | None) -> None:
    """Keep a received replica on this node's disk too: ``<local>/peer/step-<012d>/`` holds the
    replicas this node's ranks received, with the step's manifest, so they survive a reboot."""
    from ..storage.targets import Target, makedirs_private, open_sink, write_bytes
    from ..checkpoint.single_file import write_raw

    peer_root = os.path.join(root, "peer")
    step_dir = os.path.join(peer_root, f"step-{step:012d}")
    makedirs_private(os.path.join(step_dir, "data"))
    path = os.path.join(step_dir, "data", f"rank-{src:05d}.bin")
    sink = open_sink(Target(display=path, path=path))
    try:
        write_raw(sink, [lambda: buf], hash_bytes=False)
        sink.commit(b"")
    except BaseException:
        sink.abort()
        raise
    # Every rank of the node writes the same manifest: by rename, whoever is last, same bytes.
    write_bytes(Target(display=f"{step_dir}/{MANIFEST}", path=os.path.join(step_dir, MANIFEST)), manifest)
    if keep is not None:
        steps = sorted(int(n[5:]) for n in os.listdir(peer_root) if n.startswith("step-") and n[5:].isdigit())
        for old in steps[:-keep]:
            import shutil

            old_dir = os.path.join(peer_root, f"step-{old:012d}")
            try:
                os.unlink(os.path.join(old_dir, MANIFEST))
            except FileNotFoundError:
                pass
            shutil.rmtree(old_dir, ignore_errors=True)


def _as_state_dict(state: Any) -> Any:
    from ..train_state import TrainState

    return state.state_dict() if isinstance(state, TrainState) else state


def _groups(process_group: Any, timeout_s: float, peer_timeout_s: float) -> tuple[Group, Group, Group, Group, Group]:
    """Five gloo groups of the store's own over the ranks of ``process_group`` (or the world): the
    trainer thread's, one per background lane (fast, durable, peer), and one that carries only the
    point-to-point transfers of a restore."""
    group = Group(process_group)
    if group.world == 1:
        solo = Group.solo()
        return solo, solo, solo, solo, solo
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"backend": "gloo", "timeout": datetime.timedelta(seconds=timeout_s)}
    ranks = None
    if process_group is not None:
        ranks = dist.get_process_group_ranks(process_group)
        if len(ranks) < dist.get_world_size():
            kwargs["use_local_synchronization"] = True  # only the members take part in creating it
    fg, fast, durable, p2p = (Group(dist.new_group(ranks=ranks, **kwargs)) for _ in range(4))
    kwargs["timeout"] = datetime.timedelta(seconds=peer_timeout_s)
    return fg, fast, durable, Group(dist.new_group(ranks=ranks, **kwargs)), p2p


def _resolve(f: concurrent.futures.Future | None, value: Any) -> None:
    if f is not None and not f.done():
        f.set_result(value)


def _map(path: str) -> torch.Tensor:
    """A file's bytes, mapped read-only (no copy; the page cache serves the reads)."""
    import mmap

    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable; nothing writes it
        return torch.frombuffer(m, dtype=torch.uint8)


class _LocalFiles:
    """The local tier's files of one rank's step, addressed like the staged slot: bytes
    ``[0, frozen_end)`` are the frozen file's, bytes from ``frozen_end`` on the other file's (the
    local tier writes each region as it lies in the slot). Tiers only ever ask for a range inside one
    region (a region's file, or one chunk)."""

    def __init__(self, frozen: torch.Tensor | None, rest: torch.Tensor | None, frozen_end: int, nbytes: int) -> None:
        self.frozen, self.rest, self.frozen_end, self.nbytes = frozen, rest, frozen_end, nbytes

    def numel(self) -> int:
        return self.nbytes

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        assert dim == 0
        if start >= self.frozen_end:
            assert self.rest is not None
            return self.rest.narrow(0, start - self.frozen_end, length)
        assert self.frozen is not None and start + length <= self.frozen_end
        return self.frozen.narrow(0, start, length)
