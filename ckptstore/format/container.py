"""The single-file container written by ``ckptstore.save``.

::

    offset 0      header   32 bytes: magic "CKPTSTOR", u16 major, u16 minor, u32 flags (0),
                                     u64 container length (0 = up to the end of the file), u64 reserved (0)
    offset 4096   data     chunk bytes, each chunk starting on a 4 KiB boundary (mmap- and O_DIRECT-friendly)
    ...           manifest UTF-8 JSON (see manifest.py), starts on a 4 KiB boundary
    end - 32      footer   32 bytes: u64 manifest offset, u64 manifest length, u64 xxh3-64 of the manifest,
                                     magic "CKPTFOOT"

All integers are little-endian; offsets are relative to the start of the container. The manifest
comes last so the writer can stream data without knowing the manifest in advance, and a reader
finds it from the footer with two small reads.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..errors import CorruptCheckpointError, UnsupportedFormatVersionError
from .manifest import FORMAT_MAJOR, FORMAT_MINOR

MAGIC = b"CKPTSTOR"
FOOTER_MAGIC = b"CKPTFOOT"
HEADER = struct.Struct("<8sHHIQQ")
FOOTER = struct.Struct("<QQQ8s")
ALIGN = 4096
DATA_START = ALIGN
assert HEADER.size == 32 and FOOTER.size == 32


# Writer layout (section 2.3 of docs/format.md): chunks under SMALL_BYTES are packed SMALL_ALIGN
# apart (torch.save's own alignment, enough for every dtype) in groups of up to BATCH_BYTES that
# start and end on ALIGN boundaries. Readers never depend on any of this.
SMALL_BYTES = 1 << 20
SMALL_ALIGN = 64
BATCH_BYTES = 4 << 20


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def pack_header(length: int = 0, minor: int = FORMAT_MINOR) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_MAJOR, minor, 0, length, 0)


def pack_footer(manifest_offset: int, manifest: bytes) -> bytes:
    return FOOTER.pack(manifest_offset, len(manifest), xxhash.xxh3_64_intdigest(manifest), FOOTER_MAGIC)


def stated_length(head: bytes | bytearray) -> int:
    """The container length a header states, or 0 when ``head`` is no complete header of this
    format (or states none): where a stream reader may stop without reading past the container."""
    if len(head) < HEADER.size:
        return 0
    magic, major, _minor, _flags, length, _ = HEADER.unpack_from(head)
    return length if magic == MAGIC and major >= 1 else 0


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    length: int


def unpack_header(data: bytes, *, where: str) -> Header:
    if len(data) < HEADER.size:
        raise CorruptCheckpointError(f"{where}: file is truncated ({len(data)} bytes, no complete header)", location=where)
    magic, major, minor, _flags, length, _ = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{where}: bad header magic {magic!r}", location=where)
    if major == 0:
        raise CorruptCheckpointError(f"{where}: header format version 0.{minor} was never released", location=where)
    if major > FORMAT_MAJOR:
        raise UnsupportedFormatVersionError(
            f"{where} was written in ckptstore format {major}.{minor}; this ckptstore reads format "
            f"{FORMAT_MAJOR}.x only. Upgrade ckptstore to read it."
        )
    return Header(major, minor, length)


@dataclass(frozen=True)
class Footer:
    manifest_offset: int
    manifest_length: int
    manifest_checksum: int


def unpack_footer(data: bytes, container_length: int, *, where: str) -> Footer:
    if len(data) != FOOTER.size:
        raise CorruptCheckpointError(f"{where}: file is truncated (no complete footer)", location=where)
    offset, length, digest, magic = FOOTER.unpack(data)
    if magic != FOOTER_MAGIC:
        raise CorruptCheckpointError(
            f"{where}: footer magic missing: the file is truncated or was not completely written", location=where
        )
    if offset < DATA_START or offset + length != container_length - FOOTER.size:
        raise CorruptCheckpointError(
            f"{where}: footer points at manifest bytes [{offset}, {offset + length}) which do not end where the "
            f"footer starts ({container_length - FOOTER.size}); the file is truncated or damaged",
            location=where,
        )
    return Footer(offset, length, digest)


def check_manifest_bytes(data: bytes, footer: Footer, *, where: str) -> None:
    if xxhash.xxh3_64_intdigest(data) != footer.manifest_checksum:
        raise CorruptCheckpointError(f"{where}: manifest checksum mismatch; the file is damaged", location=where)
