"""The background event loop, and the one way synchronous code calls a coroutine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code (the sync mirrors of the tiers' coroutines:
    the CLI, restores on the trainer's thread, tests). Never from inside a running event loop,
    where it would block that loop: there the coroutine is awaited instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("a ckptstore sync call was made from a running event loop; await its coroutine instead")


class LoopThread:
    """An event loop running in a daemon thread of its own: one per CheckpointStore, owning all of
    its background I/O. ``submit`` hands it a coroutine from any other thread.

    ``nice`` > 0 runs the loop's worker threads (``asyncio.to_thread``: hashing, file writes,
    uploads, transfers, each with the GIL released for its heavy part) at that lower scheduling
    priority on Linux, so that on cores the training step needs, the step goes first. The loop's
    own thread keeps the caller's priority: it holds the GIL between awaits, and a thread that
    holds the GIL while the scheduler keeps it off the CPU would stall the trainer instead."""

    def __init__(self, name: str = "ckptstore-loop", *, nice: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        if nice > 0:
            self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
                thread_name_prefix=f"{name}-worker", initializer=lower_priority, initargs=(nice,)))
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, grace_s: float = 2.0) -> bool:
        """Stop the loop once its executor's threads (aiofiles', to_thread's) have ended, waiting
        at most ``grace_s`` for them: a thread stuck in a transfer to a peer that stopped answering
        must not hang the caller (it ends with its group's timeout). Returns whether every one of
        them ended (False: one may still be inside a collective)."""
        if self.loop.is_closed():
            return True
        ended = True
        try:
            self.submit(self.loop.shutdown_default_executor()).result(timeout=grace_s)
        except concurrent.futures.TimeoutError:
            ended = False
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        return ended


def lower_priority(nice: int) -> None:
    """Lower the calling thread's scheduling priority by ``nice`` (Linux: per thread, and inherited
    by the threads it starts). Elsewhere a priority is the whole process's, so nothing changes."""
    if not sys.platform.startswith("linux") or nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # a sandbox that forbids it: the work runs, at the trainer's priority
        logging.getLogger("ckptstore").debug("ckptstore: cannot lower the priority of thread %d: %s", tid, exc)
