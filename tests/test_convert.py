"""ckptstore.convert: detect_format and conversions between ckptstore, torch, safetensors and DCP.

Every conversion is checked by a round trip A -> B -> A, comparing tensors bit for bit and the rest
type-exactly (conftest.assert_same). Where a format cannot hold something, the test states exactly
what comes back instead:

- safetensors (through convert's exporter) holds the whole test state: nested structure, key types,
  OrderedDict + _metadata, and tied weights (identical views of one storage) via "ckptstore.tree".
- DCP stringifies dict keys, turns OrderedDicts into dicts (no _metadata), drops empty dicts and
  unties shared tensors.
- a sharded ckptstore directory unties tensors that only share storage (two state_dict entries of a
  tied weight are two manifest entries); its PerRank values are dropped by every conversion.
"""

from __future__ import annotations

import collections
import fractions
import io
import json
import os
import pickle
import uuid

import fsspec
import pytest
import safetensors.torch
import torch
from conftest import assert_same
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

import ckptstore
from ckptstore import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    StorageError,
    UnsupportedObjectError,
)
from ckptstore.convert import FORMATS, SAFETENSORS_TREE_KEY, convert, detect_format

LOSSLESS = ("ckptstore", "torch", "safetensors")

# ------------------------------------------------------------------------------------ fixtures


def make_state() -> dict:
    """A training state: model state_dict with a tied weight, Adam state after one step, bf16, plain values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied: state_dict() holds two tensors viewing one storage
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),  # OrderedDict with _metadata
        "optim": opt.state_dict(),  # int keys in "state", param_groups with tuples, None, bools
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "epoch": 3,
        "loss": 0.25,
        "name": "run-1",
        "big": 2**60,
    }


def tied(obj: dict) -> bool:
    return obj["model"]["0.weight"].data_ptr() == obj["model"]["1.weight"].data_ptr()


def _dcp_walks(obj) -> bool:
    """DCP descends into dicts, and into lists holding a tensor, a dict or such a list; it pickles the rest whole."""
    if isinstance(obj, dict):
        return True
    return isinstance(obj, list) and any(isinstance(v, torch.Tensor) or _dcp_walks(v) for v in obj)


def dcp_view(obj):
    """What DCP gives back for ``obj``: str keys, plain dicts, no empty dicts; values it pickles stay whole."""
    if isinstance(obj, dict):
        return {str(k): dcp_view(v) for k, v in obj.items() if not (isinstance(v, dict) and not v)}
    if isinstance(obj, list) and _dcp_walks(obj):
        return [dcp_view(v) for v in obj]
    return obj


def write_native(state: dict, path, fmt: str, tmp_path) -> None:
    """``state`` written by the format's own writer (safetensors: by convert's exporter, the only way to nest)."""
    if fmt == "ckptstore":
        ckptstore.save(state, path)
    elif fmt == "torch":
        torch.save(state, path)
    elif fmt == "dcp":
        tmp = tmp_path / f"native-{uuid.uuid4().hex}.pt"
        torch.save(state, tmp)
        torch_save_to_dcp(tmp, path)
    else:
        src = tmp_path / f"native-{uuid.uuid4().hex}.ckpt"
        ckptstore.save(state, src)
        convert(str(src), str(path), "safetensors")


def read_any(path, fmt: str, tmp_path):
    """Read a file of ``fmt`` back as a nested object, with each format's own reader where it has one."""
    if fmt == "ckptstore":
        return ckptstore.load(path)
    if fmt == "torch":
        return torch.load(path, weights_only=True)
    if fmt == "dcp":
        out = tmp_path / f"read-{uuid.uuid4().hex}.pt"
        dcp_to_torch_save(path, out)  # torch's own DCP reader: what convert writes is standard DCP
        return torch.load(out, weights_only=True)
    # safetensors: the nested object lives in the metadata; decode it through a conversion to ckptstore
    out = tmp_path / f"read-{uuid.uuid4().hex}.ckpt"
    convert(str(path), str(out), "ckptstore")
    return ckptstore.load(out)


def name(tmp_path, fmt: str, tag: str = "") -> str:
    ext = {"ckptstore": ".ckpt", "torch": ".pt", "safetensors": ".safetensors", "dcp": ".dcp"}[fmt]
    return str(tmp_path / f"{fmt}{tag}-{uuid.uuid4().hex[:8]}{ext}")


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("a", LOSSLESS)
@pytest.mark.parametrize("b", LOSSLESS)
def test_lossless_round_trip(tmp_path, a, b):
    state = make_state()
    assert tied(state)
    first, middle, back = name(tmp_path, a), name(tmp_path, b), name(tmp_path, a, "-back")
    write_native(state, first, a, tmp_path)
    report = convert(first, middle, b)
    assert (report["src_format"], report["dst_format"]) == (a, b)
    assert report["dropped"] == [] and report["notes"] == []
    convert(middle, back, a)
    for path, fmt in ((middle, b), (back, a)):
        out = read_any(path, fmt, tmp_path)
        assert_same(out, state)
        assert tied(out), f"{fmt}: tied weights must still share storage"


def test_report_counts_distinct_tensors(tmp_path):
    state = make_state()
    src, dst = name(tmp_path, "ckptstore"), name(tmp_path, "torch")
    ckptstore.save(state, src)
    report = convert(src, dst, "torch")
    loaded = ckptstore.load(src)
    tensors = [*loaded["model"].values(), *(t for s in loaded["optim"]["state"].values() for t in s.values()), loaded["bf16"]]
    assert report["tensors"] == len(tensors)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in tensors)
    assert report["src"] == src and report["dst"] == dst


def test_safetensors_file_is_flat_contiguous_and_unshared(tmp_path):
    state = make_state()
    state["view"] = state["bf16"][:, 1:3]  # a non-contiguous view of another saved tensor
    src, dst = name(tmp_path, "ckptstore"), name(tmp_path, "safetensors")
    ckptstore.save(state, src)
    convert(src, dst, "safetensors")
    flat = safetensors.torch.load_file(dst)
    expected_keys = {"bf16", "view", *(f"model/{k}" for k in state["model"])}
    expected_keys |= {f"optim/state/{p}/{k}" for p, s in state["optim"]["state"].items() for k in s}
    assert set(flat) == expected_keys
    assert torch.equal(flat["model/1.weight"], state["model"]["0.weight"])  # the tied copy, for other readers
    assert torch.equal(flat["view"], state["bf16"][:, 1:3])
    with safetensors.safe_open(dst, framework="pt") as f:
        tree = json.loads(f.metadata()[SAFETENSORS_TREE_KEY])
    assert tree["epoch"] == 3 and tree["name"] == "run-1"
    back = read_any(dst, "safetensors", tmp_path)
    assert_same(back, ckptstore.load(src))
    # the view's sharing with bf16 is partial, which safetensors cannot express: values survive, sharing not
    assert back["view"].data_ptr() != back["bf16"].data_ptr() and back["view"].is_contiguous()


def test_a_safetensors_tree_marking_an_int_tensor_as_trainable_is_refused(tmp_path):
    """The tree in the metadata is data: flags an integer tensor cannot take mean a damaged or
    crafted file (CorruptCheckpointError naming it), never torch's RuntimeError from requires_grad_."""
    path = name(tmp_path, "safetensors")
    for flags in ({"requires_grad": True}, {"param": True, "requires_grad": True}):
        tree = {"ids": {"$tensor": "ids", **flags}}
        safetensors.torch.save_file({"ids": torch.arange(4)}, path, metadata={SAFETENSORS_TREE_KEY: json.dumps(tree)})
        with pytest.raises(ckptstore.CorruptCheckpointError, match=r"'ids' is a torch.int64 tensor marked as requiring"):
            convert(path, name(tmp_path, "ckptstore"), "ckptstore")


def test_same_tensor_object_twice_stays_one_object(tmp_path):
    t = torch.arange(6.0)
    state = {"a": t, "b": [t, {"c": t}], "p": nn.Parameter(torch.ones(2))}
    src, mid, back = name(tmp_path, "torch"), name(tmp_path, "safetensors"), name(tmp_path, "ckptstore")
    torch.save(state, src)
    convert(src, mid, "safetensors")
    assert set(safetensors.torch.load_file(mid)) == {"a", "b/0", "b/1/c", "p"}
    convert(mid, back, "ckptstore")
    out = ckptstore.load(back)
    assert out["a"] is out["b"][0] is out["b"][1]["c"]
    assert type(out["p"]) is nn.Parameter and out["p"].requires_grad
    assert torch.equal(out["a"], t)


@pytest.mark.parametrize("a", LOSSLESS)
def test_dcp_round_trip_and_its_losses(tmp_path, a):
    state = make_state()
    first, middle, back = name(tmp_path, a), name(tmp_path, "dcp"), name(tmp_path, a, "-back")
    write_native(state, first, a, tmp_path)
    report = convert(first, middle, "dcp")
    assert sorted(os.listdir(middle)) == [".metadata", "__0_0.distcp"]
    notes = " ".join(report["notes"])
    for what in ("non-string dict keys", "OrderedDicts", "sharing storage"):
        assert what in notes, report["notes"]
    convert(middle, back, a)
    expected = dcp_view(state)
    assert set(expected["optim"]["state"]) == {"0", "1"}  # the optimizer's int keys come back as str
    for path, fmt in ((middle, "dcp"), (back, a)):
        out = read_any(path, fmt, tmp_path)
        assert_same(out, expected)
        assert type(out["model"]) is dict and not hasattr(out["model"], "_metadata")
        assert not tied(out), "DCP stores the two tied entries separately"


@pytest.mark.parametrize("b", LOSSLESS)
def test_from_native_dcp_round_trip(tmp_path, b):
    state = make_state()
    first, middle, back = name(tmp_path, "dcp"), name(tmp_path, b), name(tmp_path, "dcp", "-back")
    write_native(state, first, "dcp", tmp_path)
    original = read_any(first, "dcp", tmp_path)
    assert_same(original, dcp_view(state))
    assert detect_format(first) == "dcp"
    convert(first, middle, b)
    assert_same(read_any(middle, b, tmp_path), original)
    convert(middle, back, "dcp")
    assert_same(read_any(back, "dcp", tmp_path), original)


def test_dcp_structure_rules(tmp_path):
    state = {
        "empty": {},
        "groups": [{1: "a", "t": torch.ones(2)}],  # a list holding dicts: walked, keys stringified
        "plain": [{1: "a"}, 2],  # walked too (it holds a dict), so its int key becomes str as well
        "ints": [1, 2],  # pickled whole
        "pair": (torch.zeros(1), {3: "x"}),  # a tuple is pickled whole, tensor and int key included
        "od": collections.OrderedDict(a=torch.ones(1)),
    }
    src, dst = name(tmp_path, "ckptstore"), name(tmp_path, "dcp")
    ckptstore.save(state, src)
    report = convert(src, dst, "dcp")
    expected = {
        "groups": [{"1": "a", "t": torch.ones(2)}],
        "plain": [{"1": "a"}, 2],
        "ints": [1, 2],
        "pair": (torch.zeros(1), {3: "x"}),
        "od": {"a": torch.ones(1)},
    }
    assert_same(dcp_view(state), expected)
    assert_same(read_any(dst, "dcp", tmp_path), expected)
    notes = " ".join(report["notes"])
    assert "obj['empty']" in notes and "obj['od']" in notes and "obj['groups'][0][1]" in notes


def test_dcp_cannot_hold_colliding_dotted_keys_or_a_non_dict_root(tmp_path):
    src = name(tmp_path, "ckptstore")
    ckptstore.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, src)
    dst = name(tmp_path, "dcp")
    with pytest.raises(UnsupportedObjectError, match="duplicated flatten key a.b"):
        convert(src, dst, "dcp")
    src2 = name(tmp_path, "torch")
    torch.save([torch.ones(1)], src2)
    with pytest.raises(UnsupportedObjectError, match="dict at its root"):
        convert(src2, dst, "dcp")
    assert not os.path.exists(dst)
    assert [n for n in os.listdir(tmp_path) if "convert-tmp" in n] == []


# ------------------------------------------------------------------------------------ sharded source


@pytest.mark.parametrize("b", FORMATS)
def test_from_sharded_directory(tmp_path, b):
    state = make_state()
    state["alias"] = state["bf16"]  # one object twice: save_sharded writes it once
    sharded = dict(state, rng=ckptstore.PerRank(torch.get_rng_state()))
    src = str(tmp_path / "sharded")
    ckptstore.save_sharded(sharded, src)
    assert detect_format(src) == "ckptstore-sharded"
    dst = name(tmp_path, b)
    report = convert(src, dst, b)
    assert report["src_format"] == "ckptstore-sharded"
    assert report["dropped"] == ["obj['rng']"] and "per-rank" in report["notes"][0]
    out = read_any(dst, b, tmp_path)
    expected = state if b != "dcp" else dcp_view(state)
    assert_same(out, expected)
    # The sharded format keeps one object as one entry, but two tensors sharing storage as two.
    assert not tied(out)
    if b != "dcp":
        assert out["alias"] is out["bf16"]
        back = name(tmp_path, "ckptstore", "-back")
        convert(dst, back, "ckptstore")
        assert_same(ckptstore.load(back), state)


def test_sharded_per_rank_inside_a_list_becomes_none(tmp_path):
    src = str(tmp_path / "sharded")
    ckptstore.save_sharded({"loaders": [ckptstore.PerRank(5), 7], "w": torch.ones(3)}, src)
    dst = name(tmp_path, "ckptstore")
    report = convert(src, dst, "ckptstore")
    assert report["dropped"] == ["obj['loaders'][0]"]
    assert_same(ckptstore.load(dst), {"loaders": [None, 7], "w": torch.ones(3)})


# ------------------------------------------------------------------------------------ foreign safetensors


@pytest.mark.parametrize("b", ("ckptstore", "torch", "dcp"))
def test_foreign_safetensors_is_a_flat_dict(tmp_path, b):
    flat = {
        "encoder.layer.0.weight": torch.randn(4, 3),
        "encoder.layer.0.bias": torch.randn(4).to(torch.bfloat16),
        "head": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
    }
    src = name(tmp_path, "safetensors")
    safetensors.torch.save_file(flat, src, metadata={"format": "pt"})
    assert detect_format(src) == "safetensors"
    middle, back = name(tmp_path, b), name(tmp_path, "safetensors", "-back")
    convert(src, middle, b)
    out = read_any(middle, b, tmp_path)
    assert_same(dict(sorted(out.items())), dict(sorted(flat.items())))
    convert(middle, back, "safetensors")
    again = safetensors.torch.load_file(back)
    assert_same(dict(sorted(again.items())), dict(sorted(flat.items())))


def test_safetensors_refuses_what_it_cannot_hold(tmp_path):
    src, dst = name(tmp_path, "ckptstore"), name(tmp_path, "safetensors")
    ckptstore.save({"w": torch.ones(2), "frac": fractions.Fraction(1, 3)}, src, allow_pickle=True)
    with pytest.raises(PickleNotAllowedError):
        convert(src, dst, "safetensors")
    with pytest.raises(UnsupportedObjectError, match=r"obj\['frac'\] is a fractions.Fraction.*safetensors"):
        convert(src, dst, "safetensors", allow_pickle=True)
    src2 = name(tmp_path, "ckptstore")
    ckptstore.save({"c": torch.ones(2, dtype=torch.complex128)}, src2)
    with pytest.raises(UnsupportedObjectError, match=r"obj\['c'\] has dtype torch.complex128"):
        convert(src2, dst, "safetensors")
    assert not os.path.exists(dst)
    assert [n for n in os.listdir(tmp_path) if "convert-tmp" in n] == []


def test_safetensors_keeps_numpy_and_odd_keys(tmp_path):
    import numpy as np

    state = {
        0: torch.ones(2),
        "0": torch.zeros(2),  # same escaped key as the int 0: stored under a de-duplicated name
        "a/b~c": torch.full((2,), 3.0),
        ("t", 1): {"x": np.arange(6, dtype=">i4").reshape(2, 3), "s": np.float16(1.5)},
        "misc": {"set": {1, 2}, "bytes": b"\x00\x01", "nan": float("nan"), "dtype": torch.float16},
    }
    src, mid, back = name(tmp_path, "ckptstore"), name(tmp_path, "safetensors"), name(tmp_path, "ckptstore")
    ckptstore.save(state, src)
    convert(src, mid, "safetensors")
    assert {"0", "0#2", "a~1b~0c"} <= set(safetensors.torch.load_file(mid))
    convert(mid, back, "ckptstore")
    assert_same(ckptstore.load(back), state)


# ------------------------------------------------------------------------------------ pickle


def test_torch_source_with_pickled_objects_needs_allow_pickle(tmp_path):
    src, dst = name(tmp_path, "torch"), name(tmp_path, "ckptstore")
    torch.save({"w": torch.ones(2), "frac": fractions.Fraction(1, 3)}, src)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        convert(src, dst, "ckptstore")
    assert not os.path.exists(dst)
    convert(src, dst, "ckptstore", allow_pickle=True)
    assert ckptstore.load(dst, weights_only=False)["frac"] == fractions.Fraction(1, 3)


def test_dcp_pickled_values_need_allow_pickle(tmp_path):
    tmp = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "frac": fractions.Fraction(1, 3)}, tmp)
    src = name(tmp_path, "dcp")
    torch_save_to_dcp(tmp, src)
    dst = name(tmp_path, "torch")
    with pytest.raises(PickleNotAllowedError, match="'frac'"):
        convert(src, dst, "torch")
    assert not os.path.exists(dst)
    convert(src, dst, "torch", allow_pickle=True)
    assert torch.load(dst, weights_only=False)["frac"] == fractions.Fraction(1, 3)


class _Trap:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_dcp_metadata_is_not_unpickled_freely(tmp_path):
    src = name(tmp_path, "dcp")
    write_native({"w": torch.ones(2)}, src, "dcp", tmp_path)
    marker = tmp_path / "pwned"
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Trap(str(marker)), f)
    with pytest.raises(PickleNotAllowedError, match=r"refers to (io|builtins)\.open"):
        convert(src, name(tmp_path, "torch"), "torch")
    assert not marker.exists()


# ------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("to", FORMATS)
def test_existing_destination_is_refused_and_untouched(tmp_path, to):
    src = name(tmp_path, "ckptstore")
    ckptstore.save(make_state(), src)
    dst = tmp_path / "taken"
    dst.write_bytes(b"precious")
    with pytest.raises(CheckpointError, match="already exists") as info:
        convert(src, str(dst), to)
    assert "move or delete it first" in str(info.value)
    assert dst.read_bytes() == b"precious"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "keep").write_text("x")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(src, str(folder), to)
    assert os.listdir(folder) == ["keep"]
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(src), "taken", "folder"])


def test_bad_arguments(tmp_path):
    src = name(tmp_path, "ckptstore")
    ckptstore.save({"w": torch.ones(1)}, src)
    with pytest.raises(InvalidArgumentError, match="ckptstore, torch, safetensors, dcp") as info:
        convert(src, str(tmp_path / "out"), "onnx")
    assert "'onnx'" in str(info.value)
    with pytest.raises(CheckpointNotFoundError, match="nothing exists there"):
        convert(str(tmp_path / "missing.pt"), str(tmp_path / "out"), "torch")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(NotACheckpointError, match="not a checkpoint"):
        convert(str(junk), str(tmp_path / "out"), "torch")
    with pytest.raises(StorageError, match="does not exist; create it first"):
        convert(src, str(tmp_path / "no" / "such" / "dir.pt"), "torch")
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(src), "junk.bin"])


def test_detect_format_on_each_kind(tmp_path):
    state = {"w": torch.ones(2), "n": 1}
    kinds = {}
    for fmt in FORMATS:
        path = name(tmp_path, fmt)
        write_native(state, path, fmt, tmp_path)
        kinds[fmt] = detect_format(path)
    assert kinds == {f: f for f in FORMATS}
    ckptstore.save_sharded(state, tmp_path / "sharded")
    assert detect_format(str(tmp_path / "sharded")) == "ckptstore-sharded"
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert detect_format(str(legacy)) == "torch"
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(NotACheckpointError, match="empty"):
        detect_format(str(tmp_path / "empty.bin"))
    (tmp_path / "text.json").write_bytes(b'{"a": 1}')
    with pytest.raises(NotACheckpointError):
        detect_format(str(tmp_path / "text.json"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(NotACheckpointError, match="neither manifest.json"):
        detect_format(str(tmp_path / "emptydir"))
    with pytest.raises(CheckpointNotFoundError):
        detect_format(str(tmp_path / "missing"))
    os.unlink(tmp_path / "sharded" / "manifest.json")
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        detect_format(str(tmp_path / "sharded"))


def test_fsspec_urls(tmp_path):
    state = make_state()
    base = f"memory://convert-{uuid.uuid4().hex}"
    ckptstore.save(state, f"{base}/a.ckpt")
    assert detect_format(f"{base}/a.ckpt") == "ckptstore"
    convert(f"{base}/a.ckpt", f"{base}/b.safetensors", "safetensors")
    assert detect_format(f"{base}/b.safetensors") == "safetensors"
    convert(f"{base}/b.safetensors", f"{base}/c.pt", "torch")
    local = str(tmp_path / "d.ckpt")
    convert(f"{base}/c.pt", local, "ckptstore")
    out = ckptstore.load(local)
    assert_same(out, state)
    assert tied(out)
    with pytest.raises(CheckpointError, match="already exists"):
        convert(local, f"{base}/c.pt", "torch")
    with pytest.raises(InvalidArgumentError, match="local filesystem"):
        convert(local, f"{base}/e.dcp", "dcp")
    fs = fsspec.filesystem("memory")
    with fs.open(f"{base}/c.pt", "rb") as f:
        assert_same(torch.load(io.BytesIO(f.read()), weights_only=True), state)
    fs.rm(base.removeprefix("memory://"), recursive=True)


def test_odict_metadata_survives_lossless_formats(tmp_path):
    od = collections.OrderedDict([("w", torch.ones(1))])
    od._metadata = collections.OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]
    src, mid, back = name(tmp_path, "torch"), name(tmp_path, "safetensors"), name(tmp_path, "torch")
    torch.save({"m": od}, src)
    convert(src, mid, "safetensors")
    convert(mid, back, "torch")
    assert_same(torch.load(back, weights_only=True), {"m": od})
