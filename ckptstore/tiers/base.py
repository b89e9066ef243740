"""The one contract every tier meets: RAM, local directory, peer replicas, durable URL, and any
third-party tier (ckptstore.testing ships the suite that checks it).

A tier stores *this rank's* part of a staged snapshot (``put``) and later, once every rank's part
is in, the step's global manifest (``commit``). Only committed steps are listed, loaded or kept: a
step whose manifest is missing is not a checkpoint, whatever bytes it left behind.

The methods are coroutines, run on the store's event loop: small files go through aiofiles
(storage/small.py), bulk bytes through threads of their own. Each has a synchronous mirror
(``put_sync``, ``steps_sync``, ...) for code that has no loop: the CLI, a restore on the trainer's
thread, tests.

What a tier can do is declared in :class:`Capabilities`, never found out by its class: the
engine asks ``tier.capabilities.node_local`` where it would otherwise ask "is this the local
directory?". A restore asks every node-local tier what its node holds of a step (``holdings``)
and fetches what a rank's node lacks from the nodes that have it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._aio import run_sync
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.manifest import Manifest
from ..storage.targets import Source


@dataclass(frozen=True)
class Capabilities:
    """What a tier offers, as the engine relies on it.

    ``node_local``: it holds only what the ranks of this node wrote or received, so a restore asks
    each node what it holds (``holdings``) and moves bytes between nodes; a tier without it is
    reachable from every rank (``opener``). ``exclusive_commit``: ``commit`` is a conditional create,
    so of two writers of one step exactly one commits and the other gets CheckpointExistsError.
    ``reuses_unchanged``: a region the caller declared frozen is kept by link or server-side copy
    while its checksums are unchanged, so bytes written follow what changed. ``collective``:
    ``put`` and ``commit`` exchange data between ranks, so every rank of the store calls them for
    the same step at the same time (in one order). ``sweeps``: a crash can leave debris that
    ``sweep`` removes at start-up."""

    node_local: bool = False
    exclusive_commit: bool = False
    reuses_unchanged: bool = False
    collective: bool = False
    sweeps: bool = False


@dataclass
class Snapshot:
    """One rank's staged bytes of one step, as every tier receives them.

    ``data`` is the staged slot (uint8, laid out like a sharded data file); ``chunks`` maps each
    entry key to its chunk table with offsets into ``data``; ``frozen_end`` is where the region of
    tensors the caller declared frozen ends (0 when none), so a tier can keep that region in a file
    of its own and reuse it while its content is unchanged.
    """

    step: int
    rank: int
    world: int
    data: Any  # a uint8 tensor, or a view that narrows like one (the local files of a step)
    chunks: dict[str, list[dict[str, Any]]]
    frozen_end: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


@dataclass(frozen=True)
class Held:
    """A copy of one data file of a step that this node can serve: its name in the manifest, where
    it lies (for messages, and to exclude it after damage), the tier holding it, an opener, and
    ``manifest``: the ``where`` of the copy of the step's manifest (one of the same Holdings'
    ``manifests``) whose chunk table gives this copy's offsets. Tiers lay a step out differently
    (the local tier splits off the frozen region, a compressing tier changes every offset), so a
    copy is only ever read with its own tier's manifest; a copy without one is read only when
    every manifest its tier lists describes the same layout."""

    file: str
    where: str
    tier: str
    open: Callable[[], Source]
    manifest: str = ""


@dataclass(frozen=True)
class NodePart:
    """One rank's part of a step as a node copy records it instead of the whole manifest: the
    rank's chunk table (``part``), the step's ``meta`` (step, job, cadence, world size, save id)
    and the header of the rank's structure (tree, tensor table, layouts), at ``where``. A restore
    plans each rank's load from its own part, or assembles the step's manifest from every rank's
    part (engine/exchange.py)."""

    rank: int
    part: dict[str, Any]
    meta: dict[str, Any]
    header: dict[str, Any] | None
    where: str


@dataclass
class Holdings:
    """What a node-local tier holds of one step on this node: data files and manifest copies
    (``(body, where)``, each checked by whoever reads it), or parts (:class:`NodePart`) where a
    copy holds its own rank's part only; each file names the manifest copy or part that describes
    it (``Held.manifest``)."""

    files: list[Held] = field(default_factory=list)
    manifests: list[tuple[bytes, str]] = field(default_factory=list)
    parts: list[NodePart] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)  # copies of parts that failed their checksum


class Tier(abc.ABC):
    """Where snapshots live: ``put`` a rank's part, ``commit`` the step, list, open, remove."""

    name: str
    capabilities: Capabilities = Capabilities()

    # ---------------------------------------------------------------------------- writing

    @abc.abstractmethod
    async def put(self, snap: Snapshot) -> dict[str, Any]:
        """Store this rank's bytes of ``snap``; return its part, which goes into the step's manifest:
        ``rank``, ``host``, ``pid``, ``bytes`` (what the part holds), ``written_bytes`` (what this put
        wrote; less when unchanged regions were reused), ``timings`` (seconds per stage), and
        ``chunks`` (key -> chunk tables, with the files and offsets as this tier holds them)."""

    @abc.abstractmethod
    async def commit(self, step: int, manifest: Manifest) -> None:
        """Make ``step`` a checkpoint of this tier (the manifest appears last, atomically)."""

    async def discard(self, step: int) -> None:  # noqa: B027 - most tiers leave nothing behind
        """Remove what this writer's failed ``put`` of ``step`` left behind, never a committed step
        or another writer's files."""

    # ---------------------------------------------------------------------------- reading

    @abc.abstractmethod
    async def steps(self) -> list[int]:
        """Committed steps, oldest first."""

    @abc.abstractmethod
    async def manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step`` (CheckpointNotFoundError / CorruptCheckpointError)."""

    @abc.abstractmethod
    def opener(self, step: int) -> Callable[[str | None], Source]:
        """Opens the chunk files named in ``step``'s manifest."""

    def holdings(self, step: int) -> Holdings:
        """What this node holds of ``step`` (node-local tiers; others hold nothing node-wise)."""
        return Holdings()

    def node_steps(self) -> set[int]:
        """Every step this node holds anything of (node-local tiers)."""
        return set()

    def small_reader(self, step: int) -> Callable[[str], bytes] | None:
        """Reads ``step``'s small files by name (its index and part files: checkpoint/index.py),
        for a tier that keeps an index beside its manifests; None for one that does not."""
        return None

    @abc.abstractmethod
    def display(self, step: int) -> str:
        """Where ``step`` lives, for messages."""

    # ---------------------------------------------------------------------------- removing

    @abc.abstractmethod
    async def remove(self, step: int) -> None:
        """Delete ``step``: uncommit first, so a half-removed step never looks complete."""

    async def sweep(self) -> list[int]:
        """Remove what a crashed save left behind; returns the incomplete steps removed. Only safe
        while no save of this job is running (the store calls it at start-up)."""
        return []

    # ---------------------------------------------------------------------------- sync mirrors

    def put_sync(self, snap: Snapshot) -> dict[str, Any]:
        return run_sync(self.put(snap))

    def commit_sync(self, step: int, manifest: Manifest) -> None:
        run_sync(self.commit(step, manifest))

    def discard_sync(self, step: int) -> None:
        run_sync(self.discard(step))

    def steps_sync(self) -> list[int]:
        return run_sync(self.steps())

    def manifest_sync(self, step: int) -> Manifest:
        return run_sync(self.manifest(step))

    def remove_sync(self, step: int) -> None:
        run_sync(self.remove(step))

    def sweep_sync(self) -> list[int]:
        return run_sync(self.sweep())


def uint8(data: bytes) -> torch.Tensor:
    """Bytes as a uint8 tensor (an empty one for no bytes, which frombuffer refuses)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class PartsMissing(CheckpointNotFoundError):
    """The parts of some ranks (``ranks``) are held by no node: the step's manifest cannot be
    assembled from the node copies."""

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        # ``ranks`` has a default: a failure carried to other ranks is rebuilt from its message alone.
        super().__init__(message)
        self.ranks = list(ranks)


def manifest_of_parts(parts: list[NodePart], where: str, *, partial: bool = False) -> Manifest:
    """The step's whole manifest, assembled from one part per rank: what the fast lane's gather
    used to build at every save. Each structure's header comes from its lowest rank that carries
    one (the representative, when its copy survives), merged in rank order as the save merged
    them, so the manifest is the one the old whole-manifest copies held. Raises PartsMissing
    when a rank's part, or every header of a structure, is missing; ``partial``: the ranks whose
    parts are at hand only (a node agent's view of the node), never raising for the others."""
    from ..checkpoint.sharded import build_manifest

    by_rank, world, meta, shared = shared_of_parts(parts, where, partial=partial)
    try:
        tensors = {k: (v[0], tuple(v[1])) for k, v in shared["tensors"].items()}
        manifest = build_manifest(shared["tree"], tensors, [by_rank[r].part for r in sorted(by_rank)], world,
                                  layouts=shared.get("layouts") or None)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptCheckpointError(f"{where}: the parts of the step do not make a manifest: {exc}",
                                     location=where) from None
    manifest.meta.update({"step": meta.get("step"), "job": meta.get("job"), "cadence": meta.get("cadence", {})})
    if isinstance(meta.get("sdc"), dict):  # the replica check's verdict: sdc="raise" never restores a suspect step
        manifest.meta["sdc"] = meta["sdc"]
    return manifest


def shared_of_parts(parts: list[NodePart], where: str, *, partial: bool = False
                    ) -> tuple[dict[int, NodePart], int, dict[str, Any], dict[str, Any]]:
    """One part per rank (by rank), the world size, the step's meta and the merged header (tree,
    tensor table, layouts) of ``parts``: what a manifest of the step, in either format, is built
    from. Raises as :func:`manifest_of_parts` does."""
    from ..checkpoint.sharded import merge_structures

    if not parts:
        raise PartsMissing(f"{where}: no part of the step is held", ranks=[])
    by_rank: dict[int, NodePart] = {}
    for p in sorted(parts, key=lambda p: p.rank):
        by_rank.setdefault(p.rank, p)
    meta = by_rank[min(by_rank)].meta
    world = meta.get("world_size")
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{where}: a part's meta names no world size", location=where)
    missing = [r for r in range(world) if r not in by_rank]
    if missing and not partial:
        raise PartsMissing(f"{where}: no node holds the parts of ranks {ranks_shown(missing)}", ranks=missing)
    headers: dict[str, tuple[int, dict[str, Any]]] = {}
    present = sorted(by_rank)
    for r in present:
        p = by_rank[r]
        digest = str(p.part.get("digest", ""))
        if p.header is not None and digest not in headers:
            headers[digest] = (r, p.header)
    headless = [r for r in present if str(by_rank[r].part.get("digest", "")) not in headers]
    if headless:
        raise PartsMissing(f"{where}: no node holds the tree and tensor table of the structure of ranks "
                           f"{ranks_shown(headless)}", ranks=headless)
    try:
        shared = merge_structures(sorted(headers.values(), key=lambda h: h[0]), where)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptCheckpointError(f"{where}: the parts of the step do not make a manifest: {exc}",
                                     location=where) from None
    return by_rank, world, meta, shared


def ranks_shown(ranks: list[int]) -> str:
    """At most eight ranks of ``ranks``, and how many more, for messages."""
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
