"""Every name ckptstore gives a file, an object or a shared-memory segment, and the parsers of them.

One module builds and parses them all, so a tier, the restore path and the CLI can never disagree
about what a name means. The layouts themselves are specified in docs/format.md::

    <root>/step-<step:012d>/                    one step of a tier (local, durable): a sharded checkpoint
        manifest.json                           the commit point, written last
        parts/rank-<r:05d>.json                 what rank r wrote
        data/rank-<r:05d>.bin                   rank r's bytes
        data/rank-<r:05d>-frozen-<codec>-<digest>.bin   rank r's frozen tensors, shared by later steps
    <local>/peer/step-<step:012d>/              replicas this node received from other nodes
    <local>/events.jsonl                        the store's event log

    <ram_dir>/ckptstore-<job>-r<r:05d>-s<slot>.{bin,json}              rank r's staging slot, its manifest
    <ram_dir>/ckptstore-<job>-r<r:05d>-peer<src:05d>-s<slot>.{bin,json} a replica of rank src held by rank r
    <ram_dir>/ckptstore-<job>.agent.lock        held by the job's node agent while it runs
    <ram_dir>/ckptstore-<job>.stores.lock       held (shared) by every store of the job that started an agent
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

MANIFEST = "manifest.json"
# Beside the manifest: what one rank reads to plan its load (checkpoint/index.py).
INDEX = "index.json"
PEER_DIR = "peer"
# Under a local root: the copies of damaged steps a restore went past, kept for inspection.
DAMAGED_DIR = "damaged"
EVENTS_FILE = "events.jsonl"
# Part of every temporary name: a sweep after a crash removes what carries it.
TMP_MARK = ".ckptstore-tmp-"

_STEP = re.compile(r"^step-(\d{12,})$")
_DATA = re.compile(r"^data/rank-(\d{5})(?:-frozen-[a-z+]+-[0-9a-f]+)?(?:\.w[0-9a-f]+)?\.bin$")
_JOB = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_SEGMENT = re.compile(r"^ckptstore-(?P<job>.+)-r(?P<rank>\d{5})-(?:peer(?P<src>\d{5})-)?s(?P<slot>\d+)\.(?P<ext>bin|json)$")


def step_dir(step: int) -> str:
    """The directory (or key prefix) of ``step`` under a tier's root."""
    return f"step-{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a ``step-<012d>`` name stands for, or None for any other name."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


def data_file(rank: int) -> str:
    return f"data/rank-{rank:05d}.bin"


def part_file(rank: int) -> str:
    return f"parts/rank-{rank:05d}.json"


def is_frozen_file(rel: str) -> bool:
    return "-frozen-" in rel.rsplit("/", 1)[-1]


def frozen_file(rank: int, codec: str | None, digest: str) -> str:
    """Rank ``rank``'s file of frozen tensors, named by its content, so an unchanged region is
    recognised (and linked instead of rewritten) by name."""
    return f"data/rank-{rank:05d}-frozen-{codec or 'raw'}-{digest}.bin"


def writer_variant(rel: str, token: str) -> str:
    """``rel`` made unique to one writer (``data/rank-00000.w<token>.bin``): used where the usual
    name is taken by a crashed save or by another writer of the same step."""
    stem, dot, ext = rel.rpartition(".")
    return f"{stem}.w{token}.{ext}" if dot else f"{rel}.w{token}"


def data_file_rank(rel: str | None) -> int | None:
    """The rank whose bytes the data file ``rel`` holds (its data, frozen or writer-unique file), or None."""
    m = _DATA.match(rel or "")
    return int(m.group(1)) if m else None


def local_temporary(path: str) -> str:
    """A temporary name beside ``path`` on a local disk: hidden, unique to this process and call."""
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def remote_temporary(path: str) -> str:
    """A temporary key beside ``path`` in an fsspec filesystem without atomic uploads."""
    return f"{path}{TMP_MARK}{secrets.token_hex(4)}"


def document_temporary(path: str) -> str:
    """Where a RAM-tier document is written before its rename: one fixed name per process, opened
    without following links, so a link planted there in a shared directory fails the write."""
    return f"{path}.tmp-{os.getpid()}"


def is_temporary(name: str) -> bool:
    return TMP_MARK in name.rsplit("/", 1)[-1]


def valid_job(job: object) -> bool:
    """Job names become parts of file names: letters, digits, '.', '_' and '-', 1-100 characters."""
    return isinstance(job, str) and _JOB.match(job) is not None


def segment(job: str, rank: int, slot: int, ext: str) -> str:
    """The file name (in the RAM directory) of rank ``rank``'s staging slot ``slot``."""
    return f"ckptstore-{job}-r{rank:05d}-s{slot}.{ext}"


def replica_segment(job: str, holder: int, src: int, slot: int, ext: str) -> str:
    """The file name of the replica of rank ``src``'s snapshot that rank ``holder`` keeps in slot ``slot``."""
    return f"ckptstore-{job}-r{holder:05d}-peer{src:05d}-s{slot}.{ext}"


def agent_lock(job: str) -> str:
    """The lock file (in the RAM directory) the node agent of ``job`` holds while it runs: one per node."""
    return f"ckptstore-{job}.agent.lock"


def stores_lock(job: str) -> str:
    """The lock file every ``CheckpointStore(agent=True)`` of ``job`` on the node holds shared while it
    is open: the agent it started exits once it can take it exclusively and nothing is pending."""
    return f"ckptstore-{job}.stores.lock"


def segment_prefix(job: str) -> str:
    """What every segment name of ``job`` starts with."""
    return f"ckptstore-{job}-"


@dataclass(frozen=True)
class Segment:
    """A parsed segment name: ``src`` is None for a rank's own slot, the source rank for a replica."""

    job: str
    rank: int
    src: int | None
    slot: int
    ext: str

    @property
    def owner(self) -> int:
        """The rank whose snapshot the segment holds."""
        return self.rank if self.src is None else self.src


def parse_segment(name: str) -> Segment | None:
    m = _SEGMENT.match(name)
    if m is None:
        return None
    src = m.group("src")
    return Segment(m.group("job"), int(m.group("rank")), None if src is None else int(src), int(m.group("slot")),
                   m.group("ext"))
