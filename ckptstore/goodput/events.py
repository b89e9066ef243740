"""The store's event log and the goodput accounting read back from it.

The log is one JSON object per line, appended and fsynced by rank 0 of a store created with
``events=True`` (``<local>/events.jsonl``) or ``events=PATH``. Every record has ``t`` (Unix time),
``event`` and ``pid``; the events are:

- ``start``: a store was created (``job``, ``world``, ``host``); a start that follows a run without a
  ``close`` is a failure, and the store writes ``failure`` (``last_seen``: the failed run's last record)
  right after it, so the log itself carries the failure history the interval planner adapts to;
- ``save``: ``step``, ``blocking_s`` (what ``save`` cost the training loop), ``waited_s``, ``staged_s``, ``bytes``;
- ``skip``: a save dropped under ``policy="skip"``;
- ``overtaken``: ``step``, ``by``: a queued promotion dropped, every rank having queued a newer one;
- ``plan``: the interval the store planned (``interval_s``, ``cost_s``, ``mtbf_s``, ``step_s``, ``next_step``);
- ``restore``: ``step`` (null when nothing was found), ``seconds``, ``tier``;
- ``tick``: ``step``, written at most once a minute from ``should_save``: how far a run got before it died;
- ``close``: the store was closed cleanly.

A harness that causes the failures itself (benchmarks/bench_goodput_e2e.py: a supervisor and rank 0
append to one log) adds ``setup`` (the configuration: ``tiers`` as ``ckptstore simulate --tier``
specs), ``kill`` (the instant a failure was injected, its ``class``), ``end`` (the end of the measured
window), ``commit`` (``step``, ``tier``: when a copy became usable there) and ``step_s`` on every
step's ``tick``; the accounting then knows the failure times exactly and splits out useful steps.

Writes go through an event loop (the store's own), so the training loop never waits for an fsync, and
they never raise: a log that cannot be written costs a warning, never a save.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiofiles
import aiofiles.os

from .._aio import LoopThread
from ..errors import InvalidArgumentError
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
    """One process lifetime of the job, from a ``start`` to its last record (or to its ``kill``)."""

    start: float
    last: float
    clean: bool = False
    killed: bool = False  # ended by a ``kill`` record: its failure time is exact
    resumed_at: float | None = None  # end of its restore
    restored: int | None = None
    restore_tier: str | None = None
    saves: list[dict[str, Any]] = field(default_factory=list)
    ticks: list[dict[str, Any]] = field(default_factory=list)
    commits: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False
    failure_class: str = "crash"  # a kill record's class; a failure inferred from a log is a crash
    kept_step: int | None = None  # a failed run: the step its work was kept up to
    lost: float = 0.0
    restart: float = 0.0
    reload: float = 0.0  # the restore's own seconds


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
    reload: float = 0.0
    # From ticks that carry ``step_s``: the net progress and the median step time, which split the
    # productive time into useful steps x step time and the rest (steps slower than the median).
    useful_steps: int | None = None
    step_s: float | None = None

    @property
    def useful(self) -> float:
        return self.productive if self.useful_steps is None or self.step_s is None else self.useful_steps * self.step_s

    def fractions(self) -> dict[str, float]:
        w = self.wall or 1.0
        return {"productive": self.productive / w, "checkpoint": self.checkpoint / w, "lost": self.lost / w,
                "restart": self.restart / w, "reload": self.reload / w}

    def per_save(self) -> tuple[float, float] | None:
        """What a save cost training, on average: the time it blocked, and the slowdown of the steps
        (their excess over the median step, most of it an asynchronous save's steps in flight); the
        sum is the cost to plan an interval with. None without saves or step times."""
        if not self.saves or self.useful_steps is None:
            return None
        return self.checkpoint / self.saves, max(0.0, self.productive - self.useful) / self.saves

    @property
    def goodput(self) -> float:
        """Useful steps x step time / wall when the log has step times, else the productive share."""
        return self.useful / (self.wall or 1.0)

    def to_json(self) -> dict[str, Any]:
        return {"wall_s": self.wall, "productive_s": self.productive, "checkpoint_s": self.checkpoint,
                "lost_s": self.lost, "restart_s": self.restart, "reload_s": self.reload, "idle_s": self.idle,
                "useful_steps": self.useful_steps, "step_s": self.step_s, "useful_s": self.useful,
                "slowdown_s": self.productive - self.useful, "failures": self.failures,
                "saves": self.saves, "runs": len(self.runs), "open_run": self.open_run,
                "goodput": self.goodput, "fractions": self.fractions()}


def runs_of(events: list[dict[str, Any]]) -> list[Run]:
    """The runs of a log, its records in time order (a supervisor and rank 0 may both append).
    ``kill`` (a supervisor's record of a failure it caused) ends a run, failed, at that instant;
    what a dying run still wrote after it is left out. ``end`` ends the log."""
    runs: list[Run] = []
    dead = False  # after a kill, until the next start
    for e in sorted(events, key=lambda e: e["t"]):
        kind = e["event"]
        if kind == "setup":
            continue
        if kind == "start" or not runs:
            runs.append(Run(e["t"], e["t"]))
            dead = False
        elif dead:
            continue
        run = runs[-1]
        run.last = max(run.last, e["t"])
        if kind == "save":
            run.saves.append(e)
        elif kind == "tick":
            run.ticks.append(e)
        elif kind == "commit":
            run.commits.append(e)
        elif kind == "restore" and run.resumed_at is None:
            run.resumed_at, run.restored, run.restore_tier = e["t"], e.get("step"), e.get("tier")
            run.reload = float(e.get("seconds") or 0.0)
        elif kind == "kill":
            run.killed = dead = True
            run.failure_class = str(e.get("class") or "crash")
        elif kind in ("close", "end"):
            run.clean = True
            if kind == "end":
                break
    for prev in runs[:-1]:
        prev.failed = not prev.clean
    if runs and runs[-1].killed:
        runs[-1].failed = True
    return runs


def account(events: list[dict[str, Any]]) -> Account:
    """Split the wall-clock time the log covers into productive time, checkpoint overhead (what saves
    blocked), lost work (training after the checkpoint a failed run was later resumed from), restart
    time (from a failed run's end, or a run's start, until its restore began) and reload (the
    restores themselves). Time between a clean close and the next start is idle and left out. A
    failure's time is exact where a ``kill`` record gives it, else known to the resolution of the
    log's records (a save or a tick at least once a minute from should_save)."""
    runs = runs_of(events)
    restoring = any(r.resumed_at is not None for r in runs)
    checkpoint = sum(float(s.get("blocking_s", 0.0)) for r in runs for s in r.saves)
    lost = restart = idle = 0.0
    for i, run in enumerate(runs):
        prev = runs[i - 1] if i else None
        down = prev.last if prev is not None and prev.failed else run.start
        if prev is not None and not prev.failed:
            idle += max(0.0, run.start - prev.last)
        if run.resumed_at is not None:
            run.reload = min(run.reload, max(0.0, run.resumed_at - down))
            run.restart = max(0.0, run.resumed_at - run.reload - down)
        elif run.failed and restoring:
            run.restart = run.last - down  # killed before its restore ended: it never trained
        else:
            run.restart = max(0.0, run.start - down)
        restart += run.restart
    committed = any(r.commits for r in runs)
    for i, run in enumerate(runs):
        if not run.failed or (run.resumed_at is None and restoring):
            continue
        resumed = run.resumed_at if run.resumed_at is not None else run.start
        # The step this run's work was kept up to: the oldest that a later run that got going restored
        # (a later failure can roll back past this run's work too); when none did before the log
        # ended, the newest step committed (saved, in a log without commits).
        later = [r.restored or 0 for r in runs[i + 1:] if r.resumed_at is not None]
        if later:
            run.kept_step = min(later)
        else:
            made = [c.get("step") for c in run.commits] if committed else [s.get("step") for s in run.saves]
            run.kept_step = max((m for m in made if isinstance(m, int)), default=run.restored)
        kept = _kept_at(run, resumed)
        overhead = sum(float(s.get("blocking_s", 0.0)) for s in run.saves if s["t"] > kept)
        run.lost = max(0.0, run.last - kept - overhead)
        lost += run.lost
    reload = sum(r.reload for r in runs)
    wall = (runs[-1].last - runs[0].start - idle) if runs else 0.0
    productive = max(0.0, wall - checkpoint - lost - restart - reload)
    useful_steps, step_s = _progress(runs)
    return Account(wall, productive, checkpoint, lost, restart, idle, sum(r.failed for r in runs),
                   sum(len(r.saves) for r in runs), runs, bool(runs) and not runs[-1].clean, reload,
                   useful_steps, step_s)


def _kept_at(run: Run, resumed: float) -> float:
    """When this run's training reached ``run.kept_step``: its save of that step, or the end of that
    step; its resumption when the step is older than where it started, its end when newer."""
    k = run.kept_step or 0
    for s in run.saves:
        if s.get("step") == k and s["t"] >= resumed:
            return float(s["t"])
    if k <= (run.restored or 0):
        return resumed
    for t in run.ticks:
        if t.get("step") == k:
            return float(t["t"])
    known = [int(x["step"]) for x in run.ticks + run.saves if isinstance(x.get("step"), int)]
    return run.last if known and k > max(known) else resumed


def _progress(runs: list[Run]) -> tuple[int | None, float | None]:
    """Net progress in steps (from the first run's starting step to the step the job holds at the
    end) and the median step time, from ticks with ``step_s``."""
    times = sorted(float(t["step_s"]) for r in runs for t in r.ticks if "step_s" in t)
    if not times:
        return None, None
    held = 0
    for run in runs:  # the last run that trained decides
        if run.failed and run.resumed_at is not None:
            held = run.kept_step or 0
        elif run.resumed_at is not None or not run.failed:
            held = max([run.restored or held] + [int(t["step"]) for t in run.ticks])
    return max(0, held - (runs[0].restored or 0)), times[len(times) // 2]


def predicted(events: list[dict[str, Any]], acc: Account | None = None) -> dict[str, Any]:
    """The simulator's replay of a log: its failures at the times and of the classes they happened,
    under a configuration measured from the log itself: the mean blocking cost, wall time from one
    save to the next and from a run's start of training to its first save, restart and reload time
    (means: what the replay adds up is their totals, which a median of a skewed few misses); per
    tier, the median time from a save to its ``commit`` there (a threshold: which save a failure
    finds there) and the mean reload from it. Tiers and what they survive come from the log's
    ``setup`` record (one durable tier that survives everything without one)."""
    from statistics import fmean as mean
    from statistics import median

    from .simulate import Config, TierSpec, replay, tier_from_spec

    acc = acc if acc is not None else account(events)
    runs = acc.runs
    costs = [float(s.get("blocking_s", 0.0)) for r in runs for s in r.saves]
    gaps = [b["t"] - a["t"] for r in runs for a, b in zip(r.saves, r.saves[1:])]
    if not costs or not gaps:
        raise InvalidArgumentError("the log has fewer than two saves in one run: no checkpoint interval to simulate")
    setup = next((e for e in events if e["event"] == "setup"), {})
    latency: dict[str, list[float]] = {}
    reads: dict[str, list[float]] = {}
    for r in runs:
        saved = {s.get("step"): s["t"] for s in r.saves}
        for c in r.commits:
            if c.get("step") in saved:
                latency.setdefault(str(c.get("tier")), []).append(max(0.0, c["t"] - saved[c.get("step")]))
        if r.resumed_at is not None and r.restored is not None:
            for name in re.findall(r"\w+", str(r.restore_tier)):  # "peer+ram": assembled from both
                reads.setdefault(name, []).append(r.reload)
    any_read = [x for v in reads.values() for x in v]
    tiers = []
    for spec in setup.get("tiers") or ["durable"]:
        t = tier_from_spec(spec)
        lat, read = latency.get(t.name), reads.get(t.name) or any_read
        tiers.append(TierSpec(t.name, t.survives, t.every, median(lat) if lat else t.latency,
                              mean(read) if read else t.read))
    restarts = [r.restart for r in runs if r.resumed_at is not None]
    # A run's first checkpoint comes later than the interval when its first steps are slower (a
    # restarted process warming up beside the work its failure left): measured from each run's
    # training start (its restore's end) to its first save, the replay's first cycle.
    firsts = [r.saves[0]["t"] - r.resumed_at for r in runs if r.resumed_at is not None and r.saves]
    interval, cost = mean(gaps), mean(costs)
    first = max(mean(firsts), cost * 1.001 + 1e-9) if firsts else None
    config = Config(str(setup.get("config", "measured")), interval, cost,
                    mean(restarts) if restarts else 0.0, tuple(tiers), first=first)
    t0 = runs[0].start
    failures = [(r.last - t0, r.failure_class) for r in runs if r.failed]
    split = replay(config, failures, acc.wall)
    return {"interval_s": config.interval, "first_s": config.first, "cost_s": config.cost, "restart_s": config.restart,
            "tiers": [{"name": t.name, "every": t.every, "latency_s": t.latency, "read_s": t.read,
                       "survives": sorted(t.survives)} for t in tiers],
            "failures": len(failures), "split_s": split,
            "fractions": {k: v / (acc.wall or 1.0) for k, v in split.items()}}


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
    colors = {"productive": "#2ca02c", "checkpoint": "#1f77b4", "lost": "#ff7f0e", "restart": "#d62728",
              "reload": "#9467bd"}
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
