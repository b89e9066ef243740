"""Agreeing across ranks without losing what failed: every rank raises an error that names each
failing rank and keeps its class (a StorageError stays a StorageError), and a background failure
reaches the trainer with its original class, once."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import threading

import dist_workers
import pytest
import torch

import ckptstore
from ckptstore.collective import failure_record, settle
from ckptstore.errors import BackgroundError, CollectiveError, RankFailure, background_error, collective_error


def _failed(rank: int, exc: BaseException) -> dict:
    return {"ok": False, "failure": failure_record(rank, exc)}


def test_every_rank_failing_with_one_class_raises_that_class_with_every_failure():
    statuses = [_failed(0, ckptstore.StorageError("cannot write /a: disk full", errno=errno.ENOSPC)), {"ok": True},
                _failed(2, ckptstore.StorageError("cannot write /c: disk full", errno=errno.ENOSPC))]
    with pytest.raises(ckptstore.StorageError) as info:
        settle("writing step 5 to the local tier", statuses, 1, None)
    exc = info.value
    assert isinstance(exc, CollectiveError) and isinstance(exc, OSError)
    assert sorted(exc.failures) == [0, 2] and exc.errno == errno.ENOSPC
    assert exc.failures[2].message == "cannot write /c: disk full" and exc.failures[2].errno == errno.ENOSPC
    assert str(exc).startswith("writing step 5 to the local tier failed: rank 0 (")
    assert "cannot write /a: disk full; rank 2 (" in str(exc)


def test_failures_of_different_classes_raise_a_plain_collective_error():
    statuses = [_failed(0, ckptstore.StorageError("disk full")), _failed(1, ckptstore.CorruptCheckpointError("bad"))]
    with pytest.raises(CollectiveError) as info:
        settle("committing", statuses, 0, None)
    assert not isinstance(info.value, (ckptstore.StorageError, ckptstore.CorruptCheckpointError))
    assert {r: f.type.rsplit(".", 1)[1] for r, f in info.value.failures.items()} == {
        0: "StorageError", 1: "CorruptCheckpointError"}


def test_a_corrupt_copy_keeps_its_location_and_key_across_ranks():
    bad = ckptstore.CorruptCheckpointError("checksum mismatch", location="/l/step/data/rank-00001.bin", key="w")
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        settle("loading", [{"ok": True}, _failed(1, bad)], 0, None)
    assert (info.value.location, info.value.key) == ("/l/step/data/rank-00001.bin", "w")


def test_the_rank_that_alone_failed_a_vote_gets_its_own_exception_object():
    mine = ckptstore.UnsupportedObjectError("obj['x'] cannot be stored")
    statuses = [{"ok": True}, _failed(1, mine)]
    with pytest.raises(ckptstore.UnsupportedObjectError) as info:
        settle("save of step 20", statuses, 1, mine, own_error_first=True)
    assert info.value is mine
    with pytest.raises(ckptstore.UnsupportedObjectError) as other:
        settle("save of step 20", statuses, 0, None, own_error_first=True)
    assert isinstance(other.value, CollectiveError)
    assert str(other.value) == "save of step 20 failed on other ranks: rank 1: obj['x'] cannot be stored"


def test_a_class_from_outside_ckptstore_is_never_looked_up_from_a_record():
    class Private(Exception):
        pass

    record = failure_record(1, Private("boom"))
    assert record["type"].endswith("Private")
    with pytest.raises(CollectiveError) as info:
        settle("writing", [{"ok": True}, {"ok": False, "failure": record}], 0, None)
    assert type(info.value) is CollectiveError  # named in the failures, not rebuilt
    local = Private("boom")
    with pytest.raises(Private):  # this rank's own class is known: it is kept
        settle("writing", [{"ok": False, "failure": failure_record(0, local)}, {"ok": False, "failure": record}], 0,
               local)


def test_a_background_failure_keeps_its_class_and_names_its_step():
    cause = collective_error("promoting step 7 failed: rank 0: timed out", {
        0: RankFailure(0, "ckptstore.errors.StorageError", "timed out", "h", errno=errno.ETIMEDOUT)})
    exc = background_error(7, cause)
    assert isinstance(exc, BackgroundError) and isinstance(exc, ckptstore.StorageError)
    assert exc.errno == errno.ETIMEDOUT and exc.__cause__ is cause
    assert str(exc) == "an earlier background save (step 7) failed: promoting step 7 failed: rank 0: timed out"
    plain = background_error(8, RuntimeError("gloo: connection closed"))
    assert isinstance(plain, RuntimeError) and isinstance(plain, ckptstore.CheckpointError)
    assert dataclasses.asdict(plain.failures[0])["type"] == "builtins.RuntimeError"


def test_a_failed_promotion_reaches_the_next_save_as_a_storage_error(job, tmp_path):
    durable = tmp_path / "durable"
    durable.mkdir()
    (durable / "step-000000000002").write_text("a file where the step directory must go")
    store = ckptstore.CheckpointStore(job, local=str(tmp_path / "local"), durable=str(durable), durable_every=1)
    store.save(1, {"w": torch.ones(100)}).wait("durable")
    handle = store.save(2, {"w": torch.ones(100)})
    with pytest.raises(ckptstore.StorageError):
        handle.wait("durable")
    with pytest.raises(ckptstore.StorageError, match=r"earlier background save \(step 2\) failed") as info:
        store.save(3, {"w": torch.ones(100)})
    assert isinstance(info.value, BackgroundError)
    store.save(4, {"w": torch.ones(100)}).wait("durable")  # raised once; the store goes on
    store.close()


def test_two_ranks_learn_one_ranks_disk_failure_as_a_storage_error(tmp_path, job):
    ram_root = f"/dev/shm/{job}-nodes"
    try:
        dist_workers.spawn(2, "collective_workers:one_rank_disk_fails_job", tmp_path, name=job, root=str(tmp_path),
                           ram_root=ram_root)
    finally:
        shutil.rmtree(ram_root, ignore_errors=True)


# ------------------------------------------------------------------------------ options first


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("bad, match", [
    (dict(sdc="sometimes"), "sdc must be"),
    (dict(interval="auto"), "pass mtbf="),
    (dict(local=None, events=True), "pass local= too"),
    (dict(local=None, peer_to_local=True), "pass local= too"),
    (dict(tuning={"local": {"chunk_bytes": 3}}), "chunk_bytes must be"),
    (dict(durable_every=0), "durable_every must be a positive int"),
    (dict(timeout_s=-1), "timeout_s must be a positive number"),
    (dict(ram_dir="/nonexistent-ram-dir"), "is not a directory"),
    (dict(frozen="base/"), "frozen must be a function"),
])
def test_every_argument_is_checked_before_anything_is_created(job, tmp_path, bad, match):
    before = _threads()
    args = dict(local=str(tmp_path / "local"), durable=str(tmp_path / "durable"))
    args.update(bad)
    with pytest.raises(ckptstore.InvalidArgumentError, match=match):
        ckptstore.CheckpointStore(job, **args)
    assert _threads() == before, "no loop thread was started"
    assert not (tmp_path / "local").exists() and not (tmp_path / "durable").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptstore-{job}-")]


def test_a_failure_after_the_start_releases_the_loop_and_the_segments(job, tmp_path, monkeypatch):
    from ckptstore.engine import store as store_module

    def broken(*args, **kwargs):
        raise ckptstore.StorageError("cannot start the pipeline")

    before = _threads()
    monkeypatch.setattr(store_module, "Pipeline", broken)
    with pytest.raises(ckptstore.StorageError, match="cannot start the pipeline"):
        ckptstore.CheckpointStore(job, local=str(tmp_path / "local"), events=True)
    assert _threads() == before, "the loop thread and the event log's writes ended"
