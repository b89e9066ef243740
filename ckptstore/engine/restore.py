"""Where a step is chosen on restore: the newest step every rank can load a sound copy of.

Every rank lists the steps its node-local tiers hold something of (RAM slots, peer replicas, the
local directory) and the durable tier's committed steps; the union, newest first, is the list of
candidates, the same on every rank. Each candidate is tried collectively (exchange.py): every rank
learns what its node holds of the step, fetches from other nodes what it lacks, reads anything no
node holds from the durable tier, and verifies every byte. A damaged copy is excluded and the step
tried again (twice at most); a step that cannot be loaded gives way to the next older one. A state
that does not match the checkpoint is the caller's error, raised at once, never a fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..checkpoint.materialize import decode_value
from ..checkpoint.sharded import chunks_needed, load_manifest
from ..collective import StoreGroups, failure_record, failures_from
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    collective_error,
)
from ..format.manifest import Manifest
from ..names import MANIFEST
from ..storage.targets import Source
from ..tiers.base import Tier
from .exchange import FetchedSource, Inventory, exchange, get_manifest
from .replicas import ReplicaCheck

log = logging.getLogger("ckptstore")
_RESTORE_BUFFER = 256 << 20
_ATTEMPTS = 3


class Restorer:
    """``node_tiers``: the node-local tiers in order of preference (RAM, local, peer); ``durable``:
    the tier every rank reaches, or None."""

    def __init__(self, job: str, groups: StoreGroups, node_tiers: Sequence[Tier], durable: Tier | None,
                 check: ReplicaCheck, peer_timeout_s: float) -> None:
        self.job, self.groups, self.node_tiers, self.durable = job, groups, list(node_tiers), durable
        self.check, self.peer_timeout_s = check, peer_timeout_s
        self.rank, self.world = groups.rank, groups.world

    def _durable_steps(self) -> set[int]:
        if self.durable is None:
            return set()
        try:
            return set(self.durable.steps_sync())
        except (CheckpointError, OSError) as exc:
            log.warning("ckptstore: cannot list the durable tier: %s", exc)
            return set()

    def _node_steps(self) -> set[int]:
        return set().union(*(t.node_steps() for t in self.node_tiers))

    def newest(self, state: Any, per_rank: str) -> tuple[int | None, str]:
        """Load the newest step with a sound copy into ``state``; returns it and the tiers it came
        from, or (None, "") when no tier of any rank holds any step. Raises CorruptCheckpointError,
        listing what was tried, when steps exist but none has a sound copy for every rank."""
        durable = self._durable_steps()
        seen = self._node_steps() | durable
        candidates = sorted(set().union(*map(set, self.groups.trainer.all_gather(sorted(seen)))), reverse=True)
        tried: list[str] = []
        for step in candidates:
            ok, detail = self._attempt(state, step, step in durable, per_rank)
            if ok:
                return step, detail
            log.warning("ckptstore: step %d cannot be restored (%s); trying an older step", step, detail)
            tried.append(detail)
        if tried:
            raise CorruptCheckpointError("no sound copy of any checkpoint of this job: " + "; ".join(tried))
        return None, ""

    def exact(self, state: Any, step: int, per_rank: str) -> str:
        """Load exactly ``step`` into ``state``, never another one; returns the tiers it came from.
        Raises CheckpointNotFoundError when no tier of any rank holds the step, CorruptCheckpointError
        when no sound copy of it is left."""
        in_durable = step in self._durable_steps()
        held = step in self._node_steps()
        if not any(self.groups.trainer.all_gather(held or in_durable)):
            raise CheckpointNotFoundError(f"no tier holds step {step} of job {self.job}")
        ok, detail = self._attempt(state, step, in_durable, per_rank)
        if not ok:
            raise CorruptCheckpointError(f"no sound copy of step {step} of job {self.job}: {detail}")
        return detail

    def latest(self) -> int | None:
        """The newest step any tier of any rank holds committed (collective)."""
        seen = self._node_steps() | self._durable_steps()
        steps = set().union(*map(set, self.groups.trainer.all_gather(sorted(seen))))
        return max(steps) if steps else None

    def newest_held(self) -> tuple[int, dict[str, Any], bool] | None:
        """The newest step any tier of any rank holds committed, its manifest's ``meta`` and whether
        the durable tier holds it (collective); None when there is none. What a new store counts on
        from: steps only grow past it, and its cadence continues."""
        durable = self._durable_steps()
        node = self._node_steps()
        newest = max(node | durable, default=None)
        mine = None if newest is None else (newest, self._meta(newest, newest in durable))
        found = [m for m in self.groups.trainer.all_gather(mine) if m is not None]
        if not found:
            return None
        step = max(m[0] for m in found)
        meta = next((m[1] for m in found if m[0] == step and m[1] is not None), {})
        in_durable = any(self.groups.trainer.all_gather(step in durable))
        return step, meta, in_durable

    def meta_of(self, step: int) -> tuple[dict[str, Any], bool]:
        """The ``meta`` of ``step``'s manifest as this node or the durable tier holds it, and whether
        the durable tier holds the step (collective: every rank gets rank 0's answer)."""
        durable = step in self._durable_steps()
        first = self.groups.trainer.all_gather((self._meta(step, durable), durable))[0]
        return first[0], first[1]

    def _meta(self, step: int, in_durable: bool) -> dict[str, Any]:
        inv = Inventory.of(self.node_tiers, step)
        if inv.parsed is not None:
            return dict(inv.parsed.meta)
        if in_durable and self.durable is not None:
            try:
                return dict(self.durable.manifest_sync(step).meta)
            except (CheckpointError, OSError) as exc:
                log.warning("ckptstore: cannot read the manifest of step %d in the durable tier: %s", step, exc)
        return {}

    def _attempt(self, state: Any, step: int, in_durable: bool, per_rank: str) -> tuple[bool, str]:
        """One collective attempt (retried with bad copies excluded) to load ``step`` on every rank."""
        fg = self.groups.trainer
        durable = self.durable if in_durable else None
        display = f"step {step} of job {self.job}"
        excluded: set[str] = set()
        bad_owners: set[tuple[str, int]] = set()
        detail = ""
        for attempt in range(_ATTEMPTS):
            inv = Inventory.of(self.node_tiers, step)
            fatal: Exception | None = None
            retry = False
            problem = ""
            used: set[str] = set()
            manifest = get_manifest(fg, inv, f"{display}/{MANIFEST}")
            try:
                if manifest is None and durable is not None:
                    manifest = durable.manifest_sync(step)
                if manifest is None and inv.unsupported is not None:
                    raise inv.unsupported  # written by a newer ckptstore: say so, do not fall back silently
                if manifest is None:
                    raise CheckpointNotFoundError(f"no copy of the manifest of {display}")
                self.check.refuse(manifest, display)
                wanted = chunks_needed(state, manifest, display, self.rank, self.world)
            except (CorruptCheckpointError, CheckpointNotFoundError, StorageError, OSError) as exc:
                wanted, problem = [], f"{exc}"
            except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
                wanted, fatal = [], exc
            fetched, slow = exchange(fg, self.groups.transfer, inv, wanted, excluded, bad_owners, display,
                                     attempt=attempt, timeout_s=self.peer_timeout_s)
            if slow:
                bad_owners |= slow
                problem = "no answer within peer_timeout_s from " + ", ".join(f"rank {o} ({n})" for n, o in sorted(slow))
                retry = True
            if not problem and fatal is None:
                assert manifest is not None
                opener = _Opener(fetched, inv, excluded, durable.opener(step) if durable is not None else None,
                                 display, used)
                problem, retry, fatal = self._load(state, manifest, display, opener, per_rank, fetched, inv, excluded,
                                                   bad_owners)
            mine: dict[str, Any] = {"fatal": None if fatal is None else f"rank {self.rank}: {fatal}",
                                    "failure": None if fatal is None else failure_record(self.rank, fatal),
                                    "problem": problem, "retry": retry, "used": sorted(used)}
            outcomes = fg.all_gather(mine) if self.world > 1 else [mine]
            if any(o["fatal"] for o in outcomes):
                if fatal is not None:
                    raise fatal  # this rank's own error, as raised
                failures = failures_from([o["failure"] for o in outcomes])
                raise collective_error("restore failed on other ranks: " + "; ".join(o["fatal"] for o in outcomes
                                                                                   if o["fatal"]), failures)
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

    def _load(self, state: Any, manifest: Manifest, display: str, opener: _Opener, per_rank: str,
              fetched: dict[str, FetchedSource], inv: Inventory, excluded: set[str],
              bad_owners: set[tuple[str, int]]) -> tuple[str, bool, Exception | None]:
        """Load this rank's part; returns (a problem with the copies read, whether another copy is
        worth a retry, an error of the caller's state)."""
        try:
            load_manifest(state, manifest, display, opener, group=self.groups.trainer, strict=True, per_rank=per_rank,
                          buffer_bytes=_RESTORE_BUFFER, decode_per_rank=decode_value)
        except CorruptCheckpointError as exc:
            bad = _exclude(exc, fetched, inv, excluded, bad_owners)
            return str(exc) + (f" (the copy read was {bad})" if bad else ""), bad is not None, None
        except (CheckpointNotFoundError, StorageError, OSError) as exc:
            return str(exc), False, None
        except Exception as exc:  # noqa: BLE001 - the state does not match the checkpoint
            return "", False, exc
        return "", False, None


class _Opener:
    """Opens a chunk file for a restore: fetched from a peer, from this node, or from durable."""

    def __init__(self, fetched: dict[str, FetchedSource], inv: Inventory, excluded: set[str],
                 durable: Callable[[str | None], Source] | None, display: str, used: set[str]) -> None:
        self.fetched, self.inv, self.excluded, self.durable = fetched, inv, excluded, durable
        self.display, self.used = display, used

    def __call__(self, rel: str | None) -> Source:
        if rel in self.fetched:
            self.used.add("peer")
            return self.fetched[rel]
        opened = self.inv.open(rel or "", self.excluded)
        if opened is not None:
            self.used.add(opened[0].tier)
            return opened[1]
        if self.durable is not None:
            self.used.add("durable")
            return self.durable(rel)
        raise CheckpointNotFoundError(f"{self.display}: no rank holds {rel} and the durable tier lacks the step")


def _exclude(exc: CorruptCheckpointError, fetched: dict[str, FetchedSource], inv: Inventory, excluded: set[str],
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
