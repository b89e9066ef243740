"""A save of an unchanged structure reuses the last save's plan and slot views, and copies in one
grouped call: every structural change must plan afresh, and no save may ever stage stale values.

Each test saves into a real store (RAM segments in /dev/shm, a local directory) and restores the
step it just saved, comparing bitwise with what was saved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch

import ckptstore._buffers as buffers
import ckptstore.engine.pipeline as pipeline_module
from ckptstore import CheckpointStore
from ckptstore.planning.flatten import fingerprint


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(8, 6, generator=g) for i in range(20)},
        "opt": {"step": 3, "lr": 0.1, "moments": [torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]},
        "ids": torch.arange(7, dtype=torch.int64),
        "groups": [[torch.randn(3, generator=g), torch.randn(3, generator=g)], [torch.randn(3, generator=g)]],
    }


def _zeros_like(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)  # keeps the strides of a dense tensor: a restore into the same layout
    if isinstance(obj, dict):
        return type(obj)((k, _zeros_like(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_zeros_like(v) for v in obj]
    return None


def _assert_bitwise(got: Any, want: Any, where: str = "state") -> None:
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_bitwise(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_bitwise(a, b, f"{where}/{i}")
    else:
        assert got == want, where


class Saver:
    """A real store; every save is restored at once into a fresh skeleton and compared bitwise.
    The copy, the skeleton and the comparison are the module's: a subclass may name others."""

    copy = staticmethod(lambda state: _clone(state))
    blank = staticmethod(lambda state: _zeros_like(state))
    same = staticmethod(lambda got, want: _assert_bitwise(got, want))

    def __init__(self, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store, self.step, self.planned = store, 0, 0
        real = pipeline_module.collect

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.planned += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(pipeline_module, "collect", counting)

    def save_and_check(self, state: Any) -> bool:
        """Save ``state``, restore it, compare; True when the save planned afresh."""
        before = self.planned
        self.step += 1
        self.store.save(self.step, state).wait("local")
        # The skeleton is built after the save: values written after save returned must not matter.
        expected = self.copy(state)
        target = self.blank(state)
        assert self.store.restore(target, step=self.step) == self.step
        self.same(target, expected)
        return self.planned > before


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return type(obj)((k, _clone(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


@pytest.fixture
def saver(job, tmp_path, monkeypatch):
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=2) as store:
        yield Saver(store, monkeypatch)


def _model(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return state["model"]


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "new key": lambda s: _model(s).__setitem__("extra", torch.randn(9)),
    "removed key": lambda s: _model(s).pop("layer3.weight"),
    "dtype": lambda s: _model(s).__setitem__("layer4.weight", torch.randn(8, 6).to(torch.bfloat16)),
    # Same bytes, same numel, same dtype: only the shape says where the values go.
    "shape": lambda s: _model(s).__setitem__("layer5.weight", torch.randn(6, 8)),
    # Same strides: only the shape tells the entries apart.
    "length": lambda s: _model(s).__setitem__("layer5.weight", torch.randn(16, 6)),
    # Same shape and dtype, another order of the same memory: a transposed view.
    "stride": lambda s: _model(s).__setitem__("layer6.weight", torch.randn(6, 8).t()),
    "non-contiguous slice": lambda s: _model(s).__setitem__("layer7.weight", torch.randn(8, 12)[:, ::2]),
    "key order": lambda s: s.__setitem__("model", dict(reversed(list(_model(s).items())))),
    "scalar leaf": lambda s: s["opt"].__setitem__("step", 4),
    "float leaf": lambda s: s["opt"].__setitem__("lr", 0.05),
    "list length": lambda s: s["opt"]["moments"].append(torch.randn(2)),
    # The same tensors in the same order, cut into lists elsewhere: only the lengths differ.
    "list boundary": lambda s: s.__setitem__("groups", [[s["groups"][0][0]], [s["groups"][0][1], s["groups"][1][0]]]),
    "container type": lambda s: s.__setitem__("model", OrderedDict(_model(s))),
    "same tensor twice": lambda s: _model(s).__setitem__("layer9.weight", _model(s)["layer8.weight"]),
    "zero-size tensor": lambda s: _model(s).__setitem__("layer10.weight", torch.empty(0, 6)),
}


def test_every_structural_change_in_turn_plans_afresh_and_restores_bitwise(saver):
    """All the changes above, one after the other on one store (the default run's version of the
    test after it): each plans afresh, restores bitwise, and its plan is kept for the next save."""
    state = _state()
    assert saver.save_and_check(state)
    assert not saver.save_and_check(_state(1))
    for i, (change, apply) in enumerate(CHANGES.items()):
        apply(state)
        assert saver.save_and_check(state), f"a {change} change reused the last plan"
        for t in _tensors(state):
            t.add_(i + 1) if t.dtype.is_floating_point else t.add_(2)
        assert not saver.save_and_check(state), f"after {change}"


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_structural_change_plans_afresh_and_restores_bitwise(saver, change):
    state = _state()
    assert saver.save_and_check(state)  # the first save plans
    state = _state(1)
    assert not saver.save_and_check(state)  # the same structure: the plan is reused
    assert not saver.save_and_check(_state(2))  # new tensor objects of the same structure, too
    CHANGES[change](state)
    assert saver.save_and_check(state), f"a {change} change reused the last plan"
    for t in _tensors(state):
        t.add_(1) if t.dtype.is_floating_point else t.add_(2)
    assert not saver.save_and_check(state)  # the new structure is kept (an alias of one tensor too)
    # And back: the old structure is a change as well.
    assert saver.save_and_check(_state(3))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_values_changed_in_place_between_saves_are_never_stale(saver):
    state = _state()
    saver.save_and_check(state)
    for step in range(4):  # both slots, twice each, with the plan and the slot views reused
        for t in _tensors(state):
            t.mul_(-1.5) if t.dtype.is_floating_point else t.add_(1)
        with torch.no_grad():
            _model(state)["layer0.weight"].data[0, 0] = 1000.0 + step  # a write that bumps no version counter
        assert not saver.save_and_check(state)


def test_tensors_that_require_grad_and_conjugate_views_stage_their_values(saver):
    state = {"p": torch.nn.Parameter(torch.randn(4, 3)), "c": torch.randn(5, dtype=torch.complex64).conj()}
    saver.save_and_check(state)
    with torch.no_grad():
        state["p"].add_(1)
    assert not saver.save_and_check(state)


def test_frozen_keys_and_the_reused_plan(job, tmp_path, monkeypatch):
    with CheckpointStore(job, local=str(tmp_path / "local"), frozen=lambda k: "layer1" in k) as store:
        saver = Saver(store, monkeypatch)
        state = {"model": {f"layer{i}.weight": torch.randn(128, 128) for i in range(3)}}  # 64 KiB each
        saver.save_and_check(state)
        for _ in range(3):
            for t in _tensors(state):
                t.add_(1)  # the frozen one too: its version counter moves, so it is copied again
            assert not saver.save_and_check(state)


def test_fingerprint_tells_devices_and_subclasses_apart():
    cpu = fingerprint({"w": torch.zeros(3)})
    meta = fingerprint({"w": torch.zeros(3, device="meta")})
    assert cpu is not None and meta is not None and cpu[1] != meta[1]
    # What the fingerprint cannot describe completely (a tensor subclass, a cycle, a key that is
    # neither str nor int) is planned afresh at every save.

    class Sub(torch.Tensor):
        pass

    assert fingerprint({"w": torch.zeros(3).as_subclass(Sub)}) is None
    loop: list[Any] = []
    loop.append(loop)
    assert fingerprint({"cycle": loop}) is None
    assert fingerprint({("tuple", "key"): torch.zeros(1)}) is None
    assert fingerprint({"a": 0.0})[1] != fingerprint({"a": -0.0})[1]  # type: ignore[index]
    assert fingerprint({"a": 1})[1] != fingerprint({"a": True})[1]  # type: ignore[index]


def _pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    srcs = [torch.randn(5, 4).t(), torch.arange(6, dtype=torch.int16), torch.randn(3, dtype=torch.complex64).conj(),
            torch.randn(2, 2, requires_grad=True), torch.randn(7).to(torch.bfloat16)]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    return dsts, srcs


def _check(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.detach().resolve_conj())


def test_grouped_copy_with_torch_foreach_copy():
    assert hasattr(torch, "_foreach_copy_"), "torch no longer has _foreach_copy_: every save takes the copy_ loop"
    dsts, srcs = _pairs()
    with torch.no_grad():
        buffers.copy_grouped(dsts, srcs)
    _check(dsts, srcs)


@pytest.mark.parametrize("how", ["missing", "refused"])
def test_grouped_copy_falls_back_to_the_copy_loop(monkeypatch, how):
    if how == "missing":
        monkeypatch.delattr(torch, "_foreach_copy_")
    else:
        def refuse(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
            dsts[0].copy_(srcs[0])  # a refusal after part of the work
            raise RuntimeError("no foreach kernel for this dtype")

        monkeypatch.setattr(torch, "_foreach_copy_", refuse)
    dsts, srcs = _pairs()
    with torch.no_grad():
        buffers.copy_grouped(dsts, srcs)
    _check(dsts, srcs)
