"""SIGKILL at every commit point of a save (tests/crash_worker.py, a real process with a local
tier and a durable tier on the local S3 server): after a restart the newest step is the old or
the new one, never a torn one, every committed step of every tier loads bit for bit, and nothing
the dead save started is left behind (temporary files, incomplete steps, multipart uploads).

One trial of each stage runs by default; ``-m slow`` runs every point, the later hits of some
(the part manifest after the data file, the second S3 part), each with a raw and a zstd durable tier.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from conftest import s3_keys, s3_pending_uploads, wipe_ram

import ckptstore
from ckptstore import CheckpointStore

sys.path.insert(0, os.path.dirname(__file__))
from crash_worker import state  # noqa: E402 - the worker's own state, so both sides agree on the bytes

WORKER = Path(__file__).with_name("crash_worker.py")
LAST = 3  # steps 1 and 2 are committed everywhere before the armed save of step 3
OLD, NEW = LAST - 1, LAST
LOCAL3, DURABLE3 = f"local/step-{LAST:012d}", f"durable/step-{LAST:012d}"

# (point, where it fires, hits, the step a restarted process restores: RAM is committed before
# any other tier, so every point after the RAM commit leaves the new step restorable)
CASES = [
    ("ram.staged", str(LAST), 1, OLD),
    ("ram.before_commit", str(LAST), 1, OLD),
    ("ram.committed", str(LAST), 1, NEW),
    ("file.written", LOCAL3, 1, NEW),  # the data file, before fsync
    ("file.fsynced", LOCAL3, 1, NEW),
    ("file.renamed", LOCAL3, 1, NEW),
    ("tier.data_written", LOCAL3, 1, NEW),
    ("tier.part_written", LOCAL3, 1, NEW),
    ("tier.before_manifest", LOCAL3, 1, NEW),
    ("manifest.linked", LOCAL3, 1, NEW),
    ("tier.removing", "local/step-000000000001", 1, NEW),  # retention, mid-delete
    ("tier.data_written", DURABLE3, 1, NEW),
    ("tier.part_written", DURABLE3, 1, NEW),
    ("s3.part_uploaded", DURABLE3, 1, NEW),  # mid multipart upload: more parts in flight
    ("s3.before_complete", DURABLE3, 1, NEW),
    ("tier.before_manifest", DURABLE3, 1, NEW),
    ("tier.removing", "durable/step-000000000001", 1, NEW),
]
SLOW_CASES = [
    ("file.written", LOCAL3, 2, NEW),  # the part manifest
    ("file.fsynced", LOCAL3, 2, NEW),
    ("file.renamed", LOCAL3, 2, NEW),
    ("s3.part_uploaded", DURABLE3, 2, NEW),
]


def _ids(cases: list[tuple]) -> list[str]:
    return [f"{p}-{'durable' if 'durable' in w else 'local' if 'local' in w else 'ram'}-{h}" for p, w, h, _ in cases]


def _template() -> dict:
    return {"model": {"w": torch.zeros(1536, 2048), "b": torch.zeros(7)}, "extra": {"step": -1, "note": ""}}


def _same(got: dict, step: int) -> bool:
    want = state(step)
    return got["extra"] == want["extra"] and all(
        torch.equal(got["model"][k], want["model"][k]) for k in want["model"]
    )


def _trial(job: str, tmp_path: Path, s3: dict, point: str, where: str, hits: int, codec: str | None) -> dict:
    cfg = {
        "job": job,
        "local": str(tmp_path / "local"),
        "durable": f"s3://{s3['bucket']}/{s3['prefix']}/durable",
        "storage_options": {k: v for k, v in s3["storage_options"].items() if k != "skip_instance_cache"},
        "keep_local": 2,
        "keep_durable": 2,
        "codec": codec,
        "last": LAST,
        "point": point,
        "where": where,
        "hits": hits,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, CKPTSTORE_S3_PART_SIZE=str(5 << 20))
    proc = warm_python.run([str(WORKER), str(path)], env=env, timeout=240)
    assert proc.returncode == -9, f"{point} x{hits} at {where!r} was never reached (exit {proc.returncode}):\n" + \
        proc.stderr[-3000:]
    return cfg


def _check_after_restart(job: str, cfg: dict, s3: dict, expected: int) -> None:
    opts = s3["storage_options"]
    local, durable = cfg["local"], cfg["durable"]
    # A restarted process: opening the store sweeps what the dead save left behind. A restore also
    # promotes the step it loaded when the durable tier lacks it: the tiers are listed once the
    # store is closed, and that promotion with it.
    with CheckpointStore(job, local=local, durable=durable, storage_options=opts) as store:
        target = _template()
        assert store.restore(target) == expected
        assert _same(target, expected)
    local_steps, durable_steps = store.local.steps_sync(), store.durable.steps_sync()
    assert expected in durable_steps, "the restored step reached the durable tier"
    # Nothing committed was lost: step OLD reached every tier before the crash, and each tier
    # keeps its two newest steps, so its newest is OLD or NEW.
    assert max(local_steps) in (OLD, NEW) and max(durable_steps) in (OLD, NEW), (local_steps, durable_steps)
    # Every committed step of every tier loads bit for bit: none is torn.
    for root, steps in ((local, local_steps), (durable, durable_steps)):
        for step in steps:
            got = _template()
            ckptstore.load_sharded(got, f"{root}/step-{step:012d}", storage_options=opts if root == durable else None)
            assert _same(got, step), (root, step)
    # No debris: temporary files, step directories without a manifest, unfinished uploads.
    for top, _dirs, files in os.walk(local):
        assert not [f for f in files if "ckptstore-tmp" in f], (top, files)
    assert sorted(os.listdir(local)) == [f"step-{s:012d}" for s in local_steps]
    keys = s3_keys(s3, f"{s3['prefix']}/durable/")
    assert not [k for k in keys if "ckptstore-tmp" in k], keys
    assert {k.split("/")[2] for k in keys} == {f"step-{s:012d}" for s in durable_steps}, keys
    assert s3_pending_uploads(s3, f"{s3['prefix']}/") == []
    # Each lower tier on its own restores its newest step.
    wipe_ram(job)
    with CheckpointStore(job, local=local, durable=durable, storage_options=opts) as store:
        target = _template()
        assert store.restore(target) == max(local_steps + durable_steps) and _same(target, max(local_steps + durable_steps))
    wipe_ram(job)
    with CheckpointStore(job, durable=durable, storage_options=opts) as store:
        target = _template()
        assert store.restore(target) == max(durable_steps) and _same(target, max(durable_steps))


# The default run: one trial per stage of the commit (RAM, local file, local manifest, retention,
# multipart upload, durable manifest); -m slow runs every point.
DEFAULT = [c for c in CASES if (c[0], "durable" in c[1]) in {
    ("ram.before_commit", False), ("ram.committed", False), ("file.fsynced", False), ("manifest.linked", False),
    ("tier.removing", False), ("s3.part_uploaded", True), ("tier.before_manifest", True)}]


@pytest.mark.parametrize("point,where,hits,expected", DEFAULT, ids=_ids(DEFAULT))
def test_sigkill_at_commit_points(job, tmp_path, s3, point, where, hits, expected):
    cfg = _trial(job, tmp_path, s3, point, where, hits, codec=None)
    _check_after_restart(job, cfg, s3, expected)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "zstd"])
@pytest.mark.parametrize("point,where,hits,expected", CASES + SLOW_CASES, ids=_ids(CASES + SLOW_CASES))
def test_sigkill_at_every_commit_point_many(job, tmp_path, s3, point, where, hits, expected, codec):
    cfg = _trial(job, tmp_path, s3, point, where, hits, codec=codec)
    _check_after_restart(job, cfg, s3, expected)


def test_incomplete_steps_never_count_as_kept_and_never_become_the_latest(job, tmp_path, s3):
    """What a crashed save leaves (a step directory with data but no manifest, newer than every
    committed step) is not a step: it is not listed, not restored, not counted by retention,
    and the next store sweeps it."""
    local = tmp_path / "local"
    with CheckpointStore(job, local=str(local), keep_local=2) as store:
        for step in (1, 2):
            store.save(step, state(step)).wait("local")
    torn = local / "step-000000000009"
    (torn / "data").mkdir(parents=True)
    (torn / "data" / "rank-00000.bin").write_bytes(b"\0" * 4096)
    (local / "step-000000000002" / ".manifest.json.ckptstore-tmp-1-deadbeef").write_bytes(b"{")
    wipe_ram(job)
    with CheckpointStore(job, local=str(local), keep_local=2) as store:
        assert not torn.exists()  # swept at start-up
        assert not (local / "step-000000000002" / ".manifest.json.ckptstore-tmp-1-deadbeef").exists()
        target = _template()
        assert store.restore(target) == 2 and _same(target, 2)
        torn.mkdir()  # a save that dies now, while this store runs: retention must not count it
        store.save(3, state(3)).wait("local")
        store._drain()
        assert store.local.steps_sync() == [2, 3]
        assert sorted(p.name for p in local.iterdir()) == ["step-000000000002", "step-000000000003",
                                                           "step-000000000009"]
