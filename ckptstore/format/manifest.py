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
from ..names import data_file_rank
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
# Format 2.0 is a sharded manifest that names each rank's part file (with its size and checksum)
# instead of listing every chunk: its size grows with ranks plus the model, not ranks x tensors.
# A new major: a 1.x reader must refuse it ("upgrade ckptstore"), never read it as a checkpoint
# without chunks. Single files and other sharded manifests keep 1.x, readable by 1.x readers.
PARTED_MAJOR = 2
PARTED_VERSION = f"{PARTED_MAJOR}.0"
READ_MAJOR = PARTED_MAJOR  # the newest major this reader implements

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
    # Not part of the format: the walk of a caller's state over this manifest's tree that planned
    # a load (checkpoint/sharded.py: load_boxes), handed to the load that follows so the state's
    # tensors are walked once per load, not once per planning step (three walks cost 0.4 s each
    # at 10,000 DTensors).
    walk: Any = field(default=None, repr=False, compare=False)

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
    if major > READ_MAJOR:
        raise UnsupportedFormatVersionError(
            f"{where} was written in ckptstore format {version} (by {doc.get('writer', 'an unknown writer')}); "
            f"this ckptstore {__version__} reads formats 1.x and {READ_MAJOR}.x only. Upgrade ckptstore to read it."
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
    verify_checksum_member(data, where)


def parse_manifest(data: bytes, *, where: str) -> Manifest:
    """Parse and validate manifest bytes; every failure is a CorruptCheckpointError naming ``where``.
    A 2.x manifest (its chunks in part files) is refused: read it with :func:`parse_sharded`."""
    doc = parse_sharded(data, where=where)
    if isinstance(doc, Parted):
        raise CorruptCheckpointError(
            f"{where}: a format {doc.header.format_version} manifest names part files instead of chunks: it is "
            "read through its checkpoint directory (load_sharded, or ckptstore's CLI on the directory)",
            location=where)
    return doc


def parse_sharded(data: bytes, *, where: str) -> Manifest | Parted:
    """Parse and validate manifest bytes of any version: a 1.x manifest whole, or a 2.x one
    (``Parted``: the header, with each rank's part file named) whose chunks its caller reads from
    the part files. Every failure is a CorruptCheckpointError naming ``where``."""
    check_manifest_size(len(data), where=where)
    doc = load_json(data, where=where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: manifest is not a ckptstore manifest", location=where)
    _check_version(doc, where)
    _verify_own_checksum(data, doc, where)
    if int(doc["format_version"].split(".")[0]) == PARTED_MAJOR:
        return _parse_parted(doc, where)
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


def verify_checksum_member(data: bytes, where: str) -> None:
    """The checksum member a format 2.0 manifest must end with, checked on its bytes alone (no
    JSON parse): what tells a damaged copy from a sound one before any of it is used."""
    m = _OWN_CHECKSUM.search(data)
    if m is None or checksum(data[: m.start()] + b"}") != m.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: the manifest does not match its own checksum: this copy is damaged; "
            "load another copy (another tier) or an earlier step",
            location=where,
        )


def check_version(doc: dict[str, Any], where: str) -> None:
    """Refuse a document of a newer major format version, or one with no valid version."""
    _check_version(doc, where)


def layout_digest(manifest: Manifest) -> str:
    """A name for ``manifest``'s chunk table: equal for two manifests exactly when every chunk of
    every tensor lies in the same file at the same offset, with the same length, codec and checksums
    (timings and other ``meta`` differ between tiers' copies of one step and do not count). It is
    composed of one digest per rank (the rank whose data file holds the chunk), so a committer that
    sees no chunk (format 2.0) computes it from each rank's digest of its own part."""
    per_rank: dict[int, list[tuple[str, Any]]] = {}
    for key, entry in manifest.tensors.items():
        for c in entry.chunks:
            rank = data_file_rank(c.file)
            per_rank.setdefault(-1 if rank is None else rank, []).append((key, c.to_json()))
    return combine_digests({r: chunk_digest(items) for r, items in per_rank.items()})


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


# ------------------------------------------------------------------------------ format 2.0


@dataclass
class Parted:
    """A format 2.x sharded manifest: ``header`` is the manifest with no chunks (tree, tensor table,
    ``meta``); each rank's chunks are in its part file, ``parts[r]`` = (file relative to the
    checkpoint directory, its size in bytes, the checksum of its bytes). ``writers`` names the one
    rank whose part holds every chunk of a tensor that rank wrote whole (replicated tensors, per-rank
    values); the chunks of any other tensor may be in any part. ``layout``: the layout digest
    (:func:`layout_digest`) of the whole chunk table."""

    header: Manifest
    writers: dict[str, int]
    parts: list[tuple[str, int, str]]
    layout: str

    @property
    def world(self) -> int:
        return len(self.parts)


def encode_parted(header: Manifest, writers: dict[str, int], parts: list[tuple[str, int, str]], layout: str,
                  inline: dict[str, list[Any]] | None = None) -> bytes:
    """The bytes of a format 2.0 manifest (see :class:`Parted`); ``header.tensors`` have no chunks.
    ``inline``: the chunks (JSON objects) of tensors one rank wrote whole, by key, listed in their
    entries as well as in the writer's part."""
    tensors: dict[str, Any] = {}
    inline = inline or {}
    for key, entry in header.tensors.items():
        doc: dict[str, Any] = {"dtype": entry.dtype, "shape": entry.shape}
        writer = writers.get(key)
        if writer is not None:
            doc["writer"] = writer
            if key in inline:
                doc["chunks"] = inline[key]
        tensors[key] = doc
    body = json.dumps({
        "format": FORMAT_NAME,
        "format_version": PARTED_VERSION,
        "writer": header.writer,
        "kind": "sharded",
        "byte_order": "little",
        "layout": layout,
        "tensors": tensors,
        "pickled": [],
        "meta": header.meta,
        "tree": header.tree,
        "parts": parts,
    }, allow_nan=False, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return body[:-1] + b',"checksum":"' + checksum(body).encode() + b'"}'


_PART_FILE = re.compile(r"^parts/[A-Za-z0-9._\-]{1,200}\.json$")


def _parse_parted(doc: dict[str, Any], where: str) -> Parted:
    if "checksum" not in doc:
        raise CorruptCheckpointError(f"{where}: a format 2 manifest must carry its own checksum", location=where)
    kind, meta, raw_tensors, parts, layout = (doc.get(k) for k in ("kind", "meta", "tensors", "parts", "layout"))
    if kind != "sharded":
        raise CorruptCheckpointError(f"{where}: kind {kind!r}: format 2 defines sharded manifests only", location=where)
    if (not isinstance(meta, dict) or not isinstance(raw_tensors, dict) or not isinstance(parts, list)
            or not isinstance(layout, str) or "tree" not in doc):
        raise CorruptCheckpointError(f"{where}: manifest lacks meta/tensors/parts/layout/tree", location=where)
    if doc.get("pickled", []) != []:
        raise CorruptCheckpointError(f"{where}: a sharded checkpoint holds no pickled entries", location=where)
    if doc.get("byte_order", "little") != "little":
        raise CorruptCheckpointError(f"{where}: byte_order {doc.get('byte_order')!r} is not supported", location=where)
    world = meta.get("world_size")
    if type(world) is not int or world < 1:
        raise CorruptCheckpointError(f"{where}: meta.world_size must be a positive int, got {world!r}", location=where)
    if len(parts) != world:
        raise CorruptCheckpointError(
            f"{where}: the manifest names {len(parts)} part files for world_size {world}: it is damaged or crafted",
            location=where)
    table: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    for rank, value in enumerate(parts):
        at = f"{where}: part of rank {rank}"
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not _PART_FILE.match(value[0]) or not _FILE_RE.match(value[0]) or type(value[1]) is not int
                or not 0 <= value[1] <= _MAX_BYTES):
            raise CorruptCheckpointError(
                f"{at}: {str(value)[:200]} is not [file under parts/, size, checksum]", location=where)
        if value[0] in seen:
            raise CorruptCheckpointError(f"{at}: part file {value[0]!r} is named twice", location=where)
        seen.add(value[0])
        table.append((value[0], value[1], validate_checksum_string(value[2], where=at)))
    tensors: dict[str, TensorEntry] = {}
    writers: dict[str, int] = {}
    heads: dict[str, TensorEntry] = {}  # tensors of one dtype and shape are checked once
    for key, value in raw_tensors.items():
        if not isinstance(value, dict):
            raise CorruptCheckpointError(f"{where}: tensor {key!r}: entry must be an object", location=where, key=key)
        head = f"{value.get('dtype')!r}{value.get('shape')!r}"
        if head not in heads:
            heads[head] = _parse_entry(key, {"dtype": value.get("dtype"), "shape": value.get("shape"), "chunks": []},
                                       where, coverage=False)
        tensors[key] = TensorEntry(heads[head].dtype, heads[head].shape, [])
        if "writer" in value:
            writer = value["writer"]
            if type(writer) is not int or not 0 <= writer < world:
                raise CorruptCheckpointError(f"{where}: tensor {key!r}: writer {writer!r} is not a rank below {world}",
                                             location=where, key=key)
            writers[key] = writer
        if "chunks" in value:
            # A tensor one rank wrote whole may list its chunks here too (a copy of its writer's):
            # a rank loading it then needs no other rank's part. Checked as a 1.x entry is.
            if "writer" not in value:
                raise CorruptCheckpointError(f"{where}: tensor {key!r} lists chunks but names no writer",
                                             location=where, key=key)
            tensors[key] = _parse_entry(key, value, where)
            if any(c.file is None for c in tensors[key].chunks):
                raise CorruptCheckpointError(f"{where}: tensor {key!r} has a chunk with no file", location=where, key=key)
            tensors[key].chunks.sort(key=lambda c: c.offsets)
    check_byte_ranges({k: e for k, e in tensors.items() if e.chunks}, where)
    header = Manifest(kind="sharded", tensors=tensors, tree=doc["tree"], pickled=[], meta=meta,
                      format_version=doc["format_version"], writer=str(doc.get("writer", "")))
    return Parted(header, writers, table, layout)


def chunk_digest(items: list[tuple[str, Any]]) -> str:
    """The layout digest of one rank's chunks: (entry key, chunk as a JSON object) pairs."""
    rows = []
    for key, c in items:
        blocks = c.get("block_checksums")
        rows.append(repr((key, tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"],
                          c["codec"], c["checksum"], c.get("block_size"), None if blocks is None else tuple(blocks))))
    rows.sort()
    return checksum("\n".join(rows).encode())


def combine_digests(per_rank: dict[int, str]) -> str:
    """The layout digest of a chunk table from its ranks' :func:`chunk_digest`."""
    return checksum("\n".join(f"{r}:{d}" for r, d in sorted(per_rank.items())).encode())
