"""A rank's RAM document is encoded from a template kept per structure (tiers/ram.py, _Template):
the text each save writes must be the text encoding the document's objects gives, through changing
data and every kind of structural change, and what it writes must restore bitwise. Documents as
older stores wrote them still restore, and a damaged one is refused. Real /dev/shm segments."""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import assert_same
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptstore import CheckpointStore
from ckptstore._aio import run_sync
from ckptstore.errors import CorruptCheckpointError
from ckptstore.tiers.base import manifest_of_parts
from ckptstore.tiers.ram import RamTier, doc_part, extra_checksum, node_extra, read_doc, usable_doc, whole_manifest_doc

SHM = "/dev/shm"


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _doc_of(job: str, step: int) -> tuple[str, bytes, dict[str, Any]]:
    """Rank 0's committed RAM document of ``step``: its path, bytes and parsed content."""
    for path in glob.glob(os.path.join(SHM, f"ckptstore-{job}-r00000-s*.json")):
        with open(path, "rb") as fh:
            raw = fh.read()
        doc = json.loads(raw)
        if doc["step"] == step:
            return path, raw, doc
    raise AssertionError(f"no RAM document of step {step}")


@contextmanager
def _ram_only(local: str):
    """The local tier's directory out of the way, so a restore can only read the RAM documents."""
    hidden = local + ".hidden"
    os.rename(local, hidden)
    try:
        yield
    finally:
        os.rename(hidden, local)


def _zeros(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            out[key] = distribute_tensor(torch.zeros(value.shape, dtype=value.dtype), mesh, value.placements)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = value
    return out


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _states(mesh: Any) -> list[tuple[str, dict[str, Any]]]:
    """Saves in order: each either new values in the same structure, or one structural change."""
    g = torch.Generator().manual_seed(11)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def sharded(t: torch.Tensor, placement: Any = None) -> DTensor:
        return distribute_tensor(t, mesh, [placement or Shard(0)])

    def base() -> dict[str, Any]:
        # "big" is past the 4 MiB block size: it carries block checksums in the chunk table.
        return {"w": sharded(r(8, 4)), "b": r(5), "big": r((1 << 20) + 1), "k\u00e9y \"q\"": r(3), "n": 3,
                "empty": torch.empty(0, 2)}

    first = base()
    same = base()
    new_key = {**base(), "c": r(6)}
    new_dtype = {**new_key, "b": r(5, dtype=torch.float64)}
    new_shape = {**new_dtype, "w": sharded(r(16, 4))}
    new_placement = {**new_shape, "w": sharded(r(16, 4), Replicate())}
    again = {**new_placement, "b": r(5, dtype=torch.float64), "c": r(6)}
    return [("first", first), ("new values", same), ("new key", new_key), ("new dtype", new_dtype),
            ("new shape", new_shape), ("new placement", new_placement), ("new values again", again)]


def test_each_save_writes_the_full_encoding_through_structural_changes_and_restores(tmp_path, job, mesh):
    """Every save's document is byte for byte the compact JSON of its objects (the layout, the
    staged checksums, the part, meta and header the pipeline handed the commit), its extra checksum
    is the one over those objects, and a restore from RAM alone returns every step bitwise. The
    template is kept while the structure holds and made anew at each change."""
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        ram = store._pipeline.ram
        handed: dict[int, dict[str, Any]] = {}
        commit = ram.commit

        async def recording(step: int, manifest: Any = None, **kwargs: Any) -> None:
            # A copy of what the commit is handed, as it is then (the local tier adds its timings
            # to the part afterwards).
            staged = ram._by_step[step]
            handed[step] = json.loads(_compact({"layout": staged.layout.to_json(), "checksums": staged.sums,
                                                "extra": kwargs["own"]}))
            await commit(step, manifest, **kwargs)

        ram.commit = recording  # type: ignore[method-assign]
        templates = []
        for step, (what, state) in enumerate(_states(mesh), start=1):
            store.save(step, state).wait("local")
            path, raw, doc = _doc_of(job, step)
            assert raw == _compact({**doc, **handed[step]}), f"step {step} ({what}): the document is not the full encoding"
            assert doc["minor"] == 1 and doc["extra_checksum"] == extra_checksum(handed[step]["extra"]), what
            assert usable_doc(doc) and doc_part(doc, path) is not None, what
            assert [e["key"] for e in doc["layout"]] == list(doc["checksums"]) == list(doc["extra"]["part"]["chunks"])
            templates.append(ram._held_template)
            target = _zeros(state, mesh)
            with _ram_only(local):
                assert store.restore(target, step=step) == step, what
            assert_same(_plain(target), _plain(state), f"step {step} ({what}) restored from RAM")
    blocks = doc["extra"]["part"]["chunks"]["big"][0]["block_checksums"]
    assert len(blocks) == 2 and blocks == doc["checksums"]["big"]["block_checksums"]
    # Saves 2 and 7 kept the structure of the save before; every other save changed it.
    kept = [templates[i] is templates[i - 1] for i in range(1, len(templates))]
    assert kept == [True, False, False, False, False, True], kept


def test_the_tier_writes_the_full_encoding_with_reused_frozen_bytes(job):
    """The tier alone: block checksums, an empty entry, keys JSON escapes, and a frozen entry whose
    bytes the slot still held (its checksums carried over from the slot's last save)."""
    tier = RamTier(job, ram_dir=SHM, slots=1)
    frozen = torch.arange(1 << 15, dtype=torch.float32)  # 128 KiB: at least the 64 KiB skipping needs
    try:
        for step in (1, 2, 3):
            items = [("frozen", frozen), ("w\u00e9\"\\", torch.full((3, 2), float(step))), ("empty", torch.empty(0, 3)),
                     ("big", torch.full((1 << 18,), float(step)))]
            staged = tier.stage(step, items, may_skip=frozenset({"frozen"}))
            assert staged.reused == (() if step == 1 else ("frozen",))
            tier.checksums(staged, 1 << 18)
            snap = tier.snapshot(staged, 1, {})
            part = {"rank": 0, "chunks": snap.chunks, "step": step}
            meta = {"step": step, "job": job, "world_size": 1}
            own = node_extra(part, meta, {"tree": {}, "tensors": {}, "layouts": {}})
            run_sync(tier.commit(step, save_id="00ff", own=own))
            path = os.path.join(SHM, f"ckptstore-{job}-r00000-s0.json")
            with open(path, "rb") as fh:
                raw = fh.read()
            doc = json.loads(raw)
            assert raw == _compact({**doc, "layout": staged.layout.to_json(), "checksums": staged.sums, "extra": own})
            assert doc["extra"]["part"]["chunks"]["big"][0]["block_checksums"] == staged.sums["big"]["block_checksums"]
            assert doc["extra"]["part"]["chunks"]["empty"] == []
            got = tier.read(doc)
            for key, t in items:
                assert torch.equal(got[key], t), key
    finally:
        tier.close(unlink=True)


def test_a_state_without_tensors_commits_and_restores(tmp_path, job):
    """No entry at all in the slot: the document's tables are empty, and the state restores."""
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        for step in (1, 2):
            store.save(step, {"step": step, "note": "no tensors"}).wait("local")
            path, raw, doc = _doc_of(job, step)
            assert doc["layout"] == [] and doc["checksums"] == {} and doc["extra"]["part"]["chunks"] == {}
            assert raw == _compact(doc) and doc_part(doc, path) is not None
            target: dict[str, Any] = {"step": None, "note": None}
            with _ram_only(local):
                assert store.restore(target, step=step) == step
            assert target == {"step": step, "note": "no tensors"}


def _two_steps(tmp_path, job, mesh) -> tuple[str, list[dict[str, Any]]]:
    local = str(tmp_path / "local")
    states = [_states(mesh)[i][1] for i in (0, 1)]
    with CheckpointStore(job, local=local) as store:
        for step, state in enumerate(states, start=1):
            store.save(step, state).wait("local")
        store.close(keep_ram=True)
    return local, states


def _restore_from_ram(job: str, local: str, mesh: Any, like: dict[str, Any], step: int | None = None) -> tuple[int | None, dict[str, Any]]:
    target = _zeros(like, mesh)
    with _ram_only(local), CheckpointStore(job, local=local) as store:
        found = store.restore(target, step=step)
        store.close(keep_ram=True)
    return found, target


@pytest.mark.parametrize("older", ["minor 0: the whole manifest", "minor 1: encoded by another writer",
                                   "minor 1: compact, without a head"])
def test_documents_as_older_stores_wrote_them_still_restore(tmp_path, job, mesh, older):
    """A document of minor version 0 (the step's whole manifest, what stores wrote before minor 1),
    one of minor version 1 in another JSON layout (spaces, indentation: its extra checksum is over
    the compact encoding of the parsed member, not over the bytes of the file), and one as stores
    wrote it before documents had a head (compact, no ``head`` or ``meta`` member: what a job
    upgraded in place finds in /dev/shm) restore bitwise, parsed whole."""
    local, states = _two_steps(tmp_path, job, mesh)
    path, _raw, doc = _doc_of(job, 2)
    if older.startswith("minor 0"):
        doc = whole_manifest_doc(doc, manifest_of_parts([doc_part(doc, path)], path))
        assert "minor" not in doc and "manifest" in doc["extra"]
    with open(path, "w") as fh:
        if older.endswith("without a head"):
            fh.write(_compact({k: v for k, v in doc.items() if k not in ("head", "meta")}).decode())
        else:
            json.dump(doc, fh, indent=1)
    found, target = _restore_from_ram(job, local, mesh, states[1])
    assert found == 2
    assert_same(_plain(target), _plain(states[1]), f"step 2 from a document of {older}")


def test_a_damaged_document_is_refused_and_the_older_step_restores(tmp_path, job, mesh):
    """One chunk checksum changed in step 2's document (valid JSON, a plausible value): its extra
    checksum no longer matches, the part is refused, and the restore returns step 1 bitwise; a
    document cut short is refused too."""
    local, states = _two_steps(tmp_path, job, mesh)
    path, raw, doc = _doc_of(job, 2)
    digest = doc["extra"]["part"]["chunks"]["b"][0]["checksum"]
    forged = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    damaged = raw.replace(f'"checksum":"{digest}","block_size"'.encode(), f'"checksum":"{forged}","block_size"'.encode())
    assert damaged != raw
    with open(path, "wb") as fh:
        fh.write(damaged)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        doc_part(read_doc(path), path)
    found, target = _restore_from_ram(job, local, mesh, states[0])
    assert found == 1
    assert_same(_plain(target), _plain(states[0]), "step 1 after step 2's document was damaged")
    with open(path, "wb") as fh:
        fh.write(raw[: len(raw) // 2])
    found, target = _restore_from_ram(job, local, mesh, states[0])
    assert found == 1
    assert_same(_plain(target), _plain(states[0]), "step 1 after step 2's document was cut short")


def test_sources_copied_by_address_and_the_rest_stay_bitwise(tmp_path, job, mesh):
    """While the structure holds, the pipeline lets the RAM tier copy small contiguous CPU sources
    by address (Slot.copy_small). A state that mixes them with what must not go that way (a
    transposed view, a complex tensor, a parameter that requires grad, one past 64 KiB) restores
    bitwise at every save, its values changed in place in between; the complex and transposed
    ones keep the whole state on torch's copy, and without them the address copy is taken."""
    g = torch.Generator().manual_seed(5)
    mixed = {"small": torch.randn(3, 5, generator=g), "t": torch.randn(6, 4, generator=g).t(),
             "z": torch.randn(4, generator=g, dtype=torch.complex64),
             "p": torch.nn.Parameter(torch.randn(7, generator=g)), "large": torch.randn(1 << 15, generator=g)}
    plain = {k: v for k, v in mixed.items() if k not in ("t", "z")}
    local = str(tmp_path / "local")
    for state, by_address in ((mixed, False), (plain, True)):
        with CheckpointStore(job, local=local) as store:
            start = (store.last_step or 0) + 1
            for step in range(start, start + 3):
                with torch.no_grad():
                    for value in state.values():
                        value.add_(1)
                store.save(step, state).wait("local")
                assert store._pipeline._planned is not None
                assert store._pipeline._planned.plain is by_address
                target = {k: torch.zeros_like(v.detach()) for k, v in state.items()}
                with _ram_only(local):
                    assert store.restore(target, step=step) == step
                assert_same(target, {k: v.detach() for k, v in state.items()}, f"step {step}")
