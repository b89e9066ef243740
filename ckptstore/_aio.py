"""The background event loop, and the one way synchronous code calls a coroutine."""

from __future__ import annotations

import asyncio
import concurrent.futures
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
    its background I/O. ``submit`` hands it a coroutine from any other thread."""

    def __init__(self, name: str = "ckptstore-loop") -> None:
        self.loop = asyncio.new_event_loop()
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
