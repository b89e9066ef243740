"""The store's event log and the goodput accounting read back from it.

The log is one JSON object per line, appended and fsynced by rank 0 of a store created with
``events=True`` (``<local>/events.jsonl``) or ``events=PATH``. Every record has ``t`` (Unix time),
``event`` and ``pid``; the events are:

- ``start``: a store was created (``job``, ``world``, ``host``); a start that follows a run without a
  ``close`` is a failure, and the store writes ``failure`` (``last_seen``: the failed run's last record)
  right after it, so the log itself carries the failure history the interval planner adapts to;
- ``save``: ``step``, ``blocking_s`` (what ``save`` cost the training loop), ``waited_s``, ``staged_s``, ``bytes``;
- ``skip``: a save dropped under ``policy="skip"``;
- ``plan``: the interval the store planned (``interval_s``, ``cost_s``, ``mtbf_s``, ``step_s``, ``next_step``);
- ``restore``: ``step`` (null when nothing was found), ``seconds``, ``tier``;
- ``tick``: ``step``, written at most once a minute from ``should_save``: how far a run got before it died;
- ``close``: the store was closed cleanly.

Writes go through an event loop (the store's own), so the training loop never waits for an fsync, and
they never raise: a log that cannot be written costs a warning, never a save.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiofiles
import aiofiles.os

from .._aio import LoopThread
from ..names import EVENTS_FILE

_fsync = aiofiles.os.wrap(os.fsync)
log = logging.getLogger("ckptstore")


class EventLog:
    """Append-only JSON lines, fsynced one by one on an event loop (the store's, or one of the log's
    own), through aiofiles: the caller never waits for a write, and writes keep their order."""

    def __init__(self, path: str, loop: LoopThread | None = None) -> None:
        self.path = path
        self._own = loop is None
        self._loop = loop or LoopThread("ckptstore-events")
        self._lock: asyncio.Lock | None = None  # created on the loop, at the first write
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._warned = False
        self._closed = False

    def write(self, event: str, **fields: Any) -> None:
        if self._closed:
            return
        record = {"t": round(time.time(), 6), "event": event, "pid": os.getpid(), **fields}
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        future = self._loop.submit(self._append(line))
        self._pending = {f for f in self._pending if not f.done()} | {future}

    async def _append(self, line: bytes) -> None:
        # Coroutines start in the order they were submitted; the lock keeps their writes in it.
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                await aiofiles.os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                async with aiofiles.open(self.path, "ab") as fh:
                    await fh.write(line)
                    await fh.flush()
                    await _fsync(fh.fileno())
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("ckptstore: cannot write the event log %s (goodput accounting misses events; saves "
                                "go on): %s", self.path, exc)

    def flush(self) -> None:
        """Wait until every record written so far is on disk (or failed)."""
        concurrent.futures.wait(list(self._pending))

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._own:
            self._loop.close()


def events_path(root: str) -> str:
    """``root`` itself when it is a file, else ``root/events.jsonl``."""
    return root if os.path.isfile(root) else os.path.join(root, EVENTS_FILE)


def read_events(path: str) -> list[dict[str, Any]]:
    """Every well-formed record, in order; a torn last line (a crash mid-append) is skipped."""
    out = []
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("t"), (int, float)) and "event" in record:
                out.append(record)
    return out


@dataclass
class Run:
    """One process lifetime of the job, from a ``start`` to its last record."""

    start: float
    last: float
    clean: bool = False
    resumed_at: float | None = None  # end of its restore
    restored: int | None = None
    restore_tier: str | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False
    lost: float = 0.0
    restart: float = 0.0


@dataclass
class Account:
    wall: float
    productive: float
    checkpoint: float
    lost: float
    restart: float
    idle: float
    failures: int
    saves: int
    runs: list[Run]
    open_run: bool  # the last run has not closed: still running, or it died and was not restarted

    def fractions(self) -> dict[str, float]:
        w = self.wall or 1.0
        return {"productive": self.productive / w, "checkpoint": self.checkpoint / w, "lost": self.lost / w,
                "restart": self.restart / w}

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall, "productive_s": self.productive, "checkpoint_s": self.checkpoint,
                "lost_s": self.lost, "restart_s": self.restart, "idle_s": self.idle, "failures": self.failures,
                "saves": self.saves, "runs": len(self.runs), "open_run": self.open_run,
                "goodput": self.fractions()["productive"], "fractions": self.fractions()}


def runs_of(events: list[dict[str, Any]]) -> list[Run]:
    runs: list[Run] = []
    for e in events:
        kind = e["event"]
        if kind == "start" or not runs:
            runs.append(Run(e["t"], e["t"]))
        run = runs[-1]
        run.last = max(run.last, e["t"])
        if kind == "save":
            run.saves.append(e)
        elif kind == "restore" and run.resumed_at is None:
            run.resumed_at, run.restored, run.restore_tier = e["t"], e.get("step"), e.get("tier")
        elif kind == "close":
            run.clean = True
    for prev in runs[:-1]:
        prev.failed = not prev.clean
    return runs


def account(events: list[dict[str, Any]]) -> Account:
    """Split the wall-clock time the log covers into productive time, checkpoint overhead (what saves
    blocked), lost work (training after the checkpoint a failed run was later resumed from) and restart
    time (from a failed run's last record, or a run's start, until its restore ended). Time between a
    clean close and the next start is idle and left out. The failure time is known to the resolution
    of the log's records (a save or a tick at least once a minute from should_save)."""
    runs = runs_of(events)
    checkpoint = sum(float(s.get("blocking_s", 0.0)) for r in runs for s in r.saves)
    lost = restart = idle = 0.0
    for i, run in enumerate(runs):
        resumed = run.resumed_at if run.resumed_at is not None else run.start
        if i == 0 or not runs[i - 1].failed:
            if i:
                idle += max(0.0, run.start - runs[i - 1].last)
            run.restart = max(0.0, resumed - run.start)
        else:
            run.restart = max(0.0, resumed - runs[i - 1].last)
        restart += run.restart
        if run.failed:
            nxt = runs[i + 1]
            kept = resumed
            for s in run.saves:
                if nxt.restored is not None and s.get("step") == nxt.restored and s["t"] >= resumed:
                    kept = s["t"]
            overhead = sum(float(s.get("blocking_s", 0.0)) for s in run.saves if s["t"] > kept)
            run.lost = max(0.0, run.last - kept - overhead)
            lost += run.lost
    wall = (runs[-1].last - runs[0].start - idle) if runs else 0.0
    productive = max(0.0, wall - checkpoint - lost - restart)
    return Account(wall, productive, checkpoint, lost, restart, idle, sum(r.failed for r in runs),
                   sum(len(r.saves) for r in runs), runs, bool(runs) and not runs[-1].clean)


def history(events: list[dict[str, Any]]) -> tuple[int, float]:
    """(failures, seconds of running) so far: what the planner's MTBF estimate learns from."""
    runs = runs_of(events)
    return sum(r.failed for r in runs), sum(r.last - r.start for r in runs)


def plot(acc: Account, path: str, title: str = "goodput") -> None:
    """A timeline of the runs (failures marked) over the split of wall-clock time; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.2), gridspec_kw={"height_ratios": [2, 1]})
    t0 = acc.runs[0].start if acc.runs else 0.0
    scale = 3600.0 if acc.wall > 7200 else 60.0
    unit = "h" if scale == 3600.0 else "min"
    for i, run in enumerate(acc.runs):
        resumed = run.resumed_at if run.resumed_at is not None else run.start
        down = acc.runs[i - 1].last if i and acc.runs[i - 1].failed else run.start  # a failure's downtime too
        top.broken_barh([((down - t0) / scale, (resumed - down) / scale)], (i - 0.35, 0.7), color="#d62728")
        top.broken_barh([((resumed - t0) / scale, (run.last - resumed) / scale)], (i - 0.35, 0.7), color="#2ca02c")
        for s in run.saves:
            top.plot([(s["t"] - t0) / scale] * 2, [i - 0.35, i + 0.35], color="#1f77b4", lw=1)
        if run.failed:
            top.plot((run.last - t0) / scale, i, "kx", ms=9)
    top.set_yticks(range(len(acc.runs)), [f"run {i + 1}" for i in range(len(acc.runs))])
    top.set_xlabel(f"wall clock ({unit}); blue: saves, red: restart, x: failure")
    top.invert_yaxis()
    fr = acc.fractions()
    left = 0.0
    colors = {"productive": "#2ca02c", "checkpoint": "#1f77b4", "lost": "#ff7f0e", "restart": "#d62728"}
    for name, share in fr.items():
        bottom.barh(0, share * 100, left=left, color=colors[name], label=f"{name} {share * 100:.1f}%")
        left += share * 100
    bottom.set_xlim(0, 100)
    bottom.set_yticks([])
    bottom.set_xlabel("% of wall-clock time")
    bottom.legend(ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45), fontsize=8, frameon=False)
    top.set_title(f"{title}: goodput {fr['productive'] * 100:.1f}% over {acc.wall / scale:.3g} {unit}, "
                  f"{acc.failures} failure(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
