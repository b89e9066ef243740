"""What the RAM directory of a node holds, and how segments leave it.

Staging slots and peer replicas are files in a tmpfs (/dev/shm): their memory stays taken until
someone removes them, long after the process that made them is gone. A store removes its own on
``close()`` once their newest step is committed at a lower tier; what a crash or
``close(keep_ram=True)`` left is listed and removed here, by ``ckptstore ram`` and by anything
else that runs on the node without a store (a node agent).

A segment's document records who committed it (process id and start time, host) and where the
store's lower tiers were (``local`` directory, ``durable`` URL). From that, this node can tell:

- whether the owner is alive: the recorded process still runs with the recorded start time, or
  some live process of this user has the segment mapped (a store that is staging into it, or
  that restored from it);
- whether the step exists at a lower tier: the local directory holds that step, or a newer one,
  committed (its ``manifest.json``); so does a durable URL that is a path on this node
  (``file://``). An object store's URL is not reachable without the job's credentials, so for it
  the answer is "unknown" (``None``), and a removal without ``force`` treats it as "nowhere else".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CheckpointError, InvalidArgumentError
from ..names import Segment, parse_segment, valid_job
from .directory import committed_steps
from .ram import process_start, read_doc, remove_file, usable_doc

__all__ = ["SegmentRecord", "inventory", "remove_job", "remove_segments", "unsafe_reason"]


@dataclass(frozen=True)
class SegmentRecord:
    """One staging slot (``src`` None) or peer replica (``src``: the rank whose snapshot it is) in
    a RAM directory.

    ``step`` is the committed step it holds, None when nothing in it is committed (a save staging
    into it, or one a crash cut short). ``size``: bytes of the segment and its document.
    ``owner_pid``: the process that committed it, or that has it mapped now; ``owner_alive``:
    whether that process runs. ``elsewhere``: the lower tiers this node sees holding ``step`` or a
    newer step of the job (``()``: none does), None when it cannot tell (an object store)."""

    job: str
    rank: int
    src: int | None
    slot: int
    step: int | None
    size: int
    owner_pid: int | None
    owner_alive: bool
    elsewhere: tuple[str, ...] | None
    paths: tuple[str, ...]

    @property
    def committed(self) -> bool:
        return self.step is not None

    @property
    def name(self) -> str:
        return os.path.basename(self.paths[0])


def inventory(ram_dir: str = "/dev/shm", job: str | None = None, *, owners: bool = True) -> list[SegmentRecord]:
    """Every segment of ``job`` (every job: None) in ``ram_dir``, sorted by job, rank, replica
    source and slot. Files that vanish while being listed are passed over. ``owners=False`` skips
    looking for processes that map the segments (a store closing knows it is their owner)."""
    if job is not None and not valid_job(job):
        raise InvalidArgumentError(f"job {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-'")
    try:
        names = sorted(os.listdir(ram_dir))
    except OSError as exc:
        raise CheckpointError(f"cannot list the RAM directory {ram_dir}: {exc.strerror or exc}") from None
    groups: dict[tuple[str, int, int | None, int], list[str]] = {}
    for name in names:
        seg = parse_segment(name)
        if seg is None or (job is not None and seg.job != job):
            continue
        groups.setdefault((seg.job, seg.rank, seg.src, seg.slot), []).append(name)
    bins = {os.path.join(ram_dir, n) for ns in groups.values() for n in ns if n.endswith(".bin")}
    mapped = _mapped_by(bins) if owners else {}
    found = []
    def order(key: tuple[str, int, int | None, int]) -> tuple[str, int, int, int]:
        return key[0], key[1], -1 if key[2] is None else key[2], key[3]

    for (job_, rank, src, slot), members in sorted(groups.items(), key=lambda kv: order(kv[0])):
        record = _record(ram_dir, Segment(job_, rank, src, slot, "bin"), sorted(members), mapped)
        if record is not None:
            found.append(record)
    return found


def _record(ram_dir: str, seg: Segment, members: list[str], mapped: dict[str, int]) -> SegmentRecord | None:
    # The segment first, then its document: the order a removal goes in reverse.
    paths = tuple(os.path.join(ram_dir, n) for n in sorted(members, key=lambda n: not n.endswith(".bin")))
    size = 0
    for path in paths:
        try:
            size += os.lstat(path).st_size
        except FileNotFoundError:
            pass
    doc = None
    json_path = next((p for p in paths if p.endswith(".json")), None)
    if json_path is not None:
        try:
            doc = read_doc(json_path)
        except (OSError, CheckpointError):
            doc = None
    if doc is not None and not (usable_doc(doc) and doc.get("job") == seg.job and doc.get("rank") == seg.rank
                                and doc.get("src") == seg.src and doc.get("slot") == seg.slot):
        doc = None  # a document that is not this segment's commits nothing
    bin_path = os.path.join(ram_dir, f"{os.path.basename(paths[0]).rsplit('.', 1)[0]}.bin")
    try:
        whole = doc is not None and os.lstat(bin_path).st_size == doc["size"]
    except FileNotFoundError:
        whole = False
    step = doc["step"] if doc is not None and whole else None  # what a restore would read, as scan() decides
    owner = doc.get("owner") if doc is not None else None
    pid, alive = None, False
    if isinstance(owner, dict) and type(owner.get("pid")) is int:
        pid = owner["pid"]
        alive = owner.get("start") is not None and process_start(pid) == owner.get("start")
    if not alive and bin_path in mapped:
        pid, alive = mapped[bin_path], True
    lower = doc.get("lower") if doc is not None else None
    # A document without the record (an older writer's) cannot say where its store's tiers were.
    elsewhere = _elsewhere(step, lower) if step is not None and isinstance(lower, dict) else None
    return SegmentRecord(seg.job, seg.rank, seg.src, seg.slot, step, size, pid, alive, elsewhere, paths)


def _elsewhere(step: int, lower: dict[str, object]) -> tuple[str, ...] | None:
    """The lower tiers holding ``step`` or a newer step, as this node can see them (see the module
    docstring); None when one of them cannot be looked at and none that can holds it."""
    found, unknown = [], False
    for tier in ("local", "durable"):
        where = lower.get(tier)
        if not isinstance(where, str):
            continue
        path = where[len("file://"):] if where.startswith("file://") else where if "://" not in where else None
        if path is None:
            unknown = True
        elif any(s >= step for s in committed_steps(path)):
            found.append(tier)
    return tuple(found) if found or not unknown else None


def _mapped_by(paths: set[str]) -> dict[str, int]:
    """Which live process has each of ``paths`` mapped (processes of this user: a segment is
    mode 0600), from /proc/<pid>/maps."""
    out: dict[str, int] = {}
    if not paths:
        return out
    me = os.geteuid()
    try:
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            if me != 0 and os.stat(f"/proc/{pid}").st_uid != me:
                continue
            with open(f"/proc/{pid}/maps", "rb") as fh:
                text = fh.read().decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5] in paths and process_start(pid) is not None:
                out.setdefault(fields[5], pid)
    return out


def unsafe_reason(record: SegmentRecord) -> str | None:
    """Why removing ``record`` could lose something or pull memory from under a live process, or
    None when it is safe: its owner is alive, or its step exists at no lower tier this node can see."""
    if record.owner_alive:
        return f"its owner, process {record.owner_pid}, is alive"
    if record.step is None:
        return None  # nothing committed: no restore can use it
    if record.elsewhere is None:
        return (f"step {record.step}: this node cannot tell whether a lower tier holds it (the durable tier is an "
                "object store, or the segment's document does not record the store's tiers)")
    if not record.elsewhere:
        return f"step {record.step} exists at no lower tier (local or durable) this node can see"
    return None


def remove_segments(records: Iterable[SegmentRecord]) -> int:
    """Remove each segment, its document first (so nothing is left that looks committed); returns
    the bytes freed."""
    freed = 0
    for record in records:
        for path in reversed(record.paths):
            remove_file(path)
        freed += record.size
    return freed


def remove_job(job: str, ram_dir: str = "/dev/shm", *, force: bool = False,
               rank: int | None = None) -> list[SegmentRecord]:
    """Remove the segments of ``job`` (of one ``rank`` only, if given) from ``ram_dir``; returns
    what was removed. Without ``force``, any segment :func:`unsafe_reason` objects to makes the
    whole call refuse with a CheckpointError naming each one, and nothing is removed."""
    records = [r for r in inventory(ram_dir, job) if rank is None or r.rank == rank]
    if not force:
        refused = [(r, why) for r in records if (why := unsafe_reason(r)) is not None]
        if refused:
            listed = "; ".join(f"{r.name}: {why}" for r, why in refused)
            raise CheckpointError(
                f"refusing to remove the RAM segments of job {job} in {ram_dir}: {listed}. Nothing was removed; "
                "stop the job, or wait until its steps reach the local or durable tier, or pass --force "
                "(force=True) to remove them anyway"
            )
    remove_segments(records)
    return records
