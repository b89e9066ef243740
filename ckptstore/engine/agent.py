"""The node agent: a RAM snapshot never dies with the trainer.

A store's ``save`` returns once the snapshot is in the RAM tier; the local write and the durable
promotion follow in the trainer's own process. When that process dies in between, the snapshot
sits committed in /dev/shm, and a job rescheduled on other nodes never sees it. One agent per node
(``ckptstore agent``, or ``CheckpointStore(agent=True)``) watches the job's RAM segments and, for a
committed snapshot whose owner process is gone before it reached the tiers it was meant for,
finishes the job with the store's own code: the local and durable :class:`DirectoryTier` write and
commit it (same files, same part files, same manifest-last conditional create), the manifest is
built by the pipeline's :func:`step_manifest`, and every chunk's checksum is verified on a private
copy of the slot before a byte of it is written.

It persists what the store would have: local when the store had a local tier and the step was due
there (``meta.cadence.local == 0``, every ``local_every``-th step) or is the newest the dead
trainer committed (its RAM goes back to the node afterwards), durable only when
the step was due there by its cadence (``meta.cadence.durable == 0`` in the step's manifest) and
its replicas agreed under ``sdc="raise"``; a step a tier already holds, or older than the newest
step that tier holds, is left alone. It needs no process group: the RAM manifest of a committed
step already lists every rank's chunks (a step is committed in RAM only once every rank staged
it), so each agent writes the parts of its node's ranks, tagged with the snapshot they came from;
the local manifest is written at once (other nodes' ranks are named as the local tier lays them
out, from the RAM manifest), the durable one by whichever agent finds every rank's part of the
snapshot there, by conditional create. An agent never removes a durable part it wrote: another
node's agent may be committing a manifest that names it.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.sharded import Directory, part_summary
from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, InvalidArgumentError
from ..format.checksum import checksum, verify
from ..format.manifest import Manifest, load_json, parse_manifest
from ..names import agent_lock, data_file, data_file_rank, step_dir, stores_lock, valid_job
from ..storage import small
from ..tiers.base import Snapshot, manifest_of_parts
from ..tiers.directory import DirectoryTier, write_node_part
from ..tiers.ram import doc_part, node_extra, process_start, scan
from ..tiers.segments import inventory, remove_segments
from .options import agent_linger
from .pipeline import parted_step_manifest, same_table, shared_of, step_manifest

log = logging.getLogger("ckptstore")

# The environment variable through which a store hands its agent the durable tier's storage
# options: a command line is readable by every user of the node, credentials must not go there.
STORAGE_OPTIONS_ENV = "CKPTSTORE_AGENT_STORAGE_OPTIONS"


def still_committed(job: str, ram_dir: str, step: int, segments: list[tuple[str, dict[str, Any]]]) -> bool:
    """Whether ``segments`` (read earlier) are still the node's committed segments of ``step``."""
    now = {(path, doc.get("committed_unix")) for path, doc in committed_segments(job, ram_dir)
           if doc.get("step") == step}
    return all((path, doc.get("committed_unix")) in now for path, doc in segments)


def committed_segments(job: str, ram_dir: str) -> list[tuple[str, dict[str, Any]]]:
    """This node's committed RAM snapshots of ``job``: (segment path, document) of each rank's own
    slot (replicas held for other nodes are theirs to persist). The agent's one view of the RAM
    directory, kept in this function so that it can follow the RAM tier's own inventory."""
    return [(path[:-5] + ".bin", doc) for seg, path, doc in scan(job, ram_dir)
            if seg.src is None and doc.get("rank") == seg.rank and doc.get("slot") == seg.slot]


def owner_gone(doc: dict[str, Any], manifest: Manifest) -> bool:
    """Whether the process that committed this snapshot is gone: no such pid, a zombie, or another
    process under a reused pid (its start time differs). A snapshot committed on another host (a
    shared RAM directory) is never taken over: its owner cannot be seen from here. Documents written
    before the owner was recorded fall back to the manifest's record of the rank's process."""
    owner = doc.get("owner")
    if not isinstance(owner, dict):
        owner = _rank_record(manifest, doc.get("rank"))
    pid, host, start = owner.get("pid"), owner.get("host"), owner.get("start")
    if type(pid) is not int or pid <= 0:
        return False  # nothing says whose it is: leave it
    if host is not None and host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's process under this pid: alive, and not the owner if the start differs
    if not os.path.isdir(f"/proc/{os.getpid()}"):
        return False  # no /proc to say more: the pid is taken, so take it for the owner
    state = _process_state(pid)
    if state is None or state in ("Z", "X"):
        return True  # gone since, or dead and not yet reaped by its parent
    return type(start) is int and process_start(pid) not in (None, start)


def _process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode("ascii", "replace").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def snapshot_id(doc: dict[str, Any], manifest: Callable[[], Manifest]) -> str:
    """A name for the save a rank's RAM document commits, the same in every rank's document of that
    save on every node, and different for another save of the same step (a rerun's). The ranks agree
    on a save id when they commit in RAM, and each document records it; a document written before
    that (no ``save_id``) is named by its step's chunk table, which every rank's copy of the step's
    manifest holds alike (``manifest`` parses it, only then)."""
    save = doc.get("save_id")
    if isinstance(save, str) and save:
        body = json.dumps([doc.get("job"), doc.get("step"), "save", save], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:32]
    parsed = manifest()
    table = {key: parsed.tensors[key].to_json() for key in sorted(parsed.tensors)}
    body = json.dumps([parsed.meta.get("job"), parsed.meta.get("step"), table], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


@dataclass
class Outcome:
    """What one pass did: steps committed per tier, steps whose durable manifest waits for other
    nodes' parts, and failures (each logged once); ``given_up``: those of the failures that have
    kept failing for more than the agent's ``give_up_s``."""

    local: list[int] = field(default_factory=list)
    durable: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    given_up: list[int] = field(default_factory=list)


class NodeAgent:
    """Persists the committed RAM snapshots of ``job`` in ``ram_dir`` whose owners died (see the module
    docstring). ``local``: the node's local directory; ``durable``: the durable URL."""

    def __init__(self, job: str, *, local: str | None, durable: str | None, ram_dir: str = "/dev/shm",
                 storage_options: dict[str, Any] | None = None) -> None:
        if not valid_job(job):
            raise InvalidArgumentError(f"job {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-'")
        if local is None and durable is None:
            raise InvalidArgumentError("the agent persists to the local or the durable tier: pass --local DIR, "
                                       "--durable URL, or both")
        if not os.path.isdir(ram_dir):
            raise InvalidArgumentError(f"ram_dir {ram_dir!r} is not a directory (the RAM directory of the job's stores)")
        self.job, self.ram_dir = job, ram_dir
        self.local = DirectoryTier("local", local, node_local=True) if local is not None else None
        self.durable_url, self.storage_options = durable, storage_options
        self._durable: dict[str | None, DirectoryTier] = {}  # by codec: the store's durable_compression
        self._warned: set[tuple[int, str]] = set()
        # Snapshots found complete (persisted, or never due anywhere else), by their segments'
        # documents: a watching agent does not list the tiers for them again at every pass.
        self._settled: set[tuple[tuple[str, Any], ...]] = set()
        # When each failing snapshot first failed: a watching agent retries it at every pass (a
        # durable tier may come back) but logs it once, and an agent that exits when idle stops
        # waiting for it after give_up_s.
        self._failing: dict[tuple[tuple[str, Any], ...], float] = {}
        self.give_up_s = 600.0
        # (segment path, step) of every snapshot found persisted wherever it was meant to go: what
        # release_persisted may give back to the node.
        self._persisted: set[tuple[str, int]] = set()

    def durable(self, codec: str | None) -> DirectoryTier | None:
        if self.durable_url is None:
            return None
        tier = self._durable.get(codec)
        if tier is None:
            tier = self._durable[codec] = DirectoryTier("durable", self.durable_url, codec=codec,
                                                       storage_options=self.storage_options)
        return tier

    # ------------------------------------------------------------------------------ one pass

    def run_once(self) -> Outcome:
        """Persist every pending snapshot once; errors are logged, never raised."""
        return asyncio.run(self._pass())

    async def _pass(self) -> Outcome:
        out = Outcome()
        by_step: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for path, doc in committed_segments(self.job, self.ram_dir):
            by_step.setdefault(doc["step"], []).append((path, doc))
        local_steps: list[int] | None = None
        durable_steps: dict[str | None, list[int]] = {}
        for step in sorted(by_step):
            segments = _one_per_rank(by_step[step])
            settled = tuple(sorted((path, doc.get("committed_unix")) for path, doc in segments))
            if settled in self._settled:
                continue
            try:
                manifest = node_manifest(segments)
                if not all(owner_gone(doc, manifest) for _path, doc in segments):
                    continue  # a live store is persisting it
                if self.local is not None and local_steps is None:
                    local_steps = await self.local.steps()
                info = segments[0][1].get("store")
                info = info if isinstance(info, dict) else {}
                durable = self.durable(info.get("durable_compression") if info.get("durable_compression") in (None, "zstd")
                                       else None)
                if durable is not None and durable.codec not in durable_steps:
                    durable_steps[durable.codec] = await durable.steps()
                if await self._step(step, segments, manifest, info, local_steps or [],
                                    durable_steps.get(durable.codec, []) if durable else [], durable, out,
                                    newest=step == max(by_step)):
                    self._settled.add(settled)
                    self._persisted.update((path, step) for path, _doc in segments)
                self._failing.pop(settled, None)
            except Exception as exc:  # noqa: BLE001 - one bad segment must not stop the others
                if isinstance(exc, CorruptCheckpointError) and not still_committed(self.job, self.ram_dir, step,
                                                                                  segments):
                    # Not damage: a restarted store took the slot over while it was being read
                    # (its document goes before its bytes are overwritten).
                    log.info("ckptstore agent: step %d left the RAM tier while it was being read (a restarted store "
                             "reused its slot); not persisting it", step)
                    continue
                seen = settled in self._failing
                first = self._failing.setdefault(settled, time.monotonic())
                (log.debug if seen else log.error)(
                    "ckptstore agent: step %d of job %s in %s was not persisted: %s: %s", step, self.job,
                    self.ram_dir, type(exc).__name__, exc)
                out.failed.append(step)
                if time.monotonic() - first > self.give_up_s:
                    out.given_up.append(step)
        return out

    async def _step(self, step: int, segments: list[tuple[str, dict[str, Any]]], manifest: Manifest,
                    info: dict[str, Any], local_steps: list[int], durable_steps: list[int],
                    durable: DirectoryTier | None, out: Outcome, *, newest: bool = True) -> bool:
        """Persist one step where it is still missing; True once nothing more is to be done for it."""
        meta = manifest.meta
        cadence: dict[str, Any] = meta["cadence"] if isinstance(meta.get("cadence"), dict) else {}
        sdc = meta.get("sdc") if isinstance(meta.get("sdc"), dict) else None
        disagreed = sdc is not None and sdc.get("policy") == "raise" and bool(sdc.get("mismatches"))
        # Local when the store had a local tier and the step was due there (local_every; a manifest
        # without the count comes from a store that wrote every step locally), or is the dead
        # trainer's newest: the agent gives the RAM back once it is done, and a step that lived in
        # RAM alone would go with it (a closing store writes its last step locally for the same reason).
        want_local = (self.local is not None and info.get("local", True) is not False
                      and (cadence.get("local", 0) == 0 or newest))
        due = cadence.get("durable") == 0 and info.get("durable", True) is not False and not disagreed
        if due and durable is None and (step, "durable") not in self._warned:
            self._warned.add((step, "durable"))
            log.warning("ckptstore agent: step %d was due in the durable tier, but the agent has no --durable URL", step)
        # A tier that holds a newer step took this one's place (retention, or a failed promotion the
        # store went past): writing it there now would bring back what the store let go.
        need_local = want_local and step not in local_steps and step > max(local_steps, default=-1)
        need_durable = (due and durable is not None and step not in durable_steps
                        and step > max(durable_steps, default=-1))
        if not need_local and not need_durable:
            return True
        sid = snapshot_id(segments[0][1], lambda: manifest)
        ranks = [doc["rank"] for _path, doc in segments]
        copies: list[Snapshot] = []

        def snaps() -> list[Snapshot]:
            """The node's segments of the step, verified private copies, read once and only when a
            tier still lacks a part (a watching agent waiting for other nodes' parts reads nothing)."""
            if not copies:
                for path, doc in segments:
                    if snapshot_id(doc, functools.partial(_doc_manifest, path, doc)) != sid:
                        raise CorruptCheckpointError(
                            f"{path}: its save of step {step} is not the one the other ranks' segments hold; "
                            "not persisting a mix of two saves", location=path)
                    copies.append(read_verified(path, doc, manifest, sid))
            return copies

        def held() -> bool:
            """Whether the node's segments of the step are still the committed ones read above: a
            restarted store that restored an older step drops a newer one it cannot restore (a dead
            branch) from RAM and local, and saves that step number again; the agent's copy of it,
            committed after that drop, would stand in the way of the new save."""
            return still_committed(self.job, self.ram_dir, step, segments)

        where = ", ".join(map(str, ranks))
        if need_local:
            assert self.local is not None
            if not await self._commit_local(step, manifest, ranks, snaps, sid, cadence, sdc, held, segments):
                log.info("ckptstore agent: step %d left the RAM tier while it was being persisted (a restarted "
                         "store dropped it); not committing it in %s", step, self.local.display(step))
                return True
            log.warning("ckptstore agent: step %d (ranks %s) committed in the local tier %s", step, where,
                        self.local.display(step))
            out.local.append(step)
        if need_durable:
            assert durable is not None
            missing = await self._commit_durable(durable, step, manifest, ranks, snaps, sid, cadence, sdc, held)
            if missing:
                report = log.debug if (step, "waiting") in self._warned else log.warning  # once, not every pass
                report("ckptstore agent: step %d: parts of ranks %s are in the durable tier %s; the manifest "
                       "waits for ranks %s (their nodes' agents)", step, where, durable.display(step),
                       ", ".join(map(str, missing)))
                self._warned.add((step, "waiting"))
                out.waiting.append(step)
                return False
            log.warning("ckptstore agent: step %d committed in the durable tier %s", step, durable.display(step))
            out.durable.append(step)
        return True

    async def _commit_local(self, step: int, manifest: Manifest, ranks: list[int], snaps: Callable[[], list[Snapshot]],
                            sid: str, cadence: dict[str, Any], sdc: dict[str, Any] | None,
                            held: Callable[[], bool], segments: list[tuple[str, dict[str, Any]]]) -> bool:
        """Commit the step in this node's local directory; False (and nothing of it left there) when
        its segments left the RAM tier before the commit."""
        tier = self.local
        assert tier is not None
        world = manifest.meta["world_size"]
        found = await tier_parts(tier, step, sid, world)
        try:
            for snap in snaps() if any(r not in found for r in ranks) else []:
                if snap.rank not in found:
                    found[snap.rank] = await tier.put(snap)
            if not held():
                await tier.discard(step)
                return False
            owns = {path_doc[1]["rank"]: own for path_doc in segments
                    if (own := doc_part(path_doc[1], path_doc[0])) is not None}
            if owns and any(r not in owns for r in range(world)):
                # The node's documents hold their own ranks' parts, and other nodes' ranks are not
                # here: each of this node's parts is committed on its own, as the store does.
                for r in ranks:
                    own = owns[r]
                    mine = {**found[r], "step": step, "digest": own.part.get("digest", ""),
                            "layout": "staged" if same_table(found[r]["chunks"], own.part["chunks"]) else "local"}
                    await write_node_part(tier.root, step, r, node_extra(mine, own.meta, own.header), holder=r)
                return True
            # The ranks of other nodes: named as the local tier lays a snapshot out (its slot written
            # whole to data/rank-<r>.bin), which is the RAM manifest's own table.
            parts = [found[r] if r in found else ram_part(manifest, r) for r in range(world)]
            body = step_manifest(shared_of(manifest), parts, world, job=manifest.meta.get("job", self.job),
                                 step=step, cadence=cadence, sdc=sdc)
            await tier.commit(step, body)
        except CheckpointExistsError:
            if step not in await tier.steps():
                raise
            log.info("ckptstore agent: step %d was committed in %s by another writer first", step, tier.display(step))
        except BaseException:
            await tier.discard(step)  # this node's directory: only this agent writes the step there
            raise
        return True

    async def _commit_durable(self, tier: DirectoryTier, step: int, manifest: Manifest, ranks: list[int],
                              snaps: Callable[[], list[Snapshot]], sid: str, cadence: dict[str, Any],
                              sdc: dict[str, Any] | None, held: Callable[[], bool]) -> list[int]:
        """Put this node's parts (those not there from an earlier run), then commit when every rank's
        part of the snapshot is there; returns the ranks still missing. Nothing is committed once
        the node's segments of the step left the RAM tier (``held``): a restarted store dropped the
        step as a dead branch, and its own save of that number is the one the durable tier takes."""
        world = manifest.meta["world_size"]
        found = await tier_parts(tier, step, sid, world)
        try:
            for snap in snaps() if any(r not in found for r in ranks) else []:
                if snap.rank not in found:
                    await tier.put(snap)
        except CheckpointExistsError:
            if step in await tier.steps():
                return []  # committed meanwhile (the other writer's copy is the step)
            raise
        found = await tier_parts(tier, step, sid, world)  # again: other nodes' agents write theirs meanwhile
        missing = [r for r in range(world) if r not in found]
        if missing:
            return missing
        if not held():
            # The parts stay uncommitted (the tier lists no step): a store start sweeps them once
            # the tier holds a newer step (a start beside agents leaves newer ones to them).
            log.info("ckptstore agent: step %d left the RAM tier while it was being persisted (a restarted store "
                     "dropped it); not committing it in %s", step, tier.display(step))
            return []
        shared = shared_of(manifest)
        # The chunks of the tensors a rank wrote whole go into their entries too, as the trainers'
        # coordinator puts them: a rank loading a replicated tensor then reads no other part.
        shapes = {k: v[1] for k, v in shared["tensors"].items()}
        summaries = [part_summary(found[r], shapes) for r in range(world)]
        # Format 2.0, as the trainers' coordinator commits: the manifest names the part files.
        body = await asyncio.to_thread(parted_step_manifest, shared, summaries, world,
                                       job=manifest.meta.get("job", self.job), step=step, cadence=cadence, sdc=sdc)
        try:
            await tier.commit_document(step, body)
        except CheckpointExistsError:
            # Another agent found every part too, and its manifest won; ours backs off. Our parts
            # stay: the winner's manifest may name them.
            log.info("ckptstore agent: step %d was committed in %s by another writer first", step, tier.display(step))
        return []

    def release_persisted(self, *, empty: bool = False) -> tuple[int, int]:
        """Remove the segments of dead trainers whose snapshots this agent found persisted wherever
        they were meant to go, so that a finished job leaves no RAM held on the node; returns
        (segments, bytes) freed. A segment a live process maps (a trainer restarted on this node
        restoring from it) or committed since by a restarted trainer is kept. ``empty``: also the
        job's staging slots that hold no committed step and that no process maps (made ahead for
        a save that never came), for a caller that knows no store of the job is open on the node
        (a store's slot between its document's removal and its commit is one, and it maps it)."""
        done = [r for r in inventory(self.ram_dir, self.job)
                if r.src is None and not r.owner_alive
                and (any((path, r.step) in self._persisted for path in r.paths) if r.step is not None else empty)]
        return len(done), remove_segments(done)

    # ------------------------------------------------------------------------------ watching

    def watch(self, *, poll_s: float = 2.0, exit_when_idle: bool = False,
              release: Callable[[], None] | None = None, keep_ram: bool = False, linger_s: float = 0.0) -> None:
        """Pass after pass, ``poll_s`` apart. ``exit_when_idle`` (how a store's agent runs): return once
        no store of the job on this node has held the stores lock for ``linger_s`` and a last pass
        found nothing to do, calling ``release`` (which gives up the agent lock) while still holding
        the stores lock.

        The linger is for the restart of a crashed job: between its trainers' deaths and the new
        trainers' stores no store is open, and an agent that exited then gave back the RAM slots
        the restart restores from fastest (and, after a node loss, the survivors' own copies of
        the step whose other parts live on as peer replicas)."""
        stores_fd = None
        idle_since: float | None = None
        try:
            while True:
                out = self.run_once()
                if exit_when_idle and set(out.failed) <= set(out.given_up):
                    if stores_fd is None:
                        stores_fd = _open_lock(os.path.join(self.ram_dir, stores_lock(self.job)))
                    free = _try_lock(stores_fd, fcntl.LOCK_EX)
                    now = time.monotonic()
                    since = now if idle_since is None else idle_since
                    idle_since = since if free else None  # a store is open: the job runs on this node
                    if free and now - since < linger_s:
                        fcntl.flock(stores_fd, fcntl.LOCK_UN)  # lingering: a restarted store may open meanwhile
                    elif free:
                        # No store is open; a new one blocks on its shared lock until this returns,
                        # and then finds the agent lock free and starts another agent.
                        last = self.run_once()
                        if set(last.failed) <= set(last.given_up):
                            if not keep_ram:
                                self.release_persisted(empty=True)  # the stores lock is held: no store is open
                            if release is not None:
                                release()  # before the stores lock: a store waiting on it then starts an agent
                            return
                        fcntl.flock(stores_fd, fcntl.LOCK_UN)
                time.sleep(poll_s)
        finally:
            if stores_fd is not None:
                os.close(stores_fd)


# ---------------------------------------------------------------------------------- the pieces


def _doc_manifest(path: str, doc: dict[str, Any]) -> Manifest:
    own = doc_part(doc, path)
    if own is not None:
        return manifest_of_parts([own], path, partial=True)
    return parse_manifest(doc["extra"]["manifest"].encode(), where=path)


def node_manifest(segments: list[tuple[str, dict[str, Any]]]) -> Manifest:
    """The step's manifest as the node's documents of it hold it: the whole one of an older
    document, or the one this node's ranks' parts assemble (every rank's in a single-node job;
    in a multi-node job only this node's ranks' chunks, with the meta and the headers they carry)."""
    path, doc = segments[0]
    if doc_part(doc, path) is None:
        return parse_manifest(doc["extra"]["manifest"].encode(), where=path)
    parts = [p for where, d in segments if (p := doc_part(d, where)) is not None]
    return manifest_of_parts(parts, path, partial=True)


def _one_per_rank(segments: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """One segment per rank (a rank never holds one step in two slots; if it did, the newer commit)."""
    by_rank: dict[int, tuple[str, dict[str, Any]]] = {}
    def committed(segment: tuple[str, dict[str, Any]]) -> float:
        when = segment[1].get("committed_unix")
        return float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else 0.0

    for path, doc in sorted(segments, key=committed):
        by_rank[doc["rank"]] = (path, doc)
    return [by_rank[r] for r in sorted(by_rank)]


def read_verified(path: str, doc: dict[str, Any], manifest: Manifest, sid: str) -> Snapshot:
    """Rank ``doc["rank"]``'s committed slot at ``path``, copied into private memory and every chunk's
    checksum verified on the copy: what is persisted is exactly what was committed, even if the
    segment is reused (a restarted trainer) while it is read."""
    rank, size = doc["rank"], doc["size"]
    buf = bytearray(size)
    fd = small.open_nofollow(path, os.O_RDONLY)
    try:
        view, got = memoryview(buf), 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise CorruptCheckpointError(f"{path}: the segment ends at byte {got}, its manifest says {size}",
                                             location=path)
            got += n
    finally:
        os.close(fd)
    mine = data_file(rank)
    chunks = {key: [c.to_json() for c in entry.chunks if c.file == mine] for key, entry in manifest.tensors.items()}
    chunks = {key: table for key, table in chunks.items() if table}
    for key, table in chunks.items():
        for c in table:
            if c["offset"] + c["length"] > size:
                raise CorruptCheckpointError(f"{path}: chunk of {key!r} ends past the segment's {size} bytes",
                                             location=path, key=key)
            verify(memoryview(buf)[c["offset"] : c["offset"] + c["length"]], c["checksum"], location=path, key=key)
    data = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    timings = _rank_record(manifest, rank).get("timings")
    meta = {"timings": dict(timings) if isinstance(timings, dict) else {}, "part": {"snapshot": sid, "agent": True}}
    return Snapshot(doc["step"], rank, manifest.meta["world_size"], data, chunks, 0, meta)


def ram_part(manifest: Manifest, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s part as the RAM manifest records it (its chunks in ``data/rank-<r>.bin``)."""
    chunks: dict[str, list[dict[str, Any]]] = {}
    for key, entry in manifest.tensors.items():
        table = [c.to_json() for c in entry.chunks if data_file_rank(c.file) == rank]
        if table:
            chunks[key] = table
    record = _rank_record(manifest, rank)
    return {"rank": rank, "host": record.get("host", "?"), "pid": record.get("pid", 0),
            "bytes": sum(c["length"] for t in chunks.values() for c in t), "timings": record.get("timings", {}),
            "chunks": chunks}


def _rank_record(manifest: Manifest, rank: Any) -> dict[str, Any]:
    ranks = manifest.meta.get("ranks")
    if isinstance(ranks, list):
        for r in ranks:
            if isinstance(r, dict) and r.get("rank") == rank:
                return r
    return {}


async def tier_parts(tier: DirectoryTier, step: int, sid: str, world: int) -> dict[int, dict[str, Any]]:
    """The part files of ``step`` in ``tier`` that an agent wrote for snapshot ``sid``, by rank (a
    part file is written after its data, so each one found is complete)."""
    d = Directory(f"{tier.root}/{step_dir(step)}", tier.storage_options)
    found: dict[int, dict[str, Any]] = {}
    for name in sorted(await small.listdir(d.target("parts"))):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            body = await asyncio.to_thread(d.read_small, f"parts/{name}")
            part = load_json(body, where=f"{d.display}/parts/{name}", what="part file")
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore agent: passing over %s/parts/%s: %s", d.display, name, exc)
            continue
        if not isinstance(part, dict) or part.get("snapshot") != sid:
            continue
        rank = part.get("rank")
        if type(rank) is int and 0 <= rank < world and isinstance(part.get("chunks"), dict):
            # What the committer's index names the part by (the file may be a writer's variant).
            part.update(part_file=f"parts/{name}", part_size=len(body), part_checksum=checksum(body))
            found.setdefault(rank, part)
    return found


# ---------------------------------------------------------------------------------- one per node


def _open_lock(path: str) -> int:
    return small.open_nofollow(path, os.O_RDWR | os.O_CREAT)


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def hold_agent_lock(job: str, ram_dir: str) -> int:
    """Take the node's agent lock of ``job`` for this process (held until it exits), or raise."""
    path = os.path.join(ram_dir, agent_lock(job))
    fd = _open_lock(path)
    if not _try_lock(fd, fcntl.LOCK_EX):
        os.close(fd)
        raise CheckpointError(f"an agent of job {job!r} already runs on this node (it holds {path}); one agent per "
                              "node persists every rank's snapshots: stop it first, or leave it to that one")
    return fd


# How far below the store's background work (``background_nice``) a store-started agent runs. It
# finishes what dead trainers left: where the job restarted on the node, the restarted trainers'
# steps come first (what the agent persists sits in RAM meanwhile, and the restart restored from
# it); where the job went elsewhere, nothing else wants the cores and the priority changes
# nothing. At the trainers' priority its copy, checksums and writes of each killed rank's
# snapshot slowed the first steps after every restart of the crash loop.
AGENT_NICE = 10


def agent_running(job: str, ram_dir: str) -> bool:
    """Whether a node agent of ``job`` runs on this node now (it holds the agent lock exclusively).
    The probe takes the lock shared, for an instant: an exclusive probe could make an agent that
    is starting at that instant find its lock taken and refuse to run."""
    path = os.path.join(ram_dir, agent_lock(job))
    if not os.path.exists(path):
        return False
    fd = _open_lock(path)
    try:
        if _try_lock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def start_agent(job: str, *, ram_dir: str, local: str | None, durable: str | None,
                storage_options: dict[str, Any] | None, nice: int = 0) -> tuple[int, bool]:
    """What ``CheckpointStore(agent=True)`` does: hold the stores lock shared (released when this
    process closes the store or dies), and start the node's agent as a detached process unless one
    runs already, ``nice`` steps below this process's scheduling priority (it persists what a dead
    trainer left while the restarted one needs the cores). Returns the stores lock's descriptor (to
    close with the store) and whether this call started the agent."""
    try:
        options = json.dumps(storage_options or {})
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"agent=True hands storage_options to the agent process as JSON, and these are not "
                                   f"JSON ({exc}); start `ckptstore agent` yourself with --storage-options") from None
    stores_fd = _open_lock(os.path.join(ram_dir, stores_lock(job)))
    fcntl.flock(stores_fd, fcntl.LOCK_SH)  # blocks only while an idle agent is exiting
    agent_fd = _open_lock(os.path.join(ram_dir, agent_lock(job)))
    try:
        if not _try_lock(agent_fd, fcntl.LOCK_EX):
            return stores_fd, False  # the node's agent runs already (another rank's store started it)
        argv = [sys.executable, "-m", "ckptstore.cli", "agent", job, "--ram-dir", ram_dir, "--exit-when-idle",
                "--lock-fd", str(agent_fd)]
        linger = agent_linger()
        if linger is not None:
            argv += ["--linger", linger]
        argv += ["--local", local] if local is not None else []
        argv += ["--durable", durable] if durable is not None else []
        env = {**os.environ, STORAGE_OPTIONS_ENV: options}
        # Its own session: a signal to the trainer's process group (Ctrl-C, torchrun stopping its
        # workers) must not stop the process that persists what the trainer leaves behind. Started
        # through a shell that exits at once, so the agent is no child of the trainer's (nothing to
        # reap, and it outlives the trainer as it must).
        niced = shutil.which("nice") if nice > 0 else None
        if niced is not None:
            argv = [niced, "-n", str(nice), *argv]
        launcher = subprocess.Popen(["/bin/sh", "-c", 'exec "$@" &', "sh", *argv], pass_fds=(agent_fd,),
                                    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    env=env)
        if launcher.wait() != 0:
            raise CheckpointError(f"cannot start the node agent ({' '.join(argv[:5])} ...): /bin/sh exited with "
                                  f"{launcher.returncode}")
        return stores_fd, True
    except BaseException:
        os.close(stores_fd)
        raise
    finally:
        os.close(agent_fd)  # the agent holds the lock through its own descriptor from here on
