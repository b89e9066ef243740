"""CheckpointStore, single process (issue 4, in progress; not public yet).

``save`` stages the state into a reused RAM-tier slot and returns; a background asyncio loop then
checksums the staged copy, commits it in RAM, persists it to the local directory and promotes
every ``durable_every``-th step (and the last one, on close) to the durable URL, applying
retention after each commit. ``restore`` loads the newest step that has a sound copy, trying RAM,
then local, then durable, and falling back to the next copy on any damage.

Still missing before this becomes public: collectives over a process group of its own (multi-rank
snapshots), version-counter skips, pinned memory with CUDA side streams, peer replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, InvalidArgumentError
from ..format.manifest import Chunk, Manifest, TensorEntry
from ..storage.targets import Target, open_source
from ..tiers.ram import RamTier, Staged
from .materialize import decode_value, encode_value
from .persist import persist_staged
from .sharded import BLOCK_SIZE, MANIFEST, Directory, Group, _collect, load_manifest, read_manifest
from .single_file import io_pool

log = logging.getLogger("ckptstore")
TIERS = ("ram", "local", "durable")


class _Loop:
    """The one background event loop that owns this store's I/O."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ckptstore-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class SaveHandle:
    """The background progress of one save: wait for a tier, or ask whether it is done."""

    def __init__(self, step: int, futures: dict[str, concurrent.futures.Future | None], skipped: bool = False) -> None:
        self.step, self.skipped, self._futures = step, skipped, futures

    def done(self, tier: str = "local") -> bool:
        f = self._future(tier)
        return f is None or f.done()

    def wait(self, tier: str = "local", timeout: float | None = None) -> None:
        """Block until the snapshot is committed at ``tier``; re-raises a background failure."""
        f = self._future(tier)
        if f is not None:
            f.result(timeout)

    def _future(self, tier: str) -> concurrent.futures.Future | None:
        if tier not in TIERS:
            raise InvalidArgumentError(f"tier must be one of {', '.join(TIERS)}, not {tier!r}")
        return self._futures.get(tier)


def step_dir(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:012d}"


class CheckpointStore:
    def __init__(
        self,
        job: str,
        *,
        local: str | None = None,
        durable: str | None = None,
        durable_every: int = 10,
        keep_local: int | None = 3,
        keep_durable: int | None = None,
        ram_dir: str = "/dev/shm",
        ram_slots: int = 2,
        policy: str = "block",
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        frozen: Callable[[str], bool] | None = None,
        refresh_every: int = 10,
    ) -> None:
        if Group(process_group).world != 1:
            raise CheckpointError("CheckpointStore runs in one process for now; multi-rank snapshots are not built yet")
        if policy not in ("block", "skip"):
            raise InvalidArgumentError(f"policy must be 'block' or 'skip', not {policy!r}")
        if durable_every < 1 or (keep_local is not None and keep_local < 1) or (keep_durable is not None and keep_durable < 1):
            raise InvalidArgumentError("durable_every, keep_local and keep_durable must be at least 1")
        self.job, self.local, self.durable = job, local, durable
        self.durable_every, self.keep_local, self.keep_durable = durable_every, keep_local, keep_durable
        self.policy, self.storage_options = policy, storage_options
        self.ram = RamTier(job, ram_dir=ram_dir, slots=ram_slots)
        self._loop = _Loop()
        self._busy: dict[int, concurrent.futures.Future] = {}  # slot -> its pipeline
        self._errors: list[BaseException] = []
        self._last: tuple[int, Staged, Any, dict[str, Any] | None] | None = None
        self._last_step: int | None = None
        self._promoted: set[int] = set()
        self.skipped = 0
        self._closed = False
        # Opt-in skipping of unchanged tensors (see RamTier.stage): ``frozen(key)`` says which
        # manifest keys may be skipped when their version counter did not move; every
        # ``refresh_every``-th save copies everything, so a change the counter missed (a write
        # through .data or numpy) is captured within that many saves.
        self.frozen, self.refresh_every = frozen, max(1, refresh_every)
        self._saves = 0
        if local:
            self._sweep(local)

    def _sweep(self, root: str) -> None:
        """Remove step directories a crashed save left without a manifest: they are not checkpoints.
        (Safe here because nothing else writes under ``root`` while the store starts; a multi-rank
        store must sweep on one rank between barriers.)"""
        if not os.path.isdir(root):
            return
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("step-") and os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST)):
                log.warning("ckptstore: removing %s, an incomplete step (no %s)", path, MANIFEST)
                _remove_tree(Directory(path, None))

    # ------------------------------------------------------------------------------ saving

    def _raise_pending(self) -> None:
        if self._errors:
            exc = self._errors.pop(0)
            raise CheckpointError(f"an earlier background save failed: {exc}") from exc

    def save(self, step: int, state: Any) -> SaveHandle:
        """Stage ``state`` in RAM (the only blocking part) and persist it in the background."""
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed")
        self._raise_pending()
        if self._last_step is not None and step <= self._last_step:
            raise InvalidArgumentError(f"step {step} is not after the last saved step {self._last_step}")
        slot = self.ram._next
        busy = self._busy.get(slot)
        if busy is not None and not busy.done():
            if self.policy == "skip":
                self.skipped += 1
                return SaveHandle(step, {}, skipped=True)
            concurrent.futures.wait([busy])
        local = _collect(state, 0, encode_value)
        items = [(key, t) for (key, _o, _s), t in local.items.items()]
        self._saves += 1
        refresh = self._saves % self.refresh_every == 0
        may_skip = frozenset() if self.frozen is None or refresh else frozenset(k for k, _ in items if self.frozen(k))
        staged = self.ram.stage(step, items, may_skip=may_skip)
        self._last_step = step
        futures: dict[str, concurrent.futures.Future | None] = {"ram": concurrent.futures.Future()}
        futures["local"] = concurrent.futures.Future() if self.local else None
        promote = self.durable is not None and step % self.durable_every == 0
        futures["durable"] = concurrent.futures.Future() if promote else None
        self._last = (step, staged, local.tree, None)  # before the pipeline can fill in its checksums
        self._busy[staged.slot] = self._loop.submit(self._pipeline(staged, local.tree, futures))
        return SaveHandle(step, futures)

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(io_pool(), lambda: fn(*args, **kwargs))

    async def _pipeline(self, staged: Staged, tree: Any, futures: dict[str, concurrent.futures.Future | None]) -> None:
        pending = [f for f in futures.values() if f is not None]
        try:
            sums = await self._run(self.ram.checksums, staged, BLOCK_SIZE)
            await self._run(self.ram.commit, staged, sums, {"tree": tree})
            if self._last is not None and self._last[0] == staged.step:
                self._last = (staged.step, staged, tree, sums)
            _resolve(futures["ram"], staged.step)
            if self.local:
                await self._run(persist_staged, self.ram, staged, sums, tree, step_dir(self.local, staged.step))
                _resolve(futures["local"], staged.step)
                await self._run(self._retain, self.local, self.keep_local, None)
            if futures["durable"] is not None:
                await self._promote(staged, tree, sums)
                _resolve(futures["durable"], staged.step)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the next save/wait/close
            log.error("ckptstore: background save of step %d failed: %s", staged.step, exc)
            self._errors.append(exc)
            for f in pending:
                if not f.done():
                    f.set_exception(exc)

    async def _promote(self, staged: Staged, tree: Any, sums: dict[str, Any]) -> None:
        assert self.durable is not None
        await self._run(
            persist_staged, self.ram, staged, sums, tree, step_dir(self.durable, staged.step), storage_options=self.storage_options
        )
        self._promoted.add(staged.step)
        # Durable retention never removes the newest durable step (it is the one just written).
        await self._run(self._retain, self.durable, self.keep_durable, self.storage_options)

    def _steps(self, root: str, storage_options: dict[str, Any] | None) -> list[int]:
        """Committed steps under ``root``: step directories that have a manifest."""
        base = Directory(root, storage_options if "://" in root else None)
        try:
            if base.base.path is not None:
                names = os.listdir(base.base.path) if os.path.isdir(base.base.path) else []
            else:
                names = [p.rstrip("/").rsplit("/", 1)[-1] for p in base.base.fs.ls(base.base.fspath, detail=False)]
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            if name.startswith("step-") and name[5:].isdigit() and base.exists(f"{name}/{MANIFEST}"):
                steps.append(int(name[5:]))
        return sorted(steps)

    def _retain(self, root: str, keep: int | None, storage_options: dict[str, Any] | None) -> None:
        if keep is None:
            return
        steps = self._steps(root, storage_options)
        for step in steps[:-keep]:
            d = Directory(step_dir(root, step), storage_options if "://" in root else None)
            d.remove(MANIFEST)  # uncommit first: a half-deleted step must never look complete
            _remove_tree(d)

    # ------------------------------------------------------------------------------ restoring

    def restore(self, state: Any) -> int | None:
        """Load the newest step with a sound copy into ``state`` in place; None when there is none."""
        self._drain()
        ram = {d["step"]: d for d in self.ram.committed() if "tree" in d.get("extra", {})}
        local = set(self._steps(self.local, None)) if self.local else set()
        durable = set(self._steps(self.durable, self.storage_options)) if self.durable else set()
        tried: list[str] = []
        for step in sorted(set(ram) | local | durable, reverse=True):
            copies: list[tuple[str, Any]] = []
            if step in ram:
                copies.append(("ram", ram[step]))
            if step in local:
                copies.append(("local", step_dir(self.local or "", step)))
            if step in durable:
                copies.append(("durable", step_dir(self.durable or "", step)))
            for tier, where in copies:
                try:
                    if tier == "ram":
                        self._load_ram(state, where)
                    else:
                        so = self.storage_options if tier == "durable" else None
                        directory = Directory(where, so)
                        load_manifest(state, read_manifest(directory), directory.display, directory.open, group=Group(None),
                                      strict=True, per_rank="error", buffer_bytes=256 << 20, decode_per_rank=decode_value)
                    self._last_step = max(self._last_step or step, step)
                    return step
                except CorruptCheckpointError as exc:
                    log.warning("ckptstore: step %d in the %s tier is damaged (%s); trying the next copy", step, tier, exc)
                    tried.append(f"step {step} from {tier}: {exc}")
        if tried:
            raise CorruptCheckpointError("no sound copy of any checkpoint of this job: " + "; ".join(tried))
        return None

    def _load_ram(self, state: Any, doc: dict[str, Any]) -> None:
        rel = f"ckptstore-{self.job}-r{self.ram.rank:05d}-s{doc['slot']}.bin"
        tensors = {}
        for e in doc["layout"]:
            sums = doc["checksums"][e["key"]]
            blocks = sums.get("block_checksums")
            chunks = []
            if e["nbytes"] or not e["shape"]:
                chunks.append(
                    Chunk((0,) * len(e["shape"]), tuple(e["shape"]), rel, e["offset"], e["nbytes"], "raw", sums["checksum"],
                          BLOCK_SIZE if blocks else None, tuple(blocks) if blocks else None)
                )
            tensors[e["key"]] = TensorEntry(e["dtype"], tuple(e["shape"]), chunks)
        manifest = Manifest(kind="sharded", tensors=tensors, tree=doc["extra"]["tree"], meta={"world_size": 1})
        display = f"RAM tier ({self.ram.ram_dir}, step {doc['step']})"

        def open_file(name: str | None) -> Any:
            return open_source(Target(display=f"{self.ram.ram_dir}/{name}", path=os.path.join(self.ram.ram_dir, name or "")))

        load_manifest(state, manifest, display, open_file, group=Group(None), strict=True, per_rank="error",
                      buffer_bytes=256 << 20, decode_per_rank=decode_value)

    # ------------------------------------------------------------------------------ closing

    def _drain(self) -> None:
        concurrent.futures.wait(list(self._busy.values()))

    def close(self) -> None:
        """Drain the pipeline, promote the last snapshot if it was not, and stop the loop."""
        if self._closed:
            return
        self._drain()
        try:
            last = self._last
            if self.durable and last is not None and last[0] not in self._promoted and last[3] is not None and not self._errors:
                self._loop.submit(self._promote(last[1], last[2], last[3])).result()
        finally:
            self._closed = True
            self._loop.close()
            self.ram.close()
        self._raise_pending()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _resolve(f: concurrent.futures.Future | None, value: Any) -> None:
    if f is not None and not f.done():
        f.set_result(value)


def _remove_tree(d: Directory) -> None:
    if d.base.path is not None:
        import shutil

        shutil.rmtree(d.base.path, ignore_errors=True)
    else:
        try:
            d.base.fs.rm(d.base.fspath, recursive=True)
        except FileNotFoundError:
            pass
