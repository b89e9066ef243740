"""The replica check (``sdc="warn"`` or ``"raise"``): tensors that data-parallel replicas must hold
identically are compared by checksum at every save, which flags silent data corruption on a host.

Round one swaps a digest of each replica group's checksums with the group's neighbours and carries
one flag in the staging all-reduce: a few bytes per rank whatever the number of ranks. Only a
disagreement costs round two, where the ranks exchange the checksums themselves and the
mismatching ranks and hosts are named (goodput/sdc.py does the arithmetic).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from ..collective import Group
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.manifest import Manifest
from ..goodput import sdc
from ..planning.flatten import contiguous_bytes
from .job import StepJob

log = logging.getLogger("ckptstore")

# Between a key and a box's offsets in the slot entry name of a replica staged only to be compared.
_CHECK_MARK = "@check@"


class ReplicaCheck:
    def __init__(self, mode: str, rank: int, world: int,
                 group_ranks: Callable[[Iterable[int]], tuple[int, ...]] = tuple) -> None:
        self.mode, self.rank, self.world = mode, rank, world
        self.on = mode != "off" and world > 1
        self._group_ranks = group_ranks  # global ranks (a DTensor mesh's) -> the store's group ranks
        self._groups: dict[tuple[int, ...], tuple[int, ...]] = {}

    def items(self, local: Any, written: Mapping[tuple[str, tuple[int, ...], tuple[int, ...]], str], job: StepJob,
              same: Sequence[int] | None = None, plain: Mapping[str, tuple[int, ...]] | None = None
              ) -> list[tuple[str, Any]]:
        """Every replica's bytes get a checksum: the replicated boxes this rank holds but another
        rank writes are hashed in place while save blocks when they sit contiguous in host memory
        (reading costs less than copying), and staged after everything written (never written)
        otherwise. ``written``: the slot entry name of each box this rank writes. Each box's replica
        group is noted: for a plain tensor every rank holding it as one (``plain``, from the ranks'
        agreement on their structures; else ``same``, the ranks of this rank's structure, all by
        default), for a DTensor's box the ranks along its replicated mesh dimensions. A rank may
        hold several boxes of one key (a strided layout): each is noted under its entry's name.
        Returns the entries to stage for the check."""
        if not self.on:
            return []
        # Fresh for each plan: a reused plan hands its own to every save that reuses it, and a save
        # that planned again after the vote (another rank's structure changed) must not rewrite
        # what an earlier step, still being compared, reads.
        job.replicated, job.live = {}, {}
        everyone = tuple(range(self.world)) if same is None else tuple(same)
        plain = plain or {}
        extra = []
        taken = set(written.values())
        for box, tensor in local.items.items():
            holders = local.holders[box]
            if holders[0] == "own" or (holders[0] == "replicas" and holders[1] < 2) or tensor.numel() == 0:
                continue
            group = plain.get(box[0], everyone) if holders[0] == "all" else self._ranks(holders[3])
            name = written.get(box)
            if name is None:
                # Never written: a name no written entry has (offsets tell a key's boxes apart).
                name = f"{box[0]}{_CHECK_MARK}{','.join(map(str, box[1]))}"
                while name in taken:  # a key of the state spelled like that
                    name += "'"
                taken.add(name)
            job.replicated[name] = (box[0], box[1], box[2], holders[0], group)
            if box in written:
                continue
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                job.live[name] = tensor
            else:
                extra.append((name, tensor))
        job.check = {k for k, _ in extra}
        return extra

    def _ranks(self, global_ranks: tuple[int, ...]) -> tuple[int, ...]:
        if global_ranks not in self._groups:
            self._groups[global_ranks] = self._group_ranks(global_ranks)
        return self._groups[global_ranks]

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

    def _held(self, job: StepJob) -> list[list[Any]]:
        sums = {**((job.staged.sums or {}) if job.staged is not None else {}), **job.live}
        return sdc.boxes(job.replicated, sums)

    def neighbours(self, group: Group, job: StepJob) -> int:
        """Round one, once every rank staged the step (so every rank knows its groups): swap each
        replica group's digest with the group's neighbours; 1 when a neighbour's differs, else 0."""
        digests = sdc.group_digests(self._held(job), {v[0]: v[4] for v in job.replicated.values()})
        send, expect = sdc.ring(digests, group.rank)
        got = group.swap_int64(send, {r: len(v) for r, v in expect.items()})
        return int(any(got[r] != v for r, v in expect.items()))

    async def compare(self, job: StepJob,
                      agree: Callable[[str, Callable[[], Any]], Awaitable[list[Any]]]) -> list[dict[str, Any]]:
        """Round two, after some neighbours differed: every rank's checksums and host, and the
        mismatching boxes named (the same list on every rank)."""
        held = await agree(f"comparing the replicas of step {job.step}",
                           lambda: [socket.gethostname(), self._held(job)])
        return sdc.mismatches([h[1] for h in held], [str(h[0]) for h in held])

    def verdict(self, job: StepJob, event: Callable[..., None]) -> None:
        """Report the mismatches found at ``job``'s step; under ``sdc="raise"`` the save fails (the
        step stays in RAM, and on the local tier where it went there, for inspection, and is never
        promoted)."""
        if not job.sdc:
            return
        message = sdc.describe(job.step, job.sdc)
        event("sdc", step=job.step, mismatches=job.sdc)
        if self.mode == "raise":
            raise CheckpointError(message + " (the step is kept for inspection in RAM, and on the local tier where "
                                            "it went there; a restore skips it, and moves a local copy to "
                                            "<local>/damaged/)")
        if self.rank == 0:
            log.warning("ckptstore: %s", message)

    def refuse(self, manifest: Manifest, display: str) -> None:
        """Under sdc='raise' a step whose replicas disagreed is never restored."""
        if self.mode == "raise" and (manifest.meta.get("sdc") or {}).get("mismatches"):
            raise CorruptCheckpointError(f"{display}: its data-parallel replicas differed when it was saved "
                                         "(silent data corruption suspected); trying an older step", location=display)
