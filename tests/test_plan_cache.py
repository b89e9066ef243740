"""The plan cache of sharded states: DTensors, per-rank values and a TrainState reuse the plan of an
unchanged structure, every structural change (a key, a dtype, a shape, a placement, a mesh, a
per-rank value's length) plans again, and no save ever stages stale values.

One process is a one-rank gloo job (a real process group and device meshes over it); each save goes
into a real store (RAM segments in /dev/shm, a local directory) and is restored at once into a fresh
skeleton of the same layout, compared bitwise with a copy taken right after the save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_save_cache import Saver as _SaveCacheSaver
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptstore import CheckpointStore, PerRank, TrainState


def _dt(t: torch.Tensor, mesh: DeviceMesh, placements: list[Any] | None = None) -> DTensor:
    return distribute_tensor(t, mesh, placements or [Shard(0)])


def _state(mesh: DeviceMesh, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": _dt(torch.randn(8, 6, generator=g), mesh) for i in range(12)},
        "bias": torch.randn(5, generator=g),
        "step": 3,
        "rng": PerRank({"pos": seed, "note": "x" * 40}),
    }


def _blank(obj: Any) -> Any:
    """A skeleton of the same layout, zero-filled."""
    if isinstance(obj, DTensor):
        return DTensor.from_local(torch.zeros_like(obj.to_local()), obj.device_mesh, obj.placements)
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, PerRank):
        return PerRank(None)
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    return None


def _copy(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return DTensor.from_local(obj.to_local().clone(), obj.device_mesh, obj.placements)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, PerRank):
        return PerRank(obj.value)
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    return obj


def _assert_bitwise(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, DTensor):
        assert isinstance(got, DTensor) and got.placements == want.placements, where
        got, want = got.to_local(), want.to_local()
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), where
    elif isinstance(want, PerRank):
        _assert_bitwise(got.value, want.value, f"{where}.value")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_bitwise(got[k], want[k], f"{where}/{k}")
    elif want is not None:
        assert got == want, where


class Saver(_SaveCacheSaver):
    """A real store; each save is restored at once and compared bitwise (DTensors and per-rank
    values included). Counts the plans."""

    copy = staticmethod(lambda state: _copy(state))  # after the save: what is written later must not matter
    blank = staticmethod(lambda state: _blank(state))
    same = staticmethod(lambda got, want: _assert_bitwise(got, want))


@pytest.fixture
def saver(mesh, job, tmp_path, monkeypatch) -> Iterator[Saver]:
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        yield Saver(store, monkeypatch)


def _model(state: dict[str, Any]) -> dict[str, Any]:
    return state["model"]


def _named_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def _mesh_2d() -> DeviceMesh:
    return init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))


CHANGES: dict[str, Callable[[dict[str, Any], DeviceMesh], None]] = {
    "new key": lambda s, m: _model(s).__setitem__("extra", _dt(torch.randn(9), m)),
    "removed key": lambda s, m: _model(s).pop("layer3.weight"),
    "dtype": lambda s, m: _model(s).__setitem__("layer4.weight", _dt(torch.randn(8, 6).to(torch.bfloat16), m)),
    # Same numel, dtype and local strides' kind: only the shape says where the values go.
    "shape": lambda s, m: _model(s).__setitem__("layer5.weight", _dt(torch.randn(6, 8), m)),
    # On one rank a Replicate()d tensor has the same local tensor as a Shard(0) one: only the
    # placement tells them apart.
    "placement": lambda s, m: _model(s).__setitem__("layer6.weight", _dt(torch.randn(8, 6), m, [Replicate()])),
    "shard dim": lambda s, m: _model(s).__setitem__("layer6.weight", _dt(torch.randn(8, 6), m, [Shard(1)])),
    # The same placements and local tensor on another mesh of the same shape.
    "mesh": lambda s, m: _model(s).__setitem__("layer7.weight", _dt(torch.randn(8, 6), _named_mesh())),
    "mesh dims": lambda s, m: _model(s).__setitem__("layer7.weight",
                                                    _dt(torch.randn(8, 6), _mesh_2d(), [Shard(0), Replicate()])),
    "plain tensor for a DTensor": lambda s, m: _model(s).__setitem__("layer8.weight", torch.randn(8, 6)),
    "DTensor for a plain tensor": lambda s, m: s.__setitem__("bias", _dt(torch.randn(5), m)),
    "per-rank value's length": lambda s, m: s.__setitem__("rng", PerRank({"pos": 7, "note": "y" * 300})),
    # Past the room the slot keeps for per-rank values: a new slot layout.
    "per-rank value's length, far": lambda s, m: s.__setitem__("rng", PerRank({"pos": 7, "note": "y" * 50_000})),
    "per-rank value's type": lambda s, m: s.__setitem__("rng", PerRank(torch.arange(5))),
    "same DTensor twice": lambda s, m: _model(s).__setitem__("layer9.weight", _model(s)["layer10.weight"]),
    "scalar leaf": lambda s, m: s.__setitem__("step", 4),
}
# A per-rank value is bytes the plan does not look into: a change of them (their length included)
# keeps the plan and moves the slot's tail, unless it outgrows the room kept for it. Every other
# change plans afresh.
KEEPS_PLAN = {"per-rank value's length", "per-rank value's type"}


def test_every_structural_change_in_turn_plans_afresh_and_restores_bitwise(saver, mesh):
    """All the changes below, one after the other on one store (the default run's version of the
    test after it): each plans afresh, restores bitwise, and its plan is kept for the next save."""
    state = _state(mesh)
    assert saver.save_and_check(state)
    assert not saver.save_and_check(_state(mesh, 1))
    for i, (change, apply) in enumerate(CHANGES.items()):
        apply(state, mesh)
        if change == "per-rank value's type":
            # After the far one the slot has room to spare: a shorter value only moves the tail.
            assert not saver.save_and_check(state), change
            continue
        assert saver.save_and_check(state) == (change not in KEEPS_PLAN), change
        with torch.no_grad():
            for t in _tensors(state):
                t.add_(i + 1) if t.dtype.is_floating_point else t.add_(2)
        assert not saver.save_and_check(state), f"after {change}"


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_structural_change_plans_afresh_and_restores_bitwise(saver, mesh, change):
    assert saver.save_and_check(_state(mesh))  # the first save plans
    state = _state(mesh, 1)
    assert not saver.save_and_check(state)  # the same structure, new objects: the plan is reused
    CHANGES[change](state, mesh)
    assert saver.save_and_check(state) == (change not in KEEPS_PLAN), change
    for t in _tensors(state):
        t.add_(1) if t.dtype.is_floating_point else t.add_(2)
    state["rng"] = PerRank({"pos": 8, "note": state["rng"].value})
    assert not saver.save_and_check(state)  # the new structure is kept
    # And back is a change too; a per-rank value that shrinks fits the slot it grew.
    assert saver.save_and_check(_state(mesh, 3)) == ("per-rank" not in change)


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in [*state["model"].values(), state["bias"]]:
        t = v.to_local() if isinstance(v, DTensor) else v
        if all(t is not o for o in out):
            out.append(t)
    return out


def test_values_of_an_unchanged_structure_are_never_stale(saver, mesh):
    state = _state(mesh)
    saver.save_and_check(state)
    for step in range(4):  # both slots, twice each, with the plan and the slot views reused
        with torch.no_grad():
            for t in _tensors(state):
                t.mul_(-1.5)
            _model(state)["layer0.weight"].to_local()[1:3, 2:].fill_(50.0 + step)  # through a view
            _model(state)["layer1.weight"].to_local().data[0, 0] = 1000.0 + step  # bumps no version counter
        # A DTensor whose local tensor was replaced, and a plain tensor replaced, by equal-shaped ones.
        _model(state)["layer2.weight"] = _dt(torch.full((8, 6), float(step)), mesh)
        state["bias"] = torch.full((5,), -float(step))
        state["rng"] = PerRank({"pos": step, "note": "z" * 40})
        assert not saver.save_and_check(state)


def test_a_train_state_of_dtensors_reuses_its_plan(mesh, job, tmp_path, monkeypatch):
    """A TrainState of a model with DTensor parameters, an optimizer with state, and RNG states
    that move between saves: after the first save, no save plans again, and each restores bitwise."""
    import random

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    for mod in model:
        for name, p in list(mod.named_parameters()):
            setattr(mod, name, torch.nn.Parameter(_dt(p.detach().clone(), mesh)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizer=opt, extra={"epoch": 0})

    def train_step() -> None:
        random.random()  # the python RNG state's encoded length moves with its numbers
        loss = sum(p.to_local().sum() for p in model.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()

    def snapshot() -> tuple[dict[str, torch.Tensor], Any]:
        sd = state.state_dict()
        return ({k: v.to_local().clone() for k, v in sd["model"].items()},
                {k: {n: (t.to_local() if isinstance(t, DTensor) else t).clone() for n, t in v.items()}
                 for k, v in sd["optimizer"]["state"].items()})

    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        saver = Saver(store, monkeypatch)
        train_step()
        for step in range(1, 5):
            before = saver.planned
            store.save(step, state).wait("local")
            assert (saver.planned > before) == (step == 1), step
            want = snapshot()
            draws = (random.random(), torch.rand(2))  # what the restored RNG states must draw again
            for _ in range(2):
                train_step()
            assert store.restore(state, step=step) == step
            again = (random.random(), torch.rand(2))
            assert draws[0] == again[0] and torch.equal(draws[1], again[1])
            got = snapshot()
            for k, v in want[0].items():
                assert torch.equal(got[0][k], v), k
            for k, v in want[1].items():
                for n, t in v.items():
                    assert torch.equal(got[1][k][n], t), (k, n)
