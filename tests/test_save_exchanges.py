"""Issue 19: what a rank receives through the store's collectives must not grow with the number
of ranks: per steady save (rank 0, the durable manifest's coordinator, excepted), at the promotion
of a restored step and at close. Real processes over gloo at two and four ranks, each rank a node
of its own (a local directory each, one peer replica), every second save promoted."""

from __future__ import annotations

import json

import dist_workers
import pytest
from conftest import wipe_ram


def _run(tmp_path_factory, kind: str, job: str, prefix: str):
    """Run ``save_exchange_workers:<job>`` at two and four ranks; each rank's JSON, by world size."""
    root = tmp_path_factory.mktemp(kind)
    out = root / "out"
    out.mkdir()
    for world in (2, 4):
        name = f"test-{kind}-{world}-{root.name}"
        try:
            dist_workers.spawn(world, f"save_exchange_workers:{job}", root, name=name, root=str(root), out=str(out))
        finally:
            wipe_ram(name)
    return root, {world: [json.loads((out / f"{prefix}w{world}-r{r}.json").read_text()) for r in range(world)]
                  for world in (2, 4)}


@pytest.fixture(scope="module")
def received(tmp_path_factory):
    return _run(tmp_path_factory, "save-exchanges", "exchanges_job", "")[1]


def _seen(received, phase: str, role: str, what: str, ranks: slice = slice(None)) -> set[float]:
    return {g[phase].get(role, {}).get(what, 0) for world in (2, 4) for g in received[world][ranks]}


def test_a_steady_save_receives_the_same_bytes_on_every_rank_but_the_coordinator_at_two_and_four(received):
    for role in ("trainer", "fast", "peer", "durable"):
        seen = _seen(received, "steady", role, "bytes", slice(1, None))
        assert len(seen) == 1 and seen.pop() > 0, (role, received)
    # Rank 0 writes the durable manifest of the promoted step: the parts it receives are that manifest.
    assert received[4][0]["steady"]["durable"]["bytes"] > received[2][0]["steady"]["durable"]["bytes"]


def test_a_steady_save_issues_one_vote_and_three_fast_lane_collectives_at_any_size(received):
    """Each ring all-reduce is 2 x (ranks - 1) message steps at any size: their number per save is
    the latency a steady save pays at thousands of ranks. A job whose ranks each write a local
    directory of their own commits the local tier with its write agreement alone."""
    assert _seen(received, "steady", "trainer", "calls") == {1}, received
    assert _seen(received, "steady", "fast", "calls") == {3}, received  # staging, RAM commit, local write
    assert _seen(received, "steady", "peer", "calls") == {2}, received  # replicas written, committed
    # Every second save promoted: written and committed, two flags per promotion (the coordinator
    # also receives the part summaries).
    assert _seen(received, "steady", "durable", "calls", slice(1, None)) == {1}, received


def test_a_restored_step_is_promoted_after_one_all_reduced_flag_at_any_size(received):
    seen = _seen(received, "promote", "trainer", "bytes")
    assert len(seen) == 1 and seen.pop() > 0, received  # the job checked that step 3 landed and restores bitwise
    assert _seen(received, "promote", "trainer", "calls") == {1}, received


def test_close_agrees_on_the_last_promotion_with_one_all_reduced_flag_at_any_size(received):
    seen = _seen(received, "close", "trainer", "bytes")
    assert len(seen) == 1 and seen.pop() > 0, received
    assert _seen(received, "close", "trainer", "calls") == {1}, received


# ---------------------------------------------------------------------- with the replica check on


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    return _run(tmp_path_factory, "save-exchanges-sdc", "replica_check_job", "sdc-")


def _sdc(root, world: int, step: int) -> dict:
    return json.loads((root / f"sdc-local-{world}" / f"step-{step:012d}" / "manifest.json").read_text())["meta"]["sdc"]


def test_the_replica_check_costs_a_rank_the_same_bytes_at_two_and_four_ranks(checked):
    """Round one swaps a digest per replica group with the group's neighbours, then agrees on one
    flag: it used to gather every rank's part on every rank, twice per save."""
    _root, got = checked
    # Staging, the swap and its flag, the RAM commit, the local write and the single-node local commit.
    assert {g["fast"]["calls"] for world in (2, 4) for g in got[world]} == {6}, got
    # The swap: 16 bytes per replica group from its previous rank. At four ranks two groups, the
    # plain tensors' ring over every rank and the DTensor's pair; at two ranks the pair is every rank.
    assert [{g["swap"]["bytes"] for g in got[world]} for world in (2, 4)] == [{16}, {32}], got
    # Everything else (the flags): the same at two and four ranks.
    assert len({g["fast"]["bytes"] - g["swap"]["bytes"] for world in (2, 4) for g in got[world]}) == 1, got


def test_the_replica_check_names_the_changed_replica_and_its_rank_across_structures(checked):
    """Every rank holds a plain tensor of its own, so each has a structure of its own: the plain
    tensors they all hold are still compared over every rank."""
    root, _got = checked
    for world in (2, 4):
        for step in (1, 2, 3, 4):  # every replica alike: nothing named
            assert _sdc(root, world, step) == {"policy": "warn", "mismatches": []}, (world, step)
        last = world - 1
        (plain,) = _sdc(root, world, 5)["mismatches"]
        assert plain["key"] == "w3", (world, plain)
        # Two replicas that differ are a tie: both are suspects.
        assert plain["suspects"] == ([last] if world > 2 else [0, 1]), plain
        (box,) = _sdc(root, world, 6)["mismatches"]
        assert box["key"] == "h" and box["offsets"] == [0 if world == 2 else 4, 0], (world, box)
        assert box["suspects"] == ([last - 2, last] if world > 2 else [0, 1]), box
        # At four ranks each holds two boxes of the strided DTensor (rows 2-3 and 6-7 on the last):
        # the second is the one named, with the pair that holds it.
        (strided,) = _sdc(root, world, 7)["mismatches"]
        assert (strided["key"], strided["offsets"], strided["sizes"]) == (
            ("x", [0, 0], [8, 3]) if world == 2 else ("x", [6, 0], [2, 3])), (world, strided)
        assert strided["suspects"] == ([last - 2, last] if world > 2 else [0, 1]), strided


@pytest.fixture(scope="module")
def reused(tmp_path_factory):
    return _run(tmp_path_factory, "save-exchanges-sdc-reuse", "replica_check_reuse_job", "reuse-")


def test_the_replica_check_keeps_a_structures_plan_and_still_finds_every_kind_of_replica(reused):
    """With the check on, a save of an unchanged structure stages into the last save's plan (it
    used to plan afresh at every save: per-tensor work at each one); the replicas hashed in place,
    those staged only to be compared and a DTensor's replicated box are still compared at every
    save. A per-rank value's new length moves the slot's tail, the check's entries behind it (step
    4), until it outgrows the room kept for it (step 6: planned afresh). The job restores steps 4
    and 7 bitwise."""
    root, got = reused
    for world in (2, 4):
        assert {tuple(g["reused"]) for g in got[world]} == {(False, True, True, True, True, False, True)}, got
        sdc = {step: json.loads((root / f"reuse-local-{world}" / f"step-{step:012d}" / "manifest.json").read_text())
               ["meta"]["sdc"]["mismatches"] for step in range(1, 8)}
        assert {step: [m["key"] for m in found] for step, found in sdc.items()} == {
            1: [], 2: [], 3: ["t"], 4: [], 5: ["w3"], 6: ["h"], 7: []}, (world, sdc)


def test_a_step_still_being_compared_keeps_its_replica_groups_when_the_next_save_plans_again(tmp_path):
    """A reused plan's replica groups belong to each save that reuses them: a save that plans again
    after the vote (another rank dropped a key) used to rewrite them in place while the previous step
    was still being compared, whose round one then swapped other messages than its neighbours'."""
    out = tmp_path / "out"
    out.mkdir()
    name = f"test-replan-{tmp_path.name}"
    try:
        dist_workers.spawn(3, "save_exchange_workers:replica_check_replan_job", tmp_path, name=name,
                           root=str(tmp_path), out=str(out))
    finally:
        wipe_ram(name)
    got = [json.loads((out / f"replan-r{r}.json").read_text()) for r in range(3)]
    for r in (0, 1):
        assert got[r]["seen"]["2"] == {"x": [0, 1, 2], "y": [0, 1, 2]}, got[r]
        assert got[r]["seen"]["3"] == {"x": [0, 1], "y": [0, 1, 2]}, got[r]
    assert all(g["sdc"][s] == [] for g in got for s in ("1", "2", "3", "4")), got
