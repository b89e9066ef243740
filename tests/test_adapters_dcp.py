"""ckptstore.dcp: torch.distributed.checkpoint's own save/load over a CheckpointStore's tiers.

The multi-rank trials run real processes on gloo over loopback: two ranks save DTensors (sharded
on different dims), a plain replicated tensor, a 0-dim tensor and non-tensor values through
``dcp.save`` and ``dcp.async_save``; the checkpoint is then loaded through ``dcp.load`` by one
process without a process group, and by two ranks with another sharding (DCP's planner reshards),
and every value is compared bitwise with the reference.
"""

from __future__ import annotations

import os
import shutil
import traceback
import warnings

import dist_workers
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import assert_tensor_identical, wipe_ram
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

import ckptstore
from ckptstore.dcp import Reader, Writer

# dcp.save/load without an initialised process group warn that they assume a single process.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def reference(scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10, 6, generator=g) * scale,  # 10 rows: uneven over 3, even over 2
        "big": torch.randn(64, 1200, generator=g) * scale,  # over 4 MiB? no: ~300 KB, several block reads
        "ids": torch.randint(-(2**40), 2**40, (7, 5), generator=g, dtype=torch.int64) * scale,
        "plain": torch.randn(11, generator=g) * scale,
        "scalar": torch.tensor(3.25 * scale),
    }


def _state(layout: dict[str, int | None], *, zeros: bool, scale: int = 1) -> dict:
    """The reference as DTensors on a 1-D mesh (``layout``: the shard dim, None for Replicate);
    keys not in ``layout`` stay plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),)) if layout else None
    out: dict = {}
    for name, ref in reference(scale).items():
        full = torch.zeros_like(ref) if zeros else ref.clone()
        if name in layout:
            dim = layout[name]
            out[name] = distribute_tensor(full, mesh, [Replicate() if dim is None else Shard(dim)])
        else:
            out[name] = full
    out["meta"] = {"step": 0 if zeros else 42 * scale, "names": [] if zeros else ["a", "b"]}
    return out


def _check(state: dict, scale: int) -> None:
    from torch.distributed.tensor import DTensor

    for name, ref in reference(scale).items():
        got = state[name]
        full = got.full_tensor() if isinstance(got, DTensor) else got
        assert_tensor_identical(full, ref, name)
    assert state["meta"] == {"step": 42 * scale, "names": ["a", "b"]}


# ----------------------------------------------------------------------------------- workers


def _run(rank: int, world: int, init: str, fn: str, args: dict, results: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        warnings.simplefilter("error")
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        try:
            globals()[fn](**args)
        finally:
            dist.destroy_process_group()
        open(os.path.join(results, f"ok-{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(results, f"error-{rank}"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def save_job(job: str, local: str) -> None:
    with ckptstore.CheckpointStore(job, local=local) as store:
        writer = Writer(store)
        dcp.save(_state({"w": 0, "big": 1, "ids": None}, zeros=False), storage_writer=writer, checkpoint_id=5)
        assert writer.handle is not None and writer.handle.step == 5
        # async_save: DCP stages a CPU copy, then saves through the same writer in its own thread.
        fut = dcp.async_save(_state({"w": 1, "big": 0}, zeros=False, scale=2), storage_writer=Writer(store))
        fut.result()
        # Without checkpoint_id the step follows the newest one.
        assert store.last_step == 6
        store.close(keep_ram=True)  # the loads that follow on this node read these RAM segments


def load_job(job: str, local: str, layout: dict, step: int | None, scale: int) -> None:
    with ckptstore.CheckpointStore(job, local=local) as store:
        state = _state(layout, zeros=True)
        reader = Reader(store, step=step)
        dcp.load(state, storage_reader=reader)
        assert reader.step == (6 if step is None else step)
        _check(state, scale)


# Rows of "w" (10 x 6) each rank holds as a ShardedTensor of two local shards, and how a later plan
# (rows over 2 ranks as a DTensor on dim 1) asks for them.
SPANS = {0: [(0, 3), (5, 3)], 1: [(3, 2), (8, 2)]}


def several_shards_save_job(job: str, local: str) -> None:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()
    full = reference()["w"]
    shards = [Shard(full[o : o + n].clone(), ShardMetadata([o, 0], [n, 6], f"rank:{rank}/cpu")) for o, n in SPANS[rank]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor is deprecated, yet DCP's tests still use it
        state = {"w": init_from_local_shards(shards, [10, 6])}
        with ckptstore.CheckpointStore(job, local=local) as store:
            dcp.save(state, storage_writer=Writer(store), checkpoint_id=1)


def several_shards_load_job(job: str, local: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)])}
    with ckptstore.CheckpointStore(job, local=local) as store:
        dcp.load(state, storage_reader=Reader(store, step=1))
    assert_tensor_identical(state["w"].full_tensor(), reference()["w"], "w")


def _spawn(world: int, fn: str, tmp_path, **args) -> None:
    dist_workers.spawn(world, fn, tmp_path, target=_run, **args)


# ------------------------------------------------------------------------------------- tests


def test_two_ranks_save_and_reshard_on_load_into_one_process_and_another_sharding(tmp_path, job):
    local = str(tmp_path / "local")
    _spawn(2, "save_job", tmp_path, job=job, local=local)
    # Every tier holds an ordinary sharded checkpoint that ckptstore reads without DCP.
    assert sorted(os.listdir(local)) == ["step-000000000005", "step-000000000006"]
    plain: dict = {"dcp": None}
    ckptstore.load_sharded(plain, os.path.join(local, "step-000000000006"))
    assert_tensor_identical(plain["dcp"]["w"], reference(2)["w"], "w")

    # One process, no process group: the newest step (6, from async_save), then step 5 by id,
    # read from the RAM segments the two dead ranks left behind.
    with ckptstore.CheckpointStore(job, local=local) as store:
        state = _state({}, zeros=True)
        reader = Reader(store)
        dcp.load(state, storage_reader=reader)
        assert reader.step == 6
        _check(state, 2)
        state = _state({}, zeros=True)
        dcp.load(state, storage_reader=Reader(store), checkpoint_id=5)
        _check(state, 1)

    # Two ranks with another sharding (w sharded on dim 1 now, big replicated, ids sharded), read
    # from the local tier once the RAM copies are gone.
    wipe_ram(job)
    _spawn(2, "load_job", tmp_path, job=job, local=local, layout={"w": 1, "big": None, "ids": 0}, step=5, scale=1)


def test_single_process_round_trip_of_a_model_and_optimizer(tmp_path, job):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        writer = Writer(store)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, storage_writer=writer)
        assert writer.handle is not None and writer.handle.step == 0  # returns once in RAM; the rest follows
        writer.handle.wait("local")
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, storage_writer=writer)
        assert writer.handle.step == 1
    wipe_ram(job)  # a fresh node: only the local directory is left
    model2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.Adam(model2.parameters())
    model2(torch.randn(2, 8)).sum().backward()
    opt2.step()
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        dcp.load(state, storage_reader=Reader(store))
    for k, v in model.state_dict().items():
        assert_tensor_identical(state["model"][k], v, k)
    for p in (0, 1):
        for k, v in opt.state_dict()["state"][p].items():
            assert_tensor_identical(state["optim"]["state"][p][k], v, f"optim.state.{p}.{k}")


def test_a_missing_step_and_a_bad_id_are_clear_errors(tmp_path, job):
    with ckptstore.CheckpointStore(job, local=tmp_path / "local") as store:
        with pytest.raises(CheckpointException, match="has no checkpoint in any tier"):
            dcp.load({"x": torch.zeros(2)}, storage_reader=Reader(store))
        dcp.save({"x": torch.ones(2)}, storage_writer=Writer(store), checkpoint_id=3)
        with pytest.raises(CheckpointException, match="no tier holds step 4"):
            dcp.load({"x": torch.zeros(2)}, storage_reader=Reader(store), checkpoint_id=4)
        with pytest.raises(ckptstore.InvalidArgumentError, match="the checkpoint id is the store's step"):
            Writer(store, step="latest")  # type: ignore[arg-type]
        with pytest.raises(ckptstore.InvalidArgumentError, match="needs a ckptstore.CheckpointStore"):
            Writer("/tmp/x")  # type: ignore[arg-type]
        store.save(9, {"y": torch.ones(1)})  # a step not written through DCP
        with pytest.raises(CheckpointException, match="lacks 1 key"):
            dcp.load({"x": torch.zeros(2)}, storage_reader=Reader(store))


def test_odd_sized_bytes_beside_a_0_dim_tensor_load(tmp_path):
    """Regression: read buffers were cut at odd offsets, and a 0-dim float read after a 3783-byte
    item could not be viewed as float (found through DCP's pickled non-tensor values)."""
    state = {"b": torch.arange(3783).to(torch.uint8), "s": torch.tensor(3.5)}
    ckptstore.save_sharded(state, str(tmp_path / "x"))
    out: dict = {"b": None, "s": None}
    ckptstore.load_sharded(out, str(tmp_path / "x"))
    assert_tensor_identical(out["s"], state["s"], "s")
    assert_tensor_identical(out["b"], state["b"], "b")
    shutil.rmtree(tmp_path / "x")


def test_adapters_load_lazily_from_the_package():
    import subprocess
    import sys

    code = ("import sys, ckptstore; assert 'ckptstore.dcp' not in sys.modules and 'lightning' not in sys.modules; "
            "from ckptstore.dcp import Writer; assert ckptstore.dcp.Writer is Writer; "
            "assert ckptstore.hf.export_safetensors; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ckptstore.nope  # noqa: B018


def test_several_local_shards_of_a_sharded_tensor_save_and_load_into_another_plan(tmp_path, job):
    local = str(tmp_path / "local")
    _spawn(2, "several_shards_save_job", tmp_path, job=job, local=local)
    plain: dict = {"dcp": None}
    ckptstore.load_sharded(plain, os.path.join(local, "step-000000000001"))
    assert_tensor_identical(plain["dcp"]["w"], reference()["w"], "w")
    wipe_ram(job)
    _spawn(2, "several_shards_load_job", tmp_path, job=job, local=local)
