"""Damaged copies, one class at a time: a byte flipped, a file truncated, a file deleted, in the
RAM tier (/dev/shm), the local tier and the durable tier (the local S3 server), for a step's data
and for its manifests. Each is detected, the next copy is used (bit for bit), an older sound step
when no copy of the newest is left (with a warning), and a CorruptCheckpointError when nothing
sound is left: never wrong data, never a silent fresh start. (Peer replicas: see
tests/test_sharded_dist.py, a corrupt replica and a lost node.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import s3_object_bytes, wipe_ram

import ckptstore
from ckptstore import CheckpointStore

TIERS = ("ram", "local", "durable")
KINDS = ("flip", "truncate", "delete")
WHAT = ("data", "manifest", "part")


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(9, generator=g)}, "step": step}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(9)}, "step": -1}


def _same(got: dict, step: int) -> bool:
    want = _state(step)
    return got["step"] == step and all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])


class Copies:
    """Two steps saved to every tier of one job, and a way to damage any file of any copy."""

    def __init__(self, job: str, tmp_path: Path, s3: dict) -> None:
        self.job, self.s3 = job, s3
        self.local = str(tmp_path / "local")
        self.prefix = f"{s3['prefix']}/{job}/durable"  # parametrized tests share s3['prefix']
        self.durable = f"s3://{s3['bucket']}/{self.prefix}"
        store = self.store()
        for step in (1, 2):
            handle = store.save(step, _state(step))
            handle.wait("local")
            handle.wait("durable")
        store.close(keep_ram=True)  # a restart on this node finds a copy in every tier, RAM too

    def store(self, **kw) -> CheckpointStore:
        return CheckpointStore(self.job, local=self.local, durable=self.durable, durable_every=1,
                               storage_options=self.s3["storage_options"], **kw)

    def _ram_files(self, step: int) -> dict[str, str]:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptstore-{self.job}-r00000-s") and name.endswith(".json"):
                path = os.path.join("/dev/shm", name)
                with open(path) as fh:
                    if json.load(fh)["step"] == step:
                        return {"manifest": path, "data": path[:-5] + ".bin"}
        raise AssertionError(f"no RAM copy of step {step}")

    def damage(self, tier: str, what: str, kind: str, step: int) -> str:
        """Damage one file of ``step``'s copy in ``tier``; returns where (for the messages)."""
        rel = {"data": "data/rank-00000.bin", "manifest": "manifest.json", "part": "parts/rank-00000.json",
               "index": "index.json"}[what]
        if tier == "durable":
            if what == "data":
                # On an object store a data object is named for its writer: its part file names it.
                doc = json.loads(s3_object_bytes(self.s3, f"{self.prefix}/step-{step:012d}/parts/rank-00000.json"))
                rel = next(c["file"] for chunks in doc["chunks"].values() for c in chunks)
            key = f"{self.prefix}/step-{step:012d}/{rel}"
            client, bucket = self.s3["client"], self.s3["bucket"]
            if kind == "delete":
                client.delete_object(Bucket=bucket, Key=key)
            else:
                client.put_object(Bucket=bucket, Key=key, Body=_damaged(s3_object_bytes(self.s3, key), kind))
            return key
        if tier == "ram":
            path = self._ram_files(step)["manifest" if what in ("manifest", "part") else "data"]
        else:
            path = os.path.join(self.local, f"step-{step:012d}", rel)
        if kind == "delete":
            os.unlink(path)
        else:
            with open(path, "rb") as fh:
                raw = fh.read()
            with open(path, "r+b") as fh:  # in place, as a disk error would: same inode, same segment
                fh.truncate(0)
                fh.write(_damaged(raw, kind))
        return path


def _damaged(raw: bytes, kind: str) -> bytes:
    if kind == "truncate":
        return raw[: len(raw) // 2]
    out = bytearray(raw)
    out[len(out) // 2] ^= 0x10
    return bytes(out)


def _restore(copies: Copies, caplog, **kw) -> tuple[int | None, dict, str]:
    caplog.clear()
    target = _empty()
    store = copies.store(**kw)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptstore"):
            step = store.restore(target)
    finally:
        store.close(keep_ram=True)  # the test's next restore finds the RAM copies as they were
    return step, target, caplog.text


@pytest.fixture
def copies(job, tmp_path, s3):
    return Copies(job, tmp_path, s3)


# The RAM tier keeps a step's manifest and part table in one JSON document: "part" is "manifest" there.
SINGLE = [(t, w, k) for t in TIERS for w in WHAT for k in KINDS if not (t == "ram" and w == "part")]
# A durable manifest or part file carries a checksum: truncating it is caught as a flipped byte is
# (flip and delete stay in the default run; a truncated data file, a short read, does too).
_SLOW = {("durable", "manifest", "truncate"), ("durable", "part", "truncate")}


@pytest.mark.parametrize("tier,what,kind", [pytest.param(*c, marks=pytest.mark.slow) if c in _SLOW else c for c in SINGLE],
                         ids=["-".join(c) for c in SINGLE])
def test_one_damaged_copy_is_detected_and_the_next_copy_used(copies, job, caplog, tier, what, kind):
    """The damaged copy is made the nearest one (the tiers above it are emptied), so the restore
    has to read it: RAM damaged -> local used; local damaged, RAM gone -> durable used; durable
    data damaged, RAM and local gone -> no copy of step 2 is left, the older step 1 is restored."""
    where = copies.damage(tier, what, kind, 2)
    if tier in ("local", "durable"):
        wipe_ram(job)
    if tier == "durable":
        shutil.rmtree(copies.local)
    step, target, log = _restore(copies, caplog)
    # On a node, part files are the writers' records (sizes, hosts, timings): the manifest carries
    # all a restore reads, so damage to a part file costs nothing. On the durable tier the manifest
    # (format 2.0) names the part files, which hold the chunk table: damage to any of the three is
    # damage to the step's only durable copy, and a manifest that is gone means the step was never
    # committed.
    durable_lost = tier == "durable"
    expected = 1 if durable_lost else 2
    assert step == expected and _same(target, expected)
    if (what == "part" and tier != "durable") or (kind == "delete" and (what == "manifest" or tier == "local")):
        # A step without a manifest was never committed, and a file that is gone is no copy:
        # nothing was read that needs reporting (the next copy simply serves).
        return
    # The damaged copy was read, named, and passed over.
    assert os.path.basename(where) in log or where in log, log
    if tier == "durable":
        assert "step 2 cannot be restored" in log and "trying an older step" in log, log


@pytest.mark.parametrize("kind", KINDS)
def test_every_copy_of_the_newest_step_damaged_falls_back_to_the_older_step_with_a_warning(copies, caplog, kind):
    for tier in TIERS:
        copies.damage(tier, "data", kind, 2)
    step, target, log = _restore(copies, caplog)
    assert step == 1 and _same(target, 1)
    assert "step 2 cannot be restored" in log and "trying an older step" in log, log


@pytest.mark.parametrize("kind", ("flip", "truncate"))
def test_nothing_sound_left_is_an_error_never_a_fresh_start(copies, caplog, kind):
    for step in (1, 2):
        for tier in TIERS:
            copies.damage(tier, "data", kind, step)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=r"no sound copy of any checkpoint of this job") as err:
        _restore(copies, caplog)
    # The error lists what was tried, step by step.
    assert "step 2" in str(err.value) and "step 1" in str(err.value)


def test_a_damaged_manifest_in_every_tier_is_an_error_not_wrong_data(copies, caplog):
    for step in (1, 2):
        for tier in TIERS:
            copies.damage(tier, "manifest", "flip", step)
    with pytest.raises(ckptstore.CorruptCheckpointError, match=r"no sound copy of any checkpoint"):
        _restore(copies, caplog)
    assert "does not match its own checksum" in caplog.text  # each damaged copy was named



def test_a_failed_read_returns_only_after_every_other_read_has_stopped():
    """The fallback above reloads into the tensors a failed attempt was filling: a read still
    running after the failure would overwrite them later (it did: the restored step 1 came back
    with step 2's bias about one run in four). The pool's own map returns while reads still run."""
    import threading
    import time

    from ckptstore.checkpoint.single_file import map_all

    landed: list[int] = []
    started = threading.Event()

    def read(i: int) -> int:
        if i == 0:
            started.wait(5)
            raise ckptstore.CorruptCheckpointError("damaged")
        started.set()
        time.sleep(0.3)
        landed.append(i)
        return i

    with pytest.raises(ckptstore.CorruptCheckpointError):
        list(map_all(read, [0, 1]))
    assert landed == [1], "map_all returned while a read was still running"
