"""Options that decide which collectives a save runs must be the same on every rank: a store whose
ranks differ refuses at construction on every rank alike, naming the options and the ranks,
instead of each rank waiting in another collective until the group's timeout."""

from __future__ import annotations

import json

import dist_workers
from conftest import wipe_ram


def test_ranks_that_pass_different_options_are_refused_on_every_rank(tmp_path, job):
    out = tmp_path / "out"
    out.mkdir()
    try:
        dist_workers.spawn(3, "options_workers:mismatched_options_job", tmp_path, name=job, root=str(tmp_path),
                           out=str(out))
    finally:
        wipe_ram(job)
    got = [json.loads((out / f"r{r}.json").read_text()) for r in range(3)]
    assert got[0]["raised"] == got[1]["raised"] == got[2]["raised"], got
    message = got[0]["raised"]
    assert message.startswith("CheckpointStore options differ between the ranks of its process group: "), message
    assert "local_every is 1 on ranks 0, 1 but 2 on rank 2" in message, message
    assert "sdc is 'off' on ranks 0, 1 but 'warn' on rank 2" in message, message
    assert "durable_every" not in message and "peer_every" not in message, message  # only what differs
    assert all(g["segments"] == [] for g in got), got  # the refused stores left no RAM segment behind
