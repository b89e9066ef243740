"""The tier contract suite (ckptstore/tiers/base.py), as a class any tier's tests subclass.

Every tier of ckptstore runs it (tests/test_tier_contract.py), and so can a third-party tier: the
suite only talks to a tier through the :class:`~ckptstore.tiers.base.Tier` interface and the hooks
of a :class:`TierEnv`, and it asks ``tier.capabilities`` (never the tier's class) which of the
optional promises to check. This module needs pytest (``pip install pytest``); it is imported by
no other part of ckptstore.

A third-party tier subclasses :class:`TierContract` in a test module (the class name must start
with ``Test`` for pytest to collect it) and provides an ``env`` fixture that yields a
:class:`TierEnv` around the tier::

    import pytest
    from ckptstore.testing import TierContract, TierEnv

    class TestMyTier(TierContract):
        @pytest.fixture
        def env(self, tmp_path):
            with TierEnv(MyTier(tmp_path)) as env:
                yield env

Snapshots are built the way a store builds them: staged in a RAM tier (``TierEnv.source``),
checksummed with the sharded layout's block size, handed to the tier with ``put`` and committed
with the step's manifest (``commit``); reads go to ``TierEnv.tier``. A tier whose snapshots
arrive some other way (a collective ``put`` over several ranks, a writer that is not the reader)
overrides :meth:`TierEnv.put` and :meth:`TierEnv.commit`. The damage tests flip a stored byte
through :meth:`TierEnv.damage` (by default at the place :meth:`TierEnv.locate` names: the
node-local ``holdings`` of the step); a tier whose bytes are not files of this machine, or that
``sweeps`` (whose uncommitted debris the suite looks for), overrides ``locate`` or ``damage``.

For pytest's detailed assertion messages in the suite, call
``pytest.register_assert_rewrite("ckptstore.testing")`` in your conftest.py before importing it.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from .checkpoint.materialize import decode_value, encode_value
from .checkpoint.sharded import BLOCK_SIZE, Collected, PerRank, build_manifest, collect, load_manifest, my_writes
from .collective import Group
from .errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError
from .format.container import align_up
from .format.manifest import Manifest, parse_manifest
from .names import segment_prefix
from .storage.targets import Target
from .tiers.base import Snapshot, Tier
from .tiers.ram import RamTier

__all__ = [
    "Saved",
    "TierContract",
    "TierEnv",
    "assert_loaded_equal",
    "assert_tensor_identical",
    "frozen_state",
    "make_state",
    "tensor_bytes",
    "zeroed",
]

# ------------------------------------------------------------------------------------ states


def make_state(seed: int) -> dict[str, Any]:
    """A state that covers what a tier must keep bit for bit: a tensor over two checksum blocks
    (5 MB), bf16, int64 over the full range, a 0-dim and an empty tensor, an int and a PerRank value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1_250_000, generator=g),  # 5 MB: two 4 MiB checksum blocks
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(seed + 0.5),
        "empty": torch.empty(0, 3),
        "step": seed,
        "rng": PerRank({"seed": seed, "offsets": [seed, 2 * seed]}),
    }


def frozen_state(seed: int) -> dict[str, Any]:
    """A state whose ``frozen/`` tensors are the same for every seed and whose others are not."""
    g = torch.Generator().manual_seed(100)
    frozen = {"emb": torch.randn(300_000, generator=g), "head": torch.randn(100, 3, generator=g).to(torch.bfloat16)}
    g.manual_seed(seed)
    return {"frozen": frozen, "w": torch.randn(20_000, generator=g), "n": torch.tensor(seed)}


def zeroed(state: dict[str, Any]) -> dict[str, Any]:
    """A state of the same structure to load into: tensors zeroed, PerRank values None, ints 0."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, PerRank):
            out[k] = PerRank(None)
        elif isinstance(v, dict):
            out[k] = zeroed(v)
        else:
            out[k] = type(v)()
    return out


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The logical elements of ``t`` (row-major) as a flat contiguous uint8 tensor, for any dtype,
    0-dim, empty, non-contiguous and expanded tensors (viewed as a same-sized integer first)."""
    t = t.detach()
    same_size_int = _INT_OF_SIZE.get(t.dtype.itemsize)  # None for complex128, which copies as is
    if same_size_int is not None and t.dtype != same_size_int:
        t = t.view(same_size_int)
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_tensor_identical(actual: Any, expected: torch.Tensor, where: str = "tensor") -> None:
    """Type, dtype, shape, device, requires_grad and every byte equal (NaN payloads included,
    which torch.equal cannot tell)."""
    assert type(actual) is type(expected), f"{where}: type {type(actual)} != {type(expected)}"
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.device == expected.device, f"{where}: device {actual.device} != {expected.device}"
    assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad differs"
    a, e = tensor_bytes(actual), tensor_bytes(expected)
    assert torch.equal(a, e), f"{where}: bytes differ (first at {int((a != e).nonzero()[0])})"


def assert_loaded_equal(got: dict[str, Any], want: dict[str, Any], where: str = "state") -> None:
    """What a load put into ``got`` is ``want``: tensors bitwise, PerRank values, exact ints."""
    for k, v in want.items():
        if isinstance(v, dict):
            assert_loaded_equal(got[k], v, f"{where}[{k!r}]")
        elif isinstance(v, torch.Tensor):
            assert_tensor_identical(got[k], v, f"{where}[{k!r}]")
        elif isinstance(v, PerRank):
            assert got[k].value == v.value, f"{where}[{k!r}]: {got[k].value!r} != {v.value!r}"
        else:
            assert type(got[k]) is type(v) and got[k] == v, f"{where}[{k!r}]: {got[k]!r} != {v!r}"


# ------------------------------------------------------------------------------------ the environment


@dataclass
class Saved:
    """One save through a :class:`TierEnv`: the part ``put`` returned, the step's manifest (committed
    or not) and what :func:`~ckptstore.checkpoint.sharded.collect` made of the state."""

    step: int
    part: dict[str, Any]
    manifest: Manifest
    local: Collected


def _default_ram_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class TierEnv:
    """A tier under test, and how the suite writes to it and damages it.

    ``tier``: the tier the suite reads back (and, by default, writes to). ``source``: the RAM tier
    snapshots are staged in (by default a new one in /dev/shm, three slots; pass the tier itself to
    test a RamTier); the env closes it and removes its segments on :meth:`close`. ``keeps``: how
    many committed steps the tier holds at once (None: as many as are written; a RAM tier holds
    one per slot, the peer tier two per source rank); the listing test stays within it.

    Override :meth:`put` and :meth:`commit` when a snapshot reaches the tier other than by its own
    ``put``/``commit``; :meth:`locate` (or :meth:`damage`) when the stored bytes are not found
    through the tier's node-local ``holdings``; :meth:`written_files` when a ``put`` leaves more
    than the data files its part names; :meth:`another` to give exclusive-commit tests a second
    writer; :meth:`check_reused` to check how a reused frozen file is kept; :meth:`close` to clean
    up more (call the base's)."""

    def __init__(self, tier: Tier, *, source: RamTier | None = None, keeps: int | None = None) -> None:
        self.tier = tier
        self.source = source if source is not None else RamTier(
            f"contract-{uuid.uuid4().hex[:12]}", ram_dir=_default_ram_dir(), slots=3)
        self.keeps = keeps

    def __enter__(self) -> TierEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the staging slots and remove every segment of the source's job in its ram_dir."""
        self.source.close(unlink=True)
        prefix = segment_prefix(self.source.job)
        for name in os.listdir(self.source.ram_dir):
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(self.source.ram_dir, name))
                except FileNotFoundError:
                    pass

    # ---------------------------------------------------------------------------- writing

    def put(self, snap: Snapshot, *, use_async: bool = False) -> dict[str, Any]:
        """Hand ``snap`` to the tier; returns its part (the coroutine, or its sync mirror)."""
        return asyncio.run(self.tier.put(snap)) if use_async else self.tier.put_sync(snap)

    def commit(self, step: int, manifest: Manifest, *, use_async: bool = False) -> None:
        if use_async:
            asyncio.run(self.tier.commit(step, manifest))
        else:
            self.tier.commit_sync(step, manifest)

    def save(self, step: int, state: Any, *, commit: bool = True, use_async: bool = False,
             frozen: str | None = None) -> Saved:
        """The store's pipeline for one rank of a one-rank job: stage (the keys under ``frozen``
        first, their region ending on a page), checksum, :meth:`put`, :meth:`commit`."""
        local = collect(state, 0, encode_value)
        mine = my_writes(local, 1, 0)
        is_frozen = [bool(frozen) and m.key.startswith(frozen or "") for m in mine]
        ordered = [m for m, f in zip(mine, is_frozen) if f] + [m for m, f in zip(mine, is_frozen) if not f]
        nfrozen = sum(is_frozen)
        staged = self.source.stage(step, [(m.key, local.items[(m.key, m.offsets, m.sizes)]) for m in ordered],
                                   breaks=frozenset({nfrozen}))
        self.source.checksums(staged, BLOCK_SIZE)
        frozen_end = 0
        if nfrozen:
            last = staged.layout.entries[nfrozen - 1]
            frozen_end = align_up(last.offset + last.nbytes)
        snap = self.source.snapshot(staged, world=1, boxes={}, frozen_end=frozen_end)
        part = self.put(snap, use_async=use_async)
        manifest = self.manifest_of(step, local, part)
        if commit:
            self.commit(step, manifest, use_async=use_async)
        return Saved(step, part, manifest, local)

    @staticmethod
    def manifest_of(step: int, local: Collected, part: dict[str, Any], job: str = "contract") -> Manifest:
        """The global manifest of a one-rank step whose rank wrote ``part``."""
        manifest = build_manifest(local.tree, local.tensors, [part], 1)
        manifest.meta.update(step=step, job=job)
        return manifest

    def another(self) -> Tier | None:
        """A second writer on the same storage (another process, or a restarted one), or None."""
        return None

    # ---------------------------------------------------------------------------- reading

    def load(self, step: int, like: dict[str, Any], tier: Tier | None = None) -> dict[str, Any]:
        """``step`` read back from ``tier`` (the tier under test) into a zeroed copy of ``like``."""
        tier = tier or self.tier
        state = zeroed(like)
        load_manifest(state, tier.manifest_sync(step), tier.display(step), tier.opener(step), group=Group.solo(),
                      strict=True, per_rank="error", buffer_bytes=1 << 20, decode_per_rank=decode_value)
        return state

    # ---------------------------------------------------------------------------- the stored bytes

    def locate(self, step: int, file: str) -> Target:
        """Where the tier keeps ``file`` (a chunk's file in the manifest) of ``step``. By default the
        copy this node holds (``holdings``), for node-local tiers with the step committed."""
        for held in self.tier.holdings(step).files:
            if held.file == file and os.path.exists(held.where):
                return Target(display=held.where, path=held.where)
        raise NotImplementedError(
            f"{type(self).__name__}.locate: {file} of step {step} is not in the {self.tier.name} tier's holdings; "
            "override TierEnv.locate (or TierEnv.damage) to say where the tier stores it"
        )

    def exists(self, step: int, file: str) -> bool:
        target = self.locate(step, file)
        if target.path is not None:
            return os.path.exists(target.path)
        return bool(target.fs.exists(target.fspath))

    def size(self, step: int, file: str) -> int:
        target = self.locate(step, file)
        return os.path.getsize(target.path) if target.path is not None else int(target.fs.size(target.fspath))

    def damage(self, step: int, file: str, at: int) -> None:
        """XOR the stored byte ``at`` of ``file`` of ``step`` with 0x5A (doing it twice undoes it)."""
        target = self.locate(step, file)
        if target.path is not None:
            with open(target.path, "r+b") as fh:
                fh.seek(at)
                byte = fh.read(1)
                fh.seek(at)
                fh.write(bytes([byte[0] ^ 0x5A]))
        else:
            data = bytearray(target.fs.cat_file(target.fspath))
            data[at] ^= 0x5A
            target.fs.pipe_file(target.fspath, bytes(data))

    def written_files(self, step: int, part: dict[str, Any]) -> list[str]:
        """What a ``put`` that returned ``part`` left in the tier (the sweep and discard tests check
        it is gone): by default the files its chunks name."""
        return sorted({c["file"] for cs in part["chunks"].values() for c in cs})

    def check_reused(self, earlier: int, later: int, file: str) -> None:
        """Check how the tier kept the frozen ``file`` of step ``earlier`` for step ``later`` (a hard
        link, a server-side copy, ...); nothing by default."""


# ------------------------------------------------------------------------------------ the suite


def _frozen_extent(part: dict[str, Any], frozen: bool) -> int:
    return sum(c["length"] for k, cs in part["chunks"].items() if k.startswith("frozen/") == frozen for c in cs)


def _frozen_file(part: dict[str, Any]) -> str:
    """The one file that holds the frozen chunks of ``part``, and no other chunk."""
    files = {c["file"] for k, cs in part["chunks"].items() if k.startswith("frozen/") for c in cs}
    assert len(files) == 1, f"the frozen region lies in one file of its own, not {sorted(files)}"
    rest = {c["file"] for k, cs in part["chunks"].items() if not k.startswith("frozen/") for c in cs}
    assert not files & rest, f"{sorted(files)} holds frozen chunks only"
    return files.pop()


class TierContract:
    """The contract of ckptstore/tiers/base.py, as pytest tests over an ``env`` fixture that a
    subclass provides (a :class:`TierEnv`; see the module docstring). The optional promises are
    checked where ``env.tier.capabilities`` declares them, and skipped where it does not."""

    @pytest.fixture
    def env(self) -> Iterator[TierEnv]:
        raise NotImplementedError(f"{type(self).__name__} must define an `env` fixture that yields a TierEnv")

    def test_committed_step_is_listed_and_loads_back_bitwise(self, env: TierEnv) -> None:
        state = make_state(3)
        env.save(3, state, use_async=True)
        assert asyncio.run(env.tier.steps()) == [3] == env.tier.steps_sync()
        manifest = asyncio.run(env.tier.manifest(3))
        assert manifest.kind == "sharded" and manifest.meta["world_size"] == 1
        assert {"big", "bf16", "i64", "scalar", "empty"} <= set(manifest.tensors)
        assert manifest.tensors["empty"].chunks == []
        (big,) = manifest.tensors["big"].chunks
        if big.codec == "raw":
            assert len(big.block_checksums or ()) == 2, "block checksums are kept"
        assert_loaded_equal(env.load(3, state), state)

    def test_uncommitted_step_is_invisible_and_swept(self, env: TierEnv) -> None:
        kept = make_state(1)
        env.save(1, kept)
        left = env.save(2, make_state(2), commit=False)
        assert env.tier.steps_sync() == [1]
        with pytest.raises(CheckpointNotFoundError):
            env.tier.manifest_sync(2)
        if env.tier.capabilities.sweeps:
            files = env.written_files(2, left.part)
            assert files and all(env.exists(2, f) for f in files), f"an uncommitted put leaves {files} behind"
            assert env.tier.sweep_sync() == [2]
            assert not any(env.exists(2, f) for f in files), f"{files} are swept"
        assert env.tier.sweep_sync() == []
        assert env.tier.steps_sync() == [1]
        assert_loaded_equal(env.load(1, kept), kept)

    def test_discard_removes_a_failed_put_and_never_a_committed_step(self, env: TierEnv) -> None:
        kept = make_state(1)
        env.save(1, kept)
        left = env.save(2, make_state(2), commit=False)
        env.tier.discard_sync(2)
        asyncio.run(env.tier.discard(1))  # committed: untouched
        if env.tier.capabilities.sweeps:  # the tiers whose put leaves files before the commit
            files = env.written_files(2, left.part)
            assert not any(env.exists(2, f) for f in files), f"{files} are discarded"
        assert env.tier.steps_sync() == [1]
        with pytest.raises(CheckpointNotFoundError):
            env.tier.manifest_sync(2)
        assert_loaded_equal(env.load(1, kept), kept)

    def test_a_failed_put_never_costs_the_newest_committed_step(self, env: TierEnv) -> None:
        kept = make_state(1)
        env.save(1, kept)
        env.save(2, make_state(2), commit=False)  # a save that failed after its put
        later = env.save(3, make_state(3), commit=False)  # the next save, its put done, its commit to come
        assert env.tier.steps_sync() == [1], "the newest committed step survives the puts that follow it"
        assert_loaded_equal(env.load(1, kept), kept)
        env.commit(3, later.manifest)
        assert env.tier.steps_sync() == [1, 3]
        assert_loaded_equal(env.load(1, kept), kept)

    def test_steps_are_listed_oldest_first_and_remove_deletes_exactly_one(self, env: TierEnv) -> None:
        order = [2, 10, 7] if env.keeps is None or env.keeps >= 3 else [10, 7]  # committed out of order
        states = {step: make_state(step) for step in order}
        for step, state in states.items():
            env.save(step, state)
        assert env.tier.steps_sync() == sorted(order)
        asyncio.run(env.tier.remove(10))
        if 2 in order:
            env.tier.remove_sync(2)
        assert env.tier.steps_sync() == [7]
        for gone in order:
            if gone != 7:
                with pytest.raises(CheckpointNotFoundError):
                    env.tier.manifest_sync(gone)
        assert_loaded_equal(env.load(7, states[7]), states[7])
        env.save(11, states[10])
        assert env.tier.steps_sync() == [7, 11]
        assert_loaded_equal(env.load(11, states[10]), states[10])
        assert_loaded_equal(env.load(7, states[7]), states[7])

    @pytest.mark.parametrize("key", ["big", "i64", "rng#rank00000"], ids=["block-checksummed", "whole-chunk", "per-rank"])
    def test_damaged_bytes_raise_corrupt_never_wrong_data(self, env: TierEnv, key: str) -> None:
        state = make_state(5)
        env.save(5, state)
        chunk = env.tier.manifest_sync(5).tensors[key].chunks[0]
        assert chunk.file is not None
        at = chunk.offset + chunk.length // 2
        env.damage(5, chunk.file, at)
        with pytest.raises(CorruptCheckpointError):
            env.load(5, state)
        env.damage(5, chunk.file, at)  # undone: the same step loads again, so the error came from that byte
        assert_loaded_equal(env.load(5, state), state)

    def test_unknown_step_raises_not_found(self, env: TierEnv) -> None:
        with pytest.raises(CheckpointNotFoundError):
            env.tier.manifest_sync(1)
        assert env.tier.steps_sync() == []
        env.save(4, make_state(4))
        for unknown in (3, 5, 40):
            with pytest.raises(CheckpointNotFoundError):
                env.tier.manifest_sync(unknown)
        with pytest.raises(CheckpointNotFoundError):
            asyncio.run(env.tier.manifest(5))

    def test_a_step_is_committed_once_and_never_rewritten(self, env: TierEnv) -> None:
        if not env.tier.capabilities.exclusive_commit:
            pytest.skip(f"the {env.tier.name} tier does not declare exclusive_commit")
        state = make_state(6)
        saved = env.save(6, state)
        first = env.tier.manifest_sync(6).to_json_bytes()
        second = env.manifest_of(6, saved.local, saved.part, job="the second writer")
        other = env.another()  # a second writer on the same storage
        for writer in [w for w in (other, env.tier) if w is not None]:
            with pytest.raises(CheckpointExistsError):
                writer.commit_sync(6, second)
            assert writer.manifest_sync(6).to_json_bytes() == first
        # A new save of the step is refused, at its put or at its commit; the step stays as it was.
        try:
            again = env.save(6, make_state(60), commit=False)
        except CheckpointExistsError:
            pass
        else:
            with pytest.raises(CheckpointExistsError):
                env.commit(6, again.manifest)
            env.tier.discard_sync(6)
        assert env.tier.manifest_sync(6).to_json_bytes() == first
        assert_loaded_equal(env.load(6, state), state)

    def test_node_holdings_pair_every_copy_with_the_manifest_that_reads_it(self, env: TierEnv) -> None:
        """A restore reads each copy a node holds with the manifest its holdings pair it with; the
        layout may be the tier's own (a frozen region split off, offsets shifted)."""
        if not env.tier.capabilities.node_local:
            pytest.skip(f"the {env.tier.name} tier is not node-local: it holds nothing node-wise")
        state = frozen_state(5)
        env.save(5, state, frozen="frozen/")
        held = env.tier.holdings(5)
        assert held.files and held.manifests, "a committed step is in the node's holdings"
        bodies = dict((where, body) for body, where in held.manifests)
        for copy in held.files:
            assert copy.manifest in bodies, f"{copy.where} names no manifest of the holdings ({copy.manifest!r})"
            manifest = parse_manifest(bodies[copy.manifest], where=copy.manifest)
            files = {c.where: c for c in held.files if c.manifest == copy.manifest}
            by_name = {c.file: c for c in files.values()}
            loaded = zeroed(state)
            load_manifest(loaded, manifest, copy.manifest, lambda rel, by_name=by_name: by_name[rel or ""].open(),  # type: ignore[misc]
                          group=Group.solo(),
                          strict=True, per_rank="error", buffer_bytes=1 << 20, decode_per_rank=decode_value)
            assert_loaded_equal(loaded, state)

    def test_unchanged_frozen_region_is_reused_not_rewritten(self, env: TierEnv) -> None:
        if not env.tier.capabilities.reuses_unchanged:
            pytest.skip(f"the {env.tier.name} tier does not declare reuses_unchanged")
        s1, s2 = frozen_state(1), frozen_state(2)
        p1 = env.save(1, s1, frozen="frozen/").part
        p2 = env.save(2, s2, frozen="frozen/").part
        assert p1["written_bytes"] == p1["bytes"] == _frozen_extent(p1, True) + _frozen_extent(p1, False)
        assert _frozen_file(p2) == _frozen_file(p1)
        assert _frozen_extent(p2, True) > 0
        assert p2["written_bytes"] == _frozen_extent(p2, False), "only the non-frozen bytes are written"
        assert p2["bytes"] == p2["written_bytes"] + _frozen_extent(p2, True)
        env.check_reused(1, 2, _frozen_file(p2))
        env.tier.remove_sync(1)  # retention deletes the step that first wrote the frozen file
        assert env.tier.steps_sync() == [2]
        assert_loaded_equal(env.load(2, s2), s2)

        s3 = frozen_state(3)
        s3["frozen"]["emb"][17] += 1  # the frozen region changed: a new file, written in full
        p3 = env.save(3, s3, frozen="frozen/").part
        assert _frozen_file(p3) != _frozen_file(p2)
        assert p3["written_bytes"] == p3["bytes"] == _frozen_extent(p3, True) + _frozen_extent(p3, False)
        assert_loaded_equal(env.load(3, s3), s3)
        assert_loaded_equal(env.load(2, s2), s2)  # step 3 left step 2's frozen file alone
