"""The tier contract (ckptstore/tiers/base.py), run by ckptstore.testing.TierContract against every
tier: RAM on /dev/shm; DirectoryTier on a local directory (node-local, as the local tier), on a
local directory with zstd, on S3 (moto) and on memory://; the peer tier, two ranks over real gloo
in this process; and a dict-backed tier defined here, as a third-party tier would be."""

from __future__ import annotations

import asyncio
import datetime
import io
import os
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
from conftest import s3_pending_uploads

from ckptstore import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from ckptstore.checkpoint.materialize import encode_value
from ckptstore.checkpoint.sharded import BLOCK_SIZE, Collected, Directory, collect, my_writes
from ckptstore.collective import Group
from ckptstore.format.manifest import Manifest, parse_manifest
from ckptstore.names import data_file, part_file, step_dir
from ckptstore.storage.targets import Source, Target, open_source
from ckptstore.testing import TierContract, TierEnv, assert_loaded_equal
from ckptstore.tiers.base import Capabilities, Snapshot, Tier, uint8
from ckptstore.tiers.directory import DirectoryTier
from ckptstore.tiers.peer import PeerTier
from ckptstore.tiers.ram import RamTier

SHM = "/dev/shm"


def _job() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"


# ------------------------------------------------------------------------------------ RAM


class TestRamTier(TierContract):
    @pytest.fixture
    def env(self) -> Iterator[TierEnv]:
        ram = RamTier(_job(), ram_dir=SHM, slots=3)
        with TierEnv(ram, source=ram, keeps=3) as env:  # the RAM tier stages its own snapshots
            yield env


class TestRamTierOfTwoSlots(TierContract):
    """The default of a store: with two slots, a save that never commits must still not cost the
    newest committed snapshot (staging passes over its slot)."""

    @pytest.fixture
    def env(self) -> Iterator[TierEnv]:
        ram = RamTier(_job(), ram_dir=SHM, slots=2)
        with TierEnv(ram, source=ram, keeps=2) as env:
            yield env


# ------------------------------------------------------------------------------------ directories


class DirectoryEnv(TierEnv):
    """A DirectoryTier on ``root``; ``another()`` is a second tier on the same root."""

    def __init__(self, root: str, options: dict[str, Any] | None = None, codec: str | None = None,
                 node_local: bool = False) -> None:
        self.root, self.options, self.codec, self.node_local = root, options, codec, node_local
        super().__init__(self.another())

    def another(self) -> DirectoryTier:
        return DirectoryTier("local" if self.node_local else "durable", self.root, storage_options=self.options,
                             codec=self.codec, node_local=self.node_local)

    def step(self, step: int) -> Directory:
        return Directory(f"{self.root}/{step_dir(step)}", self.options)

    def locate(self, step: int, file: str) -> Target:
        return self.step(step).target(file)

    def written_files(self, step: int, part: dict[str, Any]) -> list[str]:
        return [*super().written_files(step, part), part_file(part["rank"])]

    def check_reused(self, earlier: int, later: int, file: str) -> None:
        assert "-frozen-" in file and file.startswith("data/"), file
        a, b = (self.locate(s, file).path for s in (earlier, later))
        if a is not None and b is not None:
            assert os.stat(a).st_ino == os.stat(b).st_ino, "the frozen file is a hard link"


class DirectoryChecks(TierContract):
    """What the DirectoryTier adds to the contract: its refusals say what happened."""

    def test_refusals_say_a_step_exists_and_is_never_rewritten(self, env: DirectoryEnv) -> None:
        state = {"w": torch.arange(10.0)}
        saved = env.save(6, state)
        second = env.manifest_of(6, saved.local, saved.part, job="the second writer")
        for writer in (env.another(), env.tier):
            with pytest.raises(CheckpointError, match="already exists"):
                writer.commit_sync(6, second)
        with pytest.raises(CheckpointError, match="never rewritten"):
            env.save(6, {"w": torch.ones(10)}, commit=False)
        assert_loaded_equal(env.load(6, state), state)


    @pytest.mark.parametrize("when", ["before our data", "after our data"])
    def test_a_writer_racing_for_the_same_step_leaves_both_copies_and_one_manifest_wins(self, env: DirectoryEnv,
                                                                                     when: str) -> None:
        """A second writer of the step (the node agent persisting what a killed trainer left, while
        the restarted job promotes the same step) takes the usual file names between this writer's
        check for them and its own write of them: neither write fails, neither replaces the
        other's bytes, the first manifest is the step, the second is refused, and the step loads
        bitwise as its manifest's writer saved it. (CI: the restarted job's promotion failed on the
        agent's part file appearing, and the job's next save raised.)"""
        step = 9 if when == "before our data" else 10  # the S3 prefix is the test's, not the case's
        ours, theirs = {"w": torch.arange(4096.0)}, {"w": -torch.arange(4096.0)}
        first, second = env.tier, env.another()
        assert isinstance(first, DirectoryTier) and isinstance(second, DirectoryTier)
        snaps = [_staged(env, step, state) for state in (ours, theirs)]
        their_part: list[dict[str, Any]] = []
        write = first._write

        def racing_write(*args: Any, **kwargs: Any) -> Any:
            if when == "before our data" and not their_part:  # once: our retry comes back here
                their_part.append(second.put_sync(snaps[1][0]))
            table = write(*args, **kwargs)
            if when == "after our data" and not their_part:
                their_part.append(second.put_sync(snaps[1][0]))
            return table

        first._write = racing_write  # type: ignore[method-assign]
        try:
            our_part = first.put_sync(snaps[0][0])
        finally:
            del first._write
        assert their_part and our_part["part_file"] != their_part[0]["part_file"]
        ours_files = {c["file"] for cs in our_part["chunks"].values() for c in cs}
        theirs_files = {c["file"] for cs in their_part[0]["chunks"].values() for c in cs}
        assert not ours_files & theirs_files, (ours_files, theirs_files)
        first.commit_sync(step, env.manifest_of(step, snaps[0][1], our_part))
        with pytest.raises(CheckpointExistsError, match="already exists"):
            second.commit_sync(step, env.manifest_of(step, snaps[1][1], their_part[0], job="the second writer"))
        assert_loaded_equal(env.load(step, ours), ours)
        assert_loaded_equal(env.load(step, theirs, tier=second), ours)


    def test_a_sweep_beside_agents_leaves_the_steps_an_agent_may_be_writing(self, env: DirectoryEnv) -> None:
        """With node agents about (they persist what killed trainers left, while the restarted
        store starts and sweeps), an incomplete step newer than every committed one may be an
        agent's write in progress: it stays, files and all; an older one is a crash's debris and
        goes. Without agents both go, as before."""
        tier = env.tier
        assert isinstance(tier, DirectoryTier)
        old, new = env.save(1, {"w": torch.ones(64)}, commit=False), env.save(3, {"w": torch.zeros(64)}, commit=False)
        env.save(2, {"w": torch.arange(64.0)})
        old_files, new_files = env.written_files(1, old.part), env.written_files(3, new.part)
        assert asyncio.run(tier.sweep(agents=True)) == [1]
        assert not any(env.exists(1, f) for f in old_files)
        assert new_files and all(env.exists(3, f) for f in new_files), "an agent's step in progress stays"
        assert tier.steps_sync() == [2]
        assert asyncio.run(tier.sweep()) == [3]
        assert not any(env.exists(3, f) for f in new_files)
        assert_loaded_equal(env.load(2, {"w": torch.arange(64.0)}), {"w": torch.arange(64.0)})


    def test_a_writer_that_puts_a_step_again_goes_beside_its_own_first_attempt(self, env: DirectoryEnv) -> None:
        """A writer retrying a step (the node agent, after a failure past its data file: nothing of
        it is discarded, another node's manifest may name its parts) writes the step again beside
        what its first attempt left, never refused by its own files, and the step commits and
        loads bitwise from the second attempt."""
        state = {"w": torch.arange(2048.0)}
        first_try, _ = _staged(env, 11, state)
        tier = env.tier
        assert isinstance(tier, DirectoryTier)
        first = tier.put_sync(first_try)
        snap, local = _staged(env, 11, state)
        second = tier.put_sync(snap)
        assert second["part_file"] != first["part_file"]
        tier.commit_sync(11, env.manifest_of(11, local, second))
        assert_loaded_equal(env.load(11, state), state)


def _staged(env: TierEnv, step: int, state: dict[str, torch.Tensor]) -> tuple[Snapshot, Collected]:
    """``state`` staged in the env's RAM source as one rank of a one-rank job, as TierEnv.save
    stages it, not yet handed to any tier."""
    local = collect(state, 0, encode_value)
    mine = my_writes(local, 1, 0)
    staged = env.source.stage(step, [(m.key, local.items[(m.key, m.offsets, m.sizes)]) for m in mine])
    env.source.checksums(staged, BLOCK_SIZE)
    return env.source.snapshot(staged, world=1, boxes={}, frozen_end=0), local


class TestLocalTier(DirectoryChecks):
    @pytest.fixture
    def env(self, tmp_path) -> Iterator[DirectoryEnv]:
        with DirectoryEnv(str(tmp_path / "tier"), node_local=True) as env:
            yield env


class TestLocalZstdTier(DirectoryChecks):
    @pytest.fixture
    def env(self, tmp_path) -> Iterator[DirectoryEnv]:
        with DirectoryEnv(str(tmp_path / "tier"), codec="zstd") as env:
            yield env

    def test_zstd_tier_stores_compressed_chunks(self, env: DirectoryEnv) -> None:
        state = {"zeros": torch.zeros(2_000_000), "noise": torch.randn(1000), "empty": torch.empty(0)}
        part = env.save(8, state).part
        raw = state["zeros"].numel() * 4 + 4000
        assert env.size(8, data_file(0)) < raw // 100
        assert part["written_bytes"] < raw // 100
        manifest = env.tier.manifest_sync(8)
        chunks = [c for e in manifest.tensors.values() for c in e.chunks]
        assert chunks and {c.codec for c in chunks} == {"zstd"}
        assert_loaded_equal(env.load(8, state), state)


class TestS3Tier(DirectoryChecks):
    @pytest.fixture
    def env(self, s3) -> Iterator[DirectoryEnv]:
        with DirectoryEnv(f"s3://{s3['bucket']}/{s3['prefix']}/tier", s3["storage_options"]) as env:
            yield env


    def test_a_sweep_beside_agents_aborts_only_uploads_of_older_steps(self, env: DirectoryEnv, s3) -> None:
        """An agent's multipart upload of a step newer than every committed one is in flight, not
        abandoned: a sweep beside agents leaves it; one of an older step is aborted."""
        env.save(2, {"w": torch.arange(64.0)})
        client, bucket = s3["client"], s3["bucket"]
        keys = [f"{s3['prefix']}/tier/{step_dir(s)}/data/rank-00000.wfeedface.bin" for s in (1, 5)]
        for key in keys:
            client.create_multipart_upload(Bucket=bucket, Key=key)
        assert sorted(s3_pending_uploads(s3, f"{s3['prefix']}/")) == keys
        asyncio.run(env.tier.sweep(agents=True))
        assert s3_pending_uploads(s3, f"{s3['prefix']}/") == keys[1:]
        asyncio.run(env.tier.sweep())
        assert s3_pending_uploads(s3, f"{s3['prefix']}/") == []


class TestMemoryTier(DirectoryChecks):
    @pytest.fixture
    def env(self) -> Iterator[DirectoryEnv]:
        root = f"memory://contract-{uuid.uuid4().hex}"
        try:
            with DirectoryEnv(f"{root}/tier") as env:
                yield env
        finally:
            fs = fsspec.filesystem("memory")
            if fs.exists(root):
                fs.rm(root, recursive=True)


# ------------------------------------------------------------------------------------ peer


def _gloo_pair(timeout_s: float = 30) -> list[Any]:
    """Two gloo process groups of one world of two, in this process: rank 0 and rank 1. Each
    constructor waits for the other at the rendezvous, so they are created in two threads."""
    store, prefix = dist.HashStore(), f"contract-{uuid.uuid4().hex}"
    pgs: list[Any] = [None, None]
    errors: list[BaseException] = []

    def create(rank: int) -> None:
        try:
            pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2,
                                              datetime.timedelta(seconds=timeout_s))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return pgs


def _group(pg: Any, rank: int, world: int) -> Group:
    group = Group.solo()
    group.pg, group.rank, group.world = pg, rank, world
    return group


class PeerEnv(TierEnv):
    """Rank 0 sends its snapshot to rank 1, which holds the replica; each rank's PeerTier has a
    ram_dir of its own under /dev/shm, and the source's slots are in rank 0's. The contract reads
    rank 1's tier. A write runs both ranks' ``put`` (rank 1 with an empty snapshot of its own: it
    sends nothing) at once, as the collective requires, then both ``commit``s."""

    def __init__(self) -> None:
        self.dirs = [tempfile.mkdtemp(prefix=f"ckptstore-contract-r{r}-", dir=SHM) for r in (0, 1)]
        self.pgs: list[Any] = []
        self.ranks: list[PeerTier] = []
        try:
            self.pgs = _gloo_pair()
            job = _job()
            self.ranks = [
                PeerTier(job, 0, ram_dir=self.dirs[0], group=_group(self.pgs[0], 0, 2), send_to=[1], hold_for=[]),
                PeerTier(job, 1, ram_dir=self.dirs[1], group=_group(self.pgs[1], 1, 2), send_to=[], hold_for=[0]),
            ]
            super().__init__(self.ranks[1], source=RamTier(job, 0, ram_dir=self.dirs[0], slots=3), keeps=2)
        except BaseException:
            self._release()
            raise

    def _both(self, calls: list[Callable[[], Any]]) -> list[Any]:
        with ThreadPoolExecutor(2, thread_name_prefix="contract-rank") as pool:
            futures = [pool.submit(call) for call in calls]
            return [f.result() for f in futures]

    def put(self, snap: Snapshot, *, use_async: bool = False) -> dict[str, Any]:
        own = Snapshot(snap.step, 1, snap.world, uint8(b""), {})
        if use_async:
            parts = self._both([lambda t=t, s=s: asyncio.run(t.put(s)) for t, s in zip(self.ranks, (snap, own))])
        else:
            parts = self._both([lambda t=t, s=s: t.put_sync(s) for t, s in zip(self.ranks, (snap, own))])
        return parts[0]

    def commit(self, step: int, manifest: Manifest, *, use_async: bool = False) -> None:
        if use_async:
            self._both([lambda t=t: asyncio.run(t.commit(step, manifest)) for t in self.ranks])
        else:
            self._both([lambda t=t: t.commit_sync(step, manifest) for t in self.ranks])

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._release()

    def _release(self) -> None:
        for tier in self.ranks:
            tier.close()
        for pg in self.pgs:
            pg.shutdown()
        self.pgs = []
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


class TestPeerTier(TierContract):
    @pytest.fixture
    def env(self) -> Iterator[PeerEnv]:
        with PeerEnv() as env:
            yield env

    def test_the_source_holds_no_replica_and_the_holder_holds_exactly_the_source(self, env: PeerEnv) -> None:
        state = {"w": torch.arange(1000.0)}
        env.save(1, state)
        source, holder = env.ranks
        assert source.steps_sync() == [] and source.holdings(1).files == []
        assert [h.file for h in holder.holdings(1).files] == [data_file(0)]
        assert holder.node_steps() == {1}
        assert_loaded_equal(env.load(1, state), state)


# ------------------------------------------------------------------------------------ a third-party tier


class DictTier(Tier):
    """A tier written outside ckptstore, as small as the contract allows: each rank's bytes and
    each step's manifest in dicts of this process."""

    capabilities = Capabilities()

    def __init__(self) -> None:
        self.name = "dict"
        self.files: dict[tuple[int, str], bytearray] = {}
        self.manifests: dict[int, bytes] = {}

    async def put(self, snap: Snapshot) -> dict[str, Any]:
        self.files[(snap.step, data_file(snap.rank))] = bytearray(snap.data.numpy().tobytes())
        return {"rank": snap.rank, "world_size": snap.world, "host": socket.gethostname(), "pid": os.getpid(),
                "bytes": snap.nbytes, "written_bytes": snap.nbytes, "chunks": snap.chunks, "timings": {}}

    async def commit(self, step: int, manifest: Manifest) -> None:
        self.manifests[step] = manifest.to_json_bytes()

    async def steps(self) -> list[int]:
        return sorted(self.manifests)

    async def manifest(self, step: int) -> Manifest:
        if step not in self.manifests:
            raise CheckpointNotFoundError(f"{self.display(step)}: not committed")
        return parse_manifest(self.manifests[step], where=self.display(step))

    def opener(self, step: int) -> Callable[[str | None], Source]:
        def open_file(rel: str | None) -> Source:
            data = self.files.get((step, rel or ""))
            if data is None:
                raise CheckpointNotFoundError(f"{self.display(step)}: no file {rel!r}")
            return open_source(Target(display=f"{self.display(step)}/{rel}", fileobj=io.BytesIO(bytes(data))))

        return open_file

    def display(self, step: int) -> str:
        return f"dict tier, step {step}"

    async def remove(self, step: int) -> None:
        self.manifests.pop(step, None)
        for key in [k for k in self.files if k[0] == step]:
            del self.files[key]


class DictEnv(TierEnv):
    def damage(self, step: int, file: str, at: int) -> None:
        assert isinstance(self.tier, DictTier)
        self.tier.files[(step, file)][at] ^= 0x5A


class TestThirdPartyTier(TierContract):
    @pytest.fixture
    def env(self) -> Iterator[TierEnv]:
        with DictEnv(DictTier()) as env:
            yield env
