"""A restart that costs what it must and no more: the slots a previous process of a rank left in
/dev/shm are mapped off the trainer's path (the one holding the newest committed step untouched
until a newer one is committed), slots released since are made again in the background within
the RAM budget, and a store's start does not wait for the durable tier's listing, which the
restore still honours.

Real processes killed by SIGKILL, real /dev/shm segments, and the real S3 server (SeaweedFS)
behind tests/s3_fault_proxy.py where a listing is held. Nothing here is timed: each test asserts
what the design guarantees (what is mapped when, which segments exist, which step comes back).
"""

from __future__ import annotations

import json
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
import warm_python
from conftest import assert_same
from s3_fault_proxy import FaultProxy

from ckptstore import CheckpointStore, InvalidArgumentError
from ckptstore.names import segment
from ckptstore.tiers.segments import remove_job

# One process of a job: modes "first" (save steps 1 and 2), "restart" and "restart_bare" (restore,
# save once, report what was mapped when), "uncommitted" (restore, save a larger state whose RAM commit never comes),
# "restore" (restore and report). Every mode but "restore" ends with SIGKILL, as a failure does.
_WORKER = r"""
import asyncio, json, logging, os, signal, sys, time
import torch
from ckptstore import CheckpointStore
from ckptstore.names import segment
from ckptstore.tiers import ram

job, ram_dir, local, mode = sys.argv[1:5]
local = local or None  # "": no local tier, the RAM tier holds the only copy of each step

def state(step, extra=False):
    g = torch.Generator().manual_seed(step)
    out = {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(4096, generator=g)}
    if extra:
        out["more"] = torch.randn(512, 1024, generator=g)
    return out

def blank():
    return {k: torch.zeros_like(v) for k, v in state(0).items()}

def slot_path(index):
    return os.path.join(ram_dir, segment(job, 0, index, "bin"))

def mapped():
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if ram_dir in line}

def mapped_within(path, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path in mapped():
            return True
        time.sleep(0.02)
    return False

def newest_slot():
    docs = [json.load(open(os.path.join(ram_dir, n))) for n in os.listdir(ram_dir)
            if n.endswith(".json") and job in n]
    return max(docs, key=lambda d: d["step"])["slot"]

messages = []
class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("ckptstore").addHandler(Keep())
logging.getLogger("ckptstore").setLevel(logging.INFO)

def report(**kw):
    print(json.dumps(kw), flush=True)

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "first":
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    for step in (1, 2):
        store.save(step, state(step)).wait("local")
    die()

if mode == "first_ram_only":
    store = CheckpointStore(job, ram_dir=ram_dir)
    for step in (1, 2):
        store.save(step, state(step)).wait("ram")
    die()

if mode == "restart":
    holding = newest_slot()
    other = slot_path(1 - holding)
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    other_at_start = mapped_within(other)
    holding_at_start = slot_path(holding) in mapped()
    target = blank()
    step = store.restore(target)
    equal = all(torch.equal(target[k], state(step)[k]) for k in target)
    handle = store.save(step + 1, state(step + 1))
    handle.wait("ram")
    holding_before_second_save = mapped_within(slot_path(holding))
    handle.wait("local")
    report(step=step, equal=equal, other_at_start=other_at_start, holding_at_start=holding_at_start,
           holding_before_second_save=holding_before_second_save, messages=messages)
    die()

if mode == "restart_released":
    holding = newest_slot()
    other = slot_path(1 - holding)
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    assert mapped_within(other)
    os.unlink(other)  # released, as a node agent does once the step it held is persisted
    target = blank()
    step = store.restore(target)
    store.save(step + 1, state(step + 1)).wait("local")
    report(step=step)
    die()

if mode == "restart_bare":
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    first_at_start = mapped_within(slot_path(0))
    target = blank()
    step = store.restore(target)
    equal = all(torch.equal(target[k], state(step)[k]) for k in target)
    handle = store.save(step + 1, state(step + 1))
    second_before_second_save = mapped_within(slot_path(1))
    handle.wait("local")
    report(step=step, equal=equal, first_at_start=first_at_start,
           second_before_second_save=second_before_second_save, messages=messages)
    die()

if mode == "uncommitted":
    async def never(self, *a, **k):
        await asyncio.Event().wait()
    ram.RamTier.commit = never  # the RAM commit of the next step never comes
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    target = blank()
    step = store.restore(target)
    store.save(step + 1, state(step + 1, extra=True))  # another size: its slot is made anew
    time.sleep(1.0)  # whatever runs after a save (the next slots being prepared) has run
    report(step=step)
    die()

# Save `first` and `first + 1` back to back, the second called before the first's RAM commit
# (held until the second save waits for its slot), and die once the second starts copying into
# its slot (the slot's document is gone by then): what survives is what the second did not pick.
def back_to_back(store, first):
    import threading
    from ckptstore.engine import pipeline
    waiting, last = threading.Event(), []
    real_wait, real_commit, real_slot = pipeline.Pipeline._wait_for_slot, ram.RamTier.commit, ram.RamTier._slot
    def wait_for_slot(self, *a, **k):
        if last:
            waiting.set()
        return real_wait(self, *a, **k)
    async def commit(self, step, *a, **k):
        if step == first:
            await asyncio.to_thread(waiting.wait)
        return await real_commit(self, step, *a, **k)
    def slot(self, *a, **k):
        if last and threading.current_thread() is threading.main_thread():
            die()
        return real_slot(self, *a, **k)
    pipeline.Pipeline._wait_for_slot, ram.RamTier.commit, ram.RamTier._slot = wait_for_slot, commit, slot
    store.save(first, state(first))
    last.append(True)
    store.save(first + 1, state(first + 1))
    report(error="the second save returned")

if mode == "back_to_back":
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    store.save(1, state(1)).wait("ram")
    back_to_back(store, 2)

if mode == "back_to_back_restarted":
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    target = blank()
    step = store.restore(target)
    back_to_back(store, step + 1)

if mode == "restore":
    store = CheckpointStore(job, ram_dir=ram_dir, local=local)
    target = blank()
    step = store.restore(target)
    equal = step is not None and all(torch.equal(target[k], state(step)[k]) for k in target)
    report(step=step, equal=equal, messages=messages)
    store.close(keep_ram=True)
"""


@pytest.fixture
def shm():
    """A RAM directory of this test's own, removed afterwards (the segments of every process in it)."""
    path = Path("/dev/shm") / f"ckptstore-restart-fast-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(job: str, shm: Path, local: Path | None, mode: str, *, killed: bool = True) -> dict[str, Any]:
    out = warm_python.run(["-c", _WORKER, job, str(shm), "" if local is None else str(local), mode], timeout=180)
    if killed:
        assert out.returncode == -signal.SIGKILL, (out.returncode, out.stderr[-3000:])
    else:
        assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return lines[-1] if lines else {}


def _segments(shm: Path, job: str) -> dict[str, int]:
    """This job's slot segments in ``shm``, by name, with their inodes."""
    return {name: os.stat(shm / name).st_ino for name in os.listdir(shm)
            if name.startswith(f"ckptstore-{job}-") and name.endswith(".bin")}


def _state(step: int, extra: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(4096, generator=g)}
    if extra:
        out["more"] = torch.randn(512, 1024, generator=g)
    return out


def test_a_restarted_process_maps_its_previous_slots_before_its_saves_and_makes_no_new_ones(job, shm, tmp_path):
    """Killed after steps 1 and 2, a rank restarts: before any save it has mapped the slot of its
    previous process that does not hold step 2, and not the one that does (the restore reads that
    one like any restarted process); once its first save is committed, that slot is mapped too,
    before the second save. Every segment is the previous process's own (same names, same
    inodes), and the next restart restores the new step bit for bit from RAM."""
    local = tmp_path / "local"
    _run(job, shm, local, "first")
    before = _segments(shm, job)
    assert len(before) == 2, before
    got = _run(job, shm, local, "restart")
    assert got["step"] == 2 and got["equal"], got
    assert any("restored step 2 from the ram tier" in m for m in got["messages"]), got["messages"]
    assert got["other_at_start"], "the free slot was not mapped before the first save"
    assert not got["holding_at_start"], "the slot of the newest step was mapped before the restore read it"
    assert got["holding_before_second_save"], "the restored step's slot was not mapped before the second save"
    assert _segments(shm, job) == before  # reused in place: no segment made, none replaced
    again = _run(job, shm, local, "restore", killed=False)
    assert again["step"] == 3 and again["equal"], again
    assert any("restored step 3 from the ram tier" in m for m in again["messages"]), again["messages"]


def test_a_restart_on_a_node_whose_segments_were_released_makes_its_first_slot_before_the_first_save(
        job, shm, tmp_path):
    """The segments of a killed rank were released once its steps were persisted (what a node
    agent or `ckptstore ram rm` does). The restarted rank makes the slot its first save takes, at
    the size of its local copy of the newest step, before that save: mapped while the store
    starts and restores (from the local tier, bit for bit); and the second slot once the first
    save returns, before the second. The new step then restores from RAM."""
    local = tmp_path / "local"
    _run(job, shm, local, "first")
    removed = remove_job(job, str(shm))
    assert len(removed) == 2 and _segments(shm, job) == {}
    got = _run(job, shm, local, "restart_bare")
    assert got["step"] == 2 and got["equal"], got
    assert any("restored step 2 from the local tier" in m for m in got["messages"]), got["messages"]
    assert got["first_at_start"], "the first save's slot was not made before the first save"
    assert got["second_before_second_save"], "the second save's slot was not made before the second save"
    again = _run(job, shm, local, "restore", killed=False)
    assert again["step"] == 3 and again["equal"], again
    assert any("restored step 3 from the ram tier" in m for m in again["messages"]), again["messages"]


def test_a_slot_released_after_it_was_mapped_ahead_is_made_again(job, shm, tmp_path):
    """A restarted rank mapped its free slot ahead; before its first save the segment is released
    (a node agent does so once its step is persisted, if it looked before the mapping). The save
    does not stage into the mapping of a file no longer there: the next restart finds the new
    step in RAM."""
    local = tmp_path / "local"
    _run(job, shm, local, "first")
    got = _run(job, shm, local, "restart_released")
    assert got["step"] == 2, got
    again = _run(job, shm, local, "restore", killed=False)
    assert again["step"] == 3 and again["equal"], again
    assert any("restored step 3 from the ram tier" in m for m in again["messages"]), again["messages"]


def test_the_newest_steps_slot_is_left_whole_until_a_newer_step_is_committed(job, shm, tmp_path):
    """After a restart from step 2, a save of a larger state (another slot size) is staged and its
    RAM commit never comes; the process is then killed. The slot holding step 2, the only RAM
    copy of the newest committed step, was neither resized nor replaced by what runs after the
    save: the next process restores step 2 from RAM, bit for bit."""
    local = tmp_path / "local"
    _run(job, shm, local, "first")
    before = _segments(shm, job)
    got = _run(job, shm, local, "uncommitted")
    assert got["step"] == 2, got
    holding = json.loads((shm / segment(job, 0, 1, "json")).read_text())
    assert holding["step"] == 2  # step 1 went to slot 0, step 2 to slot 1, the new step to slot 0
    name = segment(job, 0, 1, "bin")
    assert _segments(shm, job)[name] == before[name] and (shm / name).stat().st_size == holding["size"]
    again = _run(job, shm, local, "restore", killed=False)
    assert again["step"] == 2 and again["equal"], again
    assert any("restored step 2 from the ram tier" in m for m in again["messages"]), again["messages"]


@pytest.mark.parametrize("restarted", [False, True], ids=["steady", "restarted"])
def test_a_save_called_before_the_last_ones_ram_commit_never_overwrites_the_newest_committed_step(
        job, shm, restarted):
    """No local tier: each step's only copy is its RAM slot. Two saves are called back to back,
    the second before the first's RAM commit, and the process is killed while the second copies
    into its slot. The second save must take the slot of the step before the first (committed,
    and no longer the newest once the first commits), never the first's own: the next process
    restores the first of the two from RAM, bit for bit. After a restart the slots hold steps no
    save of the new process made, and the first save passes over the restored step's slot."""
    if restarted:
        _run(job, shm, None, "first_ram_only")
    _run(job, shm, None, "back_to_back_restarted" if restarted else "back_to_back")
    newest = 3 if restarted else 2
    again = _run(job, shm, None, "restore", killed=False)
    assert again["step"] == newest and again["equal"], again
    assert any(f"restored step {newest} from the ram tier" in m for m in again["messages"]), again["messages"]


def _maps() -> set[str]:
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if "/dev/shm/" in line}


def _appears(check, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_a_restart_within_a_budget_of_one_snapshot_makes_one_slot(job, shm, tmp_path):
    """A rank resumes with no segments left and a budget of one snapshot: the slot made ahead for
    its first save is the only one, then and after every save, and the steps restore bit for bit."""
    local = tmp_path / "local"
    with CheckpointStore(job, ram_dir=str(shm), local=local) as store:
        store.save(1, _state(1)).wait("local")
        size = os.path.getsize(shm / segment(job, 0, 0, "bin"))
    assert _segments(shm, job) == {}  # close() released them: the step is in the local tier
    only = [segment(job, 0, 0, "bin")]
    with CheckpointStore(job, ram_dir=str(shm), local=local, ram_budget_bytes=size) as store:
        assert _appears(lambda: list(_segments(shm, job)) == only), "the first save's slot was not made ahead"
        out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert store.restore(out) == 1
        assert_same(out, _state(1))
        for step in (2, 3):
            store.save(step, _state(step)).wait("local")
            time.sleep(1.0)  # what a save starts in the background has run
            assert list(_segments(shm, job)) == only
        assert store.restore(out) == 3
        assert_same(out, _state(3))


def _url(s3: dict[str, Any], job: str) -> str:
    return f"s3://{s3['bucket']}/{s3['prefix']}/{job}"


def test_a_start_does_not_wait_for_the_durable_listing_and_the_restore_still_honours_it(job, shm, tmp_path, s3):
    """This node's RAM and local tiers hold step 3; meanwhile the job ran elsewhere and promoted
    steps 4 and 5. A start here returns while the durable tier's listing is held at the server;
    the restore loads the node's step 3 meanwhile, and once the listing comes back it restores
    step 5 from the durable tier, bit for bit, and counts on from it."""
    url, opts = _url(s3, job), s3["storage_options"]
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    with CheckpointStore(job, local=here, durable=url, storage_options=opts, durable_every=100,
                         ram_dir=str(shm)) as store:
        store.save(3, _state(3)).wait("local")
        store.close(keep_ram=True)  # close promotes the last step: this node's copy is here only now
    s3_client, bucket = s3["client"], s3["bucket"]
    for key in [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix=f"{s3['prefix']}/{job}/")
                .get("Contents", [])]:
        s3_client.delete_object(Bucket=bucket, Key=key)  # the durable tier never got step 3
    other_shm = shm / "elsewhere"
    other_shm.mkdir()
    with CheckpointStore(job, local=elsewhere, durable=url, storage_options=opts, durable_every=1,
                         ram_dir=str(other_shm)) as store:
        for step in (4, 5):
            store.save(step, _state(step)).wait("durable")
    shutil.rmtree(other_shm)
    with FaultProxy(s3["endpoint_url"]) as proxy:
        proxy.add("hold", ("ListObjects", "HeadObject"))
        through = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url))
        made: list[CheckpointStore] = []
        start = threading.Thread(target=lambda: made.append(CheckpointStore(
            job, local=here, durable=url, storage_options=through, durable_every=1, ram_dir=str(shm))))
        start.start()
        start.join(60)
        try:
            assert made, "the store's start waited for the durable tier's listing"
            assert proxy.held.wait(30), "the durable tier was never listed"
            store = made[0]
            out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
            found: list[int | None] = []
            restore = threading.Thread(target=lambda: found.append(store.restore(out)))
            restore.start()
            # The node's step is loaded while the listing is held...
            assert _appears(lambda: torch.equal(out["w"], _state(3)["w"])), "the node tiers' step was not loaded"
            assert not found
        finally:
            proxy.clear()  # ...and the listing, once it comes back, decides
            start.join(60)
        restore.join(120)
        assert found == [5]
        assert_same(out, _state(5))
        assert store.last_step == 5
        with pytest.raises(InvalidArgumentError, match="not after the last saved step 5"):
            store.save(5, _state(5))
        store.save(6, _state(6)).wait("durable")
        store.close()


def test_a_restart_looks_up_no_durable_step_older_than_its_nodes_newest(job, shm, tmp_path, s3):
    """The durable tier holds steps 1-3 and this node holds step 3. Every request for step 1's
    manifest is held at the server: the restart's start and restore look up the durable tier only
    from the node's newest step on (on an object store each step's manifest is a request of its
    own, hundreds of them for a job that keeps every durable step), so the restore returns step 3,
    bit for bit, while they are held (the background sweep of crashed saves still looks at every
    step). When the node's only copy of step 3 is then damaged and the durable tier lacks it,
    the restore lists every durable step and falls back to step 2 there."""
    url, opts = _url(s3, job), s3["storage_options"]
    local = tmp_path / "local"
    with CheckpointStore(job, local=local, durable=url, storage_options=opts, durable_every=1,
                         ram_dir=str(shm)) as store:
        for step in (1, 2, 3):
            store.save(step, _state(step)).wait("durable")
        store.close(keep_ram=True)
    with FaultProxy(s3["endpoint_url"]) as proxy:
        proxy.add("hold", "HeadObject", where="step-000000000001/")
        through = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url))
        found: list[int | None] = []
        made: list[CheckpointStore] = []
        out = {k: torch.zeros_like(v) for k, v in _state(0).items()}

        def restart() -> None:
            store = CheckpointStore(job, local=local, durable=url, storage_options=through, durable_every=1,
                                    ram_dir=str(shm))
            made.append(store)
            found.append(store.restore(out))

        thread = threading.Thread(target=restart)
        thread.start()
        thread.join(60)
        try:
            assert found == [3], "the restore waited for an older durable step's manifest"
            assert_same(out, _state(3))
        finally:
            proxy.clear()
            thread.join(60)
            for store in made:
                store.close(keep_ram=False)  # the RAM copy of step 3 goes
    s3_client, bucket = s3["client"], s3["bucket"]
    for key in [o["Key"] for o in s3_client.list_objects_v2(
            Bucket=bucket, Prefix=f"{s3['prefix']}/{job}/step-000000000003/").get("Contents", [])]:
        s3_client.delete_object(Bucket=bucket, Key=key)
    for step in (1, 2):
        shutil.rmtree(local / f"step-{step:012d}")
    for path in (local / "step-000000000003").rglob("*.bin"):
        with open(path, "r+b") as fh:
            fh.write(b"\xff" * 64)
    with CheckpointStore(job, local=local, durable=url, storage_options=opts, ram_dir=str(shm)) as store:
        out = {k: torch.zeros_like(v) for k, v in _state(0).items()}
        assert store.restore(out) == 2
        assert_same(out, _state(2))
