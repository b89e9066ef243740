"""Workers of tests/test_layouts_dist.py: the parallel layouts of large training (FSDP2 over TP,
pipeline stages, experts, HSDP), saved on one layout and loaded into others, in real processes.

Every run builds the same model from a fixed seed; a save run leaves the full reference (model and
optimizer state, gathered with full_tensor) in ``ref.pt`` beside the checkpoint, and a load run
compares what it loaded with it bitwise.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import ckptstore

D, HIDDEN, HEAD = 16, 32, 4


class Block(nn.Module):
    """A transformer block small enough for 8 CPU ranks: multi-head attention and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        self.w1 = nn.Linear(D, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (w(h).view(b, t, -1, HEAD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD), dim=-1) @ v
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.w2(torch.relu(self.w1(x)))


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in range(layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


TP_PLAN = {"wq": "col", "wk": "col", "wv": "col", "w1": "col", "wo": "row", "w2": "row"}


def parallelize(model: nn.Module, dp: int, tp: int, *, hsdp: int = 1, mesh=None,
                reshard_after_forward: bool = True) -> nn.Module:
    """torchtitan's order: tensor parallelism over mesh['tp'] first, then fully_shard over mesh['dp']
    (HSDP: replicate over mesh['rep'], shard over mesh['dp'])."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if dp * tp * hsdp == 1 and mesh is None:
        return model
    if mesh is None:
        dims = [(n, name) for n, name in ((hsdp, "rep"), (dp, "dp"), (tp, "tp")) if n > 1 or name == "dp"]
        mesh = init_device_mesh("cpu", tuple(n for n, _ in dims), mesh_dim_names=tuple(name for _, name in dims))
    names = mesh.mesh_dim_names
    if "tp" in names and mesh["tp"].size() > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {k: ColwiseParallel() if v == "col" else RowwiseParallel()
                                                   for k, v in TP_PLAN.items()})
    dp_mesh = mesh["rep", "dp"] if "rep" in names else mesh["dp"]
    if dp_mesh.size() > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def batch() -> torch.Tensor:
    return torch.randn(2, 3, D, generator=torch.Generator().manual_seed(7))


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    loss = model(batch()).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": _full(v).clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{fqn}.{name}"] = _full(v).clone()
    return out


def assert_bitwise(got: dict, ref: dict, what: str) -> None:
    assert set(got) <= set(ref), sorted(set(got) - set(ref))
    for k, v in got.items():
        r = ref[k]
        assert v.dtype == r.dtype and v.shape == r.shape, (what, k)
        assert torch.equal(v.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)), (what, k)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---------------------------------------------------------------------------------------- 2-D


def two_d_save(rank: int, world: int, url: str, dp: int, tp: int, reshard_after_forward: bool = True) -> None:
    """FSDP2 over TP (model + AdamW after one step, through get_state_dict), saved with save_sharded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = parallelize(Model(), dp, tp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    strided = [k for k, v in msd.items() if isinstance(v, DTensor) and any(type(p).__name__ == "_StridedShard" for p in v.placements)]
    assert bool(strided) == (dp > 1 and tp > 1), "FSDP2 over TP (and only it) gives _StridedShard placements"
    ckptstore.save_sharded({"model": msd, "optim": osd}, url)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": msd, "optim": osd}, checkpoint_id=url + "-dcp")  # the same state by DCP, for conversions
    ref = full_state(model, opt)
    loss = train_step(model, opt)  # the uninterrupted run's next step
    if rank == 0:
        torch.save({"state": ref, "next_loss": loss}, os.path.join(url, "..", "ref.pt"))


def two_d_load(rank: int, world: int, url: str, dp: int, tp: int, same_layout: bool = False,
               reshard_after_forward: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = parallelize(Model(), dp, tp, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    ckptstore.load_sharded(sd, url)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    ref = torch.load(os.path.join(url, "..", "ref.pt"), weights_only=True)
    assert_bitwise(full_state(model, opt), ref["state"], f"dp={dp} tp={tp}")
    loss = train_step(model, opt)
    if same_layout:
        assert torch.equal(loss, ref["next_loss"]), (loss, ref["next_loss"])
    else:  # other reduction orders: the same to rounding
        assert torch.allclose(loss, ref["next_loss"], rtol=1e-5), (loss, ref["next_loss"])


# ---------------------------------------------------------------------------------- pipeline


def stage_layers(stages: int, layers: int = 4) -> list[list[str]]:
    per = layers // stages
    return [[str(i) for i in range(s * per, (s + 1) * per)] for s in range(stages)]


def pp_model(pp: int, dp: int, tp: int, layers: int = 4):
    """A hand split of the layers over ``pp`` stages (torch.distributed.pipelining needs a schedule
    this test does not: each rank keeps the modules of its stage, named as in the whole model),
    each stage sharded over its own (dp, tp) sub-mesh of a (pp, dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    full = Model(layers)
    stage = _rank() // (dp * tp) if pp > 1 else 0
    keep = stage_layers(pp, layers)[stage]
    for name in list(full.layers):
        if name not in keep:
            del full.layers[name]
    if dp * tp * pp > 1:
        dims = [(n, name) for n, name in ((pp, "pp"), (dp, "dp"), (tp, "tp"))]
        mesh = init_device_mesh("cpu", tuple(n for n, _ in dims), mesh_dim_names=tuple(name for _, name in dims))
        parallelize(full, dp, tp, mesh=mesh["dp", "tp"])
    return full, stage


def pp_save(rank: int, world: int, url: str, pp: int, dp: int, tp: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model, stage = pp_model(pp, dp, tp)
    msd = get_model_state_dict(model)
    ckptstore.save_sharded({"model": msd, "step": 3}, url)
    ref = {k: _full(v).clone() for k, v in msd.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, ref)
    if rank == 0:
        union = {}
        for r in gathered:
            union.update(r)
        torch.save(union, os.path.join(url, "..", "ref-pp.pt"))


def pp_load(rank: int, world: int, url: str, pp: int, dp: int, tp: int) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(5)
    model, stage = pp_model(pp, dp, tp)
    msd = get_model_state_dict(model)
    with torch.no_grad():
        for v in msd.values():
            v.to_local().zero_() if hasattr(v, "to_local") else v.zero_()
    sd = {"model": msd, "step": None}
    ckptstore.load_sharded(sd, url)
    assert sd["step"] == 3
    ref = torch.load(os.path.join(url, "..", "ref-pp.pt"), weights_only=True)
    assert_bitwise({k: _full(v) for k, v in sd["model"].items()}, ref, f"pp={pp} dp={dp} tp={tp}")


# ---------------------------------------------------------------------------------------- MoE


EXPERTS = 8


def expert_weights() -> torch.Tensor:
    return torch.randn(EXPERTS, D, HIDDEN, generator=torch.Generator().manual_seed(11))


def moe_state(ep: int, zeros: bool) -> dict:
    """Experts stacked in one tensor, Shard(0) over the expert-parallel mesh; and the same experts as
    separate keys present only on their owner ranks (plain tensors, EXPERTS / ep per rank)."""
    w = expert_weights()
    if zeros:
        w = torch.zeros_like(w)
    rank = _rank()
    state: dict = {"router": torch.zeros(D, EXPERTS) if zeros else torch.ones(D, EXPERTS)}
    if ep > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
        state["stacked"] = distribute_tensor(w, mesh, [Shard(0)])
    else:
        state["stacked"] = w.clone()
    per = EXPERTS // ep
    owner = rank % ep
    state["experts"] = {str(e): w[e].clone() for e in range(owner * per, (owner + 1) * per)}
    return state


def moe_save(rank: int, world: int, url: str, ep: int) -> None:
    ckptstore.save_sharded(moe_state(ep, zeros=False), url)


def moe_load(rank: int, world: int, url: str, ep: int) -> None:
    state = moe_state(ep, zeros=True)
    ckptstore.load_sharded(state, url)
    w = expert_weights()
    assert torch.equal(_full(state["stacked"]), w)
    assert torch.equal(state["router"], torch.ones(D, EXPERTS))
    for e, t in state["experts"].items():
        assert torch.equal(t, w[int(e)]), e


# --------------------------------------------------------------------------------------- HSDP


def hsdp_save(rank: int, world: int, url: str) -> None:
    """HSDP on a 2x2 mesh: replicate over 'rep', shard over 'dp'."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(0)
    model = parallelize(Model(), 2, 1, hsdp=2)
    msd = get_model_state_dict(model)
    placements = {str(list(v.placements)) for v in msd.values()}
    assert placements == {"[Replicate(), Shard(dim=0)]"}, placements
    ckptstore.save_sharded({"model": msd}, url)
    if rank == 0:
        torch.save({k: _full(v).clone() for k, v in msd.items()}, os.path.join(url, "..", "ref-hsdp.pt"))
    else:
        {k: _full(v) for k, v in msd.items()}  # full_tensor is a collective


def hsdp_load_one_process(url: str) -> None:
    model = Model()
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    ckptstore.load_sharded(sd, url)
    ref = torch.load(os.path.join(url, "..", "ref-hsdp.pt"), weights_only=True)
    assert_bitwise(sd["model"], ref, "hsdp -> 1")


def written_bytes(url: str) -> dict[int, int]:
    with open(os.path.join(url, "manifest.json")) as fh:
        manifest = json.load(fh)
    return {r["rank"]: r["bytes"] for r in manifest["meta"]["ranks"]}


# ------------------------------------------------------------------- 3-D through the store


def three_d_save(rank: int, world: int, name: str, local: str, ref: str, pp: int, dp: int, tp: int) -> None:
    """pp x dp x tp with TrainState(model=[stage]) through a CheckpointStore; then the process dies
    by SIGKILL without closing anything (the test expects -9 from every rank)."""
    import signal

    model, stage = pp_model(pp, dp, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    state = ckptstore.TrainState(model=[model], optimizer=[opt], extra={"epoch": 1})
    store = ckptstore.CheckpointStore(name, local=local)
    store.save(1, state).wait("local")
    mine = full_state(model, opt)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        union = {}
        for r in gathered:
            union.update(r)
        torch.save(union, ref)
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def three_d_restore(rank: int, world: int, name: str, local: str, ref: str, pp: int, dp: int, tp: int) -> None:
    torch.manual_seed(3)
    model, stage = pp_model(pp, dp, tp)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1) if hasattr(p, "to_local") else p.add_(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ckptstore.TrainState(model=[model], optimizer=[opt])
    with ckptstore.CheckpointStore(name, local=local) as store:
        assert store.restore(state, per_rank="skip") == 1
    assert state.extra == {"epoch": 1}
    assert_bitwise(full_state(model, opt), torch.load(ref, weights_only=True), f"pp={pp} dp={dp} tp={tp}")
