"""The one interface every tier implements (RAM, local directory, durable URL).

A tier stores *this rank's* part of a staged snapshot (``put``) and later, once every rank's part
is in, the step's global manifest (``commit``). Only committed steps are listed, loaded or kept:
a step whose manifest is missing is not a checkpoint, whatever bytes it left behind. The pipeline
in engine/store.py drives tiers through this interface only, and tests/test_tier_contract.py runs
one contract suite against every implementation.

The methods are coroutines because the pipeline is an asyncio loop; the blocking work (file
writes, fsync, fsspec calls) runs in the loop's executor, so one slow tier never stalls another.
fsspec's sync API already runs s3fs on fsspec's own I/O loop, so calling it from executor threads
gives the same concurrency as its async API without tying our loop to fsspec's.
"""

from __future__ import annotations

import abc
import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..format.manifest import Manifest
from ..storage.targets import Source

T = TypeVar("T")


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
    data: torch.Tensor
    chunks: dict[str, list[dict[str, Any]]]
    frozen_end: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


class Tier(abc.ABC):
    """Where snapshots live: ``put`` a rank's part, ``commit`` the step, list, open, remove."""

    name: str

    @abc.abstractmethod
    def put_sync(self, snap: Snapshot) -> dict[str, Any]:
        """Store this rank's bytes of ``snap``; return its part: ``{"chunks": {key: [chunk json]}, "bytes": n}``
        with the files and offsets as this tier holds them."""

    @abc.abstractmethod
    def commit_sync(self, step: int, manifest: Manifest) -> None:
        """Make ``step`` a checkpoint of this tier (the manifest appears last, atomically)."""

    @abc.abstractmethod
    def steps_sync(self) -> list[int]:
        """Committed steps, oldest first."""

    @abc.abstractmethod
    def manifest_sync(self, step: int) -> Manifest:
        """The committed manifest of ``step`` (CheckpointNotFoundError / CorruptCheckpointError)."""

    @abc.abstractmethod
    def opener(self, step: int) -> Callable[[str | None], Source]:
        """Opens the chunk files named in ``step``'s manifest."""

    @abc.abstractmethod
    def remove_sync(self, step: int) -> None:
        """Delete ``step``: uncommit first, so a half-removed step never looks complete."""

    @abc.abstractmethod
    def display(self, step: int) -> str:
        """Where ``step`` lives, for messages."""

    async def put(self, snap: Snapshot) -> dict[str, Any]:
        return await _in_thread(self.put_sync, snap)

    async def commit(self, step: int, manifest: Manifest) -> None:
        await _in_thread(self.commit_sync, step, manifest)

    async def steps(self) -> list[int]:
        return await _in_thread(self.steps_sync)

    async def manifest(self, step: int) -> Manifest:
        return await _in_thread(self.manifest_sync, step)

    async def remove(self, step: int) -> None:
        await _in_thread(self.remove_sync, step)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
