"""Property tests: any tree of supported leaves round-trips exactly; no single damaged byte goes unnoticed."""

from __future__ import annotations

import io
import math

import pytest
import torch
from conftest import assert_same, container_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore import CorruptCheckpointError, NotACheckpointError, UnsupportedFormatVersionError
from ckptstore.format import container

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------
# Round trip of generated trees
# --------------------------------------------------------------------------------------------

TENSOR_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e5m2,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    nbytes = math.prod(shape) * dtype.itemsize
    data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1  # other byte values are undefined behaviour for torch.bool
    t = raw.view(dtype).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous
    return t


dollar_text = st.text(max_size=8).map(lambda s: "$" + s)
texts = st.text(max_size=12) | dollar_text | st.sampled_from(["$tensor", "$view", "$int", "$pickle", "$float"])

leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
    | st.binary(max_size=16)
    | tensors()
)

keys = st.integers(min_value=-(2**70), max_value=2**70) | texts | st.tuples(st.integers(-5, 5), st.text(max_size=4))


def _extend(children):
    return (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | st.dictionaries(keys, children, max_size=4)
        | st.dictionaries(st.text(max_size=6), children, max_size=4)
    )


trees = st.recursive(leaves, _extend, max_leaves=16)


@SETTINGS
@given(tree=trees)
def test_any_supported_tree_round_trips_exactly(tree):
    buf = io.BytesIO()
    ckptstore.save(tree, buf)
    buf.seek(0)
    assert_same(ckptstore.load(buf), tree)
    assert buf.tell() == len(buf.getvalue())


@SETTINGS
@given(tree=trees, compression=st.sampled_from(["zstd", "shuffle+zstd"]))
def test_any_supported_tree_round_trips_compressed(tree, compression):
    buf = io.BytesIO()
    ckptstore.save(tree, buf, compression=compression)
    buf.seek(0)
    assert_same(ckptstore.load(buf), tree)


# --------------------------------------------------------------------------------------------
# Single-byte damage
# --------------------------------------------------------------------------------------------


def _payload():
    base = torch.arange(48, dtype=torch.float32) * 0.5
    return {
        "w": torch.linspace(-1, 1, 40).reshape(5, 8),
        "ids": torch.arange(16, dtype=torch.int64),
        "views": [base[:30], base[20:]],
        "meta": {"step": 12, "name": "small"},
    }


PAYLOAD = _payload()


def _saved(compression):
    buf = io.BytesIO()
    ckptstore.save(PAYLOAD, buf, compression=compression)
    data = buf.getvalue()
    lay = container_layout(data)
    protected = [(off, off + n) for _, off, n in lay["chunks"]]  # every stored chunk byte
    protected.append((lay["manifest_offset"], lay["length"]))  # manifest and footer
    positions = sorted({p for lo, hi in protected for p in range(lo, hi)})
    return data, positions


SAVED = {c: _saved(c) for c in (None, "zstd")}


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data(), compression=st.sampled_from([None, "zstd"]))
def test_flipped_byte_in_data_or_manifest_is_always_detected(data, compression):
    original, positions = SAVED[compression]
    pos = data.draw(st.sampled_from(positions), label="position")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    damaged = bytearray(original)
    damaged[pos] ^= mask
    with pytest.raises(CorruptCheckpointError):
        ckptstore.load(io.BytesIO(bytes(damaged)))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data(), compression=st.sampled_from([None, "zstd"]))
def test_flipped_byte_anywhere_never_returns_wrong_data(data, compression):
    original, positions = SAVED[compression]
    pos = data.draw(st.integers(0, len(original) - 1), label="position")
    mask = data.draw(st.integers(1, 255), label="xor mask")
    damaged = bytearray(original)
    damaged[pos] ^= mask
    try:
        loaded = ckptstore.load(io.BytesIO(bytes(damaged)))
    except NotACheckpointError:
        assert pos < len(container.MAGIC), f"NotACheckpointError for a byte outside the magic (position {pos})"
    except UnsupportedFormatVersionError:
        assert pos in (8, 9), f"UnsupportedFormatVersionError for a byte outside the major version ({pos})"
    except CorruptCheckpointError:
        pass
    else:
        # Undetected damage is only acceptable where it cannot change what load returns:
        # padding and reserved header fields.
        assert pos not in positions, f"damage at {pos} inside data/manifest/footer went unnoticed"
        assert_same(loaded, PAYLOAD)
