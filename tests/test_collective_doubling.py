"""Group.max_int64's recursive doubling (the agreement flag at thousands of ranks) on real gloo
processes: the right maximum at worlds that are not powers of two, on a subgroup, between other
collectives on the same group; the ring below the threshold; a dead peer raises, nothing hangs."""

from __future__ import annotations

import pytest
from dist_workers import spawn

from ckptstore import collective

ELEMENT = 8
VECTOR = 5  # doubling_workers._vector's length


def doubling_received(world: int, rank: int) -> int:
    """Elements a rank receives in one flag by recursive doubling (the formula the docs state)."""
    p = 1 << (world.bit_length() - 1)
    if rank >= p:
        return VECTOR
    return VECTOR * ((p.bit_length() - 1) + (1 if rank + p < world else 0))


@pytest.mark.parametrize("world", [3, 5])
def test_doubling_gives_every_rank_the_maximum(world, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn(world, "doubling_workers:maxima", tmp_path, doubling_from=2, out_dir=str(out))
    for rank in range(world):
        lines = (out / f"received-{rank}").read_text().split("\n")
        sub_world, sub_rank = world - 1, rank - 1
        for line in lines:
            gi, _, got = map(int, line.split())
            if gi == 0:
                assert got == ELEMENT * doubling_received(world, rank), (rank, line)
            else:
                assert got == ELEMENT * doubling_received(sub_world, sub_rank), (rank, line)
        assert len(lines) == (4 if rank == 0 else 8)


def test_below_the_threshold_the_ring_all_reduce_is_used(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn(3, "doubling_workers:maxima", tmp_path, doubling_from=collective.DOUBLING_FROM, out_dir=str(out))
    for rank in range(3):
        for line in (out / f"received-{rank}").read_text().split("\n"):
            assert int(line.split()[2]) == 2 * VECTOR * ELEMENT, (rank, line)  # the ring's account


def test_a_dead_peer_fails_every_other_ranks_flag(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn(5, "doubling_workers:dead_peer", tmp_path, out_dir=str(out))
    raised = sorted(p.name for p in out.iterdir())
    assert raised == [f"raised-{r}" for r in range(4)]


def test_bench_allreduce_checks_both_ways_and_counts_steps(tmp_path):
    """The benchmark asserts both ways' results on every rank and writes the step counts it
    extrapolates with."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "allreduce.json"
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_allreduce.py"), "--worlds", "2", "3",
                    "--ops", "2", "--blocks", "2", "--out", str(out)], check=True, timeout=300, cwd=root,
                   env={**os.environ, "PYTHONPATH": root}, capture_output=True)
    doc = json.loads(out.read_text())
    assert [(c["world"], c["ring_steps"], c["doubling_steps"]) for c in doc["cells"]] == [(2, 2, 1), (3, 4, 3)]
    assert doc["fits"]["ring"]["at"]["4096"] / doc["fits"]["ring"]["per_step_s"] == pytest.approx(8190)
    assert doc["fits"]["doubling"]["at"]["4096"] / doc["fits"]["doubling"]["per_step_s"] == pytest.approx(12)


def test_neighbours_swap_on_a_subgroup_whose_ranks_are_not_the_global_ones(tmp_path):
    """What the replica check's round one rests on: global ranks mapped to a subgroup's, and a
    ring of point-to-point messages there (each member receives exactly its previous member's)."""
    out = tmp_path / "out"
    out.mkdir()
    spawn(4, "doubling_workers:swaps", tmp_path, out_dir=str(out))
    assert sorted(p.name for p in out.iterdir()) == ["swapped-1", "swapped-2", "swapped-3"]
