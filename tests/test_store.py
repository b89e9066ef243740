"""CheckpointStore (single process, in progress): save returns after staging, the background loop
persists and promotes, restore finds the newest sound copy across RAM, local and durable."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from conftest import assert_same, wipe_ram

import ckptstore
from ckptstore import CheckpointStore
from ckptstore.checkpoint.sharded import Directory, read_manifest


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(600, 300, generator=g), "b": torch.randn(4, generator=g)}, "step": step}


def _empty() -> dict:
    return {"model": {"w": torch.zeros(600, 300), "b": torch.zeros(4)}, "step": -1}


def _same(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_save_wait_and_restore_from_each_tier(job, tmp_path):
    local, durable = str(tmp_path / "local"), f"memory://{job}/durable"
    with CheckpointStore(job, local=local, durable=durable, durable_every=2, keep_local=2) as store:
        for step in range(1, 6):
            handle = store.save(step, _state(step))
            handle.wait("local")
    # Retention runs after each local commit; close() has drained it.
    assert sorted(os.listdir(local)) == ["step-000000000004", "step-000000000005"]  # keep_local=2
    # close() promoted the last step although 5 is not a multiple of durable_every.
    store = CheckpointStore(job, local=local, durable=durable)
    assert store.durable.steps_sync() == [2, 4, 5]
    target = _empty()
    assert store.restore(target) == 5 and _same(target, _state(5))  # from RAM
    store.close()
    wipe_ram(job)
    store = CheckpointStore(job, local=local, durable=durable)
    target = _empty()
    assert store.restore(target) == 5 and _same(target, _state(5))  # from local
    store.close()
    wipe_ram(job)
    import shutil

    shutil.rmtree(local)
    store = CheckpointStore(job, local=local, durable=durable)
    target = _empty()
    assert store.restore(target) == 5 and _same(target, _state(5))  # from durable
    store.close()


def test_restore_without_any_checkpoint_returns_none(job, tmp_path):
    with CheckpointStore(job, local=str(tmp_path / "l")) as store:
        assert store.restore(_empty()) is None


def test_a_damaged_ram_copy_falls_back_to_local(job, tmp_path, caplog):
    local = str(tmp_path / "local")
    store = CheckpointStore(job, local=local)
    store.save(1, _state(1)).wait("local")
    store.close(keep_ram=True)  # a restart on this node: the RAM copy is read first
    seg = f"/dev/shm/ckptstore-{job}-r00000-s0.bin"
    with open(seg, "r+b") as fh:
        fh.write(b"\xff" * 64)
    with CheckpointStore(job, local=local) as store, caplog.at_level(logging.WARNING, logger="ckptstore"):
        target = _empty()
        assert store.restore(target) == 1 and _same(target, _state(1))
    assert "damaged" in caplog.text and f"the copy read was {seg}" in caplog.text


def test_no_sound_copy_is_an_error_not_a_fresh_start(job, tmp_path):
    local = str(tmp_path / "local")
    with CheckpointStore(job, local=local) as store:
        store.save(1, _state(1)).wait("local")
    wipe_ram(job)
    data = tmp_path / "local" / "step-000000000001" / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 1
    data.write_bytes(bytes(raw))
    with CheckpointStore(job, local=local) as store, pytest.raises(
        ckptstore.CorruptCheckpointError, match=r"no sound copy.*step 1: rank 0: checksum mismatch.*copy read was .*local/step-000000000001"
    ):
        store.restore(_empty())


def test_a_background_failure_surfaces_and_keeps_earlier_steps(job, tmp_path):
    local = tmp_path / "local"
    store = CheckpointStore(job, local=str(local))
    store.save(1, _state(1)).wait("local")
    (local / "step-000000000002").write_text("a file where the step directory must go")
    handle = store.save(2, _state(2))
    with pytest.raises(ckptstore.CheckpointError):
        handle.wait("local")
    with pytest.raises(ckptstore.CheckpointError, match=r"earlier background save \(step 2\) failed"):
        store.save(3, _state(3))
    store.close()
    wipe_ram(job)
    with CheckpointStore(job, local=str(local)) as again:
        target = _empty()
        assert again.restore(target) == 1 and _same(target, _state(1))


def test_skip_policy_counts_instead_of_growing_memory(job, tmp_path):
    store = CheckpointStore(job, local=str(tmp_path / "l"), ram_budget_bytes=1_000_000, policy="skip")
    gate = threading.Event()

    async def hold_the_loop():
        gate.wait()

    blocker = store._loop.submit(hold_the_loop())
    first = store.save(1, _state(1))
    second = store.save(2, _state(2))
    assert not first.skipped and second.skipped and store.skipped == 1
    gate.set()
    blocker.result()
    first.wait("local")
    store.close()


def test_steps_must_increase_and_tiers_are_named(job, tmp_path):
    with CheckpointStore(job, local=str(tmp_path / "l")) as store:
        handle = store.save(5, _state(5))
        with pytest.raises(ckptstore.InvalidArgumentError, match="not after the last saved step 5"):
            store.save(5, _state(5))
        with pytest.raises(ckptstore.InvalidArgumentError, match="tier must be one of"):
            handle.wait("nvme")
        handle.wait("local")


def test_promotion_to_s3_and_restore_from_it(job, s3):
    durable = f"s3://{s3['bucket']}/{s3['prefix']}/{job}"
    with CheckpointStore(job, durable=durable, durable_every=1, storage_options=s3["storage_options"]) as store:
        for step in (1, 2):
            store.save(step, _state(step)).wait("durable")
    wipe_ram(job)
    with CheckpointStore(job, durable=durable, storage_options=s3["storage_options"]) as store:
        target = _empty()
        assert store.restore(target) == 2 and _same(target, _state(2))


def test_incomplete_local_steps_are_swept_and_never_restored(job, tmp_path, caplog):
    local = tmp_path / "local"
    with CheckpointStore(job, local=str(local)) as store:
        store.save(1, _state(1)).wait("local")
    torn = local / "step-000000000002"
    (torn / "data").mkdir(parents=True)
    (torn / "data" / "rank-00000.bin").write_bytes(b"half a checkpoint")
    wipe_ram(job)
    with caplog.at_level(logging.WARNING, logger="ckptstore"), CheckpointStore(job, local=str(local)) as store:
        assert not torn.exists()
        target = _empty()
        assert store.restore(target) == 1 and _same(target, _state(1))
    assert "incomplete step" in caplog.text


def test_frozen_keys_skip_copies_and_the_refresh_catches_hidden_writes(job, tmp_path):
    frozen = torch.zeros(20_000)  # 80 KB: frozen tensors under 64 KiB are copied at every save
    state = {"base": frozen, "head": torch.zeros(3)}
    with CheckpointStore(job, local=str(tmp_path / "l"), ram_budget_bytes=200_000, frozen=lambda k: k == "base",
                         refresh_every=3) as store:
        first = store.save(1, state)  # save 1: everything copied
        first.wait("local")
        store.save(2, state).wait("local")  # save 2: "base" is unchanged and reused
        frozen.data.fill_(7.0)  # a write the version counter does not see
        store.save(3, state).wait("local")  # save 3: the sampled elements differ: "base" is copied again
        target = {"base": torch.zeros(20_000), "head": torch.zeros(3)}
        assert store.restore(target) == 3 and torch.equal(target["base"], torch.full((20_000,), 7.0))


def test_ram_budget_smaller_than_one_snapshot_is_refused(job, tmp_path):
    store = CheckpointStore(job, local=str(tmp_path / "l"), ram_budget_bytes=100_000)
    with pytest.raises(ckptstore.InvalidArgumentError, match=r"ram_budget_bytes=100000 is smaller than one snapshot"):
        store.save(1, _state(1))
    store.close()
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"ckptstore-{job}-")]
    assert not (tmp_path / "l").exists() or not os.listdir(tmp_path / "l")


def test_ram_budget_sets_the_number_of_slots(job, tmp_path):
    # Each snapshot of _state is 724,992 bytes in its slot: a budget of three gives three slots.
    with CheckpointStore(job, local=str(tmp_path / "l"), ram_budget_bytes=3 * 724_992) as store:
        for step in range(1, 5):
            store.save(step, _state(step)).wait("local")
        segments = sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"ckptstore-{job}-") and f.endswith(".bin"))
        assert segments == [f"ckptstore-{job}-r00000-s{i}.bin" for i in range(3)]


def _part(root, step: int) -> dict:
    return json.loads((root / f"step-{step:012d}" / "parts" / "rank-00000.json").read_text())


def test_bytes_written_follow_what_changed(job, tmp_path):
    base = {f"layer{i}": torch.randn(250_000) for i in range(9)}  # 9 MB frozen
    head = torch.randn(250_000)  # 1 MB trained
    state = {"base": base, "head": head}
    local = tmp_path / "local"
    with CheckpointStore(job, local=str(local), keep_local=5, frozen=lambda k: k.startswith("base/"),
                         refresh_every=100) as store:
        for step in range(1, 4):
            head.add_(1.0)
            store.save(step, state).wait("local")
        frozen_files = [f for f in os.listdir(local / "step-000000000001" / "data") if "frozen" in f]
        assert len(frozen_files) == 1
        inodes = {os.stat(local / f"step-{s:012d}" / "data" / frozen_files[0]).st_ino for s in (1, 2, 3)}
        assert len(inodes) == 1, "unchanged frozen tensors must be linked, not rewritten"
        assert _part(local, 1)["written_bytes"] >= 10_000_000
        for step in (2, 3):
            assert _part(local, step)["written_bytes"] < 1_100_000  # only the head
        # A frozen tensor that does change (through the version counter) is written again.
        base["layer0"].add_(1.0)
        store.save(4, state).wait("local")
        assert _part(local, 4)["written_bytes"] >= 10_000_000
    wipe_ram(job)
    with CheckpointStore(job, local=str(local)) as store:
        target = {"base": {k: torch.zeros_like(v) for k, v in base.items()}, "head": torch.zeros_like(head)}
        assert store.restore(target) == 4
        assert all(torch.equal(target["base"][k], base[k]) for k in base) and torch.equal(target["head"], head)


def test_zstd_applies_to_the_durable_tier_only(job, tmp_path):
    state = {"zeros": torch.zeros(1_000_000), "w": torch.randn(100)}
    local, durable = tmp_path / "local", tmp_path / "durable"
    with CheckpointStore(job, local=str(local), durable=str(durable), durable_every=1,
                         durable_compression="zstd") as store:
        store.save(1, state).wait("durable")
    # Read as any reader does: a durable manifest names its part files, which hold the chunks.
    codecs = lambda root: {c.codec for e in read_manifest(Directory(str(root / "step-000000000001"), None)).tensors.values()  # noqa: E731
                           for c in e.chunks}
    assert codecs(local) == {"raw"} and codecs(durable) == {"zstd"}
    assert (durable / "step-000000000001" / "data" / "rank-00000.bin").stat().st_size < 100_000
    wipe_ram(job)
    import shutil

    shutil.rmtree(local)
    with CheckpointStore(job, local=str(local), durable=str(durable)) as store:
        target = {"zeros": torch.ones(1_000_000), "w": torch.zeros(100)}
        assert store.restore(target) == 1
        assert torch.equal(target["zeros"], state["zeros"]) and torch.equal(target["w"], state["w"])


def test_two_writers_of_one_step_one_wins(job, tmp_path):
    local = tmp_path / "local"
    other_ram = tmp_path / "ram2"  # a second process's RAM tier (any directory works for the test)
    other_ram.mkdir()
    # Both start before either saves (a store that starts after step 7 is committed refuses to save
    # it again at the call: tests/test_crash_loop.py), so the race is decided at commit.
    second = CheckpointStore(job, local=str(local), ram_dir=str(other_ram))
    with CheckpointStore(job, local=str(local)) as first:
        first.save(7, _state(7)).wait("local")
    committed = (local / "step-000000000007" / "manifest.json").read_bytes()
    handle = second.save(7, _state(8))
    with pytest.raises(ckptstore.CheckpointError, match="never rewritten|already exists"):
        handle.wait("local")
    with pytest.raises(ckptstore.CheckpointError):
        second.close()
    assert (local / "step-000000000007" / "manifest.json").read_bytes() == committed
    wipe_ram(job)
    with CheckpointStore(job, local=str(local)) as store:
        target = _empty()
        assert store.restore(target) == 7 and _same(target, _state(7))


def test_restore_into_a_mismatched_state_is_an_error_not_a_fallback(job, tmp_path):
    with CheckpointStore(job, local=str(tmp_path / "l")) as store:
        store.save(1, _state(1)).wait("local")
        store.save(2, _state(2)).wait("local")
        target = _empty()
        target["model"]["extra"] = torch.zeros(3)
        with pytest.raises(ckptstore.CheckpointError, match="lacks 1 key") as info:
            store.restore(target)
        assert not isinstance(info.value, ckptstore.CorruptCheckpointError)


def test_a_restarted_store_never_restages_the_only_committed_snapshot(job):
    # RAM tier only: step 3 is committed in slot 0 by a process that then dies (never closes).
    crashed = CheckpointStore(job)
    crashed.save(3, _state(3)).wait("ram")
    crashed._loop.close()
    crashed.ram.close()

    store = CheckpointStore(job)
    target = _empty()
    assert store.restore(target) == 3
    gate = threading.Event()

    async def hold_the_loop():
        gate.wait()

    store._loop.submit(hold_the_loop())  # step 6's RAM commit cannot happen until the gate opens
    store.save(6, _state(6))  # slot 1
    threading.Timer(0.5, gate.set).start()
    handle = store.save(9, _state(9))  # slot 0 holds step 3, the only committed snapshot: must wait
    assert handle.waited_s >= 0.4
    handle.wait("ram")
    store.close()
    with CheckpointStore(job) as again:
        target = _empty()
        assert again.restore(target) == 9 and _same(target, _state(9))



def _flip_ram_copy(job: str, key: str) -> str:
    """Flip a byte in the middle of ``key``'s bytes in the RAM copy of slot 0."""
    seg = f"/dev/shm/ckptstore-{job}-r00000-s0.bin"
    with open(seg[:-4] + ".json") as fh:
        doc = json.load(fh)
    entry = next(e for e in doc["layout"] if e["key"] == key)
    at = entry["offset"] + entry["nbytes"] // 2
    with open(seg, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return seg


def _base_and_head() -> dict:
    g = torch.Generator().manual_seed(18)
    return {"base": {f"layer{i}": torch.randn(50_000, generator=g) for i in range(3)},
            "head": torch.randn(20_000, generator=g)}


@pytest.mark.parametrize("damaged", ["base/layer1", "head"])
def test_a_damaged_ram_copy_of_a_frozen_store_restores_the_same_step_from_local(job, tmp_path, caplog, damaged):
    # The local tier keeps the frozen region in a file of its own and shifts the rest's offsets:
    # its copy must be read with its own manifest, not the RAM copy's (issue 18, item 4).
    state, local = _base_and_head(), str(tmp_path / "local")
    store = CheckpointStore(job, local=local, frozen=lambda k: k.startswith("base/"))
    store.save(1, state).wait("local")
    store.close(keep_ram=True)  # a restart on this node: the RAM copy is read first
    assert any("frozen" in f for f in os.listdir(tmp_path / "local" / "step-000000000001" / "data"))
    seg = _flip_ram_copy(job, damaged)
    with CheckpointStore(job, local=local) as store, caplog.at_level(logging.WARNING, logger="ckptstore"):
        target = {"base": {k: torch.zeros_like(v) for k, v in state["base"].items()},
                  "head": torch.zeros_like(state["head"])}
        assert store.restore(target) == 1
    assert f"the copy read was {seg}" in caplog.text
    assert_same(target, state)


def test_a_damaged_ram_copy_of_a_zstd_durable_store_restores_the_same_step_from_durable(job, tmp_path, caplog):
    # The durable tier's chunks are compressed: other offsets, lengths and checksums than RAM's.
    state, durable = _base_and_head(), str(tmp_path / "durable")
    store = CheckpointStore(job, durable=durable, durable_every=1, durable_compression="zstd")
    store.save(1, state).wait("durable")
    store.close(keep_ram=True)  # a restart on this node: the RAM copy is read first
    seg = _flip_ram_copy(job, "head")
    with CheckpointStore(job, durable=durable) as store, caplog.at_level(logging.WARNING, logger="ckptstore"):
        target = {"base": {k: torch.zeros_like(v) for k, v in state["base"].items()},
                  "head": torch.zeros_like(state["head"])}
        assert store.restore(target) == 1
    assert f"the copy read was {seg}" in caplog.text
    assert_same(target, state)
