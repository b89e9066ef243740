"""Worker functions run in real processes by tests/test_sharded_dist.py (gloo over a file store).

Every worker rebuilds the same reference tensors from a fixed seed, so each process can check what
it loaded against the full reference bitwise.
"""

from __future__ import annotations

import importlib
import os
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist

import ckptstore


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        # 6000 x 1000 fp32 = 24 MB: chunks over 4 MiB, so block checksums and ranged reads are used.
        "big": torch.randn(6000, 1000, generator=g),
        "w": torch.randn(10, 7, generator=g),
        "odd": torch.randint(-(2**40), 2**40, (13, 5), generator=g, dtype=torch.int64),
        "bf": torch.randn(6, 9, 4, generator=g).to(torch.bfloat16),
        "plain": torch.randn(11, generator=g),  # plain tensor: replicated
    }


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _placements(spec: list[tuple], ndim: int):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(p[1]) if p[0] == "shard" else Replicate() for p in spec][:ndim]


def _state(mesh_shape, layouts, *, zeros: bool):
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh(tuple(mesh_shape))
    state = {}
    for name, ref in reference().items():
        full = torch.zeros_like(ref) if zeros else ref
        spec = layouts.get(name)
        state[name] = full.clone() if spec is None else distribute_tensor(full, mesh, _placements(spec, len(mesh_shape)))
    return state


def run(rank: int, world: int, store_path: str, job: str, args: dict, result_dir: str) -> None:
    """One rank: join the gloo group and run ``job`` (a function of this module, or
    ``"module:function"`` of another worker module) with ``(rank, world, **args)``; leaves
    ``ok-<rank>`` or ``error-<rank>`` (the traceback) in ``result_dir``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        module, _, name = job.rpartition(":")
        fn = getattr(importlib.import_module(module), name) if module else globals()[name]
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        try:
            fn(rank, world, **args)
        finally:
            if dist.is_initialized():  # a job may tear the group down itself, as trainers do
                dist.destroy_process_group()
        open(os.path.join(result_dir, f"ok-{rank}"), "w").close()
    except BaseException:
        with open(os.path.join(result_dir, f"error-{rank}"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


# DTensor, FSDP2 and DCP too, which nearly every rank of the layout and store tests imports (about
# 3 s a rank on a loaded 2-core machine, times a hundred ranks a run); s3fs and the CLI for the
# crash workers and other scripts tests/warm_python.py runs from this forkserver. Nothing of them
# runs before a fork (no event loop, no thread, no process group): importing only defines.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "torch.distributed.checkpoint", "ckptstore", "ckptstore.cli", "s3fs", "dist_workers"]


def context() -> Any:
    """A forkserver that imported torch and ckptstore once: each rank forks from it instead of
    importing torch anew (seconds per process on a 2-core machine, times every rank of every
    phase). Ranks are still separate processes that start with no process group and no threads."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def enter(env: dict[str, str], target: Any, *args: Any) -> None:
    """Give a forked rank the environment of the test that started it, as a spawned one has: the
    forkserver's environment is the one it started with, perhaps several tests earlier."""
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def spawn(world: int, job: str, tmp_path: Any, /, *, target: Any = None, **args: Any) -> None:
    """Run ``job`` on ``world`` real processes (``target``, by default :func:`run`, with the same
    arguments) and fail the calling test with every rank's traceback, or the ranks that hung."""

    store = tmp_path / f"store-{world}-{os.urandom(4).hex()}"
    results = tmp_path / f"results-{os.urandom(4).hex()}"
    results.mkdir()
    ctx = context()
    env = dict(os.environ)
    procs = [ctx.Process(target=enter, args=(env, target or run, r, world, str(store), job, args, str(results)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    errors = {f.name: f.read_text() for f in results.iterdir() if f.name.startswith("error-")}
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks hung: {hung}"
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    # A rank that wrote its ok-file and then died (SIGABRT from a group shut down under a transfer
    # at teardown or at exit, issue 18 item 8) is a failure too.
    died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    assert not died, f"ranks exited abnormally after their job (rank: exit code, negative = signal): {died}"
    assert sorted(f.name for f in results.iterdir()) == sorted(f"ok-{r}" for r in range(world))  # ok-10 before ok-2


def save_job(rank: int, world: int, url: str, mesh_shape, layouts, storage_options=None) -> None:
    state = _state(mesh_shape, layouts, zeros=False)
    state["step"] = 42
    state["rng"] = ckptstore.PerRank(torch.tensor([rank, rank * 10]))
    ckptstore.save_sharded(state, url, storage_options=storage_options)


def load_job(rank: int, world: int, url: str, mesh_shape, layouts, storage_options=None, per_rank="error") -> None:
    from torch.distributed.tensor import DTensor

    state = _state(mesh_shape, layouts, zeros=True)
    state["step"] = 0
    state["rng"] = ckptstore.PerRank(None)
    ckptstore.load_sharded(state, url, storage_options=storage_options, per_rank=per_rank, buffer_bytes=3 << 20)
    for name, ref in reference().items():
        got = state[name]
        full = got.full_tensor() if isinstance(got, DTensor) else got
        assert full.dtype == ref.dtype and full.shape == ref.shape, name
        assert torch.equal(full.view(torch.uint8) if full.dtype != torch.bfloat16 else full.view(torch.int16),
                           ref.view(torch.uint8) if ref.dtype != torch.bfloat16 else ref.view(torch.int16)), name
    assert state["step"] == 42
    if per_rank == "error":
        assert torch.equal(state["rng"].value, torch.tensor([rank, rank * 10])), state["rng"].value
    else:
        assert state["rng"].value is None


def failing_save_job(rank: int, world: int, url: str) -> None:
    state = {"w": torch.ones(4), "bad": object() if rank == 1 else 1}
    try:
        ckptstore.save_sharded(state, url)
    except ckptstore.CheckpointError as exc:
        assert "rank 1" in str(exc) and "nothing was committed" in str(exc), str(exc)
        return
    raise AssertionError("save_sharded should have failed on every rank")


def _fsdp_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)


def _fsdp_setup(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _fsdp_model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt, step: int) -> float:
    x, y = _batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def fsdp_save_job(rank: int, world: int, url: str, steps: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp_setup(world)
    for step in range(steps):
        _train_step(model, opt, step)
    msd, osd = get_state_dict(model, opt)
    ckptstore.save_sharded({"model": msd, "optim": osd, "step": steps}, url)
    # The uninterrupted run's next two losses, for the resumed runs to match: the first checks the
    # parameters, the second also the optimizer state (Adam's moments and step count).
    losses = [_train_step(model, opt, steps + i) for i in range(2)]
    if rank == 0:
        with open(out, "w") as fh:
            fh.write(repr(losses))


def fsdp_resume_job(rank: int, world: int, url: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp_setup(world)
    _train_step(model, opt, 999)  # materialise optimizer state with other values, then overwrite it
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    ckptstore.load_sharded(state, url)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = [_train_step(model, opt, state["step"] + i) for i in range(2)]
    if rank == 0:
        with open(out, "w") as fh:
            fh.write(repr(losses))


# ---------------------------------------------------------------------------- CheckpointStore


def _scaled_state(mesh_shape, layouts, step: int, *, per_rank: bool):
    """The reference state with every floating tensor scaled by ``step`` (zeros for step 0)."""
    from torch.distributed.tensor import DTensor

    state = _state(mesh_shape, layouts, zeros=step == 0)
    for t in state.values():
        if step and t.is_floating_point():
            with torch.no_grad():
                (t.to_local() if isinstance(t, DTensor) else t).mul_(step)
    state["step"] = step
    if per_rank:
        state["rng"] = ckptstore.PerRank(torch.tensor([dist.get_rank(), step]) if step else None)
    return state


def _check_scaled(state, step: int, *, per_rank: bool) -> None:
    from torch.distributed.tensor import DTensor

    for name, ref in reference().items():
        got = state[name]
        full = got.full_tensor() if isinstance(got, DTensor) else got
        want = ref * step if ref.is_floating_point() else ref
        assert torch.equal(full.float() if full.dtype == torch.bfloat16 else full,
                           want.float() if want.dtype == torch.bfloat16 else want), name
    assert state["step"] == step
    if per_rank:
        assert torch.equal(state["rng"].value, torch.tensor([dist.get_rank(), step])), state["rng"].value


def _ckptstore_log() -> list[str]:
    """Every message the ckptstore logger emits from now on (INFO and up)."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ckptstore").addHandler(Keep())
    logging.getLogger("ckptstore").setLevel(logging.INFO)
    return records


def store_save_job(rank: int, world: int, name: str, local: str, durable: str, steps: list[int], mesh_shape, layouts) -> None:
    store = ckptstore.CheckpointStore(name, local=local, durable=durable, durable_every=2, keep_local=2)
    handles = [store.save(step, _scaled_state(mesh_shape, layouts, step, per_rank=True)) for step in steps]
    handles[-1].wait("local")
    assert all(h.done("ram") for h in handles)
    store.close(keep_ram=True)  # the next run restarts on this node, from RAM


def store_restore_job(rank: int, world: int, name: str, local: str | None, durable: str | None, expect: int,
                      expect_tier: str, mesh_shape, layouts, per_rank: bool = True) -> None:
    records = _ckptstore_log()
    store = ckptstore.CheckpointStore(name, local=local, durable=durable)
    state = _scaled_state(mesh_shape, layouts, 0, per_rank=per_rank)
    got = store.restore(state)
    assert got == expect, (got, expect, records)
    _check_scaled(state, expect, per_rank=per_rank)
    assert any(f"restored step {expect} from the {expect_tier} tier" in m for m in records), records
    # The next save continues after the restored step, on every rank.
    store.save(expect + 1, _scaled_state(mesh_shape, layouts, expect + 1, per_rank=per_rank)).wait("local")
    store.close(keep_ram=True)  # the next run restarts on this node, from RAM


def store_disagree_job(rank: int, world: int, name: str, local: str) -> None:
    with ckptstore.CheckpointStore(name, local=local) as store:
        try:
            store.save(10 + rank, {"w": torch.ones(3)})
        except ckptstore.InvalidArgumentError as exc:
            assert "ranks passed different steps" in str(exc), str(exc)
        else:
            raise AssertionError("ranks saving different steps must all fail")
        bad = {"w": torch.ones(3), "x": object() if rank == 1 else 1}
        try:
            store.save(20, bad)
        except ckptstore.CheckpointError as exc:
            # The rank at fault gets its own error; the others learn which rank failed and why.
            assert ("obj['x']" if rank == 1 else "failed on other ranks: rank 1: obj['x']") in str(exc), str(exc)
        else:
            raise AssertionError("a save that fails on one rank must fail on all")
        store.save(30, {"w": torch.full((3,), float(rank))}).wait("local")


def fsdp_train_state_job(rank: int, world: int, name: str, local: str) -> None:
    """FSDP2 model and optimizer in a TrainState, through the store: a resume continues bitwise."""
    model, opt = _fsdp_setup(world)
    for step in range(3):
        _train_step(model, opt, step)
    with ckptstore.CheckpointStore(name, local=local) as store:
        store.save(3, ckptstore.TrainState(model=model, optimizer=opt, extra={"seen": 3})).wait("local")
    straight = [_train_step(model, opt, 3 + i) for i in range(2)]

    model2, opt2 = _fsdp_setup(world)
    _train_step(model2, opt2, 999)  # other parameters and optimizer state, overwritten by the restore
    state = ckptstore.TrainState(model=model2, optimizer=opt2)
    with ckptstore.CheckpointStore(name, local=local) as store:
        assert store.restore(state) == 3
    assert state.extra == {"seen": 3}
    resumed = [_train_step(model2, opt2, 3 + i) for i in range(2)]
    assert resumed == straight, (resumed, straight)


# ---------------------------------------------------------------------------- peer replicas


def _peer_store(name: str, rank: int, ram_root: str, local_root: str, per_node: int, replicas: int,
                to_local: bool = False):
    node = rank // per_node  # simulated nodes: each has its own RAM directory and local directory
    ram_dir = os.path.join(ram_root, f"node{node}")
    os.makedirs(ram_dir, exist_ok=True)
    return ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{node}"), ram_dir=ram_dir,
                                     peer_replicas=replicas, node=node, peer_to_local=to_local)


def peer_save_job(rank: int, world: int, name: str, ram_root: str, local_root: str, per_node: int, replicas: int,
                  steps: list[int], to_local: bool = False) -> None:
    store = _peer_store(name, rank, ram_root, local_root, per_node, replicas, to_local)
    for step in steps:
        handle = store.save(step, _scaled_state([world], _SHARD0, step, per_rank=True))
    handle.wait("peer")
    handle.wait("local")
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM and replicas


def peer_restore_job(rank: int, world: int, name: str, ram_root: str, local_root: str, per_node: int, replicas: int,
                     expect: int, expect_log: str, to_local: bool = False) -> None:
    records = _ckptstore_log()
    store = _peer_store(name, rank, ram_root, local_root, per_node, replicas, to_local)
    state = _scaled_state([world], _SHARD0, 0, per_rank=True)
    got = store.restore(state)
    assert got == expect, (got, records)
    _check_scaled(state, expect, per_rank=True)
    assert any(expect_log in m for m in records), records
    store.close()


_SHARD0 = {"big": [("shard", 0)], "w": [("shard", 0)], "odd": [("shard", 0)], "bf": [("shard", 0)]}


def peer_hang_job(rank: int, world: int, name: str, ram_root: str, local_root: str) -> None:
    """Rank 1 stops answering during the second replication: rank 0's saves and local commits go on,
    its wait('peer') fails within the bound, and replication is switched off on both ranks."""
    import time

    node = rank
    ram_dir = os.path.join(ram_root, f"node{node}")
    os.makedirs(ram_dir, exist_ok=True)
    store = ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{node}"), ram_dir=ram_dir,
                                      peer_replicas=1, node=node, peer_timeout_s=3)
    state = {"w": torch.full((1000,), float(rank))}
    store.save(1, state).wait("peer")
    if rank == 1:
        real = store.peer.replica_buffer

        def stuck(src: int, size: int):
            time.sleep(8)  # a peer that hangs
            return real(src, size)

        store.peer.replica_buffer = stuck  # type: ignore[method-assign]
    t0 = time.perf_counter()
    second = store.save(2, state)
    if rank == 0:
        second.wait("local")
        try:
            second.wait("peer", timeout=30)
        except ckptstore.CheckpointError as exc:
            raise AssertionError("expected the gloo timeout, not a checkpoint error") from exc
        except Exception:  # noqa: BLE001 - the timeout surfaces as the transport's error
            pass
        else:
            raise AssertionError("replication to a hung peer cannot succeed")
        assert time.perf_counter() - t0 < 15, time.perf_counter() - t0
    third = store.save(3, state)  # both ranks agree that replication is off now
    third.wait("local")
    assert third.done("peer") and third._futures["peer"] is None
    store.close()


_HANG_CAP_S = 120.0  # a hung peer's hang ends here at the latest: far past any bound the test allows


def _hang_until(release: str) -> bool:
    """Hang until the file ``release`` exists (a peer stuck until the test lets it go); whether it
    was let go, not timed out at _HANG_CAP_S."""
    import time

    deadline = time.monotonic() + _HANG_CAP_S
    while time.monotonic() < deadline:
        if os.path.exists(release):
            return True
        time.sleep(0.02)
    return False


def peer_restore_hang_job(rank: int, world: int, name: str, ram_root: str, local_root: str, path: str,
                          peer_timeout_s: float, release: str, out: str) -> None:
    """Node 1 (rank 1) was lost; ranks 0 and 2 hold replicas of its part and its data file. One peer
    hangs on one path a restore takes to it, until rank 1's restore returned (the file ``release``):

    - ``serve``: rank 2, which rank 1 asks for its data file first (candidates [0, 2], 1 % 2),
      hangs serving it before it touches the transfer pair, so rank 1's first send also waits for
      the lazy connection when gloo makes rank 1 the passive side; ``serve-connected``: the same,
      with the pair connected beforehand, so the wait is for the answer itself. Rank 1 must give
      rank 2 up after peer_timeout_s and read rank 0's copy, while rank 2 is still hung.
    - ``send_bytes``: rank 0, the lowest holder of rank 1's part, answers it through a collective
      of every rank (Group.send_bytes); its main thread hangs there for 3 x peer_timeout_s. No
      rank can skip a collective, so every rank waits for it, peer_timeout_s does not break the
      restore, and nothing is skipped (the hang's bound on this path is the group's timeout_s).

    Every rank checks its tensors bitwise; ``out`` gets each rank's timings as JSON."""
    import json
    import time

    from ckptstore import collective
    from ckptstore.engine import exchange

    hang = {"released": None, "calls": 0}
    if path.startswith("serve") and rank == 2:
        real = exchange._serve

        def stuck(*args):
            hang["calls"] += 1
            hang["released"] = _hang_until(release)  # serving others hangs; rank 2's own loading does not
            return real(*args)

        exchange._serve = stuck
    if path == "send_bytes" and rank == 0:
        real_send = collective.Group.send_bytes

        def slow(self, messages):
            if 1 in messages and not hang["calls"]:
                hang["calls"] += 1
                time.sleep(3 * peer_timeout_s)
            return real_send(self, messages)

        collective.Group.send_bytes = slow  # type: ignore[method-assign]
    records = _ckptstore_log()
    os.makedirs(os.path.join(ram_root, f"node{rank}"), exist_ok=True)
    store = ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{rank}"),
                                      ram_dir=os.path.join(ram_root, f"node{rank}"), peer_replicas=2, node=rank,
                                      peer_timeout_s=peer_timeout_s)
    if path == "serve-connected" and rank in (1, 2):
        pg = store._groups.transfer.pg
        hello = torch.zeros(1)
        tag = 1 << 20  # far above the tags the restore's rounds use
        (pg.send([hello], 2, tag) if rank == 1 else pg.recv([hello], 1, tag)).wait()
    state = _scaled_state([world], _SHARD0, 0, per_rank=True)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    got = store.restore(state)
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    if rank == 1 and path.startswith("serve"):
        open(release, "w").close()  # rank 1 is done: the hung peer may go on
    assert got == 2, (got, records)
    _check_scaled(state, 2, per_rank=True)
    skipped = [m for m in records if "did not send" in m]  # what the rank that gave a peer up says
    if path.startswith("serve"):
        # Every rank's log says which peer was skipped, and why, in the attempt's outcome.
        assert any("rank 2 did not answer within peer_timeout_s" in m for m in records), records
    else:
        assert not any("did not" in m for m in records), records
    if path.startswith("serve") and rank == 1:
        assert any("rank 2 did not send data/rank-00001.bin" in m for m in records), records
        assert elapsed >= peer_timeout_s, (elapsed, records)  # it did wait for rank 2, up to the bound
    else:
        assert not skipped, records
    if path.startswith("serve") and rank == 2:
        assert hang["calls"] == 1 and hang["released"], hang  # still hung when rank 1 had restored
    if path == "send_bytes" and rank == 0:
        assert hang["calls"] == 1, hang
    if path == "send_bytes":
        assert elapsed >= 3 * peer_timeout_s, elapsed  # every rank waited for the collective's answer
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "elapsed_s": elapsed, "cpu_s": cpu, "skipped": skipped}, fh)
    store.close()


# ---------------------------------------------------------------------------- bounded peer restores

_BIG_ROWS = 12_288  # rows of 4 KiB per rank: a 48 MiB shard, twelve times the restore's 4 MiB window


def _big_shard(world: int, step: int, rank: int):
    from torch.distributed.tensor import DTensor, Shard

    local = torch.full((_BIG_ROWS, 1024), float(step * 10 + rank)) if step else torch.ones(_BIG_ROWS, 1024)
    return {"big": DTensor.from_local(local, _mesh((world,)), [Shard(0)], run_check=False)}


def _node_store(name: str, rank: int, ram_root: str, local_root: str, **kw):
    ram_dir = os.path.join(ram_root, f"node{rank}")  # one rank per simulated node
    os.makedirs(ram_dir, exist_ok=True)
    return ckptstore.CheckpointStore(name, local=os.path.join(local_root, f"node{rank}"), ram_dir=ram_dir,
                                     peer_replicas=1, node=rank, **kw)


def big_peer_save_job(rank: int, world: int, name: str, ram_root: str, local_root: str, steps: list[int]) -> None:
    store = _node_store(name, rank, ram_root, local_root)
    for step in steps:
        handle = store.save(step, _big_shard(world, step, rank))
        handle.wait("peer")
        handle.wait("local")
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM and replicas


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/self/status")


def big_peer_restore_job(rank: int, world: int, name: str, ram_root: str, local_root: str, window: int,
                         out: str) -> None:
    """Rank 1's node was lost: its 48 MiB shard comes from rank 0's replica. The peak RSS of the
    restoring process may grow by the read window plus a fixed overhead, never by the shard."""
    import json

    records = _ckptstore_log()
    store = _node_store(name, rank, ram_root, local_root)
    store._restorer.buffer_bytes = window
    state = _big_shard(world, 0, rank)  # allocated and touched (ones) before the baseline
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak (VmHWM) starts again from the current RSS
    before, anon_before = _status("VmRSS"), _status("RssAnon")
    # The kernel keeps no peak of anonymous memory alone: sample it (an owner's mapped pages are
    # the page cache's, counted in VmHWM but no copy; bytes read into new memory are anonymous).
    anon_peak = [anon_before]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.002):
            anon_peak[0] = max(anon_peak[0], _status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    got = store.restore(state)
    peak = _status("VmHWM")
    sampling.set()
    sampler.join()
    assert got == 1, (got, records)
    assert torch.equal(state["big"].to_local(), torch.full((_BIG_ROWS, 1024), float(10 + rank)))
    if rank == 1:
        assert any("restored step 1 from the peer" in m for m in records), records
    with open(os.path.join(out, f"rss-{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "before": before, "peak": peak, "growth": peak - before, "window": window,
                   "anon_growth": anon_peak[0] - anon_before,
                   "shard": _BIG_ROWS * 4096}, fh)
    store.close()


def vanished_peer_restore_job(rank: int, world: int, name: str, ram_root: str, local_root: str,
                              peer_timeout_s: float) -> None:
    """Rank 0 holds the only copy of rank 1's step 2 (node 1 was lost), and the file vanishes after
    rank 0 listed it: rank 0 says so at once, and the restore falls back to step 1 without waiting
    for peer_timeout_s."""
    import glob
    import json
    import time

    from ckptstore.engine import exchange

    if rank == 0:
        real = exchange._serve
        gone: list[str] = []

        def vanishing(*args):
            if not gone:
                for doc in glob.glob(os.path.join(ram_root, "node0", f"ckptstore-{name}-r00000-peer00001-s*.json")):
                    with open(doc) as fh:
                        if json.load(fh)["step"] == 2:
                            os.unlink(doc[:-5] + ".bin")
                            gone.append(doc)
            return real(*args)

        exchange._serve = vanishing
    records = _ckptstore_log()
    store = _node_store(name, rank, ram_root, local_root, peer_timeout_s=peer_timeout_s)
    state = _small_shard(world, 0, rank)
    t0 = time.perf_counter()
    got = store.restore(state)
    elapsed = time.perf_counter() - t0
    assert got == 1, (got, records)
    assert torch.equal(state["w"].to_local(), torch.full((1000,), float(10 + rank)))
    if rank == 1:
        assert any("rank 0 no longer holds it" in m for m in records), records
        assert elapsed < peer_timeout_s / 4, (elapsed, records)
    else:
        assert any("which this node no longer holds" in m for m in records), records
    store.close()


def _small_shard(world: int, step: int, rank: int):
    from torch.distributed.tensor import DTensor, Shard

    local = torch.full((1000,), float(step * 10 + rank))  # each rank's own bytes, in its own file
    return {"w": DTensor.from_local(local, _mesh((world,)), [Shard(0)], run_check=False)}


def small_peer_save_job(rank: int, world: int, name: str, ram_root: str, local_root: str, steps: list[int]) -> None:
    store = _node_store(name, rank, ram_root, local_root)
    for step in steps:
        handle = store.save(step, _small_shard(world, step, rank))
        handle.wait("peer")
        handle.wait("local")
    store.close(keep_ram=True)  # the next run restarts on these nodes, from their RAM and replicas


def store_control_plane_job(rank: int, world: int, name: str, root: str, out: str, changes: bool) -> None:
    """Saves of one structure after the first are counted: what this rank received per save
    through each of the store's groups (collective.counting) goes to ``out`` as JSON. Then, with
    ``changes``, one rank
    at a time changes its structure (rank 1 adds a key, rank 0 changes a dtype, rank 1 a shape)
    while the others keep theirs and reuse their last plan until the save's vote shows that the
    ranks' structures changed: every rank plans again exactly at those saves, every step restores
    bitwise on every rank, and writes made after a save returned never reach its snapshot."""
    import json

    import ckptstore.engine.pipeline as pipeline
    from ckptstore.collective import counting

    real, planned = pipeline.collect, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        planned.append(1)
        return real(*args, **kwargs)

    pipeline.collect = counted
    local = os.path.join(root, f"local-{world}-{rank}")  # a directory per rank: each is a node
    # Every save is replicated to the next node's rank too (each rank its own node), so the peer
    # lane's control plane is counted with the others.
    store = ckptstore.CheckpointStore(name, local=local, durable=os.path.join(root, f"durable-{world}"),
                                      durable_every=1, keep_local=10, peer_replicas=1, node=rank)
    saved, steady = {}, (2, 3)
    traffic = None
    last = 7 if changes else steady[-1]
    for step in range(1, last + 1):
        g = torch.Generator().manual_seed(step)  # what every rank holds alike: each key written by one rank
        state = {f"w{i}": torch.randn(4, 3, generator=g) for i in range(50)}
        g = torch.Generator().manual_seed(step * 10 + rank)
        state[f"own{rank}"] = torch.randn(5, generator=g)
        if rank == 1 and step >= 4:
            state["extra1"] = torch.randn(6, generator=g)
        if rank == 0 and step >= 5:
            state["own0"] = state["own0"].to(torch.bfloat16)
        if rank == 1 and step >= 6:
            state["own1"] = torch.randn(2, 3, generator=g)
        if step == steady[0]:
            traffic = counting()
            counts = traffic.__enter__()
        store.save(step, state).wait("durable")
        if step == steady[-1]:
            assert traffic is not None
            traffic.__exit__(None, None, None)
            with open(os.path.join(out, f"w{world}-r{rank}.json"), "w") as fh:
                json.dump({role: n / len(steady) for role, n in counts.by_role.items()}, fh)
        saved[step] = {k: v.clone() for k, v in state.items()}
        for t in state.values():
            t.add_(1)
    # Step 1, then steps 4, 5 and 6: a rank whose own structure held learns of another's change in the vote.
    assert len(planned) == (4 if changes else 1), planned
    for step in range(1, last + 1) if changes else ():
        target = {k: torch.zeros_like(v) for k, v in saved[step].items()}
        assert store.restore(target, step=step) == step
        for k, v in saved[step].items():
            assert target[k].dtype == v.dtype and torch.equal(target[k], v), (rank, step, k)
    store.close()



def store_frozen_local_job(rank: int, world: int, name: str, root: str) -> None:
    """Frozen tensors lay each rank's local files out apart from its slot (their region in a file
    of its own), so the local manifest's chunk table is not the RAM manifest's: every step saved
    that way restores bitwise on every rank from the local tiers alone (the RAM copies gone, each
    rank's directory a node of its own)."""
    import json

    local = os.path.join(root, f"local-{world}-{rank}")
    store = ckptstore.CheckpointStore(name, local=local, frozen=lambda key: key.startswith("base"))
    saved = {}
    for step in (1, 2):
        g = torch.Generator().manual_seed(step * 10 + rank)
        # Plain tensors every rank holds are replicas (one rank writes each): alike on every rank.
        state = {"base": torch.arange(3000, dtype=torch.float32), f"base{rank}": torch.full((900,), float(rank)),
                 f"own{rank}": torch.randn(700, generator=g),
                 "shared": torch.randn(5, 7, generator=torch.Generator().manual_seed(step))}
        store.save(step, state).wait("local")
        saved[step] = {k: v.clone() for k, v in state.items()}
    store.close()  # its RAM segments go with it: a restore reads the local tiers
    # Each rank its own node: the step is committed there as the rank's node part (no manifest).
    with open(os.path.join(local, "step-000000000002", "node-parts", f"rank-{rank:05d}.json")) as fh:
        part = json.load(fh)["part"]
    files = {c["file"] for table in part["chunks"].values() for c in table}
    assert any("frozen" in f for f in files), files  # the local layout, not the slot's
    assert part["layout"] == "local", part
    fresh = ckptstore.CheckpointStore(name, local=local)
    try:
        for step in (1, 2):
            target = {k: torch.zeros_like(v) for k, v in saved[step].items()}
            assert fresh.restore(target, step=step) == step
            for k, v in saved[step].items():
                assert torch.equal(target[k], v), (rank, step, k)
    finally:
        fresh.close()


def crash_both(tmp_path, target: str, **args) -> None:
    """Run ``target`` on two ranks and see both die by SIGKILL at the crash point it arms."""
    import signal

    store = tmp_path / f"store-crash-{os.urandom(4).hex()}"
    results = tmp_path / f"results-{os.urandom(4).hex()}"
    results.mkdir()
    ctx = context()
    env = dict(os.environ)
    procs = [ctx.Process(target=enter, args=(env, run, r, 2, str(store), target, args, str(results))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = {f.name: f.read_text() for f in results.iterdir()}
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2, errors
