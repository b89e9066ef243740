"""Resharded loads read each stored byte once across the job (checkpoint/coop.py): real gloo
processes load rows saved by every rank into columns, replicated tensors, an uneven cut of rows and
a 2-D mesh, bitwise equal to what was saved, with the bytes read from storage across all ranks
within 1.05x the checkpoint and each rank's rounds within ``buffer_bytes``; a chunk damaged on disk
fails every rank that needed it with CorruptCheckpointError although one rank alone read it, and a
store's restore into another layout falls back from the damaged local copy to the durable one."""

from __future__ import annotations

import pytest
from dist_workers import spawn


def test_coop_reads_at_4_ranks_layouts_damage_and_restore(tmp_path):
    spawn(4, "coop_workers:all_job", tmp_path, tmp=str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_coop_reads_at_other_world_sizes(tmp_path, world):
    # At 3 ranks the rows of 6000 split 2000 apiece and load as 3000 + 3000: uneven, and the middle
    # slab is needed by two ranks.
    spawn(world, "coop_workers:resharded_job", tmp_path, url=str(tmp_path / "ckpt"), dtensors=True)
