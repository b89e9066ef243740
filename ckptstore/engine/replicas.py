"""The replica check (``sdc="warn"`` or ``"raise"``): tensors that data-parallel replicas must hold
identically are compared by checksum at every save, which flags silent data corruption on a host.

Round one compares a digest of each rank's replicated checksums, carried in its RAM part; only a
disagreement costs round two, where the ranks exchange the checksums themselves and the
mismatching ranks and hosts are named (goodput/sdc.py does the arithmetic).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.manifest import Manifest
from ..goodput import sdc
from ..planning.flatten import contiguous_bytes
from .job import StepJob

log = logging.getLogger("ckptstore")


class ReplicaCheck:
    def __init__(self, mode: str, rank: int, world: int) -> None:
        self.mode, self.rank, self.world = mode, rank, world
        self.on = mode != "off" and world > 1

    def items(self, local: Any, mine: list[Any], job: StepJob) -> list[tuple[str, Any]]:
        """Every replica's bytes get a checksum: the replicated boxes this rank holds but another
        rank writes are hashed in place while save blocks when they sit contiguous in host memory
        (reading costs less than copying), and staged after everything written (never written)
        otherwise. Returns the entries to stage for the check."""
        if not self.on:
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

    def hash_live(self, job: StepJob) -> None:
        """Hash the host-memory replicas this rank does not write, at the snapshot's moment (save has
        not returned, so training has not touched them)."""
        if not job.live:
            return
        try:
            job.live = {k: {"checksum": checksum(contiguous_bytes(t).numpy().data)} for k, t in job.live.items()}
        except Exception as exc:  # noqa: BLE001 - the pipeline reports it, so every rank learns of it
            job.live = {}
            job.error = job.error or exc

    def digest(self, job: StepJob) -> dict[str, str] | None:
        if not self.on or job.staged is None:
            return None
        return sdc.digest(sdc.boxes(job.replicated, {**(job.staged.sums or {}), **job.live}))

    async def compare(self, job: StepJob, parts: list[dict[str, Any]],
                      agree: Callable[[str, Callable[[], Any]], Awaitable[list[Any]]]) -> list[dict[str, Any]] | None:
        """Round one compares the digests in the parts; only a disagreement costs round two."""
        digests = [p.pop("sdc", None) for p in parts]
        if not self.on or any(d is None for d in digests):
            return None
        if not sdc.suspicious(digests):
            return []
        sums = {**((job.staged.sums or {}) if job.staged is not None else {}), **job.live}
        held = await agree(f"comparing the replicas of step {job.step}", lambda: sdc.boxes(job.replicated, sums))
        return sdc.mismatches(held, [str(p.get("host", "?")) for p in parts])

    def verdict(self, job: StepJob, event: Callable[..., None]) -> None:
        """Report the mismatches found at ``job``'s step; under ``sdc="raise"`` the save fails (the
        step stays in RAM and local for inspection, and is never promoted)."""
        if not job.sdc:
            return
        message = sdc.describe(job.step, job.sdc)
        event("sdc", step=job.step, mismatches=job.sdc)
        if self.mode == "raise":
            raise CheckpointError(message + " (the step is kept in RAM and local for inspection; a restore skips it, "
                                            "and moves its local copy to <local>/damaged/)")
        if self.rank == 0:
            log.warning("ckptstore: %s", message)

    def refuse(self, manifest: Manifest, display: str) -> None:
        """Under sdc='raise' a step whose replicas disagreed is never restored."""
        if self.mode == "raise" and (manifest.meta.get("sdc") or {}).get("mismatches"):
            raise CorruptCheckpointError(f"{display}: its data-parallel replicas differed when it was saved "
                                         "(silent data corruption suspected); trying an older step", location=display)
