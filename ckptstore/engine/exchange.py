"""Restoring across nodes: every rank serves the files its node holds, and fetches what it lacks.

The RAM and local tiers are per node, and a rank's load can need other ranks' data files (its
own shard was written by itself, but a replicated tensor was written once, by some rank, and a
resharded load reads from many). After a crash every file of a step usually still exists on some
node: in that node's RAM segments, its local directory, or a peer replica.

**Layouts.** The copies of one step are not all laid out alike: the RAM slot and its peer replicas
hold the staged bytes as they were, the local tier keeps the frozen region in a file of its own
(the rest's offsets shift), and a compressing durable tier has other offsets, lengths and
checksums. A *layout* is a step's chunk table (every chunk's file, offset, length, codec and
checksum); every copy of a data file is paired with the manifest of the tier that holds it, and
copies are grouped by the layout that manifest describes (:func:`layout_digest`). A copy is only
ever read with its own layout's manifest: read with another's, a sound copy looks truncated.

A restore runs, per candidate step and layout, as one collective round:

1. each rank asks its node-local tiers what its node holds of the step (:class:`NodeInventory`:
   layouts, each with its file copies and manifest; the ranks agree on an order of layouts);
2. for the layout tried, a rank with no copy of its manifest gets it from the lowest rank that has
   one; where the node copies hold their own ranks' parts, each rank plans its manifest from its
   own part, with only the chunks of other writers its load needs (:func:`own_manifest`);
3. each rank plans the files its state needs, and for each file its node lacks picks an owner
   among the ranks whose node has it (:func:`exchange`: one all-reduced flag when every node
   holds what its ranks need; else offers and requests meet at each file's directory rank, and
   nothing is gathered from every rank unless some file is offered by none); every owner learns
   who will ask it;
4. each rank loads, reading its node's copies directly and another node's through a
   :class:`RemoteSource`: every read the load makes (the rows it needs, in whole checksum
   blocks, within the load's ``buffer_bytes``) is one request to the owner, answered from the
   owner's mapped file straight into the load's buffer. Nothing is fetched ahead, so neither side
   holds more than the load's window. Checksums are verified on every byte as in any load, so a
   corrupt copy is caught wherever it came from, and the next attempt excludes it.
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ..checkpoint.index import add_chunks, part_boxes, part_digest, plan_from_part
from ..collective import Group
from ..errors import CheckpointError, CheckpointNotFoundError, StorageError, UnsupportedFormatVersionError
from ..format.manifest import Manifest, combine_digests, layout_digest, parse_manifest
from ..names import data_file_rank
from ..storage.targets import ShortRead, Source
from ..tiers.base import Held, NodePart, PartsMissing, Tier, manifest_of_parts, ranks_shown
from .guard import broadcast_from

log = logging.getLogger("ckptstore")

# Layouts are tried in this order of the tiers holding them: the staged bytes as they were (RAM,
# and the peer replicas that are byte copies of it), then anything else a node holds (the local
# tier); the durable tier's own layout comes last (restore.py).
FIRST_TIERS = frozenset({"ram", "peer"})
NODE_PREFERENCE, DURABLE_PREFERENCE = 1, 2

# What an owner answers to a request, before the bytes: served, no longer held, out of range.
_OK, _GONE, _SHORT = 0, 1, 2


class Inventory:
    """What this rank's node holds of one step in one layout: data files by name (every copy read
    with this layout's manifest), and that manifest if the node has a copy of it."""

    def __init__(self, digest: str | None = None, preference: int = NODE_PREFERENCE) -> None:
        self.digest, self.preference = digest, preference
        self.files: dict[str, list[Held]] = {}
        self.manifest: bytes | None = None
        self.parsed: Manifest | None = None  # self.manifest, parsed once (10^5 entries take seconds)
        self.where = ""
        # Where the node's copies hold their own ranks' parts instead of the whole manifest: those
        # parts by rank (each rank's manifest is planned from its own, or assembled from every
        # node's: :func:`get_manifest`), and the step's meta they carry.
        self.parts: dict[int, NodePart] = {}
        self.meta: dict[str, Any] | None = None
        self.layout: str | None = None  # the layout digest of the manifest assembled from the parts

    def names(self, excluded: set[str]) -> list[str]:
        return sorted(n for n, copies in self.files.items() if any(c.where not in excluded for c in copies))

    def open(self, name: str, excluded: set[str]) -> tuple[Held, Source] | None:
        """The first copy of ``name`` not excluded that still opens (a copy removed since the
        inventory was taken is passed over)."""
        for copy in self.files.get(name, []):
            if copy.where not in excluded:
                try:
                    return copy, copy.open()
                except (CheckpointNotFoundError, FileNotFoundError):
                    continue
        return None


class NodeInventory:
    """What this rank's node holds of one step, grouped by layout."""

    def __init__(self) -> None:
        self.layouts: dict[str, Inventory] = {}
        self.unsupported: UnsupportedFormatVersionError | None = None  # a copy only a newer reader reads
        self.damaged = False  # a copy of a manifest was unreadable: the node holds something of the step
        # Whether a tier other than the peer replicas holds something of the step: a copy this node's
        # own ranks wrote (a replica holds another node's part, never this node's own).
        self.own = False

    @classmethod
    def of(cls, tiers: Sequence[Tier], step: int, known: dict[bytes, tuple[str, Manifest]] | None = None
           ) -> NodeInventory:
        """What the node-local ``tiers`` hold of ``step`` on this node. Within a layout, copies keep
        the order of ``tiers`` (the order a load opens them in). A copy whose manifest is damaged,
        or that names no manifest of its tier, is left out: nothing says how to read it.

        ``known``: manifest bodies parsed by earlier inventories (their layout and manifest), which
        this one adds to: equal bytes are one manifest, so a body seen before is not parsed again
        (a load reads the manifest and never changes it)."""
        node = cls()
        parsed: dict[bytes, tuple[str, Manifest] | None] = dict(known or {})  # one parse per distinct body
        for tier in tiers:
            held = tier.holdings(step)
            if tier.name != "peer" and (held.manifests or held.files or held.parts or held.damaged):
                node.own = True
            if held.damaged:
                node.damaged = True  # the node holds something of the step, unreadable
            digests: dict[str, str] = {}
            for body, where in held.manifests:
                if body not in parsed:
                    got = parsed[body] = node._parse(body, where)
                    if got is not None and known is not None:
                        known[body] = got  # a damaged copy is parsed (and reported) anew each time
                got = parsed[body]
                if got is None:
                    continue
                digest, manifest = got
                digests[where] = digest
                preference = 0 if tier.name in FIRST_TIERS else NODE_PREFERENCE
                layout = node.layouts.get(digest)
                if layout is None:
                    layout = node.layouts[digest] = Inventory(digest, preference)
                layout.preference = min(layout.preference, preference)
                if layout.manifest is None:
                    layout.manifest, layout.parsed, layout.where = body, manifest, where
            for part in held.parts:
                kind = "staged" if tier.name in FIRST_TIERS or part.part.get("layout") == "staged" else "local"
                name = f"{kind}:{part.meta.get('save_id', '?')}"
                digests[part.where] = name
                preference = 0 if tier.name in FIRST_TIERS else NODE_PREFERENCE
                layout = node.layouts.get(name)
                if layout is None:
                    layout = node.layouts[name] = Inventory(name, preference)
                layout.preference = min(layout.preference, preference)
                layout.parts.setdefault(part.rank, part)
                if layout.meta is None:
                    layout.meta = part.meta
            only = set(digests.values())
            for copy in held.files:
                # A tier that does not say which of its manifests describes a copy (one written
                # before Held.manifest existed) can still be read when all its manifests agree.
                own: str | None = digests.get(copy.manifest) if copy.manifest else (
                    next(iter(only)) if len(only) == 1 else None)
                if own is not None:
                    node.layouts[own].files.setdefault(copy.file, []).append(copy)
        return node

    def _parse(self, body: bytes, where: str) -> tuple[str, Manifest] | None:
        try:
            manifest = parse_manifest(body, where=where)
        except UnsupportedFormatVersionError as exc:
            # Not damage: a newer writer's. If no copy is readable, upgrading is the answer.
            log.warning("ckptstore: ignoring a copy of a manifest: %s", exc)
            self.unsupported = exc
            return None
        except CheckpointError as exc:
            log.warning("ckptstore: ignoring a damaged copy of a manifest: %s", exc)
            self.damaged = True
            return None
        return layout_digest(manifest), manifest

    def layout(self, digest: str | None) -> Inventory:
        """This node's copies in the layout ``digest`` (none: an empty inventory)."""
        return self.layouts.get(digest or "") or Inventory(digest)

    def holds_any(self) -> bool:
        """Whether this node holds anything of the step, readable or not."""
        return bool(self.layouts) or self.damaged or self.unsupported is not None

    def first(self) -> Inventory | None:
        """The layout a restore tries first, of those this node holds."""
        return min(self.layouts.values(), key=lambda inv: (inv.preference, inv.digest or ""), default=None)


def assembled(digest: str | None) -> bool:
    """Whether the layout ``digest`` is one whose copies hold parts, not the whole manifest."""
    return digest is not None and digest.startswith(("staged:", "local:", "mixed:"))


def save_of(digest: str) -> str:
    """The save a layout of parts belongs to (its name past the kind)."""
    return digest.split(":", 1)[1]


def mixture(node: NodeInventory, name: str, choice: dict[int, str]) -> Inventory:
    """This node's copies of one save in the layout ``name`` that takes each writer's part from
    another layout of parts of that save: rank q's part, and the data files q wrote, from the layout
    ``choice[q]`` (the same choice on every rank). Each part addresses only its own writer's files
    (a data file's name carries its writer's rank), so parts of one save laid out differently
    (a slot's byte copy, a local write beside a crashed one's file, a frozen file) load together
    without one's chunk table reading another's bytes."""
    used = [node.layouts[d] for d in dict.fromkeys(choice.values()) if d in node.layouts]
    inv = Inventory(name, min((u.preference for u in used), default=NODE_PREFERENCE))
    for q, d in sorted(choice.items()):
        src = node.layouts.get(d)
        if src is not None and q in src.parts:
            inv.parts[q] = src.parts[q]
            if inv.meta is None:
                inv.meta = src.meta
    for src in used:
        for file, copies in src.files.items():
            writer = data_file_rank(file)
            if writer is not None and choice.get(writer) == src.digest:
                inv.files.setdefault(file, []).extend(copies)
    return inv


def assemble_manifest(group: Group, inv: Inventory, where: str) -> Manifest | None:
    """The manifest of a layout whose node copies hold their own ranks' parts, assembled on every
    rank from every node's parts (collective): the ranks gather which ranks' parts their nodes
    hold, the lowest holder of each sends it, and one more gather hands every rank all of them.
    None when no node holds a part; raises PartsMissing when some rank's part is held nowhere."""
    mine = sorted(inv.parts)
    held = group.all_gather(mine) if group.world > 1 else [mine]
    owner: dict[int, int] = {}
    for r, ranks in enumerate(held):
        for q in ranks:
            owner.setdefault(q, r)
    if not owner:
        return None
    sent = [(q, *fields) for q in mine if owner[q] == group.rank
            for fields in [_part_fields(inv.parts[q])] if fields is not None]
    got = group.all_gather(sent) if group.world > 1 else [sent]
    parts = [NodePart(q, part, meta, header, at) for batch in got for q, part, meta, header, at in batch]
    return manifest_of_parts(parts, where)


def _part_fields(p: NodePart) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, str] | None:
    """A part's members to send to another rank; None when its copy turns out damaged now that it
    is read (a node copy listed by its head alone): the part is then not sent, as if not held, and
    the receivers find it missing alike (raised here, it would leave them waiting)."""
    try:
        return p.part, p.meta, p.header, p.where
    except CheckpointError as exc:
        log.warning("ckptstore: ignoring a damaged copy of a part: %s", exc)
        return None


_NONE = -(1 << 63)  # the MAX identity of an int64 all-reduce


def own_manifest(group: Group, inv: Inventory, state: Any, where: str, *, layout: bool = False) -> Manifest | None:
    """The manifest this rank loads ``state`` with from a layout of parts, planned from its own part
    and its structure's header plus the chunks of other writers only for the boxes its own part
    does not cover (collective; checkpoint/index.py: plan_from_part). What a rank receives grows
    with what it loads, not with the world:

    1. one all-reduce: whether some rank's node lacks its own part, and the world the parts were
       saved by (every rank's alike, or not planned so);
    2. only when some rank lacks its own part: the ranks gather which parts their nodes hold (as
       the whole assembly does), the lowest holder of each missing one sends it to its rank, and a
       part held nowhere raises PartsMissing as the whole assembly would;
    3. each rank plans from its own part; one all-reduce says whether every rank could, and
       whether some rank needs boxes other writers hold;
    4. only then: each part's holder names every box of its part by :func:`box_id` to the rank the
       name hashes to (a directory spread over the ranks), each rank asks those directories for
       the boxes it needs, the directories forward each question to the holder, and the holder
       sends the chunks asked for: three exchanges of what each rank holds, needs and is asked,
       and one all-reduce says whether every rank found all it needs;
    5. with ``layout``: the step's layout digest from every rank's digest of its own part (an
       all-reduce of one int64 per rank), set as ``inv.layout``.

    None when the load cannot be planned so (a changed world or state, a resharded load, a header
    or a box not found, a part laid out in another rank's files): decided alike on every rank,
    which then assemble the whole manifest (:func:`assemble_manifest`)."""
    me, world = group.rank, group.world
    own = inv.parts.get(me)
    known = own or next(iter(inv.parts.values()), None)
    saved = known.meta.get("world_size") if known is not None else None
    saved = saved if type(saved) is int and saved >= 1 else 0
    lacks, most, least = group.max_int64([int(own is None), saved, -saved if saved else _NONE])
    if most != world or -least != world:
        return None
    serving: dict[int, NodePart] = {me: own} if own is not None else {}
    sent: dict[int, bytes] = {}
    holder: dict[int, int] = {}
    if lacks:
        mine = sorted(inv.parts)
        held = group.all_gather(mine)
        for r, ranks in enumerate(held):
            for q in ranks:
                holder.setdefault(q, r)
        for r, ranks in enumerate(held):
            if r in ranks:
                holder[r] = r  # a rank whose node holds its own part serves it
        missing = [q for q in range(world) if q not in holder]
        if missing:
            raise PartsMissing(f"{where}: no node holds the parts of ranks {ranks_shown(missing)}", ranks=missing)
        serving = {q: inv.parts[q] for q, r in holder.items() if r == me}
        sent = group.send_bytes({q: _encode(list(fields)) for q, p in serving.items()
                                 if q != me for fields in [_part_fields(p)] if fields is not None})
    # Whatever goes wrong from here on this rank is a flag in the next all-reduce, never an
    # exception that would leave the other ranks waiting in a collective this one skipped.
    plan = None
    digest: int | None = None
    try:
        if own is None:
            part, meta, header, at = _decode(sent[holder[me]])
            own = NodePart(me, part, meta, header, at)
        if own.header is not None and own.meta.get("world_size") == world:
            plan = plan_from_part(own.header, own.part, own.meta, state, me, world, where)
        if plan is not None and layout:
            digest = part_digest(own.part, me)
    except Exception as exc:  # noqa: BLE001 - the whole assembly says what is wrong, alike on every rank
        log.debug("ckptstore: cannot plan the load of %s from its own part: %s", where, exc)
        plan = None
    unplanned = plan is None or (layout and digest is None)
    failed, needing = group.max_int64([int(unplanned), int(plan is not None and bool(plan.needs))])
    if failed:
        return None
    assert plan is not None
    if needing:
        found = _find_boxes(group, plan.needs, serving)
        covered = False
        try:
            covered = add_chunks(plan, found, where)
        except Exception as exc:  # noqa: BLE001 - as above
            log.debug("ckptstore: the chunks other writers sent for %s do not plan its load: %s", where, exc)
        if group.max_int64([int(not covered)])[0]:
            return None
    if layout:
        # Rank 0 combines every rank's digest and hands out the result: the other ranks receive
        # one digest, not a vector of one int64 per rank (an all-reduce of 32 KiB at 4,096 ranks).
        assert digest is not None
        digests = group.gather_to_root(digest)
        combined = combine_digests({r: f"xxh3_64:{v % (1 << 64):016x}" for r, v in enumerate(digests)}) if (
            me == 0) else None
        inv.layout = group.broadcast(combined)
    return plan.manifest


def _find_boxes(group: Group, needs: list[tuple[str, Any, int]], serving: dict[int, NodePart]) -> list[tuple[str, Any]]:
    """The chunks of other writers' boxes that this rank needs, by way of the directories (see
    :func:`own_manifest`, step 4): (key, chunk as a JSON object) pairs."""
    world = group.world
    boxes: dict[int, tuple[str, Any]] = {}  # box id -> (key, chunk) of the parts this rank serves
    try:
        for _q, p in sorted(serving.items()):
            for ident, found in part_boxes(p.part).items():
                boxes.setdefault(ident, found)
    except (KeyError, TypeError, AttributeError) as exc:  # nobody finds its boxes: every rank falls back
        log.debug("ckptstore: a part this rank serves does not name its boxes: %s", exc)
        boxes = {}
    to_dir: dict[int, tuple[list[int], list[int]]] = {}
    for ident in boxes:
        to_dir.setdefault(ident % world, ([], []))[0].append(ident)
    for _key, _box, ident in needs:
        to_dir.setdefault(ident % world, ([], []))[1].append(ident)
    got = group.send_bytes({d: _ints([len(reg), *reg, *asked]) for d, (reg, asked) in to_dir.items()})
    registered: dict[int, int] = {}  # box id -> the lowest rank serving a part that holds it
    questions: list[tuple[int, int]] = []  # (box id, asker)
    for sender, data in sorted(got.items()):
        values = _from_ints(data)
        n = values[0]
        for ident in values[1:1 + n]:
            registered.setdefault(ident, sender)
        questions.extend((ident, sender) for ident in values[1 + n:])
    forward: dict[int, list[int]] = {}
    for ident, asker in questions:
        server = registered.get(ident)
        if server is not None:
            forward.setdefault(server, []).extend((ident, asker))
    asked = group.send_bytes({server: _ints(pairs) for server, pairs in forward.items()})
    answers: dict[int, list[Any]] = {}
    for data in asked.values():
        values = _from_ints(data)
        for ident, asker in zip(values[0::2], values[1::2]):
            if ident in boxes:
                answers.setdefault(asker, []).append(list(boxes[ident]))
    sent = group.send_bytes({asker: _encode(pairs) for asker, pairs in answers.items()})
    try:
        return [(key, c) for data in sent.values() for key, c in _decode(data)]
    except (ValueError, TypeError) as exc:  # the caller's coverage check fails, and every rank falls back
        log.debug("ckptstore: undecodable chunks for this rank's boxes: %s", exc)
        return []


def _ints(values: list[int]) -> bytes:
    return np.asarray(values, dtype=np.int64).tobytes()


def _from_ints(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=np.int64).tolist()


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _decode(data: bytes) -> Any:
    return json.loads(data)


def get_manifest(group: Group, inv: Inventory, where: str, state: Any = None, *, layout: bool = False
                 ) -> Manifest | None:
    """The manifest of ``inv``'s layout on every rank: its own, or the lowest holder's, or (a
    layout of parts) planned from each rank's own part (:func:`own_manifest`, given the ``state``
    to load) or assembled from every node's. None when nobody has one (every rank passes the same
    layout). ``layout``: set ``inv.layout``, the layout digest of a layout of parts."""
    if assembled(inv.digest):
        if state is not None:
            planned = own_manifest(group, inv, state, where, layout=layout)
            if planned is not None:
                return planned
        manifest = assemble_manifest(group, inv, where)
        if manifest is not None and layout:
            inv.layout = layout_digest(manifest)
        return manifest
    held = inv.manifest is not None
    body = inv.manifest
    if group.world == 1:
        if not held:
            return None
    else:
        # Whether any rank holds a copy, whether some lacks one, and the lowest holder: one
        # all-reduce, whatever the world (a gather of every rank's flag grew with it).
        some, lacking, lowest = group.max_int64([int(held), int(not held), -group.rank if held else _NONE])
        if not some:
            return None
        if lacking:
            body = broadcast_from(group, body if held else None, -lowest)
    assert body is not None
    if body is inv.manifest and inv.parsed is not None:
        parsed, inv.parsed = inv.parsed, None  # handed out once: a load fills its tree in place
        return parsed
    return parse_manifest(body, where=where)


class PeerUnavailable(StorageError):
    """An owner did not serve a file: it no longer holds it, or did not answer within the bound.
    The restore retries with (``file``, ``owner``) excluded."""

    def __init__(self, message: str, *, file: str, owner: int, names: Sequence[str]) -> None:
        super().__init__(message)
        self.file, self.owner, self.names = file, owner, list(names)


class _Channel:
    """This rank's requests to one owner, one at a time (a request's answer is the next message on
    the answer tag, so two in flight could take each other's)."""

    def __init__(self, p2p: Group, owner: int, names: list[str], tags: tuple[int, int], timeout_s: float,
                 display: str) -> None:
        self.p2p, self.owner, self.names, self.tags = p2p, owner, names, tags
        self.timeout_s, self.display = timeout_s, display
        self.lock = threading.Lock()
        self.failed: PeerUnavailable | None = None
        self.last: _Waiter | None = None  # the newest request; close() sends "done" only after it

    def read(self, name: str, offset: int, out: memoryview) -> None:
        with self.lock:
            if self.failed is not None:
                raise self.failed
            pg = self.p2p.pg
            assert pg is not None  # a plan names other ranks only in a group
            request = torch.tensor([self.names.index(name), offset, len(out)], dtype=torch.int64)
            header = torch.zeros(2, dtype=torch.int64)
            owner, tags = self.owner, self.tags

            # Posted in the waiting thread, not here: on a lazily connected gloo group the first
            # send to a peer blocks until the pair connects, and when this side is the passive one
            # (gloo picks by port) that is when the owner first touches the pair. An owner hung
            # before its first receive held this call for up to timeout_s, outside the bound.
            def post() -> tuple[Any, Any]:
                sent = pg.send([request], owner, tags[0])
                return pg.recv([header], owner, tags[1]), sent

            answer = self.last = _Waiter(post=post, keep=request, drain=(pg, owner, tags[1], header))
            if not answer.done.wait(self.timeout_s):
                answer.abandon()
                self.failed = PeerUnavailable(
                    f"{self.display}: rank {self.owner} did not answer within peer_timeout_s={self.timeout_s:g} s; "
                    "its copies are not used for this step", file=name, owner=self.owner, names=self.names)
                for n in self.names:
                    log.warning("ckptstore: rank %d did not send %s within %.0f s; trying another copy",
                                self.owner, n, self.timeout_s)
                raise self.failed
            if answer.error is not None:
                raise self._broken(name, answer.error)
            status = int(header[0])
            if status == _GONE:
                raise PeerUnavailable(
                    f"{self.display}/{name}: rank {self.owner} no longer holds it (removed since the step was "
                    "listed); another copy is used", file=name, owner=self.owner, names=[name])
            if status == _SHORT:
                raise ShortRead(offset, len(out), max(0, int(header[1]) - offset))
            data = _Waiter(pg.recv([torch.frombuffer(out, dtype=torch.uint8)], self.owner, self.tags[1]))
            if not data.done.wait(self.timeout_s):
                # The bytes may still land in ``out``; this load fails, and nothing reads ``out``
                # before the next attempt (a failed parallel read returns only after all stopped).
                self.failed = PeerUnavailable(
                    f"{self.display}/{name}: rank {self.owner} stopped sending within peer_timeout_s="
                    f"{self.timeout_s:g} s", file=name, owner=self.owner, names=self.names)
                raise self.failed
            if data.error is not None:
                raise self._broken(name, data.error)

    def _broken(self, name: str, exc: Exception) -> PeerUnavailable:
        # The transport gave up on this owner (its connection timed out or closed): like an owner
        # that does not answer, its copies are not used for this step, and another copy is.
        self.failed = PeerUnavailable(
            f"{self.display}/{name}: the connection to rank {self.owner} failed ({exc}); its copies are not used "
            "for this step", file=name, owner=self.owner, names=self.names)
        log.warning("ckptstore: the connection to rank %d failed while reading %s: %s; trying another copy",
                    self.owner, name, exc)
        return self.failed

    def close(self) -> None:
        """Tell the owner this rank asks nothing more (its serving thread ends). Never blocks: the
        "done" goes out from a thread of its own once the newest request was posted (both use the
        request tag, and the owner must see them in that order)."""
        pg = self.p2p.pg
        assert pg is not None
        done = torch.tensor([-1, 0, 0], dtype=torch.int64)
        owner, tag, last = self.owner, self.tags[0], self.last

        def post() -> tuple[Any, Any]:
            if last is not None:
                last.posted.wait()
            return pg.send([done], owner, tag), None

        _Waiter(post=post, keep=done)


class RemoteSource(Source):
    """One file of another node, read through requests to ``owner`` (no bytes held here)."""

    parallel = True

    def __init__(self, channel: _Channel, name: str, size: int, display: str) -> None:
        self.channel, self.name, self.size, self.display = channel, name, size, display
        self.owner = channel.owner

    def readinto(self, offset: int, out: memoryview) -> None:
        if offset < 0 or offset + len(out) > self.size:
            raise ShortRead(offset, len(out), max(0, self.size - offset))
        if len(out):
            self.channel.read(self.name, offset, out)


class Transfers:
    """The remote files of one attempt, and the channels they are read through."""

    def __init__(self) -> None:
        self.sources: dict[str, RemoteSource] = {}
        self.channels: list[_Channel] = []
        # Files some rank wants that no rank's node offers in this layout (the same list on every
        # rank): the restore tells a step whose part is gone with a lost node from a damaged one.
        self.unowned: list[str] = []

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


def exchange(group: Group, p2p: Group, inv: Inventory, wanted: Sequence[str], excluded: set[str],
             bad_owners: set[tuple[str, int]], display: str, *, tags: tuple[int, int],
             timeout_s: float = 60.0) -> Transfers:
    """Plan, for every file of ``wanted`` this node lacks in ``inv``'s layout, the rank whose node
    serves it, and start serving the ranks that chose this one (collective).

    Owners serve from threads of their own, on ``tags`` (request, answer: the caller gives every
    attempt its own, so a late answer to an abandoned attempt is never taken for another's), and
    an owner stuck reading its disk holds up nobody: the requester gives up on it after
    ``timeout_s`` and the attempt is retried with that owner excluded. The bytes travel on
    ``p2p``, a group that carries nothing else: gloo's collectives number their messages with tags
    of the same space, so point-to-point messages still in flight on a collective group could be
    taken for a collective's. The caller closes the result after its load (success or not)."""

    # The usual restart finds every file a rank needs on its own node: one all-reduced flag then
    # says so, and nobody sends the list of files its node holds (which grows with the node's ranks
    # and, gathered, with the world).
    remote = sorted(w for w in set(wanted) if not _opens(inv, w, excluded))
    if group.world > 1 and not group.max_int64([int(bool(remote))])[0]:
        return Transfers()
    sizes = _sizes(inv, excluded)
    remote = sorted({w for w in wanted if w not in sizes})
    out = Transfers()
    if group.world == 1:
        out.unowned = remote
        return out
    asked, serving, offered, out.unowned = _directory(group, sizes, remote, bad_owners)
    for owner, names in sorted(asked.items()):
        channel = _Channel(p2p, owner, names, tags, timeout_s, display)
        out.channels.append(channel)
        for name in names:
            out.sources[name] = RemoteSource(channel, name, offered[name], f"rank {owner}'s copy of {display}/{name}")
    for requester, names in sorted(serving.items()):
        _start(threading.Thread(target=_serve, args=(p2p, inv, excluded, requester, names, tags), daemon=True,
                         name="ckptstore-serve"))
    return out


def _home(name: str, world: int) -> int:
    """The rank that keeps the directory entry of the file ``name`` (the same on every rank): its
    writer for a rank's data file, which serves it anyway (a replicated tensor's file is wanted by
    every rank, and its directory entry with it); a hash of the name otherwise."""
    writer = data_file_rank(name)
    if writer is not None and 0 <= writer < world:
        return writer
    return xxhash.xxh3_64_intdigest(name.encode()) % world


def _directory(group: Group, sizes: dict[str, int], remote: list[str], bad_owners: set[tuple[str, int]]
               ) -> tuple[dict[int, list[str]], dict[int, list[str]], dict[str, int], list[str]]:
    """Who serves whom (collective): every file's offers and requests meet at the rank that keeps
    its entry (:func:`_home`), which picks each requester's owner as the gather of every rank's
    files did (the ranks offering it in rank order, less the requester and the owners it excludes,
    which it sends along, spread by the requester's rank) and tells both: two exchanges of what
    each rank offers and wants, then of what it asks and serves (``Group.send_bytes``), not a
    gather of every rank's files to every rank. Returns the files this rank asks of each owner,
    those each requester will ask of it (in the same order on both sides: by name), each asked
    file's size as its owner offered it, and the files some rank wants that no rank offers (the
    same list on every rank: one all-reduced flag, and a gather only when there are any)."""
    world = group.world
    to_home: dict[int, dict[str, list[Any]]] = {}
    for name, size in sorted(sizes.items()):
        to_home.setdefault(_home(name, world), {"has": [], "want": []})["has"].append([name, size])
    for name in remote:
        to_home.setdefault(_home(name, world), {"has": [], "want": []})["want"].append(
            [name, sorted(o for n, o in bad_owners if n == name)])
    got = group.send_bytes({d: _encode(v) for d, v in to_home.items()})
    owners: dict[str, list[tuple[int, int]]] = {}
    wants: list[tuple[int, str, set[int]]] = []
    for sender, data in sorted(got.items()):
        message = _decode(data)
        for name, size in message["has"]:
            owners.setdefault(name, []).append((sender, int(size)))
        wants.extend((sender, name, {int(o) for o in shunned}) for name, shunned in message["want"])
    told: dict[int, dict[str, list[Any]]] = {}
    unowned: set[str] = set()
    for requester, name, shunned in wants:
        if not owners.get(name):
            unowned.add(name)
        usable = [(o, size) for o, size in owners.get(name, []) if o != requester and o not in shunned]
        if usable:  # else the load reads it from durable, or reports it missing
            owner, size = usable[requester % len(usable)]
            told.setdefault(requester, {"ask": [], "serve": []})["ask"].append([name, owner, size])
            told.setdefault(owner, {"ask": [], "serve": []})["serve"].append([requester, name])
    asked: dict[int, list[str]] = {}
    serving: dict[int, list[str]] = {}
    offered: dict[str, int] = {}
    for data in group.send_bytes({r: _encode(m) for r, m in told.items()}).values():
        message = _decode(data)
        for name, owner, size in message["ask"]:
            asked.setdefault(int(owner), []).append(str(name))
            offered[str(name)] = int(size)
        for requester, name in message["serve"]:
            serving.setdefault(int(requester), []).append(str(name))
    for names in (*asked.values(), *serving.values()):
        names.sort()
    everywhere: list[str] = []
    if group.max_int64([int(bool(unowned))])[0]:
        everywhere = sorted(set().union(*map(set, group.all_gather(sorted(unowned)))))
    return asked, serving, offered, everywhere


def _opens(inv: Inventory, name: str, excluded: set[str]) -> bool:
    """Whether this node can serve ``name`` in ``inv``'s layout (a copy that still opens)."""
    opened = inv.open(name, excluded)
    if opened is not None:
        opened[1].close()
    return opened is not None


def _sizes(inv: Inventory, excluded: set[str]) -> dict[str, int]:
    """The size of each file this node can serve in ``inv``'s layout (a copy that no longer opens
    is not offered)."""
    out: dict[str, int] = {}
    for name in inv.names(excluded):
        opened = inv.open(name, excluded)
        if opened is not None:
            out[name] = opened[1].size
            opened[1].close()
    return out


# Transfer threads that may outlive the restore that started them (a send still draining, a
# receive abandoned for a slow peer): each is inside a point-to-point operation on the store's
# transfer group until it ends, so the store waits for them before it releases its groups.
_transfers: set[threading.Thread] = set()
_transfers_lock = threading.Lock()


def _start(thread: threading.Thread) -> None:
    with _transfers_lock:
        _transfers.difference_update([t for t in _transfers if not t.is_alive()])
        _transfers.add(thread)
    thread.start()


def transfers_ended(timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for every transfer thread to end; whether they all did."""
    deadline = time.monotonic() + timeout_s
    with _transfers_lock:
        threads = list(_transfers)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


class _Waiter:
    """Waits for a gloo work in a thread of its own: a gloo wait that times out closes the
    connection to that peer, and the group with it, so bounded waits are waits on this thread.
    ``post`` (instead of ``work``): called in that thread, it starts the work and returns it and
    a send to wait for first; posting can itself block (a lazily connected pair connects at its
    first message), so it never runs in the thread that waits with a bound. ``posted`` is set once
    it returned (or failed). ``keep`` stays referenced until the work is done (gloo reads from it
    until then). ``drain`` (group, owner, tag, header): once abandoned, a late "served" answer is
    followed by its bytes, which are received into scratch memory so that the owner's send
    completes and its serving thread goes on to the next request."""

    def __init__(self, work: Any = None, *, post: Callable[[], tuple[Any, Any]] | None = None, keep: Any = None,
                 sent: Any = None, drain: tuple[Any, int, int, torch.Tensor] | None = None) -> None:
        self.done = threading.Event()
        self.posted = threading.Event()
        self.error: Exception | None = None
        self._lock = threading.Lock()
        self._abandoned = self._finished = False
        self._keep, self._drain, self._post = keep, drain, post
        if post is None:
            self.posted.set()
        _start(threading.Thread(target=self._run, args=(work, sent), daemon=True, name="ckptstore-recv"))

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            finished = self._finished
        if finished:  # the answer came between the timeout and now: its bytes follow
            _start(threading.Thread(target=self._drain_late, daemon=True, name="ckptstore-drain"))

    def _run(self, work: Any, sent: Any) -> None:
        try:
            if self._post is not None:
                try:
                    work, sent = self._post()
                finally:
                    self.posted.set()
            if sent is not None:
                sent.wait()
            if work is not None:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        with self._lock:
            self._finished = True
            abandoned = self._abandoned
        self.done.set()
        if abandoned:
            self._drain_late()

    def _drain_late(self) -> None:
        if self.error is not None or self._drain is None:
            return
        pg, owner, tag, header = self._drain
        if int(header[0]) != _OK or int(header[1]) <= 0:
            return
        try:
            pg.recv([torch.empty(int(header[1]), dtype=torch.uint8)], owner, tag).wait()
        except Exception:  # noqa: BLE001 - the owner was given up on already
            pass


def _serve(p2p: Group, inv: Inventory, excluded: set[str], requester: int, names: list[str],
           tags: tuple[int, int]) -> None:
    """Answer ``requester``'s requests until it says it is done: each from the copy's file mapped
    read-only and sent from the mapping (no copy of the bytes here), or at once with "gone" when
    no copy opens any more, so the requester moves on without waiting for its bound."""
    pg = p2p.pg
    assert pg is not None
    mapped: dict[str, _Mapped | None] = {}
    try:
        while True:
            request = torch.zeros(3, dtype=torch.int64)
            pg.recv([request], requester, tags[0]).wait()
            index, offset, length = (int(v) for v in request.tolist())
            if index < 0:
                return
            name = names[index] if index < len(names) else ""
            if name not in mapped:
                mapped[name] = _Mapped.of(inv, name, excluded)
            source = mapped[name]
            if source is None:
                log.warning("ckptstore: rank %d asked for %s, which this node no longer holds", requester, name)
                pg.send([torch.tensor([_GONE, 0], dtype=torch.int64)], requester, tags[1]).wait()
                continue
            if offset < 0 or length < 0 or offset + length > source.size:
                pg.send([torch.tensor([_SHORT, source.size], dtype=torch.int64)], requester, tags[1]).wait()
                continue
            pg.send([torch.tensor([_OK, length], dtype=torch.int64)], requester, tags[1]).wait()
            pg.send([source.bytes(offset, length)], requester, tags[1]).wait()
    except Exception as exc:  # noqa: BLE001 - a requester that gave up on us is not our failure
        log.warning("ckptstore: serving restore data to rank %d failed: %s", requester, exc)
    finally:
        for m in mapped.values():
            if m is not None:
                m.close()


class _Mapped:
    """A copy of a file as an owner sends it: its pages mapped (a local file or RAM segment), or,
    for a copy that is not a file of this machine, read piece by piece."""

    def __init__(self, source: Source, view: torch.Tensor | None, mapping: mmap.mmap | None) -> None:
        self.source, self.view, self.mapping, self.size = source, view, mapping, source.size

    @classmethod
    def of(cls, inv: Inventory, name: str, excluded: set[str]) -> _Mapped | None:
        opened = inv.open(name, excluded)
        if opened is None:
            return None
        source = opened[1]
        if source.local_path is None or source.size == 0:
            return cls(source, None, None)
        try:
            with open(source.local_path, "rb") as fh:
                mapping = mmap.mmap(fh.fileno(), source.size, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return cls(source, None, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the buffer is not writable; only gloo reads it
            view = torch.frombuffer(mapping, dtype=torch.uint8)
        return cls(source, view, mapping)

    def bytes(self, offset: int, length: int) -> torch.Tensor:
        if self.view is not None:
            return self.view.narrow(0, offset, length)
        return torch.frombuffer(bytearray(self.source.read(offset, length)), dtype=torch.uint8) if length else (
            torch.empty(0, dtype=torch.uint8))

    def close(self) -> None:
        self.view = None
        self.source.close()
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:
                pass  # a send still holds a view; the mapping goes with its last reference


__all__ = ["DURABLE_PREFERENCE", "assembled", "assemble_manifest", "own_manifest", "Inventory", "NodeInventory", "PeerUnavailable", "RemoteSource", "Transfers",
           "exchange", "get_manifest", "layout_digest"]
