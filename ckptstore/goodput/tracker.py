"""What a CheckpointStore measures for goodput: the checkpoint interval it plans, and its event log.

Every rank keeps a tracker; rank 0's measurements (blocking cost, step time, the failure history
in the event log) travel with each save's vote, so every rank plans the same next save step from
the same numbers and :meth:`GoodputTracker.should_save` answers alike everywhere without a
collective per training step.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from .._aio import LoopThread
from ..errors import InvalidArgumentError
from ..names import EVENTS_FILE
from .events import EventLog, history, read_events
from .planner import daly, mtbf_posterior

log = logging.getLogger("ckptstore")


class GoodputTracker:
    """``interval``: seconds, ``"auto"`` (Daly's interval from the measured cost and ``mtbf_s``) or
    None (no planning); ``events``: True (``<local>/events.jsonl``), a path, or False."""

    def __init__(self, *, interval: float | str | None, mtbf_s: float | None, events: bool | str, rank: int,
                 world: int, job: str, local: str | None, loop: LoopThread | None = None) -> None:
        self._interval, self._mtbf = interval, mtbf_s
        self._costs: list[list[float]] = []  # per save: what it blocked, the slowdown of the steps it overlapped
        self._step_s: float | None = None
        self._last_call: tuple[int, float] | None = None
        self._blocked = 0.0  # what saves blocked since the last should_save (not part of the step time)
        # An asynchronous save also slows the steps it overlaps (its copies, hashes and writes share
        # the cores and the memory bandwidth): measured, that costs training several times what save
        # blocks (docs/goodput.md). Steps are timed apart while a save is in flight and while none
        # is; the in-flight steps' excess over the idle step time is added to the cost of the save
        # that was in flight.
        self.in_flight: Callable[[], bool] = lambda: False  # set by the pipeline
        self._idle_s: float | None = None
        self._was_busy = False  # a save was in flight at the last should_save, or when one returned
        self._slowdown = 0.0  # excess of in-flight steps since the last save
        self._next_save: int | None = None
        self._tick = 0.0
        self._started = time.time()
        self._history = (0, 0.0)  # failures and seconds run before this start (rank 0, from the event log)
        self.plan: dict[str, Any] | None = None  # the newest plan, for the curious
        self._events: EventLog | None = None
        if events is not False and rank == 0:
            path = os.path.join(local, EVENTS_FILE) if local is not None and events is True else str(events)
            before: list[dict[str, Any]] = []
            try:
                before = read_events(path) if os.path.exists(path) else []
            except OSError as exc:
                log.warning("ckptstore: cannot read the event log %s (the failure history starts afresh): %s", path, exc)
            self._events = EventLog(path, loop)
            self._history = history(before + [{"t": time.time(), "event": "start"}])
            self.event("start", job=job, world=world, host=socket.gethostname())
            if before and before[-1]["event"] != "close":
                self.event("failure", last_seen=before[-1]["t"])  # the previous run ended without close()

    def event(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(kind, **fields)

    def should_save(self, step: int) -> bool:
        """Whether to checkpoint at ``step`` (see CheckpointStore.should_save)."""
        if self._interval is None:
            raise InvalidArgumentError("should_save needs CheckpointStore(..., interval=SECONDS or '20m', or "
                                       "interval='auto' with mtbf=...)")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, not {step!r}")
        now = time.monotonic()
        busy_now = self.in_flight()
        if self._last_call is not None and step > self._last_call[0]:
            steps = step - self._last_call[0]
            per_step = max(0.0, now - self._last_call[1] - self._blocked) / steps
            self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
            if not (self._was_busy or busy_now):
                self._idle_s = per_step if self._idle_s is None else 0.8 * self._idle_s + 0.2 * per_step
            elif self._idle_s is not None:
                # Signed: a fast in-flight step offsets a slow one, so step noise does not add up to a cost.
                self._slowdown += (per_step - self._idle_s) * steps
        self._last_call, self._blocked = (step, now), 0.0
        self._was_busy = busy_now
        # Ticks date a crash for the goodput report: once a minute, or ten times per planned interval.
        period = min(60.0, max(1.0, ((self.plan or {}).get("interval_s") or 600.0) / 10.0))
        if self._events is not None and now - self._tick >= period:
            self._tick = now
            self.event("tick", step=step)
        return self._next_save is None or step >= self._next_save

    def inputs(self) -> dict[str, Any] | None:
        """This rank's measurements, which every rank plans from (rank 0's travel with the save vote)."""
        if self._interval is None:
            return None
        # The first save of a process also faults the staging slots in and pays one-time imports (often
        # ten times a warm save): it is never planned from, so auto plans start at the third save.
        # The newest save's slowdown so far counts; the signed excess is summed before the median is
        # taken, so noise around the idle step time cancels instead of adding up.
        costs = [list(c) for c in self._costs[1:][-5:]]
        cost = None
        if costs:
            costs[-1][1] += self._slowdown
            median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            cost = max(median([b for b, _s in costs]), median([b + s for b, s in costs]))
        mtbf = None
        if self._mtbf is not None:
            failures, ran = self._history
            mtbf = mtbf_posterior(self._mtbf, failures, ran + time.time() - self._started)
        return {"cost_s": cost, "mtbf_s": mtbf, "step_s": self._step_s}

    def planned(self, step: int, inputs: dict[str, Any] | None) -> None:
        """Plan the next save step from ``inputs`` (the same on every rank)."""
        if inputs is None or self._interval is None:
            return
        cost, mtbf, step_s = inputs["cost_s"], inputs["mtbf_s"], inputs["step_s"]
        if step_s is None or (self._interval == "auto" and not cost):
            steps, interval = 1, None  # nothing measured yet: the next step measures
        else:
            # Daly's interval is compute time between checkpoints; a fixed interval is wall time.
            interval = daly(cost, mtbf) if self._interval == "auto" else max(float(self._interval) - (cost or 0.0), 0.0)
            steps = max(1, round(interval / step_s)) if step_s > 0 else 1
        self._next_save = step + steps
        self.plan = {"interval_s": interval, "next_step": self._next_save, **inputs}
        self.event("plan", step=step, **self.plan)

    def saved(self, step: int, blocking: float, waited_s: float, staged_s: float, nbytes: int, copied: int) -> None:
        """A save returned after ``blocking`` seconds: with the slowdown of the steps it overlaps
        (added at the next save), the cost the interval plan is made from."""
        if self._costs:
            self._costs[-1][1] += self._slowdown
        self._slowdown = 0.0
        self._costs = (self._costs + [[blocking, 0.0]])[-50:]
        self._was_busy = self.in_flight()
        self._blocked += blocking
        self.event("save", step=step, blocking_s=round(blocking, 6), waited_s=round(waited_s, 6),
                   staged_s=round(staged_s, 6), bytes=nbytes, copied=copied)

    def close(self) -> None:
        if self._events is not None:
            self.event("close")
            self._events.close()
            self._events = None
