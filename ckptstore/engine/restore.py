"""Where a step is chosen on restore: the newest step every rank can load a sound copy of.

Every rank lists the steps its node-local tiers hold something of (RAM slots, peer replicas, the
local directory) and the durable tier's committed steps; the union, newest first, is the list of
candidates, the same on every rank. Each candidate is tried collectively (exchange.py): every rank
learns what its node holds of the step, fetches from other nodes what it lacks, reads anything no
node holds from the durable tier, and verifies every byte. A damaged copy is excluded and the step
tried again (twice at most); a step that cannot be loaded gives way to the next older one. A state
that does not match the checkpoint is the caller's error, raised at once, never a fallback.

A step can fail in two ways that a restore tells apart. It is *damaged* when bytes that should be
sound are not (a checksum mismatch, a file missing from a copy whose node still holds the step):
with no sound copy of any step left, that is an error, never a fresh start. It is *incomplete* when
a part was written by a rank whose node now holds no copy of its own of the step (the node was
lost, or retention dropped its copies while another node's replica of the step stayed) and no
other node nor the durable tier has it: nothing was damaged, the part never got out, and with no
complete step left the job starts fresh. Either way (or when a newer step's copies could not be
read) the steps newer than the one restored are a dead branch, which the store drops from every
tier (store.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..checkpoint.coop import abstain
from ..checkpoint.index import Index, plan_from_index, read_index
from ..checkpoint.materialize import decode_value
from ..checkpoint.sharded import chunks_needed, load_manifest
from ..collective import StoreGroups, failure_record, failures_from
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CollectiveError,
    CorruptCheckpointError,
    RankFailure,
    StorageError,
    also,
    collective_error,
)
from ..format.manifest import Manifest
from ..names import MANIFEST, data_file, data_file_rank
from ..storage.targets import Source
from ..tiers.base import PartsMissing, Tier
from .exchange import (
    DURABLE_PREFERENCE,
    FIRST_TIERS,
    Inventory,
    NodeInventory,
    PeerUnavailable,
    RemoteSource,
    Transfers,
    assembled,
    exchange,
    get_manifest,
    layout_digest,
    mixture,
    save_of,
)
from .guard import Guarded, broadcast_from
from .replicas import ReplicaCheck

log = logging.getLogger("ckptstore")
RESTORE_BUFFER = 256 << 20
_ATTEMPTS = 3
# What went wrong in one rank's attempt: a part no node holds (its writer's node holds nothing of the
# step, the durable tier lacks it), bytes that are not sound, or anything else (I/O, a peer gone).
_MISSING, _DAMAGED, _OTHER = "missing", "damaged", "other"
_NONE = -(1 << 63)  # the MAX identity of an int64 all-reduce
# What a restore raises when a collective's transport fails (a rank died, or stopped answering):
# a CollectiveError, and still the RuntimeError gloo raised, for handlers written for that.
BrokenRestore = also(CollectiveError, RuntimeError)


@dataclass(frozen=True)
class Listing:
    """The durable tier's committed steps from step ``since`` on (None: all of them). The start's
    listing looks only from the newest step rank 0's node holds: what a restart asks of it is
    whether the durable tier holds anything at least that new, and on an object store each older
    step would cost a request of its own (a job that keeps every durable step lists hundreds)."""

    steps: frozenset[int]
    since: int | None = None

    def covers(self, oldest: int | None) -> bool:
        """Whether it answers for every step from ``oldest`` on (None: for every step)."""
        return self.since is None or (oldest is not None and oldest >= self.since)


@dataclass
class Found:
    """What :meth:`Restorer.newest` found: the step loaded (None: none) and the tiers it came from;
    ``dead``: the newer steps that could not be restored because they are incomplete
    (the store drops their node copies); ``uncounted``: those of them no tier outside the nodes
    lists, which no longer count as saved; ``counted``: the newest step held that still counts;
    ``newer``: every step held that is newer than the one loaded (all of them when none was), each
    of which was tried and failed, whatever the reason: the branch of history the restore left;
    ``damaged``: those of them that failed on bytes that were not sound (evidence to keep)."""

    step: int | None
    tiers: str = ""
    dead: list[int] = field(default_factory=list)
    uncounted: set[int] = field(default_factory=set)
    counted: int | None = None
    newer: list[int] = field(default_factory=list)
    damaged: list[int] = field(default_factory=list)


class Restorer:
    """``node_tiers``: the node-local tiers in order of preference (RAM, local, peer); ``durable``:
    the tier every rank reaches, or None."""

    def __init__(self, job: str, groups: StoreGroups, node_tiers: Sequence[Tier], durable: Tier | None,
                 check: ReplicaCheck, peer_timeout_s: float,
                 durable_listing: concurrent.futures.Future[Listing | None] | None = None) -> None:
        # The trainer group's collectives raise what _broken says when a rank is gone (guard.py).
        groups = dataclasses.replace(groups, trainer=Guarded(groups.trainer, self._broken))
        self.job, self.groups, self.node_tiers, self.durable = job, groups, list(node_tiers), durable
        self._doing: tuple[int | None, str] = (None, "starting")  # (step, phase) for _broken
        # Rank 0 lists the durable tier for every rank (one listing per question, handed out by a
        # broadcast or an all-reduce: every rank decides on the same listing). The store's
        # start lists it in the background while it builds the rest; the first question takes that.
        self._prelisted = durable_listing
        self._last_listed: Listing | None = None
        # The start's listing, taken again by the first question after it unless a save came
        # between (forget_listing): a restart restores and asks for the newest step held (in
        # either order), and nothing of this job can have reached the durable tier in between but
        # a node agent's commit of a step the nodes hold anyway (a candidate through them).
        self._reusable: Listing | None = None
        self.check, self.peer_timeout_s = check, peer_timeout_s
        self.rank, self.world = groups.rank, groups.world
        self.buffer_bytes = RESTORE_BUFFER  # the restore's read budget (store.restore(buffer_bytes=))
        self._round = 0  # exchange rounds so far, the same count on every rank
        self._durable_digest: tuple[int | None, str | None] = (None, None)
        # The manifests the node tiers hold of one step, parsed, by their bytes: a start-up and the
        # restore after it, and a restore's attempt and the meta it then reads, each take the step's
        # inventory, and parsing was most of that (0.01-0.02 s a copy at 144 tensors, two copies).
        # A body that changed is other bytes, parsed anew; only the newest step's are kept.
        self._known: tuple[int | None, dict[bytes, tuple[str, Manifest]]] = (None, {})
        # The size of this rank's own data file of the step last loaded, wherever it was read (a
        # replaced node's from a peer): a byte copy of the slot it was staged in, the size to make
        # the next save's slot ahead at (the store's first save after a node loss waited for it).
        self.own_file_size: int | None = None

    def _at(self, step: int | None, phase: str) -> None:
        """Where the restore is, for the error a failed collective raises (:meth:`_broken`)."""
        self._doing = (step, phase)

    def _broken(self, exc: BaseException) -> CollectiveError:
        step, phase = self._doing
        what = f"step {step}" if step is not None else "the newest step"
        message = (f"restore of {what} of job {self.job}: rank {self.rank} of {self.world} lost the other ranks while "
                   f"{phase} (a collective of the store's gloo group failed: {exc}). Another rank died or did not "
                   "answer within the store's timeout_s. Restart the job (every rank): the checkpoints are intact, "
                   "a restore only reads them.")
        err = BrokenRestore(message, {self.rank: RankFailure.of(self.rank, exc, socket.gethostname())})
        err.step, err.phase = step, phase  # type: ignore[attr-defined]
        return err

    def _durable_steps(self, oldest: int | None = None) -> set[int]:
        """Rank 0's listing of the durable tier's committed steps (an empty set elsewhere, and when
        it cannot be listed); :meth:`_listing` (or :meth:`newest_held`'s all-reduce) hands it to every rank. ``oldest`` (rank 0's): the
        oldest step the caller asks about; the listing may leave out older ones (None: none)."""
        listed = self._listed_durable(oldest) if self.rank == 0 else None
        return set() if listed is None else listed

    def _listed_durable(self, oldest: int | None = None) -> set[int] | None:
        """The durable tier's committed steps, every one from ``oldest`` on (None: all of them);
        None when it cannot be listed (an outage)."""
        if self.durable is None:
            return set()
        prelisted, self._prelisted = self._prelisted, None
        reusable, self._reusable = self._reusable, None
        listing = reusable
        if prelisted is not None:
            listing = self._reusable = prelisted.result()
            if listing is None:  # the start could not list it
                self._last_listed = None
                return None
        if listing is None or not listing.covers(oldest):
            # A question about steps the start's listing left out (a restore falling back past the
            # node's newest step): every step, listed now.
            try:
                listing = Listing(frozenset(self.durable.steps_sync()))
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot list the durable tier: %s", exc)
                self._last_listed = None
                return None
        self._last_listed = listing
        return set(listing.steps)

    def forget_listing(self) -> None:
        """A save is under way: the next question lists the durable tier afresh."""
        self._reusable = None

    def _listing_pending(self) -> bool:
        """Whether rank 0's listing of the durable tier, started with the store, is still under way."""
        return self.rank == 0 and self._prelisted is not None and not self._prelisted.done()

    def _listing(self, listed: set[int]) -> set[int]:
        """Rank 0's listing of the durable tier on every rank (one broadcast: what every rank
        receives is the listing, whatever the number of ranks)."""
        return set(self.groups.trainer.broadcast(sorted(listed) if self.rank == 0 else None) or ())

    def _held_steps(self, oldest: int | None = None) -> tuple[set[int], set[int]]:
        """The steps any rank's node holds something of, and the durable tier's (collective; from
        step ``oldest`` on, rank 0's, where the caller needs no older ones). The ranks usually hold
        the same steps: one all-reduce of a hash of each rank's list says so, and only when the
        lists differ does every rank gather every rank's."""
        listed = self._durable_steps(oldest)
        union = self._node_union()
        return union, (self._listing(listed) if self.world > 1 else listed)

    def _node_union(self) -> set[int]:
        """The steps any rank's node holds something of (collective)."""
        mine = sorted(self._node_steps())
        if self.world == 1:
            return set(mine)
        fg = self.groups.trainer
        return set(mine) if _same_everywhere(fg, mine) else set().union(*map(set, fg.all_gather(mine)))

    def _node_steps(self) -> set[int]:
        return set().union(*(t.node_steps() for t in self.node_tiers))

    def newest(self, state: Any, per_rank: str) -> Found:
        """Load the newest step with a sound copy into ``state``; returns it, the tiers it came from
        and the newer steps found incomplete. The step is None when no tier of any rank
        holds any step, or when every step held is incomplete and none damaged (a warning says so:
        the job starts fresh). Raises CorruptCheckpointError, listing what was tried, when steps
        exist but none has a sound copy for every rank and some were damaged (or unreadable)."""
        # The node tiers' newest step first, with a listing of the durable tier from that step on
        # (_early); when the durable tier holds a newer step, or that step cannot be loaded, every
        # step any tier holds is a candidate, newest first, with the whole listing.
        self._at(None, "choosing the step to restore")
        pending = self._listing_pending()
        if self.world > 1:
            pending = bool(self.groups.trainer.max_int64([int(pending)])[0])
        found, failed = self._early(state, per_rank, self._node_union(), pending)
        if found is not None:
            return found
        self._at(None, "listing the steps every tier holds")
        node, durable = self._held_steps()
        candidates = sorted(node | durable, reverse=True)
        tried: list[str] = []
        verdicts: dict[int, str] = {}
        for step in candidates:
            if failed is not None and failed[:2] == (step, step in durable):
                ok, detail, verdict = False, failed[2], failed[3]  # tried alike already: not again
            else:
                ok, detail, verdict = self._attempt(state, step, step in durable, per_rank)
            if ok:
                return self._found(step, detail, verdicts, durable, candidates)
            if verdict == _MISSING:
                log.warning("ckptstore: step %d is incomplete, skipping it (%s); trying an older step", step, detail)
            else:
                log.warning("ckptstore: step %d cannot be restored (%s); trying an older step", step, detail)
            tried.append(detail)
            verdicts[step] = verdict
        if tried and all(v == _MISSING for v in verdicts.values()):
            log.warning("ckptstore: no step of job %s is complete (%s lost a part with a node, and none is "
                        "damaged): starting fresh", self.job, _steps(verdicts))
            return self._found(None, "", verdicts, durable, candidates)
        if tried:
            raise CorruptCheckpointError("no sound copy of any checkpoint of this job: " + "; ".join(tried))
        return Found(None)

    def _early(self, state: Any, per_rank: str, held: set[int],
               pending: bool) -> tuple[Found | None, tuple[int, bool, str, str] | None]:
        """The newest step the nodes hold, loaded, when the durable tier holds nothing newer (what
        trying the candidates newest first would find), else None (collective). ``pending``: rank
        0's listing of the durable tier, started with the store, is still under way: the step is
        loaded meanwhile and the listing taken after; otherwise the listing comes first, and a
        newer durable step costs no load of the nodes' one. Only steps from the nodes' newest on
        are looked up in the durable tier (the start's listing looks no further back). The second
        value: the step's failed attempt when it was made knowing the listing (not made again)."""
        step = max(held, default=None)
        if step is None:
            return None, None
        ok, detail = True, ""
        if pending:
            # Not in the durable tier as far as this attempt knows: a part the nodes lack fails it,
            # and the candidates are then tried with the listing, this step first again.
            ok, detail = self._attempt(state, step, False, per_rank)[:2]
        self._at(step, "listing the durable tier")
        listed = self._durable_steps(step)
        durable = self._listing(listed) if self.world > 1 else listed
        if not ok or any(s > step for s in durable):
            return None, None
        if not pending:
            in_durable = step in durable
            ok, detail, verdict = self._attempt(state, step, in_durable, per_rank)
            if not ok:
                return None, (step, in_durable, detail, verdict)
        return self._found(step, detail, {}, durable, sorted(held | durable, reverse=True)), None

    @staticmethod
    def _found(step: int | None, tiers: str, verdicts: dict[int, str], durable: set[int],
               candidates: list[int]) -> Found:
        # Only incomplete steps form the dead branch: their missing part is gone with its node, so
        # nothing is lost by dropping the rest. A damaged step is kept (and counted) as evidence for
        # whoever investigates it (a checksum mismatch, a replica check that failed the step), and
        # one that failed for another reason (an I/O error, a peer that did not answer) may be complete.
        dead = sorted(s for s, v in verdicts.items() if v == _MISSING)
        uncounted = set(dead) - durable
        newer = sorted(c for c in candidates if step is None or c > step)
        return Found(step, tiers, dead, uncounted, max((c for c in candidates if c not in uncounted), default=None),
                     newer, sorted(s for s, v in verdicts.items() if v == _DAMAGED))

    def exact(self, state: Any, step: int, per_rank: str) -> str:
        """Load exactly ``step`` into ``state``, never another one; returns the tiers it came from.
        Raises CheckpointNotFoundError when no tier of any rank holds the step, CorruptCheckpointError
        when no sound copy of it is left."""
        self._at(step, "looking up which tiers hold the step")
        listed = self._durable_steps(step)
        mine = step in self._node_steps()
        held = bool(self.groups.trainer.max_int64([int(mine)])[0]) if self.world > 1 else mine
        durable = self._listing(listed) if self.world > 1 else listed
        in_durable = step in durable
        if not (held or in_durable):
            raise CheckpointNotFoundError(f"no tier holds step {step} of job {self.job}")
        ok, detail, _verdict = self._attempt(state, step, in_durable, per_rank)
        if not ok:
            raise CorruptCheckpointError(f"no sound copy of step {step} of job {self.job}: {detail}")
        return detail

    def latest(self) -> int | None:
        """The newest step any tier of any rank holds committed (collective)."""
        # Rank 0's node's newest step bounds the answer from below: older durable steps cannot be it.
        self._at(None, "finding the newest step any tier holds")
        node, durable = self._held_steps(max(self._node_steps(), default=None) if self.rank == 0 else None)
        steps = node | durable
        return max(steps) if steps else None

    def newest_held(self, *, wait: bool = True) -> tuple[tuple[int, dict[str, Any], bool] | None, bool]:
        """The newest step any tier of any rank holds committed, its manifest's ``meta`` and whether
        the durable tier holds it (collective); None when there is none. What a new store counts on
        from: steps only grow past it, and its cadence continues.

        ``wait=False``: while rank 0's start-up listing of the durable tier is under way, the node
        tiers' answer alone, without waiting for it; the second value says so (the same on every
        rank), and the caller asks again (waiting) before it relies on the answer."""
        pending = not wait and self._listing_pending()
        node = self._node_steps()
        # Rank 0's: from rank 0's node's newest step on, as the newest step held is at least that one.
        listed = set() if pending else self._durable_steps(max(node, default=None))
        newest = max(node | listed, default=None)
        if self.world == 1:
            if newest is None:
                return None, pending
            return (newest, self._meta(newest, newest in listed), newest in listed), pending
        # Fixed-size, whatever the world: the newest step held is the maximum of every rank's newest;
        # the durable tier holds it when it is rank 0's newest listed step (no listed step is newer
        # than rank 0's newest); rank 0's pending travels alike. Its meta is the lowest rank's whose
        # newest it is (what the gather of every rank's answer picked): rank 0 when every rank holds
        # the same newest step, the usual restart; else one more all-reduce finds that rank.
        self._at(None, "finding the newest step any tier holds")
        fg = self.groups.trainer
        mine = _NONE if newest is None else newest
        top = max(listed, default=_NONE) if self.rank == 0 else _NONE
        step, least, none, top, pending_at_0 = fg.max_int64(
            [mine, _NONE if newest is None else -newest, int(newest is None), top,
             int(pending) if self.rank == 0 else 0])
        pending = bool(pending_at_0)
        if step == _NONE:
            return None, pending
        holder = 0 if (step == -least and not none) else -fg.max_int64([-self.rank if mine == step else _NONE])[0]
        in_durable = top == step
        meta = broadcast_from(fg, self._meta(step, in_durable) if self.rank == holder else None, holder)
        return (step, meta if meta is not None else {}, in_durable), pending

    def meta_of(self, step: int) -> tuple[dict[str, Any], bool | None]:
        """The ``meta`` of ``step``'s manifest as this node or the durable tier holds it, and whether
        the durable tier holds the step: None when it could not be listed (collective: every rank
        gets rank 0's answer)."""
        self._at(step, "reading the step's meta (it was loaded)")
        mine = None
        if self.rank == 0:
            # A step the restore's own listing showed is still there (only this job's retention
            # removes durable steps, and it runs after saves); any other is listed afresh.
            known = self._last_listed
            listed = (set(known.steps) if known is not None and step in known.steps
                      else self._listed_durable(step))
            durable = listed is not None and step in listed
            mine = (self._meta(step, durable), durable, listed is not None)
        # Rank 0's answer alone travels: a gather would hand every rank a padded copy per rank.
        first = self.groups.trainer.broadcast(mine)
        return first[0], (first[1] if first[2] else None)

    def _inventory(self, step: int, tiers: Sequence[Tier] | None = None) -> NodeInventory:
        if self._known[0] != step:
            self._known = (step, {})
        return NodeInventory.of(self.node_tiers if tiers is None else tiers, step, self._known[1])

    def _meta(self, step: int, in_durable: bool) -> dict[str, Any]:
        # The layout a restore tries first is one the RAM tiers hold whenever they hold one (the
        # others rank after it): only otherwise is the local tier inventoried, which in a
        # single-node job parses the step's whole manifest, every rank's chunks.
        first_tiers = [t for t in self.node_tiers if t.name in FIRST_TIERS]
        first = self._inventory(step, first_tiers).first() if first_tiers else None
        if first is None or first.preference != 0:
            first = self._inventory(step).first()
        if first is not None and first.parsed is not None:
            return dict(first.parsed.meta)
        if first is not None and first.meta is not None:  # a copy of parts: each carries the step's meta
            return dict(first.meta)
        if in_durable and self.durable is not None:
            try:
                index = self._durable_index(step)
                return dict((index.header if index is not None else self.durable.manifest_sync(step)).meta)
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot read the manifest of step %d in the durable tier: %s", step, exc)
        return {}

    def _durable_layout(self, step: int) -> str | None:
        """The layout of ``step``'s durable copy (its manifest read once per step and rank), or None
        when it cannot be read."""
        if self._durable_digest[0] != step:
            digest = None
            if self.durable is not None:
                try:
                    index = self._durable_index(step)
                    digest = index.layout if index is not None else layout_digest(self.durable.manifest_sync(step))
                except (CheckpointError, OSError) as exc:
                    log.warning("ckptstore: cannot read the manifest of step %d in the durable tier: %s", step, exc)
            self._durable_digest = (step, digest)
        return self._durable_digest[1]

    def _durable_index(self, step: int) -> Index | None:
        """The index of ``step``'s durable copy; None when it has none or it is unreadable (the
        manifest is read instead, with a warning)."""
        assert self.durable is not None
        read = self.durable.small_reader(step)
        if read is None:
            return None
        try:
            return read_index(read, self.durable.display(step))
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: cannot read the index of %s (%s); reading its manifest", self.durable.display(step),
                        exc)
            return None

    def _durable_manifest(self, state: Any, step: int, display: str) -> Manifest:
        """The manifest this rank loads ``step``'s durable copy with: planned from the step's index
        and the part files this rank's load needs (its own, at the layout it saved), never the
        whole world's chunk table; the whole manifest when the step has no sound index."""
        assert self.durable is not None
        index = self._durable_index(step)
        read = self.durable.small_reader(step)
        if index is not None and read is not None:
            try:
                planned = plan_from_index(read, state, self.rank, self.world, display, index)
                if planned is not None:
                    return planned
            except (CorruptCheckpointError, CheckpointNotFoundError, OSError) as exc:
                log.warning("ckptstore: cannot plan the load of %s from its index (%s); reading its manifest",
                            display, exc)
        return self.durable.manifest_sync(step)

    def _attempt(self, state: Any, step: int, in_durable: bool, per_rank: str) -> tuple[bool, str, str]:
        """Load ``step`` on every rank, one layout after another (collective): the layouts the
        nodes hold, in the order every rank agrees on (the staged slot's, then the local tier's),
        then the durable tier's own when it differs from all of them. Returns whether it loaded,
        the tiers it came from or what went wrong, and (on failure) why: ``_MISSING`` when every
        problem was a part no node holds, ``_DAMAGED`` when some bytes were not sound.

        The usual restart finds every rank's own copy in the RAM tiers, whose layouts come first:
        then the other node tiers are not inventoried until those layouts fail (the local tier
        reads every node rank's part, or in a single-node job the step's whole manifest, which
        grows with the node's ranks, not with this rank's bytes). Their copies join the layouts
        then, and a layout tried already is tried again only when some rank's node holds more
        copies of it than the first inventory listed."""
        self._at(step, "agreeing on the copies of the step each node holds")
        fg = self.groups.trainer
        first_tiers = [t for t in self.node_tiers if t.name in FIRST_TIERS]
        quick = None
        if first_tiers and len(first_tiers) < len(self.node_tiers):
            quick = self._inventory(step, first_tiers)
            if not (quick.layouts and quick.own and not quick.damaged and quick.unsupported is None
                    and min(inv.preference for inv in quick.layouts.values()) == 0):
                quick = None
        node = quick if quick is not None else self._inventory(step)
        said = _said(node)
        if self.world == 1:
            gathered = [said]
        else:
            # One all-reduce, as before: the ranks' lists alike (of the RAM tiers on every rank, or
            # of every tier on every rank), and whether every rank, or none, took the RAM tiers alone.
            h = xxhash.xxh3_64_intdigest(json.dumps([said], separators=(",", ":")).encode()) >> 2
            got = fg.max_int64([h, -h, int(not node.holds_any()), int(not node.own), int(quick is not None),
                                int(quick is None)])
            if got[4] and got[5]:  # some ranks took the RAM tiers alone, others could not: every tier
                if quick is not None:
                    node, quick = self._inventory(step), None
                    said = _said(node)
                gathered = fg.all_gather(said)
            elif got[0] == -got[1] and not got[2] and not got[3]:
                gathered = None  # every rank said what this one did
            else:
                gathered = fg.all_gather(said)
        excluded: set[str] = set()  # damaged copies, by where they lie: never read again in this step
        kinds: set[str] = set()  # what went wrong in every attempt so far (the same on every rank)
        details: list[str] = []
        tried: dict[str, Inventory] = {}  # the layouts tried with the RAM tiers' copies alone
        while True:
            bare, ownless, preference = _agreed(gathered, said, self.world)
            order: list[str | None] = [d for d in sorted(preference, key=lambda d: (preference[d], d))]
            if tried:
                grown = [int(_grown(tried[d], node.layout(d))) for d in order if d in tried]
                if grown and self.world > 1:
                    grown = fg.max_int64(grown)
                again = {d for d, flag in zip([d for d in order if d in tried], grown) if flag}
                order = [d for d in order if d not in tried or d in again]
            if quick is None and in_durable:
                own = self._durable_layout(step)
                known = own is not None and own in preference
                if (fg.max_int64([int(not known)])[0] if self.world > 1 else not known):
                    order.append(_DURABLE)
            if not order and quick is None and not tried:
                order = [None]  # nothing readable anywhere: one attempt says why (or that a newer reader is needed)
            if details and order:
                log.warning("ckptstore: %s; trying the next copy of the step laid out differently", details[-1])
            for digest in self._layouts(order, node, preference, everything=quick is None):
                self._at(step, "agreeing on the copies of the step each node holds")
                ok, detail = self._attempt_layout(state, step, node, digest, in_durable, excluded, per_rank, bare,
                                                  kinds, ownless)
                if ok:
                    return True, detail, ""
                details.append(detail)
                if quick is not None and digest is not None:
                    tried[digest] = node.layout(digest)
                if not order or digest != order[-1]:
                    log.warning("ckptstore: %s; trying the next copy of the step laid out differently", detail)
            if quick is None:
                break
            # The RAM tiers' layouts failed: every node tier now, agreed as the usual path does.
            node, quick = self._inventory(step), None
            said = _said(node)
            alike = self.world > 1 and _same_everywhere(fg, [said], flags=[not node.holds_any(), not node.own])
            gathered = None if alike else fg.all_gather(said) if self.world > 1 else [said]
        verdict = _DAMAGED if _DAMAGED in kinds else _MISSING if kinds == {_MISSING} else _OTHER
        return False, "; then ".join(details), verdict

    def _layouts(self, order: list[str | None], node: NodeInventory, preference: dict[str, int], *,
                 everything: bool) -> Iterator[str | None]:
        """The layouts to try, in ``order``; then, once those failed and ``everything`` a node
        holds was inventoried, the mixtures of one save's layouts (:meth:`_mixtures`, made only
        then: a collective)."""
        yield from order
        if everything:
            yield from self._mixtures(node, preference)

    def _mixtures(self, node: NodeInventory, preference: dict[str, int]) -> list[str]:
        """The layouts that mix the parts of one save from its layouts of parts (collective when
        there are any: one gather of which parts each node holds in them), added to ``node``.

        A node copy of a save is a byte copy of the slot (the RAM tier, a peer replica, a local
        write of it) or laid out otherwise (a local write beside a crashed one's file, frozen
        tensors in their own file): two layouts of one save. After a node loss the lost node's part
        may be left only as a replica on another node (the slot's layout) while a surviving rank's
        slot is gone (an agent gave its RAM back once it persisted it) and its local copy is laid
        out otherwise: each layout then lacks a part, yet every part is held. Each writer's part is
        taken from the first layout, in the agreed order, that some node holds it in."""
        by_save: dict[str, list[str]] = {}
        for d in sorted(preference, key=lambda d: (preference[d], d)):
            if assembled(d) and not d.startswith("mixed:"):
                by_save.setdefault(save_of(d), []).append(d)
        groups = [(save, names) for save, names in by_save.items() if len(names) > 1]
        if not groups:
            return []
        mine = [[sorted(node.layout(d).parts) for d in names] for _save, names in groups]
        gathered = self.groups.trainer.all_gather(mine) if self.world > 1 else [mine]
        out = []
        for g, (save, names) in enumerate(groups):
            choice: dict[int, str] = {}
            for i, d in enumerate(names):
                for held in gathered:
                    for q in held[g][i]:
                        choice.setdefault(q, d)
            if len(set(choice.values())) < 2:
                continue  # one layout holds every part any node holds: tried as it is
            name = f"mixed:{save}"
            node.layouts[name] = mixture(node, name, choice)
            out.append(name)
        return out

    def _lost(self, unowned: list[str], ownless: frozenset[int]) -> bool:
        """Whether every file no node offers was written by a rank whose node holds no copy of its
        own of the step: then nothing is damaged, the part is gone. A writer this job no longer has (it runs
        on fewer ranks) does not count: its node may hold the part and come back, and calling the
        step incomplete would drop the surviving nodes' copies of it."""
        writers = [data_file_rank(name) for name in unowned]
        return bool(unowned) and all(w is not None and w < self.world and w in ownless for w in writers)

    def _attempt_layout(self, state: Any, step: int, node: NodeInventory, digest: str | None, in_durable: bool,
                        excluded: set[str], per_rank: str, bare: frozenset[int] = frozenset(),
                        kinds: set[str] | None = None, ownless: frozenset[int] = frozenset()) -> tuple[bool, str]:
        """Collective attempts (retried with bad copies excluded) to load ``step`` on every rank from
        the copies in one layout: the nodes' copies in it, fetched across nodes where a node lacks
        a file, and the durable copy when it is laid out alike (or is the layout, ``_DURABLE``)."""
        fg = self.groups.trainer
        from_durable = digest == _DURABLE
        inv = Inventory(None, DURABLE_PREFERENCE) if from_durable else node.layout(digest)
        durable: Tier | _Lazy | None
        if from_durable:
            durable = self.durable
        elif in_durable and self.durable is not None:
            # A layout of parts is named by its save; the durable copy is laid out alike when its
            # layout is the one the assembled manifest describes.
            durable = _Lazy(self.durable, step, lambda: self._durable_layout(step) in (digest, inv.layout))
        else:
            durable = None
        display = f"step {step} of job {self.job}"
        bad_owners: set[tuple[str, int]] = set()
        kinds = set() if kinds is None else kinds
        # One rank whose node holds something of the step: no other node to fetch from and no part
        # lost with a node, so the files it needs are not planned ahead; the load opens them, and a
        # state that does not match the checkpoint fails there just as in the planning walk.
        solo = self.world == 1 and not bare
        detail = ""
        for _try in range(_ATTEMPTS):
            fatal: Exception | None = None
            problem = kind = ""
            retry = False
            used: set[str] = set()
            opener: _Opener | None = None
            missing: PartsMissing | CorruptCheckpointError | None = None
            self._at(step, "planning each rank's load from the step's manifest")
            try:
                # A layout of parts is planned from each rank's own part where it can be (the same
                # world loading the layout it saved), and its layout digest is known to every rank
                # only when the durable copy may fill in (it is compared with it).
                manifest = None if from_durable else get_manifest(fg, inv, f"{display}/{MANIFEST}", state,
                                                                  layout=durable is not None)
            except (PartsMissing, CorruptCheckpointError) as exc:  # alike on every rank: from what all sent
                manifest, missing = None, exc
            # Planned from own parts (alike on every rank): each rank reads its own boxes, and no
            # rank takes part in a cooperative read, not even to abstain from it.
            flat = manifest is not None and manifest.planned == "flat"
            try:
                if missing is not None:
                    raise missing
                if manifest is None and from_durable:
                    manifest = self._durable_manifest(state, step, display)
                if manifest is None and node.unsupported is not None:
                    raise node.unsupported  # written by a newer ckptstore: say so, do not fall back silently
                if manifest is None:
                    raise CheckpointNotFoundError(f"no sound copy of the manifest of {display}")
                self.check.refuse(manifest, display)
                wanted = [] if solo else sorted({name for name, _offset, _length in
                                                 chunks_needed(state, manifest, display, self.rank, self.world)})
            except PartsMissing as exc:
                # Parts no node holds: incomplete when every rank that wrote one has a node that
                # holds no copy of its own of the step (lost with it, or gone to retention while a
                # replica of another node's part stayed) and the durable tier cannot fill in.
                wanted, problem = [], f"incomplete: {exc}"
                lost_with_node = bool(exc.ranks) and all(r < self.world and r in ownless for r in exc.ranks)
                kind = _MISSING if lost_with_node and durable is None and _DAMAGED not in kinds else _OTHER
            except (CorruptCheckpointError, CheckpointNotFoundError, StorageError, OSError) as exc:
                wanted, problem = [], f"{exc}"
                unreadable = manifest is None and not from_durable  # listed, yet no node's copy parses
                kind = _DAMAGED if isinstance(exc, CorruptCheckpointError) or unreadable else _OTHER
            except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
                wanted, fatal = [], exc
            self._round += 1  # every rank counts the same rounds: the tags of this one are its own
            self._at(step, "arranging which ranks send each other the step's files")
            transfers = Transfers() if solo else exchange(
                fg, self.groups.transfer, inv, wanted, excluded, bad_owners, display,
                tags=(2 * self._round + 1, 2 * self._round + 2), timeout_s=self.peer_timeout_s)
            # Decided alike on every rank (from what the exchange gathered): when a part is gone with
            # a lost node, no rank loads, so no rank's state is left half-filled with this step.
            # Once a copy was found damaged the attempt runs as it always did, and says so.
            lost = durable is None and _DAMAGED not in kinds and self._lost(transfers.unowned, ownless)
            try:
                if lost and not problem and fatal is None:
                    gone = sorted(set(wanted) & set(transfers.unowned))
                    if gone:
                        problem, kind = (f"incomplete: {', '.join(gone)} {'is' if len(gone) == 1 else 'are'} held by "
                                         "no node (the node of the rank that wrote it holds no copy of its own of the "
                                         "step) and "
                                         "the durable tier lacks the step"), _MISSING
                elif not problem and fatal is None:
                    assert manifest is not None
                    self._at(step, "loading the step")
                    opener = _Opener(transfers.sources, inv, excluded, durable.opener(step) if durable else None,
                                     display, used, own=data_file(self.rank))
                    problem, kind, retry, fatal = self._load(state, manifest, display, opener, per_rank, transfers,
                                                             inv, excluded, bad_owners, share_whole=from_durable,
                                                             cooperate=not flat)
                elif not lost and not flat:
                    abstain(fg)  # the ranks that load read together; this one does not, and says so
            finally:
                transfers.close()
            mine: dict[str, Any] = {"fatal": None if fatal is None else f"rank {self.rank}: {fatal}",
                                    "failure": None if fatal is None else failure_record(self.rank, fatal),
                                    "problem": problem, "kind": kind, "retry": retry, "used": sorted(used)}
            self._at(step, "agreeing on the outcome of loading the step")
            outcomes = self._outcomes(mine)
            if any(o["fatal"] for o in outcomes):
                if fatal is not None:
                    raise fatal  # this rank's own error, as raised
                failures = failures_from([o["failure"] for o in outcomes])
                raise collective_error("restore failed on other ranks: " + "; ".join(o["fatal"] for o in outcomes
                                                                                   if o["fatal"]), failures)
            problems = [f"rank {r}: {o['problem']}" for r, o in enumerate(outcomes) if o["problem"]]
            kinds.update(o["kind"] for o in outcomes if o["kind"])
            if not problems:
                # Saved by this world: this rank's file held this rank's slot (resharded, another's).
                same_world = manifest is not None and manifest.meta.get("world_size") == self.world
                self.own_file_size = opener.own_size if opener is not None and same_world else None
                tiers = sorted({k for o in outcomes for k in o["used"]})
                return True, "+".join(tiers) if tiers else "ram"
            summary = f"step {step}: " + "; ".join(problems)
            detail = f"{detail}; then {summary}" if detail else summary
            if not any(o["retry"] for o in outcomes):
                break
            log.warning("ckptstore: %s; retrying with the damaged copies excluded", summary)
        return False, detail

    def _outcomes(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's outcome of an attempt (collective). A success everywhere is one all-reduce
        of a flag and of which tiers were read (a flag per tier name of ckptstore's own tiers: the
        same vector on every rank, whatever tiers each rank's store has); any failure, or a tier of
        another name, and every rank gathers every rank's outcome."""
        fg = self.groups.trainer
        if self.world == 1:
            return [mine]
        odd = (bool(mine["fatal"] or mine["problem"] or mine["kind"] or mine["retry"])
               or not set(mine["used"]) <= set(_TIER_NAMES))
        got = fg.max_int64([int(odd)] + [int(n in mine["used"]) for n in _TIER_NAMES])
        if got[0]:
            return fg.all_gather(mine)
        used = [n for n, flag in zip(_TIER_NAMES, got[1:]) if flag]
        return [{"fatal": None, "failure": None, "problem": "", "kind": "", "retry": False, "used": used}]

    def _load(self, state: Any, manifest: Manifest, display: str, opener: _Opener, per_rank: str,
              transfers: Transfers, inv: Inventory, excluded: set[str],
              bad_owners: set[tuple[str, int]], *, share_whole: bool,
              cooperate: bool = True) -> tuple[str, str, bool, Exception | None]:
        """Load this rank's part; returns (a problem with the copies read, its kind, whether another
        copy is worth a retry, an error of the caller's state). Only a load from the durable tier
        shares the reading of chunks ranks need whole: on the nodes each rank's copy is at hand."""
        try:
            load_manifest(state, manifest, display, opener, group=self.groups.trainer, strict=True, per_rank=per_rank,
                          buffer_bytes=self.buffer_bytes, decode_per_rank=decode_value, share_whole=share_whole,
                          cooperate=cooperate)
        except PeerUnavailable as exc:
            bad_owners.update((name, exc.owner) for name in exc.names)
            return str(exc), _OTHER, True, None
        except CorruptCheckpointError as exc:
            bad = _exclude(exc, transfers.sources, inv, excluded, bad_owners)
            return str(exc) + (f" (the copy read was {bad})" if bad else ""), _DAMAGED, bad is not None, None
        except (CheckpointNotFoundError, StorageError, OSError) as exc:
            return str(exc), _OTHER, False, None
        except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
            return "", "", False, exc
        return "", "", False, None


def _said(node: NodeInventory) -> tuple[list[tuple[int, str]], bool, bool]:
    """What a rank tells the others of its node's copies of a step: the layouts (preference, name),
    whether it holds anything, and whether a copy of its own."""
    return sorted((inv.preference, d) for d, inv in node.layouts.items()), node.holds_any(), node.own


def _agreed(gathered: list[Any] | None, said: Any, world: int) -> tuple[frozenset[int], frozenset[int], dict[str, int]]:
    """From every rank's :func:`_said`: the ranks whose node holds nothing of the step; those whose
    node holds no copy of its own (nothing at all, or only other nodes' replicas: their own copies
    went with a lost node or to retention, so a part only they wrote that no other node holds never
    got out of reach, it is missing, not damaged; a file lacking from a copy the writer's node still
    holds is damage); and each layout's best preference on any node.
    ``gathered`` None: every rank said ``said`` (the common case, agreed by a hash), answered
    without a pass over the world, which is thousands of ranks on a large job."""
    words = [said] if gathered is None else gathered
    if gathered is None:
        _listed, holds, own = said
        everyone = frozenset(range(world))
        bare, ownless = frozenset() if holds else everyone, frozenset() if own else everyone
    else:
        bare = frozenset(r for r, (_listed, holds, _own) in enumerate(gathered) if not holds)
        ownless = frozenset(r for r, (_listed, _holds, own) in enumerate(gathered) if not own)
    preference: dict[str, int] = {}
    for listed, _holds, _own in words:
        for p, d in listed:
            preference[d] = min(preference.get(d, p), p)
    return bare, ownless, preference


def _grown(before: Inventory, now: Inventory) -> bool:
    """Whether ``now`` holds copies of a layout that ``before`` (the RAM tiers' alone) did not."""
    return (any(len(now.files.get(n, ())) > len(c) for n, c in before.files.items()) or len(now.files) > len(before.files)
            or len(now.parts) > len(before.parts) or (now.manifest is not None and before.manifest is None))


def _same_everywhere(group: Any, value: Any, flags: Sequence[bool] = ()) -> bool:
    """Whether every rank of ``group`` holds the same ``value`` (JSON-able) and no rank raises any
    of ``flags``: one all-reduce of a 62-bit hash, its negation and the flags."""
    h = xxhash.xxh3_64_intdigest(json.dumps(value, separators=(",", ":")).encode()) >> 2
    got = group.max_int64([h, -h, *map(int, flags)])
    return got[0] == -got[1] and not any(got[2:])


def _steps(verdicts: dict[int, str]) -> str:
    steps = sorted(verdicts)
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


_DURABLE = "durable"  # the durable tier's own layout, tried after every layout the nodes hold
_TIER_NAMES = ("durable", "local", "peer", "ram")  # what an attempt reports it read from, as flags


class _Lazy:
    """The durable tier as a fallback within a layout: usable only when its copy has that layout,
    which is checked (its manifest read) the first time a rank needs a file no node holds."""

    def __init__(self, tier: Tier, step: int, same_layout: Callable[[], bool]) -> None:
        self.tier, self.step, self.same_layout = tier, step, same_layout

    def opener(self, step: int) -> Callable[[str | None], Source]:
        inner: list[Callable[[str | None], Source]] = []

        def open_file(rel: str | None) -> Source:
            if not inner:
                if not self.same_layout():
                    raise CheckpointNotFoundError(
                        f"{self.tier.display(step)} is laid out differently from the copies being read (its own "
                        "manifest says where its bytes are); it is tried on its own next")
                inner.append(self.tier.opener(step))
            return inner[0](rel)

        return open_file


class _Opener:
    """Opens a chunk file for a restore: another node's copy, this node's, or the durable one."""

    def __init__(self, fetched: dict[str, RemoteSource], inv: Inventory, excluded: set[str],
                 durable: Callable[[str | None], Source] | None, display: str, used: set[str], own: str = "") -> None:
        self.fetched, self.inv, self.excluded, self.durable = fetched, inv, excluded, durable
        self.display, self.used, self.own = display, used, own
        self.own_size: int | None = None  # the size of the file named ``own`` (this rank's data file), once opened

    def __call__(self, rel: str | None) -> Source:
        source = self._open(rel)
        if rel == self.own:
            size = getattr(source, "size", None)
            self.own_size = size if type(size) is int else None
        return source

    def _open(self, rel: str | None) -> Source:
        if rel in self.fetched:
            self.used.add("peer")
            return self.fetched[rel]
        opened = self.inv.open(rel or "", self.excluded)
        if opened is not None:
            self.used.add(opened[0].tier)
            return opened[1]
        if self.durable is not None:
            source = self.durable(rel)
            self.used.add("durable")
            return source
        raise CheckpointNotFoundError(f"{self.display}: no rank holds {rel} and the durable tier lacks the step")


def _exclude(exc: CorruptCheckpointError, fetched: dict[str, RemoteSource], inv: Inventory, excluded: set[str],
             bad_owners: set[tuple[str, int]]) -> str | None:
    """Mark the copy a corruption came from, so the next attempt reads another; returns it."""
    location = exc.location or str(exc)
    for rel, source in fetched.items():
        if rel in location:
            bad_owners.add((rel, source.owner))
            return source.display
    for rel, copies in inv.files.items():
        if rel in location:
            for copy in copies:
                if copy.where not in excluded:
                    excluded.add(copy.where)
                    return copy.where
    return None
