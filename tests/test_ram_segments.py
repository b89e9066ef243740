"""RAM segments after the job: ``close()`` releases them once their step is at a lower tier,
``close(keep_ram=True)`` keeps them for a restart on the node, ``ckptstore ram`` lists them and
``ckptstore ram rm`` removes them, refusing what could lose a step or pull memory from a live
process. Real /dev/shm segments and a real process killed with SIGKILL.

(That a SIGKILLed trainer's segments stay and a restart restores from them is tests/test_crash.py's.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import textwrap

import pytest
import torch
import warm_python
from conftest import assert_same, wipe_ram

from ckptstore import CheckpointStore
from ckptstore.cli import main
from ckptstore.names import parse_segment
from ckptstore.tiers.peer import PeerTier


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


def _empty() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(64)}


def _segments(job: str, ram_dir: str = "/dev/shm") -> list[str]:
    return sorted(n for n in os.listdir(ram_dir) if (seg := parse_segment(n)) is not None and seg.job == job)


def _restored_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "restored step" in r.getMessage()]


def test_close_releases_the_segments_once_their_step_is_local(tmp_path, job):
    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(1, _state(1))
        store.save(2, _state(2))
        store._drain()
        assert len(_segments(job)) == 4  # two slots, each with its document
    assert _segments(job) == []
    # Nothing was lost: the local tier restores the newest step, bit for bit.
    with CheckpointStore(job, local=tmp_path / "local") as again:
        out = _empty()
        assert again.restore(out) == 2
    assert_same(out, _state(2))
    assert _segments(job) == []


def test_keep_ram_keeps_them_for_a_restart_on_the_node_that_restores_from_ram(tmp_path, job, caplog):
    caplog.set_level(logging.INFO, logger="ckptstore")
    store = CheckpointStore(job, local=tmp_path / "local")
    store.save(1, _state(1))
    store.save(2, _state(2))
    store.close(keep_ram=True)
    assert [n for n in _segments(job) if n.endswith(".bin")] == [f"ckptstore-{job}-r00000-s{i}.bin" for i in (0, 1)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # A new run on the node: the finished run's segments are used.
    again = CheckpointStore(job, local=tmp_path / "local")
    out = _empty()
    assert again.restore(out) == 2
    assert_same(out, _state(2))
    assert _restored_from(caplog) == ["ckptstore: restored step 2 from the ram tier"]
    again.close()  # this run keeps nothing: step 2 is in the local tier
    assert _segments(job) == []


def test_a_store_without_a_lower_tier_keeps_its_segments_and_says_so(job, caplog):
    store = CheckpointStore(job)
    store.save(1, _state(1))
    store.close()
    assert len(_segments(job)) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"ckptstore: close() keeps 1 RAM segment of job {job}, rank 0 (") and (
        "the store has no local or durable tier, so they are the only copy of their steps. A restart on this node "
        f"restores from them; `ckptstore ram rm {job}` frees them") in warnings[0]
    with CheckpointStore(job) as again:
        out = _empty()
        assert again.restore(out) == 1
    assert_same(out, _state(1))


def test_a_newer_step_at_a_lower_tier_wins_over_older_segments_of_a_finished_run(tmp_path, job, caplog):
    """Run 1 on this node keeps steps 1-2 in RAM; run 2 on another node (its own RAM directory)
    takes the job to step 4 in the durable tier; run 3 back on this node restores step 4, not the
    older RAM copy, and its close() lets the superseded segments go."""
    caplog.set_level(logging.INFO, logger="ckptstore")
    durable = str(tmp_path / "durable")
    other_node = f"/dev/shm/{job}-other-node"
    os.mkdir(other_node)
    try:
        first = CheckpointStore(job, durable=durable, durable_every=1)
        first.save(1, _state(1))
        first.save(2, _state(2))
        first.close(keep_ram=True)
        with CheckpointStore(job, durable=durable, durable_every=1, ram_dir=other_node) as second:
            second.save(3, _state(3))
            second.save(4, _state(4))
        assert _segments(job, other_node) == []
        assert len(_segments(job)) == 4
        caplog.clear()
        with CheckpointStore(job, durable=durable, durable_every=1) as third:
            out = _empty()
            assert third.restore(out) == 4
        assert_same(out, _state(4))
        assert _restored_from(caplog) == ["ckptstore: restored step 4 from the durable tier"]
        assert _segments(job) == []
    finally:
        shutil.rmtree(other_node, ignore_errors=True)


def test_close_lets_a_replica_go_once_the_durable_tier_holds_its_step(tmp_path, job, caplog):
    durable = str(tmp_path / "durable")
    store = CheckpointStore(job, durable=durable, durable_every=1)
    store.save(1, _state(1))
    store.save(2, _state(2)).wait("durable")
    # Replicas this rank holds of rank 1's snapshots (rank 1 on another node): step 2, which the
    # durable tier holds, and step 5, which it does not.
    holder = PeerTier(job, 0, durable=durable)
    for step in (2, 5):
        slot, buf = holder.replica_buffer(1, 4096)
        buf.fill_(step)
        holder.commit_replica(1, slot, step, 4096, b"{}")
    holder.close()
    store.close()
    assert _segments(job) == [f"ckptstore-{job}-r00000-peer00001-s1.{ext}" for ext in ("bin", "json")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the durable tier lacks the replicas' step 5" in warnings[0], warnings


_KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    import torch
    from ckptstore import CheckpointStore
    ram, local, job = sys.argv[1:4]
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    a = CheckpointStore(job + "-a", local=local, ram_dir=ram)
    a.save(1, state).wait("local")
    a.save(2, state).wait("local")
    b = CheckpointStore(job + "-b", ram_dir=ram)  # no lower tier: RAM is the only copy
    b.save(1, state).wait("ram")
    for ahead in list(b.ram._preparing.values()):  # its second slot, made ahead for the next save
        ahead.result()
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def ram_dir(job):
    """A RAM directory of the test's own on /dev/shm, so listings show its segments only."""
    path = f"/dev/shm/{job}-dir"
    os.mkdir(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ram_lists_segments_and_rm_refuses_what_could_lose_a_step(tmp_path, job, ram_dir, capsys):
    local = str(tmp_path / "local")
    res = warm_python.run(["-c", _KILLED_RUN, ram_dir, local, job], timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]

    assert main(["ram", "--ram-dir", ram_dir, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    rows = [(r["job"], r["rank"], r["slot"], r["step"], r["owner_alive"], r["elsewhere"]) for r in listed]
    assert rows == [(f"{job}-a", 0, 0, 1, False, ["local"]), (f"{job}-a", 0, 1, 2, False, ["local"]),
                    (f"{job}-b", 0, 0, 1, False, []), (f"{job}-b", 0, 1, None, False, None)]
    seg_bytes = os.path.getsize(f"{ram_dir}/ckptstore-{job}-a-r00000-s0.bin")
    assert all(r["bytes"] > seg_bytes >= 4096 * 4 and r["owner_pid"] > 0 for r in listed if r["step"] is not None)
    # The made-ahead slot: the segment alone, no document, no owner recorded and none mapping it.
    assert [(r["bytes"], r["owner_pid"]) for r in listed if r["step"] is None] == [(seg_bytes, None)]
    assert main(["ram", "--ram-dir", ram_dir]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"RAM segments in {ram_dir}: 4 (")
    assert any(line.split()[:4] == [f"{job}-b", "0", "s0", "1"] and line.endswith("(exited)  nowhere")
               for line in text.splitlines()), text

    # The only copy of a step: refused with its reason, nothing removed.
    assert main(["ram", "rm", f"{job}-b", "--ram-dir", ram_dir]) == 2
    assert capsys.readouterr().err == (
        f"ckptstore ram: error: refusing to remove the RAM segments of job {job}-b in {ram_dir}: "
        f"ckptstore-{job}-b-r00000-s0.bin: step 1 exists at no lower tier (local or durable) this node can see. "
        "Nothing was removed; stop the job, or wait until its steps reach the local or durable tier, or pass --force "
        "(force=True) to remove them anyway\n")
    assert len(_segments(f"{job}-b", ram_dir)) == 3
    assert main(["ram", "rm", f"{job}-b", "--ram-dir", ram_dir, "--force"]) == 0
    assert capsys.readouterr().out.startswith(f"removed 2 RAM segments of job {job}-b from {ram_dir} (")
    assert _segments(f"{job}-b", ram_dir) == []
    # Steps in the local tier, owner dead: removed without --force.
    assert main(["ram", "rm", f"{job}-a", "--ram-dir", ram_dir]) == 0
    assert capsys.readouterr().out.startswith(f"removed 2 RAM segments of job {job}-a from {ram_dir} (")
    assert _segments(f"{job}-a", ram_dir) == []

    # A live owner: refused, even though its step is in the local tier.
    live = CheckpointStore(f"{job}-c", local=tmp_path / "local-c", ram_dir=ram_dir)
    try:
        live.save(1, {"w": torch.ones(16)}).wait("local")
        for ahead in list(live.ram._preparing.values()):  # the next save's slot, made ahead
            ahead.result()
        assert main(["ram", "rm", f"{job}-c", "--ram-dir", ram_dir]) == 2
        assert capsys.readouterr().err == (
            f"ckptstore ram: error: refusing to remove the RAM segments of job {job}-c in {ram_dir}: "
            f"ckptstore-{job}-c-r00000-s0.bin: its owner, process {os.getpid()}, is alive; "
            f"ckptstore-{job}-c-r00000-s1.bin: its owner, process {os.getpid()}, is alive. Nothing was removed; stop "
            "the job, or wait until its steps reach the local or durable tier, or pass --force (force=True) to "
            "remove them anyway\n")
        assert len(_segments(f"{job}-c", ram_dir)) == 3
    finally:
        live.close()
    assert os.listdir(ram_dir) == []
    for name in (f"{job}-a", f"{job}-b", f"{job}-c"):
        wipe_ram(name)
