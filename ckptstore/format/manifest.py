"""The manifest: one JSON document that describes a whole checkpoint, for every layout ckptstore writes.

A tensor is described by dtype, global shape and a list of chunks. A chunk is a box of the global
tensor (``offsets`` and ``sizes`` per dimension) whose bytes sit in one file at one byte range,
encoded by one codec and protected by one checksum. The single-file container (``kind="file"``)
and the sharded directory layout share this schema; only where the bytes live differs
(``file=None`` means "the container this manifest is in").

Parsing validates everything a reader later relies on (types, bounds, chunk coverage), so that a
damaged or hostile manifest is refused with a clear error before any data is read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..errors import CorruptCheckpointError, UnsupportedFormatVersionError
from .checksum import checksum, validate_checksum_string
from .codecs import CODECS
from .dtypes import dtype_from_name, element_size

FORMAT_NAME = "ckptstore"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
# Writers write FORMAT_MINOR unless the data needs a later feature (docs/format.md, section 8):
# 1.2 added the $attrs tag (a tensor's Python attributes), which 1.1 readers refuse.
ATTRS_MINOR = 2

# Chunk file names are relative, portable, and cannot climb out of the checkpoint's root.
_FILE_RE = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9._\-/]{1,255}$")
_MAX_DIMS = 64
_MAX_BYTES = 1 << 60
# The same rules for readers that check chunks in bulk (checkpoint/index.py).
SAFE_FILE = _FILE_RE
MAX_BYTES = _MAX_BYTES
# A zstd block decodes to at most 128 KiB and costs at least 4 stored bytes (3 of header, 1 of RLE
# payload), so no frame decodes to more than 32768 times its own size: a compressed chunk whose box
# is larger than that is a lie about its size, refused before a buffer for it is allocated.
MAX_ZSTD_RATIO = 32768
# Manifests are read whole into memory and parsed (JSON parsing needs several times the bytes), so
# their size is capped before reading. 256 MiB is ~1M tensors, or 4 PiB of data in 4 MiB checksummed
# blocks; CKPTSTORE_MAX_MANIFEST_BYTES raises (or lowers) it.
DEFAULT_MAX_MANIFEST_BYTES = 256 << 20


def max_manifest_bytes() -> int:
    value = os.environ.get("CKPTSTORE_MAX_MANIFEST_BYTES", "")
    return int(value) if value.isdigit() else DEFAULT_MAX_MANIFEST_BYTES


def check_manifest_size(nbytes: int, *, where: str) -> None:
    """Refuse a manifest (or RAM-tier document) larger than the cap before it is read."""
    cap = max_manifest_bytes()
    if nbytes > cap:
        raise CorruptCheckpointError(
            f"{where}: the manifest is {nbytes} bytes, over the {cap}-byte cap on manifests; refusing to read it. "
            "It is damaged or not a ckptstore manifest; if it is genuine, set CKPTSTORE_MAX_MANIFEST_BYTES "
            "above its size",
            location=where,
        )


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    offset: int
    length: int
    codec: str
    checksum: str
    # Optional (format 1.1): checksums of each block_size piece of the stored bytes, so a reader that
    # needs only part of a large chunk reads and verifies whole blocks around that part.
    block_size: int | None = None
    block_checksums: tuple[str, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def to_json(self) -> dict[str, Any]:
        # json writes tuples as arrays: no list() copies (this runs once per chunk, 10^5 times in big states).
        doc: dict[str, Any] = {
            "offsets": self.offsets,
            "sizes": self.sizes,
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "codec": self.codec,
            "checksum": self.checksum,
        }
        if self.block_checksums is not None:
            doc["block_size"] = self.block_size
            doc["block_checksums"] = self.block_checksums
        return doc


@dataclass
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(dtype_from_name(self.dtype, where="tensor entry"))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": self.shape, "chunks": [c.to_json() for c in self.chunks]}


@dataclass
class Manifest:
    kind: str
    tensors: dict[str, TensorEntry]
    tree: Any
    pickled: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: str = FORMAT_VERSION
    writer: str = f"ckptstore {__version__}"
    # Not part of the format: "" for a whole manifest; for one a rank planned from an index
    # (checkpoint/index.py), "own" when its chunks of sharded tensors are its own part's only, and
    # "writers" when it read the parts of those tensors' writers. A cooperative read computes one
    # plan on every rank from the chunk tables, so it needs to know when those tables differ.
    planned: str = ""

    def to_json_bytes(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "writer": self.writer,
            "kind": self.kind,
            "byte_order": "little",
            "tensors": {k: e.to_json() for k, e in self.tensors.items()},
            "pickled": self.pickled,
            "meta": self.meta,
            "tree": self.tree,
        }
        # allow_nan=False: non-finite floats are tagged by the tree encoder; a bare NaN here is a bug.
        try:
            body = json.dumps(doc, allow_nan=False, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates (str from undecodable file names) have no UTF-8 form; JSON's \u escapes do.
            body = json.dumps(doc, allow_nan=False, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        if self.kind != "sharded":
            return body  # a single file's footer holds the manifest's checksum
        # A sharded manifest is a file of its own, kept in several copies (RAM, local, peers,
        # durable): its last member is the checksum of the bytes before it, so a damaged copy is
        # told from a sound one before anything is read through it (see _verify_own_checksum).
        return body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}'


    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers disagree on which of two same-named members wins (Python's json keeps the last), so a
    # manifest with duplicates could mean one thing here and another to a different reader.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate member name {dup[:100]!r} in one object")
    return obj


def load_json(data: bytes | str, *, where: str, what: str = "manifest") -> Any:
    """JSON as the manifest rules read it: no NaN/Infinity, no duplicate member names, bounded depth.
    Every failure is a CorruptCheckpointError naming ``where``."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray, memoryview)) else data
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_members)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON: {exc}", location=where) from None


def _check_version(doc: dict[str, Any], where: str) -> None:
    version = doc.get("format_version")
    m = re.fullmatch(r"(\d{1,6})\.(\d{1,6})", version) if isinstance(version, str) else None
    if m is None:
        raise CorruptCheckpointError(f"{where}: manifest has no valid format_version (got {version!r})", location=where)
    major = int(m.group(1))
    if major > FORMAT_MAJOR:
        raise UnsupportedFormatVersionError(
            f"{where} was written in ckptstore format {version} (by {doc.get('writer', 'an unknown writer')}); "
            f"this ckptstore {__version__} reads format {FORMAT_MAJOR}.x only. Upgrade ckptstore to read it."
        )
    if major < 1:
        raise CorruptCheckpointError(f"{where}: format_version {version!r} is not a released version", location=where)


_OWN_CHECKSUM = re.compile(rb',"checksum":"(xxh3_64:[0-9a-f]{16})"\}\s*\Z')
_CHECKSUM_LIKE_END = re.compile(rb'"xxh3_64:[0-9a-f]{16}"\}\s*\Z')


def _verify_own_checksum(data: bytes, doc: dict[str, Any], where: str) -> None:
    """Sharded manifests end with the checksum of the bytes before that member (an optional
    member: manifests of earlier writers have none and are read unverified, as before). Every
    single damaged byte of one that has it is caught: in the body or the value, a mismatch; in
    the member's name, a checksum-like end that is not the member; in the syntax, invalid JSON."""
    has_member = "checksum" in doc
    if not has_member and not _CHECKSUM_LIKE_END.search(data):
        return
    m = _OWN_CHECKSUM.search(data)
    if m is None or checksum(data[: m.start()] + b"}") != m.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: the manifest does not match its own checksum: this copy is damaged; "
            "load another copy (another tier) or an earlier step",
            location=where,
        )


def parse_manifest(data: bytes, *, where: str) -> Manifest:
    """Parse and validate manifest bytes; every failure is a CorruptCheckpointError naming ``where``."""
    check_manifest_size(len(data), where=where)
    doc = load_json(data, where=where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: manifest is not a ckptstore manifest", location=where)
    _check_version(doc, where)
    _verify_own_checksum(data, doc, where)
    if doc.get("byte_order", "little") != "little":
        raise CorruptCheckpointError(f"{where}: byte_order {doc.get('byte_order')!r} is not supported", location=where)
    kind = doc.get("kind")
    raw_tensors = doc.get("tensors")
    pickled = doc.get("pickled", [])
    meta = doc.get("meta", {})
    if not isinstance(kind, str) or not isinstance(raw_tensors, dict) or not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{where}: manifest lacks kind/tensors/meta", location=where)
    if not isinstance(pickled, list) or any(not isinstance(p, str) or p not in raw_tensors for p in pickled):
        raise CorruptCheckpointError(f"{where}: manifest 'pickled' must list tensor keys", location=where)
    if "tree" not in doc:
        raise CorruptCheckpointError(f"{where}: manifest has no tree", location=where)
    tensors = {key: _parse_entry(key, value, where) for key, value in raw_tensors.items()}
    _check_byte_ranges(tensors, where)
    return Manifest(
        kind=kind,
        tensors=tensors,
        tree=doc["tree"],
        pickled=list(pickled),
        meta=meta,
        format_version=doc["format_version"],
        writer=str(doc.get("writer", "")),
    )


def _int_list(value: Any, what: str, where: str, *, allow_empty: bool = True) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) > _MAX_DIMS
        or (not allow_empty and not value)
        or any(type(v) is not int or v < 0 or v > _MAX_BYTES for v in value)
    ):
        raise CorruptCheckpointError(f"{where}: {what} must be a list of non-negative ints, got {value!r}", location=where)
    return tuple(value)


def _parse_entry(key: str, value: Any, where: str, *, coverage: bool = True) -> TensorEntry:
    at = f"{where}: tensor {key!r}"
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise CorruptCheckpointError(f"{at}: entry must be an object with chunks", location=where, key=key)
    dtype = dtype_from_name(value.get("dtype"), where=at)
    elsize = element_size(dtype)
    shape = _int_list(value.get("shape"), "shape", at)
    if math.prod(shape) * elsize > _MAX_BYTES:
        raise CorruptCheckpointError(f"{at}: shape {list(shape)} is absurdly large", location=where, key=key)
    chunks = []
    for i, raw in enumerate(value["chunks"]):
        cat = f"{at} chunk {i}"
        if not isinstance(raw, dict):
            raise CorruptCheckpointError(f"{cat}: must be an object", location=where, key=key)
        offsets = _int_list(raw.get("offsets"), "offsets", cat)
        sizes = _int_list(raw.get("sizes"), "sizes", cat)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CorruptCheckpointError(f"{cat}: offsets/sizes must have {len(shape)} dims", location=where, key=key)
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(
                f"{cat}: box offsets={list(offsets)} sizes={list(sizes)} exceeds shape {list(shape)}",
                location=where,
                key=key,
            )
        file = raw.get("file")
        if file is not None and (not isinstance(file, str) or not _FILE_RE.match(file)):
            raise CorruptCheckpointError(f"{cat}: file {file!r} is not a safe relative path", location=where, key=key)
        offset, length = raw.get("offset"), raw.get("length")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length > _MAX_BYTES:
            raise CorruptCheckpointError(f"{cat}: offset/length must be non-negative ints", location=where, key=key)
        codec = raw.get("codec")
        if codec not in CODECS:
            raise CorruptCheckpointError(
                f"{cat}: unknown codec {codec!r} (known: {', '.join(CODECS)})", location=where, key=key
            )
        if codec == "raw" and length != math.prod(sizes) * elsize:
            raise CorruptCheckpointError(
                f"{cat}: raw chunk length {length} != {math.prod(sizes) * elsize} bytes of its box",
                location=where,
                key=key,
            )
        if codec != "raw" and math.prod(sizes) * elsize > length * MAX_ZSTD_RATIO:
            raise CorruptCheckpointError(
                f"{cat}: {length} stored bytes of {codec} cannot decode to the {math.prod(sizes) * elsize} bytes "
                f"of its box (a zstd frame decodes to at most {MAX_ZSTD_RATIO}x its size)",
                location=where,
                key=key,
            )
        block_size, blocks = raw.get("block_size"), raw.get("block_checksums")
        if blocks is not None or block_size is not None:
            if (
                type(block_size) is not int
                or block_size <= 0
                or not isinstance(blocks, list)
                or len(blocks) != -(-length // block_size)
            ):
                raise CorruptCheckpointError(
                    f"{cat}: block_checksums must list one checksum per block_size bytes", location=where, key=key
                )
            blocks = tuple(validate_checksum_string(b, where=cat) for b in blocks)
        chunks.append(
            Chunk(
                offsets,
                sizes,
                file,
                offset,
                length,
                codec,
                validate_checksum_string(raw.get("checksum"), where=cat),
                block_size,
                blocks,
            )
        )
    if coverage:
        _check_coverage(key, shape, chunks, where)
    return TensorEntry(dtype=value["dtype"], shape=shape, chunks=chunks)


def _check_coverage(key: str, shape: tuple[int, ...], chunks: list[Chunk], where: str) -> None:
    """Chunks must tile the tensor exactly: no gap (uninitialised memory) and no overlap (ambiguity)."""
    total = math.prod(shape)
    covered = sum(c.numel for c in chunks)
    if covered != total:
        raise CorruptCheckpointError(
            f"{where}: tensor {key!r}: chunks cover {covered} of {total} elements", location=where, key=key
        )
    if total == 0 or len(chunks) < 2:
        return
    # Equal volume plus no pairwise overlap implies an exact tiling. Sweep along dim 0 so only boxes
    # whose dim-0 ranges intersect are compared.
    boxes = sorted((c for c in chunks if c.numel), key=lambda c: c.offsets[0] if c.offsets else 0)
    active: list[Chunk] = []
    for box in boxes:
        start = box.offsets[0] if box.offsets else 0
        active = [a for a in active if (a.offsets[0] + a.sizes[0] if a.offsets else 1) > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box.offsets, box.sizes, other.offsets, other.sizes)):
                raise CorruptCheckpointError(
                    f"{where}: tensor {key!r}: chunks at offsets {list(other.offsets)} and {list(box.offsets)} overlap",
                    location=where,
                    key=key,
                )
        active.append(box)


def parse_entry(key: str, value: Any, where: str, *, coverage: bool = True) -> TensorEntry:
    """One tensor entry of a manifest document, validated as :func:`parse_manifest` validates it;
    ``coverage=False`` accepts chunks that cover part of the tensor (an index holds a rank's share)."""
    return _parse_entry(key, value, where, coverage=coverage)


def check_byte_ranges(tensors: dict[str, TensorEntry], where: str) -> None:
    """No two chunks of ``tensors`` claim the same stored bytes (see :func:`parse_manifest`)."""
    _check_byte_ranges(tensors, where)


def verify_own_checksum(data: bytes, doc: dict[str, Any], where: str) -> None:
    """The checksum a sharded manifest (or an index) ends with, checked as :func:`parse_manifest` does."""
    _verify_own_checksum(data, doc, where)


def check_version(doc: dict[str, Any], where: str) -> None:
    """Refuse a document of a newer major format version, or one with no valid version."""
    _check_version(doc, where)


def layout_digest(manifest: Manifest) -> str:
    """A name for ``manifest``'s chunk table: equal for two manifests exactly when every chunk of
    every tensor lies in the same file at the same offset, with the same length, codec and checksums
    (timings and other ``meta`` differ between tiers' copies of one step and do not count)."""
    parts = []
    for key in sorted(manifest.tensors):
        entry = manifest.tensors[key]
        parts.append(repr((key, entry.dtype, tuple(entry.shape), [
            (tuple(c.offsets), tuple(c.sizes), c.file, c.offset, c.length, c.codec, c.checksum, c.block_size,
             None if c.block_checksums is None else tuple(c.block_checksums))
            for c in entry.chunks])))
    return checksum("\n".join(parts).encode())


def _check_byte_ranges(tensors: dict[str, TensorEntry], where: str) -> None:
    """No two chunks may claim the same stored bytes of one file: writers never share bytes, and
    shared bytes would make two tensors alias one mapping (mmap) or one decode serve two boxes."""
    ranges = sorted(
        (c.file or "", c.offset, c.offset + c.length, key)
        for key, entry in tensors.items()
        for c in entry.chunks
        if c.length
    )
    for (f1, _s1, e1, k1), (f2, s2, _e2, k2) in zip(ranges, ranges[1:]):
        if f1 == f2 and s2 < e1:
            name = f"file {f1!r}" if f1 else "the container"
            raise CorruptCheckpointError(
                f"{where}: tensors {k1!r} and {k2!r} claim overlapping bytes [{s2}, {e1}) of {name}; "
                "the manifest is damaged or crafted",
                location=where,
                key=k2,
            )
