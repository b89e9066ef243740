"""Named crash points, for the reliability tests: a process that arms one is killed with SIGKILL
when it reaches it, exactly as a node failure would stop it there (no exception handler, no
finally block, no flush runs).

Every commit step of a save calls :func:`crashpoint` with its name and the path (or step) it is
working on; unarmed, that is one global read. Tests arm a point in a worker process, then check
what a restarted process finds: the old or the new step, never a torn one, and no debris.
"""

from __future__ import annotations

import os
import signal
import threading

_armed: tuple[str, str, int] | None = None  # (point, substring of `where`, hits left)
_lock = threading.Lock()

POINTS = (
    "ram.staged",  # snapshot copied into the slot, no checksums yet
    "ram.before_commit",  # checksummed, RAM manifest not yet written
    "ram.committed",  # RAM manifest written
    "file.written",  # a local file's bytes written, not yet fsynced
    "file.fsynced",  # fsynced under its temporary name, not yet renamed
    "file.renamed",  # renamed into place, directory not yet fsynced
    "tier.data_written",  # a rank's data files of a step are in a tier, its part manifest is not
    "tier.part_written",  # the part manifest is in the tier
    "tier.before_manifest",  # every part is in, the step's manifest is not
    "manifest.linked",  # local manifest linked into place, its temporary name not yet removed
    "s3.part_uploaded",  # one part of a multipart upload finished, more to come
    "s3.before_complete",  # every part uploaded, the upload not completed
    "tier.removing",  # retention: a step's manifest removed, its files not yet
)


def arm(point: str, where: str = "", hits: int = 1) -> None:
    """Kill this process at the ``hits``-th call of ``point`` whose ``where`` contains ``where``."""
    global _armed
    if point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}; known: {', '.join(POINTS)}")
    with _lock:
        _armed = (point, where, hits)


def crashpoint(point: str, where: str) -> None:
    global _armed
    if _armed is None:
        return
    with _lock:
        if _armed is None or _armed[0] != point or _armed[1] not in where:
            return
        left = _armed[2] - 1
        _armed = (point, _armed[1], left)
        if left > 0:
            return
    os.kill(os.getpid(), signal.SIGKILL)
