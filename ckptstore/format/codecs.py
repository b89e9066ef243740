"""Chunk codecs: how a chunk's raw little-endian bytes are turned into stored bytes and back.

- ``raw``: stored as is (the default; mmap-able, no CPU cost).
- ``zstd``: one zstandard frame.
- ``shuffle+zstd``: the bytes of each element are first grouped by significance (byte 0 of every
  element, then byte 1, ...), which makes the exponent bytes of floating-point data compress far
  better, then one zstandard frame.
"""

from __future__ import annotations

import threading

import torch
import zstandard

from .._buffers import byte_view
from ..errors import CorruptCheckpointError, InvalidArgumentError

CODECS = ("raw", "zstd", "shuffle+zstd")
ZSTD_LEVEL = 3

_local = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    # Contexts are not thread-safe; one per thread keeps parallel chunk encoding correct.
    ctx = getattr(_local, "cctx", None)
    if ctx is None:
        ctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return ctx


def _dctx() -> zstandard.ZstdDecompressor:
    ctx = getattr(_local, "dctx", None)
    if ctx is None:
        ctx = _local.dctx = zstandard.ZstdDecompressor()
    return ctx


def resolve_compression(compression: str | None, dtype: torch.dtype) -> str:
    """The codec for one tensor, given the user's ``compression`` option."""
    if compression is None or compression == "none" or compression == "raw":
        return "raw"
    if compression == "zstd":
        return "zstd"
    if compression == "shuffle+zstd":
        # Shuffling single-byte elements is the identity: skip the copy.
        return "shuffle+zstd" if dtype.itemsize > 1 else "zstd"
    raise InvalidArgumentError(
        f"compression={compression!r} is not supported; use None, 'zstd' or 'shuffle+zstd'"
    )


def _shuffle(raw: torch.Tensor, elsize: int) -> torch.Tensor:
    return raw.view(-1, elsize).t().contiguous().view(-1)


def _unshuffle(data: torch.Tensor, elsize: int) -> torch.Tensor:
    return data.view(elsize, -1).t().contiguous().view(-1)


def encode(codec: str, raw: torch.Tensor, elsize: int) -> memoryview:
    """Encode ``raw`` (a contiguous 1-D uint8 CPU tensor) into the stored bytes of ``codec``."""
    if codec == "raw":
        return byte_view(raw)
    if codec == "shuffle+zstd":
        raw = _shuffle(raw, elsize)
    return memoryview(_cctx().compress(byte_view(raw)))


def decode_into(codec: str, stored: bytes | memoryview, out: torch.Tensor, elsize: int, *, where: str) -> None:
    """Decode stored bytes into ``out`` (a contiguous 1-D uint8 tensor of the raw size)."""
    if codec == "raw":
        if len(stored) != out.numel():
            raise CorruptCheckpointError(f"{where}: raw chunk has {len(stored)} bytes, expected {out.numel()}")
        out.numpy()[:] = memoryview(stored)
        return
    if codec not in ("zstd", "shuffle+zstd"):
        raise CorruptCheckpointError(f"{where}: unknown codec {codec!r}; known codecs are {', '.join(CODECS)}")
    try:
        plain = _dctx().decompress(stored, max_output_size=out.numel(), allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: zstd frame does not decode: {exc}") from None
    if len(plain) != out.numel():
        raise CorruptCheckpointError(f"{where}: chunk decodes to {len(plain)} bytes, expected {out.numel()}")
    decoded = torch.frombuffer(bytearray(plain), dtype=torch.uint8) if plain else torch.empty(0, dtype=torch.uint8)
    if codec == "shuffle+zstd" and decoded.numel():
        decoded = _unshuffle(decoded, elsize)
    out.copy_(decoded)
