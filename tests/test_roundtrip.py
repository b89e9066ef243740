"""Round trips through ckptstore.save / ckptstore.load: destinations, object kinds, tensors, options."""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import random
import textwrap
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
import warm_python
from conftest import (
    Point,
    assert_same,
    assert_tensor_identical,
    container_layout,
    directory_entries,
    rewrite_manifest,
    tensor_bytes,
)
from torch import nn

import ckptstore
from ckptstore import (
    InvalidArgumentError,
    PickleNotAllowedError,
    UnsupportedObjectError,
)
from ckptstore.format.dtypes import NAME_TO_DTYPE

# ckptstore's own dtype table is the list of what the format promises to store.
DTYPE_NAMES = sorted(NAME_TO_DTYPE)
# Allocating a complex32 tensor makes torch warn once per process ("ComplexHalf support is
# experimental"); which test allocates first depends on the order, so the dtype tests let only that
# message through, only for complex32. Whether ckptstore itself allocates complex32 tensors is
# checked separately, in a fresh interpreter: test_complex32_round_trip_does_not_warn.
_COMPLEX32_WARNING = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def _dtype_params():
    return [pytest.param(n, marks=_COMPLEX32_WARNING) if n == "complex32" else n for n in DTYPE_NAMES]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: covers NaN payloads, signed zeros, subnormals, ..."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1  # a bool byte other than 0/1 is undefined behaviour in torch, not data
    return raw.view(dtype).reshape(shape)


def roundtrip(obj, **save_kwargs):
    buf = io.BytesIO()
    ckptstore.save(obj, buf, **save_kwargs)
    buf.seek(0)
    return ckptstore.load(buf)


def sample_tree():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    shared = torch.randn(10)
    return {
        "weights": {"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.float64)},
        "step": 1234,
        "lr": 3e-4,
        "name": "run-ünïcode",
        "tied_a": base,
        "tied_b": base,
        "view_a": shared[2:7],
        "view_b": shared[::3],
        "list": [1, 2.5, None, True, (b"raw", {3, 4})],
    }


# --------------------------------------------------------------------------------------------
# Destinations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["str", "pathlib", "file_url", "open_file"])
def test_local_destinations_write_exactly_one_file(kind, tmp_path):
    path = tmp_path / "model.ckpt"
    obj = sample_tree()
    if kind == "str":
        ckptstore.save(obj, str(path))
        loaded = ckptstore.load(str(path))
    elif kind == "pathlib":
        ckptstore.save(obj, path)
        loaded = ckptstore.load(path)
    elif kind == "file_url":
        ckptstore.save(obj, f"file://{path}")
        loaded = ckptstore.load(f"file://{path}")
    else:
        with open(path, "wb") as fh:
            ckptstore.save(obj, fh)
        with open(path, "rb") as fh:
            loaded = ckptstore.load(fh)
            assert fh.tell() == path.stat().st_size
    assert directory_entries(tmp_path) == ["model.ckpt"]
    assert_same(loaded, obj)
    assert loaded["tied_a"] is loaded["tied_b"]
    assert loaded["view_a"].untyped_storage().data_ptr() == loaded["view_b"].untyped_storage().data_ptr()


def test_overwriting_a_path_replaces_it_and_leaves_one_file(tmp_path):
    path = tmp_path / "c.ckpt"
    ckptstore.save({"v": torch.ones(1000)}, path)
    ckptstore.save({"v": torch.zeros(3)}, path)
    assert directory_entries(tmp_path) == ["c.ckpt"]
    assert_same(ckptstore.load(path), {"v": torch.zeros(3)})


def test_bytesio_round_trip():
    obj = sample_tree()
    buf = io.BytesIO()
    ckptstore.save(obj, buf)
    assert buf.tell() == len(buf.getvalue())
    buf.seek(0)
    loaded = ckptstore.load(buf)
    assert buf.tell() == len(buf.getvalue())
    assert_same(loaded, obj)


def test_stream_at_nonzero_position_with_data_before_and_after():
    first = {"a": torch.arange(5), "x": 1}
    second = {"b": torch.randn(2, 2), "y": "two"}
    buf = io.BytesIO()
    buf.write(b"PREFIX-DATA")
    start = buf.tell()
    ckptstore.save(first, buf)
    end1 = buf.tell()
    ckptstore.save(second, buf)
    end2 = buf.tell()
    buf.write(b"TRAILER")
    assert buf.getvalue().startswith(b"PREFIX-DATA")

    buf.seek(start)
    assert_same(ckptstore.load(buf), first)
    assert buf.tell() == end1, "load must leave the stream just past the checkpoint"
    assert_same(ckptstore.load(buf), second)
    assert buf.tell() == end2
    assert buf.read() == b"TRAILER"


def test_memory_url_round_trip_and_no_temporary_keys():
    fs = fsspec.filesystem("memory")
    root = f"/ckptstore-tests/{uuid.uuid4().hex}"
    url = f"memory://{root}/ckpt.bin"
    obj = sample_tree()
    try:
        ckptstore.save(obj, url)
        assert [os.path.basename(p) for p in fs.ls(root, detail=False)] == ["ckpt.bin"]
        loaded = ckptstore.load(url)
        assert_same(loaded, obj)
        assert loaded["tied_a"] is loaded["tied_b"]
        # Overwrite keeps exactly one object.
        ckptstore.save({"z": 0}, url)
        assert [os.path.basename(p) for p in fs.ls(root, detail=False)] == ["ckpt.bin"]
        assert ckptstore.load(url) == {"z": 0}
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


# --------------------------------------------------------------------------------------------
# Python and library objects
# --------------------------------------------------------------------------------------------

SCALARS = [
    None,
    True,
    False,
    0,
    -1,
    2**53,
    2**53 + 1,
    -(2**53) - 1,
    2**63,
    2**64 + 1,
    2**100,
    -(2**70),
    0.0,
    -0.0,
    1.5,
    1e16,
    5e-324,
    1.7976931348623157e308,
    float("inf"),
    float("-inf"),
    float("nan"),
    "",
    "héllo wörld ✓ 🚀 中文 עברית",
    "\x00nul\x01",
    "$tensor",
    "$",
    b"",
    bytes(range(256)),
    bytearray(b"mutable"),
    {1, 2, 3},
    set(),
    frozenset({"a", "b"}),
    complex(1.5, -2.0),
    complex(float("nan"), -0.0),
    complex(float("inf"), float("-inf")),
    torch.float32,
    torch.bfloat16,
    torch.bool,
    torch.complex64,
    torch.device("cpu"),
    torch.device("cuda", 1),
    torch.Size([2, 3]),
    torch.Size([]),
    (),
    (1, "two", 3.0),
    [],
    {},
    collections.OrderedDict([("z", 1), ("a", 2)]),
    Point(1, "y"),
]


@pytest.mark.parametrize("value", SCALARS, ids=lambda v: f"{type(v).__name__}:{v!r}"[:40])
def test_plain_values_round_trip_exactly(value):
    # Top level, as a dict value, inside a list and inside a tuple.
    obj = {"top": value, "nested": [value, (value,)], "odict": collections.OrderedDict(k=value)}
    assert_same(roundtrip(value), value)
    assert_same(roundtrip(obj), obj)


def test_negative_zero_and_nan_keep_their_identity():
    loaded = roundtrip([-0.0, float("nan"), 0.0])
    assert math.copysign(1.0, loaded[0]) == -1.0
    assert math.isnan(loaded[1])
    assert math.copysign(1.0, loaded[2]) == 1.0


def test_dict_key_kinds_round_trip():
    obj = {
        1: "int",
        -(2**80): "huge int",
        "plain": 1,
        "$starts_with_dollar": 2,
        ("tuple", 3): 3,
        2.5: "float",
        None: "none",
        b"bytes": "bytes",
        frozenset({1}): "frozenset",
    }
    assert_same(roundtrip(obj), obj)
    nested = {"outer": {"$tensor": "not a tag", "k": {"$view": 1}}, "$pickle": [1]}
    assert_same(roundtrip(nested), nested)


def test_nested_containers_keep_types_and_order():
    obj = collections.OrderedDict(
        [
            ("z", [1, (2, [3, {"deep": (4,)}])]),
            ("a", {"inner": collections.OrderedDict([("y", 1), ("x", 2)])}),
            ("p", Point(x=torch.ones(2), y=[Point(1, 2)])),
        ]
    )
    loaded = roundtrip(obj)
    assert_same(loaded, obj)
    assert list(loaded) == ["z", "a", "p"]
    assert type(loaded["p"]) is Point and type(loaded["p"].y[0]) is Point
    assert loaded["p"].x.dtype == torch.float32


@pytest.mark.parametrize(
    "value",
    [2**20000, -(3**9000), 2**500_000 - 1, -(2**500_000)],
    ids=["2**20000", "-3**9000", "2**500000-1", "-2**500000"],
)
def test_very_large_ints_round_trip(value):
    # "int of any size": Python ints beyond 4300 decimal digits are ordinary values (pickle and
    # torch.save store them); str() of them is refused by CPython's int_max_str_digits limit, and
    # whatever save writes, load must read back.
    obj = {"big": value, "nested": [value]}
    assert_same(roundtrip(obj), obj)


def test_str_with_lone_surrogate_round_trips():
    # Python strs may hold lone surrogates (os.fsdecode of undecodable file names produces them);
    # torch.save and pickle store them. ckptstore must either store them or refuse them with its
    # own error naming the key, never crash with a bare UnicodeEncodeError.
    obj = {"name": "file-\udcff.bin"}
    try:
        loaded = roundtrip(obj)
    except UnsupportedObjectError as exc:
        assert "obj['name']" in str(exc)
    else:
        assert_same(loaded, obj)


def test_model_state_dict_keeps_metadata_and_loads_into_a_model(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    model(torch.randn(8, 4))  # updates BatchNorm running stats
    sd = model.state_dict()
    path = tmp_path / "model.ckpt"
    ckptstore.save(sd, path)
    loaded = ckptstore.load(path)

    assert type(loaded) is collections.OrderedDict
    assert hasattr(loaded, "_metadata")
    assert loaded._metadata == sd._metadata
    assert_same(loaded, sd)
    assert loaded["1.num_batches_tracked"].dtype == torch.int64

    fresh = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    fresh.load_state_dict(loaded)
    assert_same(fresh.state_dict(), sd)


def _train_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "make_opt",
    [
        pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.01), id="adam"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), id="sgd-momentum"),
    ],
)
def test_optimizer_state_dict_round_trip_and_resume_bitwise(make_opt, tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    opt = make_opt(model.parameters())
    _train_step(model, opt, torch.randn(6, 5))
    _train_step(model, opt, torch.randn(6, 5))

    sd = opt.state_dict()
    path = tmp_path / "opt.ckpt"
    ckptstore.save({"model": model.state_dict(), "optim": sd}, path)
    loaded = ckptstore.load(path)

    assert_same(loaded["optim"], sd)
    assert list(loaded["optim"]["state"]) == [0, 1, 2, 3]
    assert all(type(k) is int for k in loaded["optim"]["state"])
    assert loaded["optim"]["param_groups"] == sd["param_groups"]
    assert_same(loaded["optim"]["param_groups"], sd["param_groups"])

    model2 = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    model2.load_state_dict(loaded["model"])
    opt2 = make_opt(model2.parameters())
    opt2.load_state_dict(loaded["optim"])

    x = torch.randn(6, 5)
    _train_step(model, opt, x)
    _train_step(model2, opt2, x)
    for (name, p1), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(tensor_bytes(p1), tensor_bytes(p2)), f"parameter {name} diverged after resume"
    assert_same(opt2.state_dict(), opt.state_dict())


def test_rng_states_reproduce_the_same_draws(tmp_path):
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        torch.manual_seed(123)
        np.random.seed(456)
        random.seed(789)
        states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])

        path = tmp_path / "rng.ckpt"
        ckptstore.save(states, path)
        # Move every generator on, so equality below can only come from the restored state.
        torch.rand(7), np.random.rand(7), random.random()
        loaded = ckptstore.load(path)
        assert_same(loaded, states)

        torch.set_rng_state(loaded["torch"])
        np.random.set_state(loaded["numpy"])
        random.setstate(loaded["python"])
        assert torch.equal(torch.rand(5), expected[0])
        assert np.array_equal(np.random.rand(5), expected[1])
        assert [random.random() for _ in range(5)] == expected[2]
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


NUMPY_ARRAYS = {
    "f32_2d": np.arange(12, dtype=np.float32).reshape(3, 4),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
    "strided": np.arange(40, dtype=np.int64).reshape(5, 8)[::2, 1::3],
    "zero_d": np.array(3.25),
    "empty": np.zeros((0, 3), dtype=np.int16),
    "bool": np.array([True, False, True]),
    "big_endian": np.arange(6, dtype=">i4"),
    "complex": np.array([1 + 2j, -0.0 - 1j], dtype=np.complex128),
    "uint64_max": np.array([2**64 - 1, 0], dtype=np.uint64),
    "float16_special": np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float16),
}


@pytest.mark.parametrize("name", sorted(NUMPY_ARRAYS))
def test_numpy_arrays_round_trip(name):
    arr = NUMPY_ARRAYS[name]
    loaded = roundtrip({"a": arr})["a"]
    assert type(loaded) is np.ndarray
    assert loaded.dtype == arr.dtype
    assert loaded.shape == arr.shape
    assert loaded.tobytes() == arr.tobytes()
    if arr.dtype.kind != "f":
        assert np.array_equal(loaded, arr)


NUMPY_SCALARS = [
    np.float64(1.25),
    np.float64("nan"),
    np.float32(-0.0),
    np.float16(65504),
    np.longdouble("1.1"),
    np.int8(-5),
    np.int64(-(2**63)),
    np.uint64(2**64 - 1),
    np.bool_(True),
    np.complex64(1 - 2j),
]


@pytest.mark.parametrize("value", NUMPY_SCALARS, ids=lambda v: f"{type(v).__name__}:{v!r}")
def test_numpy_scalars_keep_their_type(value):
    loaded = roundtrip({"s": value, "l": [value]})
    assert type(loaded["s"]) is type(value)
    assert type(loaded["l"][0]) is type(value)
    assert loaded["s"].tobytes() == value.tobytes()


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def _layout(name: str, dtype: torch.dtype) -> torch.Tensor:
    if name == "contiguous":
        return random_tensor(dtype, (6, 5), 1)
    if name == "scalar":
        return random_tensor(dtype, (), 2)
    if name == "empty":
        return random_tensor(dtype, (0, 3), 3)
    if name == "transposed":
        return random_tensor(dtype, (5, 6), 4).t()
    if name == "stepped":
        return random_tensor(dtype, (10, 4), 5)[::3, 1:]
    if name == "offset_view":
        return random_tensor(dtype, (8, 4), 6)[2:5]
    if name == "expanded":
        return random_tensor(dtype, (1, 4), 7).expand(5, 4)
    if name == "large":
        return random_tensor(dtype, (1024, 1100), 8)
    raise AssertionError(name)


LAYOUTS = ["contiguous", "scalar", "empty", "transposed", "stepped", "offset_view", "expanded"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", _dtype_params())
def test_every_dtype_and_layout_round_trips_bitwise(dtype_name, layout):
    dtype = NAME_TO_DTYPE[dtype_name]
    t = _layout(layout, dtype)
    loaded = roundtrip({"t": t})["t"]
    assert_tensor_identical(loaded, t, f"{dtype_name}/{layout}")


def test_complex32_round_trip_does_not_warn(tmp_path):
    # torch warns (once per process) whenever a complex32 tensor is allocated. Views of existing
    # bytes do not allocate, so save/load of complex32 data never needs to; under `-W error` (this
    # project's CI) such a warning from inside ckptstore would be an error in the user's program.
    code = textwrap.dedent(
        """
        import io, warnings
        import torch, ckptstore
        warnings.simplefilter("error")
        raw = torch.arange(48, dtype=torch.uint8)
        c = raw.view(torch.complex32).view(4, 3)  # a view: no allocation, no warning
        for obj in ({"t": c}, {"e": c[:0]}, {"nc": c.t()}, {"a": c, "b": c[1:]}):
            buf = io.BytesIO()
            ckptstore.save(obj, buf)
            buf.seek(0)
            out = ckptstore.load(buf)
            for k, v in obj.items():
                assert out[k].dtype == torch.complex32 and out[k].shape == v.shape, k
        """
    )
    result = warm_python.run(["-c", code], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int64", "uint8", "complex128", "float8_e4m3fn"])
def test_large_tensor_round_trips_bitwise(dtype_name, tmp_path):
    t = _layout("large", NAME_TO_DTYPE[dtype_name])
    path = tmp_path / "large.ckpt"
    ckptstore.save({"t": t}, path)
    assert_tensor_identical(ckptstore.load(path)["t"], t)


@pytest.mark.parametrize("codec", ["zstd", "shuffle+zstd"])
@pytest.mark.parametrize("dtype_name", _dtype_params())
def test_every_dtype_round_trips_compressed(dtype_name, codec):
    t = _layout("contiguous", NAME_TO_DTYPE[dtype_name])
    obj = {"t": t, "scalar": _layout("scalar", t.dtype), "empty": _layout("empty", t.dtype)}
    assert_same(roundtrip(obj, compression=codec), obj)


def test_same_tensor_twice_loads_as_one_object():
    w = torch.randn(4, 4)
    loaded = roundtrip({"encoder": {"emb": w}, "decoder": {"emb": w}, "list": [w, w]})
    assert loaded["encoder"]["emb"] is loaded["decoder"]["emb"]
    assert loaded["list"][0] is loaded["encoder"]["emb"] and loaded["list"][1] is loaded["list"][0]
    assert_tensor_identical(loaded["encoder"]["emb"], w)


def test_views_of_one_storage_keep_sharing_it():
    base = torch.arange(20, dtype=torch.float32)
    obj = {
        "base": base,
        "slice": base[3:9],
        "stepped": base[1::4],
        "matrix": base.view(4, 5),
        "column": base.view(4, 5)[:, 2],
        "as_int": base.view(torch.int32),
    }
    loaded = roundtrip(obj)
    assert_same(loaded, obj)
    ptrs = {k: v.untyped_storage().data_ptr() for k, v in loaded.items()}
    assert len(set(ptrs.values())) == 1, ptrs

    loaded["slice"][0] = -1.0  # base[3]
    assert loaded["base"][3].item() == -1.0
    assert loaded["matrix"][0, 3].item() == -1.0
    loaded["column"][1] = 99.0  # base[7]
    assert loaded["base"][7].item() == 99.0
    assert loaded["slice"][4].item() == 99.0
    loaded["base"][5] = 2.5
    assert loaded["stepped"][1].item() == 2.5  # base[5]
    assert loaded["as_int"][5].item() == torch.tensor(2.5).view(torch.int32).item()


def test_partially_overlapping_views_share_storage_without_the_base():
    base = torch.randn(12)
    loaded = roundtrip({"a": base[0:6], "b": base[4:10]})
    assert_tensor_identical(loaded["a"], base[0:6])
    assert_tensor_identical(loaded["b"], base[4:10])
    loaded["a"][5] = 123.0
    assert loaded["b"][1].item() == 123.0


def test_tied_module_weights_share_storage_after_load():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    loaded = roundtrip(model.state_dict())
    assert loaded["emb.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    loaded["emb.weight"][0, 0] = 42.0
    assert loaded["head.weight"][0, 0].item() == 42.0
    Tied().load_state_dict(loaded)

    loaded_vars = roundtrip(model.state_dict(keep_vars=True))
    assert loaded_vars["emb.weight"] is loaded_vars["head.weight"]
    assert type(loaded_vars["emb.weight"]) is nn.Parameter


def test_parameters_and_requires_grad_survive():
    p = nn.Parameter(torch.randn(3, 2))
    frozen = nn.Parameter(torch.randn(2), requires_grad=False)
    plain = torch.randn(4, requires_grad=True)
    no_grad = torch.randn(4)
    loaded = roundtrip({"p": p, "frozen": frozen, "plain": plain, "no_grad": no_grad})

    assert type(loaded["p"]) is nn.Parameter and loaded["p"].requires_grad
    assert type(loaded["frozen"]) is nn.Parameter and not loaded["frozen"].requires_grad
    assert type(loaded["plain"]) is torch.Tensor and loaded["plain"].requires_grad and loaded["plain"].is_leaf
    assert type(loaded["no_grad"]) is torch.Tensor and not loaded["no_grad"].requires_grad
    for k, v in {"p": p, "frozen": frozen, "plain": plain, "no_grad": no_grad}.items():
        assert_tensor_identical(loaded[k], v, k)
    loaded["plain"].sum().backward()
    assert torch.equal(loaded["plain"].grad, torch.ones(4))


def test_expanded_tensor_keeps_values_and_is_not_materialised(tmp_path):
    row = torch.randn(1, 256)
    expanded = row.expand(4096, 256)  # 4 MiB logical, 1 KiB of storage
    path = tmp_path / "exp.ckpt"
    ckptstore.save({"e": expanded}, path)
    loaded = ckptstore.load(path)["e"]
    assert_tensor_identical(loaded, expanded)
    assert loaded.stride() == (0, 1)
    assert path.stat().st_size < 64 * 1024


def test_small_slice_of_big_tensor_is_written_compactly(tmp_path):
    big = torch.randn(1 << 20)  # 4 MiB
    path = tmp_path / "slice.ckpt"
    ckptstore.save({"s": big[10:20]}, path)
    assert_tensor_identical(ckptstore.load(path)["s"], big[10:20])
    assert path.stat().st_size < 64 * 1024


def test_conjugate_and_negative_views_store_their_values():
    z = torch.randn(3, 4, dtype=torch.complex64)
    loaded = roundtrip({"conj": z.conj(), "neg": z.conj().imag})
    assert not loaded["conj"].is_conj()
    assert torch.equal(loaded["conj"], z.conj().resolve_conj())
    assert torch.equal(loaded["neg"], z.conj().imag.resolve_neg())


# --------------------------------------------------------------------------------------------
# map_location
# --------------------------------------------------------------------------------------------

MAP_LOCATIONS = {
    "none": None,
    "str": "cpu",
    "device": torch.device("cpu"),
    "dict": {"cpu": "cpu"},
    "callable_identity": lambda storage, loc: storage,
    "callable_none": lambda storage, loc: None,
}


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("which", sorted(MAP_LOCATIONS))
def test_map_location_variants(which, mmap, tmp_path):
    base = torch.randn(16)
    obj = {"w": torch.randn(3, 5), "i": torch.arange(7), "v1": base[:8], "v2": base[4:], "e": torch.empty(0, 2)}
    path = tmp_path / "m.ckpt"
    ckptstore.save(obj, path)
    loaded = ckptstore.load(path, map_location=MAP_LOCATIONS[which], mmap=mmap)
    assert_same(loaded, obj)
    assert all(t.device == torch.device("cpu") for t in loaded.values())
    loaded["v1"][5] = 7.0  # base[5] is in both views
    assert loaded["v2"][1].item() == 7.0


def test_map_location_callable_sees_storage_and_location(tmp_path):
    seen = []

    def hook(storage, location):
        seen.append((type(storage), location))
        return storage

    path = tmp_path / "m.ckpt"
    ckptstore.save({"a": torch.ones(2), "b": torch.zeros(3)}, path)
    assert_same(ckptstore.load(path, map_location=hook), {"a": torch.ones(2), "b": torch.zeros(3)})
    assert seen and all(t is torch.UntypedStorage and loc == "cpu" for t, loc in seen)


def _saved_on_cuda(path: Path) -> dict:
    """Save tensors, then mark them in the manifest as saved on cuda:0 (no GPU needed)."""
    base = torch.randn(10)
    obj = {"w": torch.randn(3, 4), "v1": base[:6], "v2": base[4:], "step": 5}
    ckptstore.save(obj, path)

    def mark(node):
        if isinstance(node, dict):
            if next(iter(node), None) in ("$tensor", "$view"):
                node["device"] = "cuda:0"
            for v in node.values():
                mark(v)
        elif isinstance(node, list):
            for v in node:
                mark(v)

    def edit(doc):
        mark(doc["tree"])
        return doc

    path.write_bytes(rewrite_manifest(path.read_bytes(), edit))
    return obj


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cuda:0": "cpu"}, lambda storage, loc: storage],
    ids=["str", "device", "dict", "callable"],
)
def test_map_location_moves_tensors_saved_on_a_gpu(map_location, tmp_path):
    path = tmp_path / "cuda.ckpt"
    obj = _saved_on_cuda(path)
    loaded = ckptstore.load(path, map_location=map_location)
    assert_same(loaded, obj)
    loaded["v1"][5] = 3.0
    assert loaded["v2"][1].item() == 3.0


def test_map_location_callable_is_told_the_saved_location(tmp_path):
    path = tmp_path / "cuda.ckpt"
    obj = _saved_on_cuda(path)
    seen = []

    def hook(storage, location):
        seen.append(location)
        return storage

    loaded = ckptstore.load(path, map_location=hook)
    assert seen and set(seen) == {"cuda:0"}
    assert_same(loaded, obj)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when no GPU is present")
def test_tensors_saved_on_gpu_without_map_location_fail_clearly(tmp_path):
    path = tmp_path / "cuda.ckpt"
    _saved_on_cuda(path)
    with pytest.raises(ckptstore.CheckpointError) as info:
        ckptstore.load(path)
    assert "CUDA" in str(info.value) and "map_location" in str(info.value)


# --------------------------------------------------------------------------------------------
# weights_only / allow_pickle
# --------------------------------------------------------------------------------------------


class Custom:
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return type(other) is Custom and other.value == self.value


def module_level_function(x):
    return x


@pytest.mark.parametrize(
    "obj, path_expr, type_name",
    [
        ({"a": {"b": Custom(1)}}, "obj['a']['b']", "Custom"),
        ({"cfg": [0, {"fn": module_level_function}]}, "obj['cfg'][1]['fn']", "function"),
        ([1, (2, Custom(2))], "obj[1][1]", "Custom"),
    ],
)
def test_unsupported_object_names_its_path_and_writes_nothing(obj, path_expr, type_name, tmp_path):
    path = tmp_path / "c.ckpt"
    ckptstore.save({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save(obj, path)
    message = str(info.value)
    assert path_expr in message
    assert type_name in message
    assert "allow_pickle" in message
    assert isinstance(info.value, TypeError)
    assert path.read_bytes() == before
    assert directory_entries(tmp_path) == ["c.ckpt"]

    fresh = tmp_path / "fresh.ckpt"
    with pytest.raises(UnsupportedObjectError):
        ckptstore.save(obj, fresh)
    assert not fresh.exists()
    assert directory_entries(tmp_path) == ["c.ckpt"]

    buf = io.BytesIO(b"keep")
    buf.seek(4)
    with pytest.raises(UnsupportedObjectError):
        ckptstore.save(obj, buf)
    assert buf.getvalue() == b"keep" and buf.tell() == 4


def test_unpicklable_object_is_refused_even_with_allow_pickle(tmp_path):
    path = tmp_path / "c.ckpt"
    with pytest.raises(UnsupportedObjectError) as info:
        ckptstore.save({"f": lambda x: x}, path, allow_pickle=True)
    assert "obj['f']" in str(info.value)
    assert directory_entries(tmp_path) == []


def test_allow_pickle_saves_and_weights_only_controls_loading(tmp_path):
    obj = {"a": {"b": Custom(5)}, "t": torch.arange(4), "fn": module_level_function}
    path = tmp_path / "p.ckpt"
    ckptstore.save(obj, path, allow_pickle=True)
    assert directory_entries(tmp_path) == ["p.ckpt"]

    with pytest.raises(PickleNotAllowedError) as info:
        ckptstore.load(path)
    assert "weights_only=False" in str(info.value)
    assert str(path) in str(info.value)
    with pytest.raises(PickleNotAllowedError):
        ckptstore.load(path, weights_only=True)

    loaded = ckptstore.load(path, weights_only=False)
    assert type(loaded["a"]["b"]) is Custom and loaded["a"]["b"].value == 5
    assert loaded["fn"] is module_level_function
    assert_tensor_identical(loaded["t"], obj["t"])


def test_allow_pickle_without_unsupported_objects_loads_with_weights_only(tmp_path):
    path = tmp_path / "p.ckpt"
    ckptstore.save({"t": torch.ones(2)}, path, allow_pickle=True)
    assert_same(ckptstore.load(path), {"t": torch.ones(2)})


# --------------------------------------------------------------------------------------------
# mmap
# --------------------------------------------------------------------------------------------


def _mapped_ranges(path: Path) -> list[tuple[int, int, str]]:
    real = os.path.realpath(path)
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == real:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, parts[1]))
    return out


def test_mmap_load_is_file_backed_and_private(tmp_path):
    base = torch.randn(64)
    obj = {
        "w": torch.randn(256, 64),
        "i": torch.arange(1000),
        "v1": base[:40],
        "v2": base[30:],
        "s": torch.tensor(2.5),
        "e": torch.empty(0, 4),
        "meta": {"epoch": 3},
    }
    path = tmp_path / "m.ckpt"
    ckptstore.save(obj, path)
    before = path.read_bytes()

    loaded = ckptstore.load(path, mmap=True)
    assert_same(loaded, obj)
    ranges = _mapped_ranges(path)
    assert ranges, "mmap=True did not map the file"
    for key in ("w", "i", "v1"):
        ptr = loaded[key].untyped_storage().data_ptr()
        matching = [r for r in ranges if r[0] <= ptr < r[1]]
        assert matching, f"{key} is not backed by the mapped file"
        assert matching[0][2].endswith("p"), "the mapping must be private (MAP_PRIVATE)"

    loaded["w"].add_(1.0)
    loaded["v1"][0] = 1e6
    assert loaded["v2"].untyped_storage().data_ptr() == loaded["v1"].untyped_storage().data_ptr()
    assert path.read_bytes() == before, "writing to an mmap-loaded tensor changed the file"
    assert_same(ckptstore.load(path), obj)


def test_mmap_on_bytesio_is_an_invalid_argument():
    buf = io.BytesIO()
    ckptstore.save({"t": torch.ones(2)}, buf)
    buf.seek(0)
    with pytest.raises(InvalidArgumentError) as info:
        ckptstore.load(buf, mmap=True)
    assert "mmap" in str(info.value)


def test_mmap_with_verify_detects_damage(tmp_path):
    path = tmp_path / "m.ckpt"
    ckptstore.save({"w": torch.randn(100)}, path)
    data = bytearray(path.read_bytes())
    key, off, _ = container_layout(bytes(data))["chunks"][0]
    data[off + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ckptstore.CorruptCheckpointError) as info:
        ckptstore.load(path, mmap=True, verify=True)
    assert info.value.key == key


# --------------------------------------------------------------------------------------------
# Files written by torch.save
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("kind", ["path", "bytesio", "memory_url"])
def test_torch_save_files_load(kind, legacy, tmp_path):
    base = torch.randn(8)
    obj = {"w": torch.randn(3, 3), "step": 7, "v1": base[:4], "v2": base[2:], "od": collections.OrderedDict(a=1)}
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    data = buf.getvalue()
    if kind == "path":
        path = tmp_path / "t.pt"
        path.write_bytes(data)
        loaded = ckptstore.load(path)
    elif kind == "bytesio":
        loaded = ckptstore.load(io.BytesIO(data))
    else:
        url = f"memory://ckptstore-tests/{uuid.uuid4().hex}/t.pt"
        with fsspec.open(url, "wb") as fh:
            fh.write(data)
        try:
            loaded = ckptstore.load(url)
        finally:
            fsspec.filesystem("memory").rm(url)
    assert_same(loaded, obj)
    loaded["v1"][3] = 5.0
    assert loaded["v2"][1].item() == 5.0


def test_torch_save_file_with_custom_class_follows_weights_only(tmp_path):
    path = tmp_path / "t.pt"
    torch.save({"c": Custom(3), "t": torch.ones(2)}, path)
    with pytest.raises(pickle.UnpicklingError):
        ckptstore.load(path)
    with pytest.raises(pickle.UnpicklingError):
        ckptstore.load(io.BytesIO(path.read_bytes()), weights_only=True)
    loaded = ckptstore.load(path, weights_only=False)
    assert loaded["c"] == Custom(3)
    assert torch.equal(loaded["t"], torch.ones(2))


def test_torch_save_file_with_mmap_and_map_location(tmp_path):
    path = tmp_path / "t.pt"
    obj = {"w": torch.randn(4, 4)}
    torch.save(obj, path)
    assert_same(ckptstore.load(path, map_location="cpu", mmap=True), obj)
    assert_same(ckptstore.load(path, map_location=lambda s, loc: s), obj)


# --------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["zstd", "shuffle+zstd"])
def test_compressed_multi_chunk_tensor_round_trips_and_is_smaller(codec, tmp_path):
    gen = torch.Generator().manual_seed(3)
    # > 16 MiB along dim 0 (two compressed chunks), low-entropy values so it compresses.
    big = torch.randint(0, 16, (1100, 4096), dtype=torch.int32, generator=gen).to(torch.float32)
    noisy = random_tensor(torch.float32, (300, 7), 9)  # NaN payloads etc. through the codec
    obj = {"big": big, "noisy": noisy, "half": big[:, :64].to(torch.bfloat16)}
    raw_path, comp_path = tmp_path / "raw.ckpt", tmp_path / "comp.ckpt"
    ckptstore.save(obj, raw_path)
    ckptstore.save(obj, comp_path, compression=codec)

    layout = container_layout(comp_path.read_bytes())
    big_chunks = [c for c in layout["chunks"] if c[0] == "big"]
    assert len(big_chunks) >= 2, "a tensor over 16 MiB must be cut into several compressed chunks"
    assert {c["codec"] for c in layout["manifest"]["tensors"]["big"]["chunks"]} == {codec}

    assert comp_path.stat().st_size < raw_path.stat().st_size // 2
    assert_same(ckptstore.load(comp_path), obj)
    assert_same(ckptstore.load(io.BytesIO(comp_path.read_bytes())), obj)


@pytest.mark.parametrize(
    "bad, obj",
    [
        ("lz4", {"t": torch.ones(3)}),
        ("ZSTD", {"t": torch.ones(3)}),
        ("", {"t": torch.ones(3)}),
        ("gzip", {"step": 1, "name": "no tensors"}),
        ("gzip", {"a": np.zeros(3)}),
    ],
    ids=["lz4", "wrong-case", "empty-string", "no-tensors", "ndarray-only"],
)
def test_unknown_compression_is_an_invalid_argument(bad, obj, tmp_path):
    # The option is refused whatever the object holds: a typo must not go unnoticed until the
    # first checkpoint that happens to contain a tensor.
    path = tmp_path / "c.ckpt"
    with pytest.raises(InvalidArgumentError) as info:
        ckptstore.save(obj, path, compression=bad)
    assert repr(bad) in str(info.value)
    assert "zstd" in str(info.value)
    assert directory_entries(tmp_path) == []
