"""What a restart waits for: the durable tier's sweep runs behind the start, never under a save;
the newest step is chosen across every tier; the store's background work runs below the trainer.

Against the real S3 server (SeaweedFS, the session's ``s3_server``), with tests/s3_fault_proxy.py
in front of it where holding a request is the point: a sweep whose deletions do not come back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same, s3_keys, s3_object_bytes
from s3_fault_proxy import FaultProxy

from ckptstore import CheckpointStore, InvalidArgumentError, UnknownProtocolError, load_sharded


@pytest.fixture
def shm():
    """A RAM directory of this test's own, so that nothing another test leaves is restored here."""
    path = Path("/dev/shm") / f"ckptstore-restart-test-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 64, generator=g), "step": torch.tensor([step], dtype=torch.int64)}


def _blank() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(64, 64), "step": torch.zeros(1, dtype=torch.int64)}


def _url(s3: dict[str, Any], job: str) -> str:
    return f"s3://{s3['bucket']}/{s3['prefix']}/{job}"


def _through(s3: dict[str, Any], proxy: FaultProxy) -> dict[str, Any]:
    opts = dict(s3["storage_options"])
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url)
    return opts


def _nice(tid: int, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/task/{tid}/stat") as fh:
        return int(fh.read().rpartition(")")[2].split()[16])  # field 19 of stat(5)


def test_a_start_does_not_wait_for_the_durable_sweep_and_the_first_promotion_does(tmp_path, shm, s3, job):
    """A crashed promotion left step 5 half-written in the durable tier. The next start returns while
    the sweep's deletions are held at the server; a save of step 5 (the job rolled back past it)
    then waits for the sweep, writes nothing there before it ended, and commits a step that holds
    only its own bytes, which load bitwise."""
    url = _url(s3, job)
    prefix = f"{s3['prefix']}/{job}/step-{5:012d}"
    debris = [f"{prefix}/data/rank-00000.bin", f"{prefix}/parts/rank-00000.json"]
    for key in debris:
        s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=b"half of a crashed promotion")
    with FaultProxy(s3["endpoint_url"]) as proxy:
        proxy.add("hold", ("DeleteObjects", "DeleteObject"))
        made: list[CheckpointStore] = []
        start = threading.Thread(target=lambda: made.append(CheckpointStore(
            job, durable=url, storage_options=_through(s3, proxy), durable_every=1, ram_dir=str(shm))))
        start.start()
        try:
            start.join(30)
            assert made, "the store's start waited for the durable tier's sweep"
            assert proxy.held.wait(30), "the sweep never reached its deletions"
            store = made[0]
            saved: list[Any] = []
            save = threading.Thread(target=lambda: saved.append(store.save(5, _state(5))))
            save.start()
            save.join(1.0)
            assert not saved, "a save went ahead while the durable tier was still being swept"
            written = [p for op, p, _what in proxy.log if op in ("PutObject", "CreateMultipartUpload") and "step-" in p]
            assert written == [], f"promoted into the durable tier before its sweep ended: {written}"
        finally:
            proxy.clear()
            start.join(60)
        save.join(60)
        assert saved
        saved[0].wait("durable", timeout=60)
        store.close()
    keys = s3_keys(s3, prefix + "/")
    assert debris[0] not in keys, f"the crashed promotion's data survived the sweep: {keys}"
    assert s3_object_bytes(s3, debris[1]) != b"half of a crashed promotion"  # the new save's part, by its name
    out = _blank()
    load_sharded(out, f"{url}/step-{5:012d}", storage_options=s3["storage_options"])
    assert_same(out, _state(5))


def test_a_node_tier_older_than_the_durable_tier_does_not_take_the_job_back(tmp_path, shm, s3, job):
    """The local directory still holds step 3 from an earlier run on this node; meanwhile the job
    ran elsewhere and promoted step 8. A start here restores step 8, and counts on from it."""
    url, opts = _url(s3, job), s3["storage_options"]
    with CheckpointStore(job, local=tmp_path / "here", durable=url, storage_options=opts, durable_every=1,
                         ram_dir=str(shm)) as store:
        store.save(3, _state(3)).wait("durable")
    with CheckpointStore(job, local=tmp_path / "elsewhere", durable=url, storage_options=opts, durable_every=1,
                         ram_dir=str(shm)) as store:
        assert store.restore(_blank()) == 3
        store.save(8, _state(8)).wait("durable")
    for name in os.listdir(shm):  # the other node's RAM is not this one's
        os.unlink(shm / name)
    assert sorted(os.listdir(tmp_path / "here")) == [f"step-{3:012d}"]
    with CheckpointStore(job, local=tmp_path / "here", durable=url, storage_options=opts, durable_every=1,
                         ram_dir=str(shm)) as store:
        assert store.last_step == 8
        out = _blank()
        assert store.restore(out) == 8
        assert_same(out, _state(8))
        with pytest.raises(InvalidArgumentError, match="not after the last saved step 8"):
            store.save(8, _state(8))


def _agents(under: Path) -> list[int]:
    mine = str(under).encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        # The agent itself, not the shell or `nice` that start it (their argv names the agent too,
        # at the trainer's priority until they exec it).
        if b"agent" in argv and mine in argv and os.path.basename(argv[0]).startswith(b"python"):
            found.append(int(pid))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread priorities from Linux's /proc")
def test_background_work_runs_below_the_trainer(tmp_path, shm, job):
    """With background_nice=10 the store's worker threads run 10 steps below the trainer's
    priority, its node agent 10 more (capped at 19), and the trainer's own thread is left alone;
    the default (0) keeps the workers level."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(19, base + 10)
    try:
        with CheckpointStore(job, local=tmp_path / "local", ram_dir=str(shm), agent=True, background_nice=10) as store:
            store.save(1, _state(1)).wait("local")
            assert store._loop is not None
            worker = store._loop.submit(asyncio.to_thread(threading.get_native_id)).result(30)
            assert _nice(worker) == want
            assert _nice(threading.get_native_id()) == base
            deadline = time.monotonic() + 30
            while not _agents(shm) and time.monotonic() < deadline:
                time.sleep(0.05)
            (agent,) = _agents(shm)
            assert _nice(agent, agent) == min(19, base + 20)
        level = shm / "level"
        level.mkdir()
        with CheckpointStore(f"{job}-level", local=tmp_path / "level", ram_dir=str(level), agent=True) as store:
            assert store._loop is not None
            worker = store._loop.submit(asyncio.to_thread(threading.get_native_id)).result(30)
            assert _nice(worker) == base
            deadline = time.monotonic() + 30
            while not _agents(level) and time.monotonic() < deadline:
                time.sleep(0.05)
            (agent,) = _agents(level)
            assert _nice(agent, agent) == min(19, base + 10)  # the agent runs below the trainer anyway
    finally:
        for pid in _agents(shm) + _agents(shm / "level"):  # started by this test: it ends them
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread priorities from Linux's /proc")
def test_the_thread_that_maps_slots_ahead_runs_below_the_trainer(tmp_path, shm, job):
    """Zeroing and mapping a made-ahead slot (hundreds of MiB) is background work too: the store
    hands its background_nice to the RAM tier, whose slot thread runs that far below the thread
    that started it, and maps the slot whole."""
    from concurrent.futures import Future

    from ckptstore.tiers import ram

    with CheckpointStore(job, local=tmp_path / "local", ram_dir=str(shm), background_nice=10) as store:
        assert store.ram.background_nice == 10
    base = os.getpriority(os.PRIO_PROCESS, 0)
    future: Future = Future()
    seen: list[int] = []
    future.add_done_callback(lambda _f: seen.append(_nice(threading.get_native_id())))  # on the slot thread
    path = str(shm / f"ckptstore-{job}-r00000-s0.bin")
    thread = threading.Thread(target=ram._prepare_slots, args=([(0, path, 1 << 20, future)], 10))
    thread.start()
    thread.join(30)
    slot = future.result(0)
    try:
        assert seen == [min(19, base + 10)]
        assert slot is not None and slot.size == 1 << 20 and os.path.getsize(path) == 1 << 20
    finally:
        if slot is not None:
            slot.release()


def test_bad_background_nice_is_refused_before_anything_is_made(tmp_path, shm, job):
    for bad in (-1, 20, True, 2.5, "low"):
        with pytest.raises(InvalidArgumentError, match="background_nice must be an int from 0"):
            CheckpointStore(job, local=tmp_path / "local", ram_dir=str(shm), background_nice=bad)
    assert os.listdir(shm) == [] and not (tmp_path / "local").exists()
    # The durable tier's client is built at its first request; a URL none can serve fails at once.
    with pytest.raises(UnknownProtocolError, match="nosuchproto"):
        CheckpointStore(job, durable="nosuchproto://bucket/job", ram_dir=str(shm))


def test_a_restart_lists_the_durable_tier_once_and_a_save_makes_the_next_question_list_again(tmp_path, shm, s3,
                                                                                             job):
    """A restart asks for the newest step held (at the start), then restores: one listing of the
    durable tier answers both. A save between the start and the next question makes that question
    list afresh."""
    url = _url(s3, job)
    with CheckpointStore(job, durable=url, storage_options=s3["storage_options"], durable_every=1,
                         ram_dir=str(shm)) as store:
        store.save(3, _state(3)).wait("durable")
    with FaultProxy(s3["endpoint_url"]) as proxy:
        with CheckpointStore(job, durable=url, storage_options=_through(s3, proxy), durable_every=1,
                             ram_dir=str(shm)) as store:
            out = _blank()
            assert store.restore(out) == 3
            assert_same(out, _state(3))

            def listings() -> int:  # of the job's step directories (the sweep makes one too)
                return sum(op == "ListObjects" and "delimiter=%2F" in path and "step-" not in path
                           for op, path, _what in proxy.log)

            assert listings() == 2, proxy.log  # the start's, shared with the restore, and the sweep's
        with CheckpointStore(job, durable=url, storage_options=_through(s3, proxy), durable_every=1,
                             ram_dir=str(shm)) as store:
            store.save(4, _state(4)).wait("durable")
            before = listings()
            assert store.latest_step() == 4
            assert listings() == before + 1, proxy.log
