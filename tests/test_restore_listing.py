"""What a restore reads of the RAM-tier documents of its node (issue 19): every rank of a node lists
every document of the node (steps, slots, sizes, parts), and parsing them whole made a restore's
cost grow with the node's ranks times their tensors. A listing reads each document's head; a rank
parses its own document's part alone; another rank's part is read only when used. Counted in bytes
handed to the JSON parser, not in time. Real /dev/shm segments and documents throughout."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from conftest import wipe_ram

from ckptstore import CheckpointStore
from ckptstore._aio import run_sync
from ckptstore.errors import CorruptCheckpointError
from ckptstore.tiers import ram
from ckptstore.tiers.ram import RamTier, node_extra

SHM = "/dev/shm"
TENSORS = 1500


@pytest.fixture
def parsed(monkeypatch) -> list[int]:
    """Bytes (characters) of JSON text parsed in this process since the fixture began, as one count."""
    count = [0]
    real = json.loads

    def counted(text: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += len(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counted)
    return count


def _forget_parsed_documents() -> None:
    """What a restarted process knows of the documents: nothing."""
    ram._parsed_docs.clear()
    ram._checked_parts.clear()


def _items(rank: int, step: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layers.{i}.w", torch.full((4,), float(rank * 1000 + step * 10 + i % 7))) for i in range(TENSORS)]


def _node(job: str, ranks: int, steps: int) -> dict[int, dict[int, dict[str, Any]]]:
    """``ranks`` ranks of one node, each committing ``steps`` steps into its two slots, as a store's
    fast lane does (each document holds its rank's part, the step's meta and the header); returns
    each rank's committed chunk tables by step."""
    tables: dict[int, dict[int, dict[str, Any]]] = {}
    for rank in range(ranks):
        tier = RamTier(job, rank, ram_dir=SHM, slots=2)
        try:
            for step in range(1, steps + 1):
                staged = tier.stage(step, _items(rank, step))
                tier.checksums(staged)
                snap = tier.snapshot(staged, ranks, {})
                part = {"rank": rank, "chunks": snap.chunks, "step": step}
                meta = {"step": step, "job": job, "world_size": ranks, "save_id": f"{step:016x}"}
                header = {"tree": {}, "tensors": {}, "layouts": {}}
                run_sync(tier.commit(step, save_id=f"{step:016x}", own=node_extra(part, meta, header)))
                tables.setdefault(rank, {})[step] = json.loads(json.dumps(snap.chunks))
        finally:
            tier.close()
    return tables


def _doc_path(job: str, rank: int, step: int) -> str:
    for slot in (0, 1):
        path = os.path.join(SHM, f"ckptstore-{job}-r{rank:05d}-s{slot}.json")
        with open(path, "rb") as fh:
            if json.loads(fh.read())["step"] == step:
                return path
    raise AssertionError(f"no document of rank {rank} at step {step}")


def _doc_size(job: str, rank: int, step: int) -> int:
    return os.path.getsize(_doc_path(job, rank, step))


def _restart_listing(job: str, rank: int, step: int, parsed: list[int]) -> tuple[int, Any]:
    """What a restarted rank lists of its node before its load: its newest slot, the node's steps,
    and what the node holds of ``step`` with its own part; the bytes parsed doing it."""
    _forget_parsed_documents()
    before = parsed[0]
    tier = RamTier(job, rank, ram_dir=SHM, slots=2)
    try:
        assert step in tier.node_steps()
        held = tier.holdings(step)
        own = next(p for p in held.parts if p.rank == rank)
        chunks = own.part["chunks"]
    finally:
        tier.close()
    return parsed[0] - before, (held, chunks)


@pytest.mark.parametrize("ranks", [2, 8])
def test_a_restarted_rank_parses_its_own_document_not_the_nodes(job, parsed, ranks):
    """At 2 and at 8 ranks on the node, each with two committed steps of 1,500 tensors: what one
    restarted rank parses to list the node and take its own part is its own document's size at
    most, plus each document's head (before: every document of the node, whole: 16 at 8 ranks).
    Every part it lists, its own and (read on use) another rank's, is the one committed."""
    tables = _node(job, ranks, steps=3)  # slots hold steps 2 and 3
    own_size = _doc_size(job, 0, 3)
    heads = 2 * ranks * 2048
    cost, (held, chunks) = _restart_listing(job, 0, 3, parsed)
    assert cost <= own_size + heads, (cost, own_size, ranks)
    assert chunks == tables[0][3]
    assert sorted(p.rank for p in held.parts) == list(range(ranks))
    # Another rank's part is read when a restore needs it (a node that lost its own copy, a
    # resharded load), and it is the one that rank committed.
    other = next(p for p in held.parts if p.rank == ranks - 1)
    assert other.part["chunks"] == tables[ranks - 1][3]
    assert other.meta["world_size"] == ranks


def test_the_listing_costs_the_same_as_older_steps_and_ranks_are_added(job, parsed):
    """The bytes one rank parses to restart grow by no more than a head per document when the node
    has four times the ranks, and not at all with the number of older steps its slots held."""
    _node(job, 2, steps=2)
    small, _ = _restart_listing(job, 0, 2, parsed)
    ram._parsed_docs.clear()
    _node(job + "x", 8, steps=6)
    try:
        large, _ = _restart_listing(job + "x", 0, 6, parsed)
    finally:
        wipe_ram(job + "x")
    assert large - small <= 6 * 2 * 2048, (small, large)


def test_a_damaged_or_cut_document_of_another_rank_is_never_taken_as_sound(job, parsed):
    """Rank 1's document of step 3, cut short: rank 0's listing never counts it as committed (a
    file of another length than its head says is parsed whole, and found unreadable). Damaged at
    the same length: it is listed by its head, and its part, read on use, raises the checksum
    error instead of handing out the damaged bytes. Rank 0 reads its own part either way, having
    parsed no more than its own document."""
    _node(job, 3, steps=3)
    path = _doc_path(job, 1, 3)
    with open(path, "rb") as fh:
        raw = fh.read()
    i = raw.index(b'"checksum":"xxh3_64:', len(raw) // 2) + len(b'"checksum":"xxh3_64:')
    flipped = raw[:i] + (b"0" if raw[i : i + 1] != b"0" else b"1") + raw[i + 1 :]
    with open(path, "wb") as fh:
        fh.write(flipped)
    own_size = _doc_size(job, 0, 3)
    cost, (held, _chunks) = _restart_listing(job, 0, 3, parsed)
    assert cost <= own_size + 3 * 2 * 2048, cost
    other = next(p for p in held.parts if p.rank == 1)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        other.part  # noqa: B018 - reading it is the check

    with open(path, "wb") as fh:
        fh.write(raw[: len(raw) - 100])
    _forget_parsed_documents()
    tier = RamTier(job, 0, ram_dir=SHM, slots=2)
    try:
        held = tier.holdings(3)
        assert sorted(p.rank for p in held.parts) == [0, 2]
        assert not any(h.where == path[:-5] + ".bin" for h in held.files)
    finally:
        tier.close()


def test_a_store_restart_reads_its_own_document_once(job, tmp_path, parsed):
    """A store restarted on a node whose RAM tier holds its newest step, with a local tier that
    holds it and four older ones: its start and its restore parse the rank's own RAM document (its
    part) and no more than that again in heads and small files, never the local tier's manifest
    (which ranks after the RAM copy) nor the older slot's document. The restore is bitwise."""
    states = {s: {f"w{i}": torch.full((8,), float(s * 100 + i)) for i in range(TENSORS)} for s in range(1, 6)}
    with CheckpointStore(job, local=tmp_path / "local", keep_local=5) as store:
        for s, state in states.items():
            store.save(s, state).wait("local")
        store.close(keep_ram=True)
    own_size = _doc_size(job, 0, 5)
    local_manifest = os.path.getsize(tmp_path / "local" / "step-000000000005" / "manifest.json")
    _forget_parsed_documents()
    before = parsed[0]
    with CheckpointStore(job, local=tmp_path / "local", keep_local=5) as store:
        out = {k: torch.zeros_like(v) for k, v in states[5].items()}
        assert store.restore(out) == 5
        cost = parsed[0] - before
        store.close(keep_ram=False)
    for k, v in states[5].items():
        assert torch.equal(out[k], v), k
    assert cost <= own_size + 64 * 1024, (cost, own_size, local_manifest)
