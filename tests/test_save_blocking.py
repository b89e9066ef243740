"""What keeps ``CheckpointStore.save`` per byte rather than per tensor for DTensor and TrainState
states, and the proofs that the shortcuts stay exact:

- a save of an unchanged DTensor structure reads none of DTensor's Python properties (its spec and
  local tensor come from the one function that reads DTensor's private attributes; a test fails
  when torch changes them, and without them the public path still tells every change apart);
- ``TrainState.state_dict()`` equals torch's ``get_model_state_dict`` / ``get_optimizer_state_dict``
  key by key (plain, tied weights and buffers, FSDP2, Adam), after every structural change, while
  calling them only when the model's structure changed.

One process is a one-rank gloo job (a real process group and device meshes over it); saves go into
a real store (RAM segments in /dev/shm, a local directory) and are restored and compared bitwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
from test_plan_cache import Saver, _dt, _named_mesh, _state
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import ckptstore.planning.flatten as flatten
from ckptstore import CheckpointStore, TrainState


@pytest.fixture(scope="module")
def named_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Another mesh of the same shape (made once: each mesh makes process groups)."""
    return _named_mesh()


@pytest.fixture
def saver(mesh, job, tmp_path, monkeypatch) -> Iterator[Saver]:
    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        yield Saver(store, monkeypatch)


# ------------------------------------------------------------------------------ DTensors


def test_dtensor_internals_are_what_the_public_properties_say(mesh, named_mesh):
    """Fails when torch renames or changes DTensor's private ``_local_tensor`` and ``_spec``: the
    spec must tell apart exactly what the public properties tell apart."""
    base = torch.arange(48.0).reshape(8, 6)
    variants = {
        "shard0": _dt(base, mesh),
        "shard0 again": _dt(base.clone(), mesh),
        "shard1": _dt(base, mesh, [Shard(1)]),
        "replicate": _dt(base, mesh, [Replicate()]),
        "named mesh": _dt(base, named_mesh),
        "2-d mesh": _dt(base, init_device_mesh("cpu", (1, 1)), [Shard(0), Replicate()]),
        "shape": _dt(base.reshape(6, 8), mesh),
        "dtype": _dt(base.double(), mesh),
    }
    public = {}
    for name, t in variants.items():
        found = flatten.dtensor_internals(t)
        assert found is not None, name
        with torch.no_grad():
            assert found[0] is t.to_local(), name
        public[name] = (t.device_mesh, tuple(t.placements), t.shape, t.dtype)
    for a in variants:
        for b in variants:
            same_spec = flatten.dtensor_internals(variants[a])[1] == flatten.dtensor_internals(variants[b])[1]  # type: ignore[index]
            assert same_spec == (public[a] == public[b]), (a, b)
    assert flatten.dtensor_internals(torch.zeros(2)) is None  # a plain tensor has neither


_PROPERTIES = ("placements", "device_mesh", "to_local", "redistribute", "full_tensor")


def test_a_save_of_an_unchanged_dtensor_structure_reads_no_dtensor_property(saver, mesh, monkeypatch):
    """The per-save walk reads each DTensor's spec and local tensor, not its Python properties
    (about a microsecond each, per tensor, per save); the saved values are still the new ones."""
    assert saver.save_and_check(_state(mesh))
    reads: list[str] = []
    for name in _PROPERTIES:
        real = getattr(DTensor, name)
        if isinstance(real, property):
            counted: Any = property(lambda self, _r=real, _n=name: (reads.append(_n), _r.fget(self))[1])
        else:
            counted = (lambda _r, _n: lambda self, *a, **k: (reads.append(_n), _r(self, *a, **k))[1])(real, name)
        monkeypatch.setattr(DTensor, name, counted)
    state = _state(mesh, 1)
    store = saver.store
    saver.step += 1
    before = saver.planned
    store.save(saver.step, state).wait("local")
    assert saver.planned == before, "an unchanged structure plans again"
    assert reads == [], f"the save read DTensor properties: {sorted(set(reads))} ({len(reads)} reads)"
    monkeypatch.undo()
    saver.step += 1
    assert not saver.save_and_check(_state(mesh, 2))  # and the reused plan saves the values bitwise


def test_without_dtensor_internals_the_public_path_tells_every_change_apart(saver, mesh, named_mesh, monkeypatch):
    """A torch without DTensor's private attributes: each change of placement, mesh, shape or
    dtype, and a replaced local tensor, plans afresh (or stages the new tensor) and restores bitwise."""
    def missing(obj: Any) -> Any:
        raise AttributeError("_local_tensor")  # what a torch without them raises

    monkeypatch.setattr(flatten, "_dtensor_parts", missing)
    assert flatten.dtensor_internals(_dt(torch.zeros(2), mesh)) is None
    state = _state(mesh)
    assert saver.save_and_check(state)
    assert not saver.save_and_check(state)
    model = state["model"]
    changes = [
        lambda: model.__setitem__("layer1.weight", _dt(torch.randn(8, 6), mesh, [Replicate()])),
        lambda: model.__setitem__("layer2.weight", _dt(torch.randn(8, 6), named_mesh)),
        lambda: model.__setitem__("layer3.weight", _dt(torch.randn(6, 8), mesh)),
        lambda: model.__setitem__("layer4.weight", _dt(torch.randn(8, 6).double(), mesh)),
    ]
    for change in changes:
        change()
        assert saver.save_and_check(state)
    model["layer5.weight"] = _dt(torch.full((8, 6), 7.0), mesh)  # the same structure, a new local tensor
    assert not saver.save_and_check(state)


def test_the_walk_reads_every_dtensor_as_dtensor_leaf_does(mesh, named_mesh, monkeypatch):
    """The fingerprint reads the DTensors of a tree in columns (their specs and local tensors at
    once): wherever a DTensor sits, it must give dtensor_leaf's tensor, and a key that tells every
    case apart, with torch's private attributes and without them, whatever the local tensor's layout."""
    base = torch.arange(48.0).reshape(8, 6)
    cases = [
        _dt(base, mesh),
        _dt(base, mesh, [Replicate()]),
        _dt(base, named_mesh, [Shard(1)]),
        DTensor.from_local(base.t().contiguous().t(), mesh, [Shard(0)]),  # a column-major local tensor
        DTensor.from_local(base[:, 1:4], mesh, [Shard(0)]),  # a local tensor that is a strided view
        _dt(base.double(), init_device_mesh("cpu", (1, 1)), [Shard(0), Replicate()]),
    ]
    for private in (True, False):
        if not private:
            def missing(obj: Any) -> Any:
                raise AttributeError("_spec")

            monkeypatch.setattr(flatten, "_dtensor_parts", missing)
            monkeypatch.setattr(flatten, "_dtensor_local", missing)
        for dt in cases:
            with torch.no_grad():
                want_tensor, _ = flatten.dtensor_leaf(dt)  # type: ignore[misc]
            for tree in ({"w": dt}, [dt], ({"inner": [dt]},), dt):
                with torch.no_grad():
                    found = flatten.fingerprint(tree, dtensor=DTensor)
                assert found is not None, tree
                leaves, key = found
                assert len(leaves) == 1 and leaves[0] is want_tensor, (private, tree)
            # And the key tells this DTensor from the same values as a plain tensor, and from each other case.
            with torch.no_grad():
                keys = [flatten.fingerprint({"w": other}, dtensor=DTensor)[1] for other in cases]  # type: ignore[index]
                plain = flatten.fingerprint({"w": dt.to_local()}, dtensor=DTensor)[1]  # type: ignore[index]
            assert keys.count(flatten.fingerprint({"w": dt}, dtensor=DTensor)[1]) == 1  # type: ignore[index]
            assert plain not in keys


def test_the_trainers_thread_never_wakes_the_loop_itself(saver, mesh, monkeypatch):
    """Waking the background loop is a system call that releases the GIL, and the trainer's thread
    then waited for the loop (and the checksum worker it starts) to hand it back, inside ``save``:
    the hand-off thread makes that call instead. Every save still reaches every tier in order and
    restores bitwise, and close() leaves no hand-off thread behind."""
    import threading

    from ckptstore._aio import LoopThread

    callers: list[str] = []
    real = LoopThread.submit

    def recording(self: Any, coro: Any) -> Any:
        callers.append(threading.current_thread().name)
        return real(self, coro)

    monkeypatch.setattr(LoopThread, "submit", recording)
    states = [_state(mesh, seed) for seed in range(4)]
    for state in states:
        saver.save_and_check(state)
    assert callers and threading.main_thread().name not in callers, callers
    saver.store.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckptstore-handoff")]


# ------------------------------------------------------------------------------ TrainState


def _assert_same(got: Any, want: Any, where: str = "sd") -> None:
    """Key by key: containers, order, ``_metadata``, values; tensors by type, dtype, shape, strides,
    device, requires_grad and the memory they view (DTensors: placements, mesh, local tensor)."""
    assert type(got) is type(want), where
    if isinstance(want, DTensor):
        assert got.placements == want.placements and got.device_mesh == want.device_mesh, where
        assert got.shape == want.shape and got.requires_grad == want.requires_grad, where
        with torch.no_grad():
            got, want = got.to_local(), want.to_local()
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.device, got.requires_grad, got.layout) == (
            want.dtype, want.shape, want.stride(), want.device, want.requires_grad, want.layout), where
        assert (got.data_ptr(), got.storage_offset()) == (want.data_ptr(), want.storage_offset()), where
        assert got._version == want._version, where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}/{i}")
    else:
        assert got == want, where


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: two keys, one parameter
        self.norm = torch.nn.BatchNorm1d(4)  # buffers, one of them an int64 counter
        self.register_buffer("scratch", torch.zeros(3), persistent=False)  # not in the state dict
        self.again = self.blocks[0]  # a module reached twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x).mean(1))
        return self.head(self.blocks(h) + self.again(h))


def _fsdp2(mesh: DeviceMesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _dtensor_params(mesh: DeviceMesh) -> torch.nn.Module:
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    for mod in model:
        for name, p in list(mod.named_parameters()):
            setattr(mod, name, torch.nn.Parameter(_dt(p.detach().clone(), mesh)))
    return model


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    sum((p.to_local() if isinstance(p, DTensor) else p).float().pow(2).sum() for p in model.parameters()).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", ["tied", "dtensor", "fsdp2"])
def test_train_state_dicts_equal_torchs_through_structural_changes(mesh, kind, monkeypatch):
    torch.manual_seed(0)
    tied = kind == "tied"
    model = _Tied() if tied else _dtensor_params(mesh) if kind == "dtensor" else _fsdp2(mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizer=opt)
    calls = {"model": 0, "optim": 0}
    real_model, real_optim = dcp_state_dict.get_model_state_dict, dcp_state_dict.get_optimizer_state_dict

    def check(where: str) -> None:
        sd = state.state_dict()
        _assert_same(sd["model"], real_model(model), f"{where}: model")
        _assert_same(sd["optimizer"], real_optim(model, opt), f"{where}: optimizer")

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(dcp_state_dict, "get_model_state_dict", counted("model", real_model))
    monkeypatch.setattr(dcp_state_dict, "get_optimizer_state_dict", counted("optim", real_optim))
    check("no optimizer state yet")  # torch's own initialises it
    _step(model, opt)
    check("after a step")
    calls.update(model=0, optim=0)
    for i in range(3):
        _step(model, opt)
        state.state_dict()
        check(f"step {i}")
    assert calls == {"model": 0, "optim": 0}, "torch's functions ran for an unchanged structure"

    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    # A parameter's memory replaced in place (.data, set_): nothing may view the old memory.
    if tied:
        first.bias.data = first.bias.data.clone()
        check("a parameter's .data replaced")
    elif kind == "dtensor":
        with torch.no_grad():
            first.bias.to_local().set_(torch.randn(first.bias.to_local().shape))
        check("a DTensor's local tensor set_ to other memory")
    # A new parameter in the model and in a new param group: new keys, new optimizer state.
    extra = torch.nn.Parameter(torch.randn(4) if tied else _dt(torch.randn(4), mesh))
    first.register_parameter("extra", extra)
    check("a new parameter")
    opt.add_param_group({"params": [extra], "lr": 0.5})
    check("a new param group")
    _step(model, opt)
    with torch.no_grad():
        (extra.to_local() if isinstance(extra, DTensor) else extra).add_(1)  # extra gets no grad: no state
    opt.state[extra]["momentum"] = torch.ones(2)  # new optimizer state of a parameter
    check("new optimizer state")
    del first._parameters["extra"]
    opt.param_groups.pop()
    del opt.state[extra]
    check("a parameter removed")
    # A parameter replaced by another object of the same shape.
    old = first.weight
    first.weight = torch.nn.Parameter(old.detach().clone() * 2)
    opt.param_groups[0]["params"] = list(model.parameters())
    opt.state[first.weight] = opt.state.pop(old)
    check("a parameter replaced")


def test_a_wrapped_model_keeps_torchs_functions(monkeypatch):
    """A model torch renames keys for (here a module whose own state_dict differs) gets torch's
    output, not the replay."""

    class Renaming(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(3, 3)

        def get_extra_state(self) -> Any:
            return {"note": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    model = Renaming()
    state = TrainState(model=model)
    for _ in range(2):
        _assert_same(state.state_dict()["model"], dcp_state_dict.get_model_state_dict(model))


def test_a_train_state_save_restores_bitwise_after_structural_changes(mesh, job, tmp_path, monkeypatch):
    """Through the store: a TrainState of DTensor parameters restores bitwise, before and after
    its model gained a parameter; only the first save and the one after the change ask torch."""
    asked = []
    real = dcp_state_dict.get_model_state_dict
    monkeypatch.setattr(dcp_state_dict, "get_model_state_dict", lambda *a, **k: (asked.append(1), real(*a, **k))[1])
    torch.manual_seed(1)
    model = torch.nn.Module()
    model.p = torch.nn.ParameterList(torch.nn.Parameter(_dt(torch.randn(4, 3), mesh)) for _ in range(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)

    def train() -> None:
        sum(p.to_local().sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()

    with CheckpointStore(job, local=str(tmp_path / "local"), keep_local=1) as store:
        train()
        for step in range(1, 4):
            if step == 3:
                model.p.append(torch.nn.Parameter(_dt(torch.randn(2), mesh)))
                opt.add_param_group({"params": [model.p[4]]})
                train()
            before = len(asked)
            store.save(step, state).wait("local")
            assert (len(asked) > before) == (step in (1, 3)), step
            with torch.no_grad():
                want = {k: v.to_local().clone() for k, v in model.state_dict().items()}
            train()
            assert store.restore(state, step=step) == step
            with torch.no_grad():
                got = {k: v.to_local() for k, v in model.state_dict().items()}
            assert list(got) == list(want)
            for k in want:
                assert torch.equal(got[k], want[k]), (step, k)



def test_a_parameter_replaced_behind_the_optimizers_back_fails_as_torch_does():
    """The model's parameter replaced while the optimizer still holds the old one: torch's
    function refuses it, and so does the state dict, rather than save the old one's state under
    the new one's name."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt)
    _step(model, opt)
    for _ in range(2):
        _assert_same(state.state_dict()["optimizer"], dcp_state_dict.get_optimizer_state_dict(model, opt))
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
    with pytest.raises(KeyError):
        dcp_state_dict.get_optimizer_state_dict(model, opt)
    with pytest.raises(KeyError):
        state.state_dict()
