"""One step on its way through the pipeline: everything the stages learn about it."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from ..tiers.base import Snapshot
from ..tiers.ram import Layout, Staged


@dataclass
class StepJob:
    """One step on its way through the pipeline."""

    step: int
    futures: dict[str, concurrent.futures.Future | None] = field(default_factory=dict)  # tier -> committed there
    staged: Staged | None = None
    error: BaseException | None = None  # staging failed: the pipeline still runs, so every rank learns of it
    tree: Any = None
    tensors: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    boxes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    layout: Layout | None = None  # the slot layout of what this rank stages, once planned
    frozen_end: int = 0
    # Every staged tensor is a contiguous CPU tensor of a real dtype, vouched for by a fingerprint
    # equal to the one it was checked under: the RAM tier may copy them by address.
    plain: bool = False
    snap: Snapshot | None = None
    replicate: bool = False
    promote: bool = False
    # Its queued promotion was dropped for a newer step's (pipeline ``_promote``): its durable
    # future takes that promotion's outcome, not its own lane's.
    overtaken: bool = False
    to_local: bool = False  # the step goes to the local tier (every local_every-th save, a promoted or replicated one)
    cadence: dict[str, int] = field(default_factory=dict)  # saves since the newest promoted / replicated / local one
    # Done once nothing reads the staged slot any more (the next save into it waits for this).
    slot_free: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    local_part: dict[str, Any] | None = None  # this rank's part in the local tier, once committed there
    durable_data: Any = None  # the local files mapped read-only, what the promotion reads instead of the slot
    # The tree, tensor table and layouts of this rank's structure: ``shared`` on its representative
    # (the lowest rank of the structure, whose header the manifest takes), empty elsewhere;
    # ``header`` on every rank, for its own node copies (RAM document, replicas).
    shared: dict[str, Any] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)
    # What this rank's node copies of the step hold instead of the whole manifest (tiers/ram.py
    # ``node_extra``: its part, the step's meta, its header); None for a restored step's promotion.
    own: dict[str, Any] | None = None
    check: set[str] = field(default_factory=set)  # keys staged only to compare replicas (sdc), never written
    live: dict[str, Any] = field(default_factory=dict)  # CPU replicas another rank writes: hashed in place (sdc)
    # slot entry name -> (key, offsets, sizes, kind, group) of the replicated boxes this rank holds
    # (group: the store's ranks holding the same box)
    replicated: dict[str, tuple] = field(default_factory=dict)
    sdc: list[dict[str, Any]] | None = None  # replica mismatches found at this step (None: not checked)
    suspect: int = 0  # 1 when a replica group's neighbour held other bytes (round one of the check)
    save_id: str = ""  # agreed by the ranks at the RAM commit: names this save of the step on every node
    replication: Any = None  # the step's replication to peers (an asyncio task), once started
