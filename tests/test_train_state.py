"""TrainState: a resumed run draws the same random numbers and computes the same losses, bitwise."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ckptstore
from ckptstore import CheckpointStore, TrainState


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _step(model, opt, sched, gen: np.random.Generator, tgen: torch.Generator) -> float:
    # Every RNG a run may draw from: torch (dropout, randn), python random, numpy global and a
    # registered numpy Generator and torch Generator.
    x = torch.randn(4, 8) + random.random() + float(np.random.rand()) + float(gen.random())
    x = x + torch.rand(1, generator=tgen)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed), torch.Generator().manual_seed(seed)


def test_resume_through_the_store_is_bitwise_equal_to_a_straight_run(job, tmp_path):
    n = 5
    model, opt, sched = _parts()
    gen, tgen = _seed_all(1)
    state = TrainState(model=model, optimizer=opt, scheduler=sched, extra={"tokens": 0},
                       generators={"np": gen, "t": tgen})
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        for _ in range(n):
            _step(model, opt, sched, gen, tgen)
        state.extra["tokens"] = 1234
        store.save(n, state).wait("local")
        straight = [_step(model, opt, sched, gen, tgen) for _ in range(n)]
    final = {k: v.clone() for k, v in model.state_dict().items()}

    # Another "process": everything rebuilt with other seeds, then restored.
    model2, opt2, sched2 = _parts(seed=99)
    gen2, tgen2 = _seed_all(99)
    state2 = TrainState(model=model2, optimizer=opt2, scheduler=sched2, generators={"np": gen2, "t": tgen2})
    with CheckpointStore(job, local=str(tmp_path / "local")) as store:
        assert store.restore(state2) == n
    assert state2.extra == {"tokens": 1234}
    assert sched2.last_epoch == n and opt2.state_dict()["state"][0]["step"].item() == n
    resumed = [_step(model2, opt2, sched2, gen2, tgen2) for _ in range(n)]
    assert resumed == straight
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_resume_through_save_sharded_and_load_sharded(tmp_path):
    model, opt, sched = _parts()
    gen, tgen = _seed_all(3)
    for _ in range(3):
        _step(model, opt, sched, gen, tgen)
    ckptstore.save_sharded(TrainState(model=model, optimizer=opt, scheduler=sched, generators={"np": gen, "t": tgen}),
                           tmp_path / "c")
    straight = [_step(model, opt, sched, gen, tgen) for _ in range(3)]
    model2, opt2, sched2 = _parts(seed=5)
    gen2, tgen2 = _seed_all(5)
    ckptstore.load_sharded(TrainState(model=model2, optimizer=opt2, scheduler=sched2,
                                      generators={"np": gen2, "t": tgen2}), tmp_path / "c")
    assert [_step(model2, opt2, sched2, gen2, tgen2) for _ in range(3)] == straight


def test_a_generator_saved_but_not_registered_is_an_error(tmp_path):
    model, opt, sched = _parts()
    gen, tgen = _seed_all(0)
    ckptstore.save_sharded(TrainState(model=model, generators={"np": gen}), tmp_path / "c")
    with pytest.raises(ckptstore.CheckpointError, match=r"RNG generators \['np'\] but this TrainState registers \[\]"):
        ckptstore.load_sharded(TrainState(model=_parts()[0]), tmp_path / "c")


def test_bad_parts_are_refused_up_front():
    model, opt, _ = _parts()
    with pytest.raises(ckptstore.InvalidArgumentError, match="needs model= too"):
        TrainState(optimizer=opt)
    with pytest.raises(ckptstore.InvalidArgumentError, match="loader=.*state_dict"):
        TrainState(model=model, loader=[1, 2, 3])


def _split(layers: list[str], seed: int = 0) -> torch.nn.Module:
    import layout_workers as lw

    torch.manual_seed(seed)
    model = lw.Model(4)
    for name in list(model.layers):
        if name not in layers:
            del model.layers[name]
    return model


def test_model_parts_restore_into_another_split_of_the_stages(tmp_path):
    import layout_workers as lw

    parts = [_split(["0", "1"]), _split(["2", "3"])]
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in parts]
    for p, o in zip(parts, opts):
        lw.train_step(p, o)
    ckptstore.save_sharded(TrainState(model=parts, optimizer=opts, extra={"k": 1}).state_dict(), str(tmp_path / "c"))
    saved = {}
    for p, o in zip(parts, opts):
        saved.update(lw.full_state(p, o))

    whole = _split(["0", "1", "2", "3"], seed=9)  # other values: everything comes from the checkpoint
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    state = TrainState(model=[whole], optimizer=[opt])
    skeleton = state.skeleton()
    ckptstore.load_sharded(skeleton, str(tmp_path / "c"), per_rank="skip")
    state.load_skeleton(skeleton)
    lw.assert_bitwise(lw.full_state(whole, opt), saved, "2 parts -> 1")
    assert state.extra == {"k": 1}

    single = TrainState(model=whole, optimizer=opt)  # one module: TrainState's version 1, which says so
    skeleton = single.skeleton()
    with pytest.raises(ckptstore.CheckpointError, match=r"model parts; restore it with TrainState\(model=\[...parts\]\)"):
        ckptstore.load_sharded(skeleton, str(tmp_path / "c"), per_rank="skip", strict=False)
        single.load_skeleton(skeleton)


def test_model_parts_need_one_optimizer_each():
    parts = [_split(["0"]), _split(["1"])]
    with pytest.raises(ckptstore.InvalidArgumentError, match="one optimizer per part"):
        TrainState(model=parts, optimizer=[torch.optim.SGD(parts[0].parameters(), lr=0.1)])
    with pytest.raises(ckptstore.InvalidArgumentError, match=r"needs model=\[...\] parts"):
        TrainState(model=parts[0], optimizer=[torch.optim.SGD(parts[0].parameters(), lr=0.1)])
