"""A steady save's control plane: what a save of an unchanged structure no longer does per tensor
(the fingerprint's columns, the small copies' one gather), and that none of it ever stages or
commits a stale byte or checksum.

Real stores (RAM segments in /dev/shm, a local directory), every save restored bitwise.
"""

from __future__ import annotations

import ctypes
import glob
from typing import Any

import pytest
import torch
import xxhash
from torch.distributed.tensor import DTensor, Shard

import ckptstore.tiers.ram as ram_module
from ckptstore import CheckpointStore
from ckptstore.format.checksum import ALGORITHM
from ckptstore.planning.flatten import fingerprint


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "norms": {f"layer{i}.norm": torch.randn(8, generator=g) for i in range(40)},  # 32 B each
        "biases": {f"layer{i}.bias": torch.randn(4, 16, generator=g).double() for i in range(40)},  # 512 B
        "steps": [torch.tensor(float(i)) for i in range(10)],  # 4 B: not a whole word, copied by memmove
        "odd": torch.arange(11, dtype=torch.int8)[1:],  # an address off the word: memmove too
        "big": torch.randn(64, 1024, generator=g),  # 256 KiB: torch's grouped copy
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return [t for v in obj for t in _tensors(v)]


def _restore_equals(store: CheckpointStore, step: int, state: dict[str, Any]) -> None:
    target = {"norms": {k: torch.zeros_like(v) for k, v in state["norms"].items()},
              "biases": {k: torch.zeros_like(v) for k, v in state["biases"].items()},
              "steps": [torch.zeros_like(t) for t in state["steps"]],
              "odd": torch.zeros_like(state["odd"]), "big": torch.zeros_like(state["big"])}
    assert store.restore(target, step=step) == step
    for got, want in zip(_tensors(target), _tensors(state)):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_steady_saves_gather_small_tensors_and_never_stage_stale_bytes(job, tmp_path, monkeypatch):
    """From the third save of a structure on, the small tensors at the addresses of the last copy
    are copied by one gather, not a memmove each; a tensor moved to new memory (its ``.data``
    replaced, or a new tensor of the same shape in its place) is copied from where it is now."""
    calls: list[int] = []
    real = ctypes.memmove

    def counting(dst: Any, src: Any, n: int) -> Any:
        calls.append(n)
        return real(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", counting)
    state = _state()
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        for round_ in range(7):
            for t in _tensors(state):
                t.add_(1)
            if round_ == 4:
                with torch.no_grad():
                    state["norms"]["layer3.norm"].data = torch.full((8,), -3.0)  # same shape, new memory
                state["biases"]["layer7.bias"] = torch.full((4, 16), 7.0, dtype=torch.float64)
            calls.clear()
            step = round_ + 1
            store.save(step, state).wait("local")
            # Copied by address from the second save on (the first plans): the sources' addresses
            # are learnt at that copy, and the next copy (into the other slot) gathers; by memmove
            # then only what the gather cannot copy (the 4-byte steps and the odd address). After a
            # move, one save copies everything by memmove, and the next gathers again.
            gathered = sorted(calls) == [4] * 10 + [10]
            assert gathered == (round_ not in (0, 1, 4)), (round_, len(calls))


def _committed(job: str, step: int) -> dict[str, Any]:
    for path in glob.glob(f"/dev/shm/ckptstore-{job}-r00000-s*.json"):
        doc = ram_module.read_doc(path)
        if doc["step"] == step:
            return doc
    raise AssertionError(f"no RAM document of step {step}")


def test_a_changed_tensor_commits_its_new_checksum_and_the_others_keep_theirs(job, tmp_path):
    """The RAM document of a steady save (spliced from the structure's template) and its chunk table
    carry this save's checksum of a tensor whose bytes changed, and the same checksums as before
    for the tensors that did not: no checksum of an earlier save is ever committed."""
    state = _state()
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        for step in (1, 2, 3):
            store.save(step, state).wait("local")
        before = _committed(job, 3)
        state["norms"]["layer5.norm"][2] = 1234.5  # one element of one tensor, in place
        for step in (4, 5):  # both slots: each slot's template and views are reused
            store.save(step, state).wait("local")
            doc = _committed(job, step)
            want = f"{ALGORITHM}:" + xxhash.xxh3_64_hexdigest(state["norms"]["layer5.norm"].numpy().tobytes())
            key = next(k for k in doc["checksums"] if "layer5.norm" in k)
            assert doc["checksums"][key]["checksum"] == want != before["checksums"][key]["checksum"]
            assert doc["extra"]["part"]["chunks"][key][0]["checksum"] == want
            same = {k: v for k, v in doc["checksums"].items() if k != key}
            assert same == {k: v for k, v in before["checksums"].items() if k != key}
            _restore_equals(store, step, state)


def test_a_dtensors_local_dtype_is_part_of_its_fingerprint(mesh):
    """A DTensor keeps its spec when its local tensor's ``.data`` is replaced by one of another
    dtype: the fingerprint must tell the two apart, or a save would reuse a plan (and a copy by
    address) sized for the old dtype."""
    dt = DTensor.from_local(torch.randn(4, 6), mesh, [Shard(0)])
    with torch.no_grad():
        key = fingerprint({"w": dt}, dtensor=DTensor)[1]  # type: ignore[index]
        dt._local_tensor.data = dt._local_tensor.data.to(torch.bfloat16)
        changed = fingerprint({"w": dt}, dtensor=DTensor)[1]  # type: ignore[index]
    assert key != changed


@pytest.mark.parametrize("where", ["flat", "nested", "mixed"])
def test_the_fingerprint_tells_a_tensor_from_a_scalar_at_every_place(where):
    """A container of tensors hands its values over at once; the key must still say which place
    holds a tensor and which a plain value, wherever they are."""
    t = torch.zeros(2)
    trees = {
        "flat": ({"a": t, "b": 1}, {"a": 1, "b": t}),
        "nested": ({"x": [t, {"a": t}]}, {"x": [{"a": t}, t]}),
        "mixed": ([t, t, 1], [t, 1, t]),
    }[where]
    first, second = (fingerprint(tree) for tree in trees)
    assert first is not None and second is not None and first[1] != second[1]


@pytest.mark.parametrize("n", [20, 300])
def test_a_save_by_address_into_a_fresh_slot_views_only_the_large_tensors(job, tmp_path, monkeypatch, n):
    """After the first save of a structure, the copy by address needs views of the slot only for
    the entries torch copies (the large ones): the first save into each slot made one per entry
    (a few microseconds each, 50 ms at 10,000 tensors), whatever the number of small tensors.
    Every save restores bitwise."""
    made: list[str] = []
    real = ram_module.Slot.view

    def counting(self: Any, e: Any) -> Any:
        made.append(e.key)
        return real(self, e)

    monkeypatch.setattr(ram_module.Slot, "view", counting)
    g = torch.Generator().manual_seed(n)
    state = {"small": {f"s{i}": torch.randn(4, generator=g) for i in range(n)}, "big": torch.randn(64, 1024, generator=g)}
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        store.save(1, state).wait("local")  # plans: torch's grouped copy into views of every entry
        for step in (2, 3, 4, 5):  # both slots, each one's first copy by address and a steady one
            for t in [*state["small"].values(), state["big"]]:
                t.add_(1)
            made.clear()
            store.save(step, state).wait("local")
            assert len(made) <= 1, (step, len(made))  # the big tensor's view, once per slot
            target = {"small": {k: torch.zeros_like(v) for k, v in state["small"].items()},
                      "big": torch.zeros_like(state["big"])}
            assert store.restore(target, step=step) == step
            assert all(torch.equal(target["small"][k], v) for k, v in state["small"].items())
            assert torch.equal(target["big"], state["big"])


def test_a_steady_commit_makes_no_checksum_table_by_key_and_commits_every_new_checksum(job, tmp_path, monkeypatch):
    """A steady save's RAM commit writes its document's checksums from its template and the
    digests: the table by key (a dict per entry) is never made. What it commits is still each
    tensor's checksum of this save's bytes, block checksums included, in the checksums member and
    the chunk table alike."""
    made: list[int] = []
    real = ram_module._Sums.table
    monkeypatch.setattr(ram_module._Sums, "table", lambda self: made.append(1) or real(self))
    state = _state()
    state["huge"] = torch.randn(5 << 18, generator=torch.Generator().manual_seed(1))  # 5 MiB: block checksums
    digest = xxhash.xxh3_64_hexdigest
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        for step in range(1, 6):
            for t in _tensors(state):
                t.add_(1)
            store.save(step, state).wait("local")
            doc = _committed(job, step)
            want = sorted(f"{ALGORITHM}:{digest(t.numpy().tobytes())}" for t in _tensors(state))
            assert sorted(v["checksum"] for v in doc["checksums"].values()) == want
            chunks = doc["extra"]["part"]["chunks"]
            assert sorted(c[0]["checksum"] for c in chunks.values()) == want
            huge = state["huge"].numpy().tobytes()
            blocks = [f"{ALGORITHM}:{digest(huge[b:b + (4 << 20)])}" for b in range(0, len(huge), 4 << 20)]
            (key,) = [k for k, v in doc["checksums"].items() if "block_checksums" in v]
            assert doc["checksums"][key]["block_checksums"] == blocks == chunks[key][0]["block_checksums"]
    assert made == []
