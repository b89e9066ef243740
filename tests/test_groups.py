"""A store's gloo groups connect the ranks a collective or a read touches, not every pair: at
4,096 ranks five full meshes were 20,475 connections per rank before the first save."""

from __future__ import annotations

import os

import dist_workers

from ckptstore.collective import LAZY_GLOO, lazy_gloo

WORLD = 6
GROUPS = 5  # trainer, fast, durable, peer, transfer


def test_a_store_holds_far_fewer_connections_than_five_full_meshes(tmp_path, job, ram_root):
    out = tmp_path / "out"
    out.mkdir()
    os.makedirs(ram_root)
    dist_workers.spawn(WORLD, "collective_workers:store_connections_job", tmp_path, name=job,
                       root=str(tmp_path), ram_dir=ram_root, out=str(out))
    added = []
    for rank in range(WORLD):
        before, after, leaked = map(int, (out / f"sockets-{rank}").read_text().split())
        assert leaked == 0, f"rank {rank}: {LAZY_GLOO} stayed set in the trainer's environment"
        added.append(after - before)
    # Five full meshes are 5 x 5 = 25 connections per rank at six ranks; a ring's collectives touch
    # two neighbours a group, and the restore read nothing across nodes.
    full_mesh = GROUPS * (WORLD - 1)
    assert max(added) <= full_mesh - 8, (added, full_mesh)


def test_lazy_connecting_leaves_a_value_the_caller_set_alone(monkeypatch):
    monkeypatch.delenv(LAZY_GLOO, raising=False)
    with lazy_gloo():
        assert os.environ[LAZY_GLOO] == "1"
    assert LAZY_GLOO not in os.environ
    monkeypatch.setenv(LAZY_GLOO, "0")  # a caller who wants full meshes keeps them
    with lazy_gloo():
        assert os.environ[LAZY_GLOO] == "0"
    assert os.environ[LAZY_GLOO] == "0"
