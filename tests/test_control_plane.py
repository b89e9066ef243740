"""The control plane of a save after the first of its structure, on real processes over gloo:
what each rank receives through the store's collectives per save must not grow with the number
of ranks, and a structure change on any one rank still makes every rank plan again."""

from __future__ import annotations

import json

import dist_workers
import pytest
from conftest import wipe_ram


@pytest.fixture(scope="module")
def traffic(tmp_path_factory):
    """Each rank's bytes received per steady save, by group, at two and four ranks (the job at two
    also checks the structure changes and the bitwise restores)."""
    root = tmp_path_factory.mktemp("control-plane")
    out = root / "traffic"
    out.mkdir()
    for world in (2, 4):
        name = f"test-control-plane-{world}-{root.name}"
        try:
            dist_workers.spawn(world, "store_control_plane_job", root, name=name, root=str(root), out=str(out),
                               changes=world == 2)
        finally:
            wipe_ram(name)
    return {world: [json.loads((out / f"w{world}-r{r}.json").read_text()) for r in range(world)] for world in (2, 4)}


def test_a_steady_save_vote_receives_the_same_bytes_at_two_and_four_ranks(traffic):
    vote = traffic[2][0]["trainer"]
    assert vote > 0
    # Every rank, at either size, received exactly what one all-reduce of the vote carries.
    assert {g["trainer"] for world in (2, 4) for g in traffic[world]} == {vote}, traffic


def test_a_structure_change_on_any_rank_replans_every_rank_and_saves_bitwise(traffic):
    assert sorted(traffic) == [2, 4]  # the job at two ranks asserted the plans and the restores on every rank


def test_a_steady_promotion_sends_the_parts_to_the_coordinator_alone(traffic):
    others = {g["durable"] for world in (2, 4) for g in traffic[world][1:]}
    assert len(others) == 1, traffic  # two all-reduced flags: written, committed
    others_bytes = others.pop()
    # Rank 0 writes the durable manifest: it receives every rank's part, and the only growth is its own.
    assert traffic[4][0]["durable"] > traffic[2][0]["durable"] > others_bytes, traffic


def test_a_steady_replication_agrees_by_flags_alone(traffic):
    """A replica is a byte copy of its source's slot, described by its source's part: every
    rank, at either size, receives the same few flags through the peer group, never another
    rank's part (the replicated bytes travel point to point, outside the counted collectives)."""
    peer = {g.get("peer") for world in (2, 4) for g in traffic[world]}
    assert len(peer) == 1 and peer.pop(), traffic


def test_a_steady_save_fast_lane_receives_the_same_bytes_at_two_and_four_ranks(traffic):
    """The RAM and local commits of a steady save: every rank, at either size, receives what a fixed
    number of all-reduced flags carry, never another rank's part."""
    fast = {g["fast"] for world in (2, 4) for g in traffic[world]}
    assert len(fast) == 1, traffic
