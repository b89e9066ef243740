"""The parallel layouts of large training, in real processes (gloo over loopback, CPU, tiny models):
FSDP2 over tensor parallelism (2-D, _StridedShard), pipeline stages (ranks holding different keys),
experts (keys on some ranks only, and stacked experts sharded over an expert-parallel dim) and HSDP,
each saved on one layout and loaded into others, compared bitwise with the full reference."""

from __future__ import annotations

import json
import os

import dist_workers
import layout_workers as lw
import pytest
import torch
from conftest import wipe_ram

import ckptstore
from ckptstore.checkpoint.sharded import Directory, read_manifest

_spawn = dist_workers.spawn


def _manifest(url: str) -> dict:
    with open(os.path.join(url, "manifest.json")) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def two_d(tmp_path_factory):
    """One 2x2 (dp x tp) save of model + AdamW after one step, shared by the load tests."""
    root = tmp_path_factory.mktemp("two_d")
    url = str(root / "ckpt")
    _spawn(4, "layout_workers:two_d_save", root, url=url, dp=2, tp=2)
    return root, url


def test_fsdp_over_tp_resumes_on_the_same_layout_with_the_same_next_loss(two_d):
    root, url = two_d
    _spawn(4, "layout_workers:two_d_load", root, url=url, dp=2, tp=2, same_layout=True)


@pytest.mark.slow  # a variant of a default-run case; -m slow runs it
def test_fsdp_over_tp_without_reshard_after_forward_saves_and_loads_into_the_default(tmp_path):
    """FSDP2 with reshard_after_forward=False keeps the unsharded parameters between forward and
    backward; its state dict after a step is the same sharded DTensors, and loads either way."""
    url = str(tmp_path / "ckpt")
    _spawn(4, "layout_workers:two_d_save", tmp_path, url=url, dp=2, tp=2, reshard_after_forward=False)
    _spawn(4, "layout_workers:two_d_load", tmp_path, url=url, dp=2, tp=2, same_layout=True)
    _spawn(4, "layout_workers:two_d_load", tmp_path, url=url, dp=2, tp=2, same_layout=True,
           reshard_after_forward=False)


@pytest.mark.parametrize("dp,tp", [(2, 1), pytest.param(1, 4, marks=pytest.mark.slow)], ids=["fsdp-only-2", "tp-only-4"])
def test_fsdp_over_tp_loads_into_fsdp_only_and_tp_only(two_d, dp, tp):
    root, url = two_d
    _spawn(dp * tp, "layout_workers:two_d_load", root, url=url, dp=dp, tp=tp)


@pytest.mark.slow  # the reverse of test_fsdp_over_tp_loads_into_fsdp_only_and_tp_only; -m slow runs it
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 4)], ids=["from-fsdp-only-2", "from-tp-only-4"])
def test_fsdp_only_and_tp_only_load_into_fsdp_over_tp(tmp_path, dp, tp):
    url = str(tmp_path / "ckpt")
    _spawn(dp * tp, "layout_workers:two_d_save", tmp_path, url=url, dp=dp, tp=tp)
    _spawn(4, "layout_workers:two_d_load", tmp_path, url=url, dp=2, tp=2)


@pytest.mark.slow  # a reverse direction of a default-run case; -m slow runs it
def test_four_stages_load_into_two_stages_of_2d(tmp_path):
    url = str(tmp_path / "ckpt")
    _spawn(4, "layout_workers:pp_save", tmp_path, url=url, pp=4, dp=1, tp=1)
    _spawn(8, "layout_workers:pp_load", tmp_path, url=url, pp=2, dp=2, tp=2)


def test_fsdp_over_tp_loads_into_one_process(two_d):
    root, url = two_d
    lw.two_d_load(0, 1, url, 1, 1)
    meta = _manifest(url)["meta"]  # the saved mesh and placements, for ckptstore inspect
    layout = meta["layouts"]["model/layers.0.wq.weight"]
    assert layout == {"mesh": [2, 2], "names": ["dp", "tp"], "placements": ["_S(0,2)", "S(0)"]}, layout


def test_inspect_shows_the_saved_mesh_and_reshard_rewrites_the_2d_run(two_d, tmp_path, capsys):
    from ckptstore.cli import main

    root, url = two_d
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "saved mesh and placements" in out
    line = next(x for x in out.splitlines() if "model/layers.0.wq.weight " in x)
    assert line.endswith("(dp=2, tp=2) _S(0,2) S(0)"), line
    assert next(x for x in out.splitlines() if "model/layers.0.wo.weight " in x).endswith("(dp=2, tp=2) S(0) S(1)")
    for ranks in (3, 1):
        dst = str(tmp_path / f"r{ranks}")
        assert main(["reshard", url, dst, "--ranks", str(ranks)]) == 0
        sd = {"model": None, "optim": None}
        (ckptstore.load_sharded(sd, dst) if ranks > 1 else sd.update(ckptstore.load(dst)))
        ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)["state"]
        lw.assert_bitwise(_flat(sd), ref, f"reshard --ranks {ranks}")


def _flat(sd: dict) -> dict:
    """{"model": {fqn: t}, "optim": {"state": {fqn: {name: t}}}} as layout_workers.full_state keys it."""
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    for fqn, st in sd["optim"]["state"].items():
        out.update({f"optim.{fqn}.{name}": v for name, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def test_a_dcp_checkpoint_of_the_2d_run_converts_to_ckptstore_and_back(two_d, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckptstore.convert import convert

    root, url = two_d
    ref = torch.load(os.path.join(root, "ref.pt"), weights_only=True)["state"]
    convert(url + "-dcp", str(tmp_path / "from-dcp.ckpt"), "ckptstore")  # DCP's own save of the 2x2 run
    lw.assert_bitwise(_flat(ckptstore.load(str(tmp_path / "from-dcp.ckpt"))), ref, "dcp -> ckptstore")
    for src, name in ((str(tmp_path / "from-dcp.ckpt"), "back"), (url, "sharded")):
        convert(src, str(tmp_path / f"{name}-dcp"), "dcp")  # read back by DCP's library
        dcp_to_torch_save(str(tmp_path / f"{name}-dcp"), str(tmp_path / f"{name}.pt"))
        lw.assert_bitwise(_flat(torch.load(str(tmp_path / f"{name}.pt"), weights_only=False)), ref, f"{name} -> dcp")


def test_strided_split_factor_is_read_from_torch():
    """The one private torch API ckptstore reads (checkpoint/sharded.py strided_split_factor)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptstore.checkpoint.sharded import strided_split_factor

    assert strided_split_factor(_StridedShard(0, split_factor=4)) == 4
    assert strided_split_factor(Shard(0)) is None


# ------------------------------------------------------------------------------------ pipeline


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """pp=2 x dp=2 x tp=2 on 8 ranks: each stage's keys on its own ranks, on its own sub-mesh."""
    root = tmp_path_factory.mktemp("pp")
    url = str(root / "ckpt")
    _spawn(8, "layout_workers:pp_save", root, url=url, pp=2, dp=2, tp=2)
    return root, url


# Four stages and no pipeline in the default run; the other splits with -m slow.
@pytest.mark.parametrize("pp,dp,tp", [(1, 2, 2), pytest.param(2, 4, 1, marks=pytest.mark.slow), (4, 1, 1),
                                      pytest.param(2, 2, 2, marks=pytest.mark.slow)])
def test_pipeline_checkpoint_loads_into_other_stage_counts(pipeline, pp, dp, tp):
    root, url = pipeline
    _spawn(pp * dp * tp, "layout_workers:pp_load", root, url=url, pp=pp, dp=dp, tp=tp)


def test_pipeline_checkpoint_loads_into_one_process_and_writes_each_key_once(pipeline):
    root, url = pipeline
    lw.pp_load(0, 1, url, 1, 1, 1)
    # The whole chunk table: a format 2.0 manifest keeps it in the ranks' part files.
    tensors = read_manifest(Directory(url, None)).tensors
    assert sorted({k.split(".")[1] for k in tensors if k.startswith("model/")}) == ["0", "1", "2", "3"]
    for key, entry in tensors.items():
        covered = sum(torch.Size(c.sizes).numel() for c in entry.chunks)
        assert covered == torch.Size(entry.shape).numel(), key  # tiled exactly once: no duplicate writes


def test_keys_missing_from_the_checkpoint_are_named(pipeline):
    root, url = pipeline
    state = {"model": {"layers.9.w1.weight": torch.zeros(2)}}
    with pytest.raises(ckptstore.CheckpointError, match=r"layers\.9\.w1\.weight.*strict=False"):
        ckptstore.load_sharded(state, url)
    ckptstore.load_sharded(state, url, strict=False)


# ----------------------------------------------------------------------------------------- MoE


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    url = str(root / "ckpt")
    _spawn(4, "layout_workers:moe_save", root, url=url, ep=4)
    return root, url


def test_experts_ep4_load_into_ep2(moe):
    root, url = moe
    _spawn(2, "layout_workers:moe_load", root, url=url, ep=2)


def test_experts_ep4_load_into_one_process(moe):
    root, url = moe
    lw.moe_load(0, 1, url, 1)


@pytest.mark.slow  # a reverse direction of a default-run case; -m slow runs it
def test_experts_ep2_load_into_ep4(tmp_path):
    url = str(tmp_path / "ckpt")
    _spawn(2, "layout_workers:moe_save", tmp_path, url=url, ep=2)
    _spawn(4, "layout_workers:moe_load", tmp_path, url=url, ep=4)


# ---------------------------------------------------------------------------------------- HSDP


def test_hsdp_writes_each_replicated_shard_once_spread_over_the_replicas(tmp_path):
    url = str(tmp_path / "ckpt")
    _spawn(4, "layout_workers:hsdp_save", tmp_path, url=url)
    per_rank = lw.written_bytes(url)
    print("HSDP bytes written per rank:", per_rank)
    total = sum(p.numel() * 4 for p in lw.Model().parameters())
    assert sum(per_rank.values()) == total  # each shard once (2 replicas, yet no byte twice)
    assert all(b > 0 for b in per_rank.values()), per_rank  # both replicas of each shard write
    assert max(per_rank.values()) <= 1.5 * min(per_rank.values()), per_rank
    lw.hsdp_load_one_process(url)


# ------------------------------------------------------------------- 3-D through the store


def _spawn_killed(world: int, job: str, tmp_path, **args) -> None:
    """Like dist_workers.spawn, for a job whose ranks end by SIGKILL."""
    import signal


    store = tmp_path / f"store-{os.urandom(4).hex()}"
    results = tmp_path / f"results-{os.urandom(4).hex()}"
    results.mkdir()
    ctx = dist_workers.context()
    env = dict(os.environ)
    procs = [ctx.Process(target=dist_workers.enter, args=(env, dist_workers.run, r, world, str(store), job, args, str(results)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = {f.name: f.read_text() for f in results.iterdir() if f.name.startswith("error-")}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * world


# The default run restores the 2x2x2 save once, into a layout that changes all three dims (stages
# merged, dp 2 -> 4, tp 2 -> 1) on 4 ranks; -m slow restores into one that changes each part alone.
@pytest.mark.parametrize("layouts", [[(1, 4, 1)], pytest.param([(1, 2, 2), (2, 4, 1)], marks=pytest.mark.slow)],
                         ids=["all-dims-changed", "stages-then-dp-tp"])
def test_three_d_train_state_through_the_store_restores_after_sigkill_into_other_layouts(tmp_path, job, layouts):
    local, ref = str(tmp_path / "local"), str(tmp_path / "ref.pt")
    _spawn_killed(8, "layout_workers:three_d_save", tmp_path, name=job, local=local, ref=ref, pp=2, dp=2, tp=2)
    for pp, dp, tp in layouts:
        wipe_ram(job)  # another layout: from the local tier, which every rank of this node sees
        _spawn(pp * dp * tp, "layout_workers:three_d_restore", tmp_path, name=job, local=local, ref=ref, pp=pp, dp=dp, tp=tp)
