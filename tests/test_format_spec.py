"""An independent reader of the ckptstore format, written from docs/format.md alone.

The reader below uses only struct, json, base64, xxhash, zstandard and numpy. It does not import
ckptstore's format, engine, planning or api modules; ``ckptstore`` itself is imported only to call
``ckptstore.save`` / ``ckptstore.save_sharded`` (and to wrap values in ``ckptstore.PerRank``) and
produce the files under test. Even the dtype element sizes come from the table in docs/format.md.
If these tests pass, the specification is complete enough to read every file ``ckptstore.save``
writes, and every directory ``ckptstore.save_sharded`` writes in one process, for the objects covered
here, byte for byte, with every checksum (and block checksum) verified.

torch is used only on the *original* side of comparisons (to build objects and take their bytes).
"""

from __future__ import annotations

import base64
import collections
import fractions
import io
import json
import math
import pathlib
import pickle
import re
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard

import ckptstore
from ckptstore.format.checksum import checksum

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "format.md"
DOC_TEXT = DOC.read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# The reader (sections 2-9 of docs/format.md)
# ---------------------------------------------------------------------------------------------


def _doc_section(begin: str, end: str) -> str:
    start = DOC_TEXT.index(f"<!-- {begin} -->")
    return DOC_TEXT[start : DOC_TEXT.index(f"<!-- {end} -->", start)]


def _dtype_table_from_doc() -> dict[str, int]:
    """Section 4: dtype name -> element size in bytes, parsed from the spec itself."""
    table = {}
    for m in re.finditer(
        r"^\|\s*`([a-z0-9_]+)`\s*\|\s*(\d+)\s*\|", _doc_section("dtype-table-begin", "dtype-table-end"), re.M
    ):
        table[m.group(1)] = int(m.group(2))
    return table


DTYPE_SIZES = _dtype_table_from_doc()

HEADER = struct.Struct("<8sHHIQQ")
FOOTER = struct.Struct("<QQQ8s")
MAGIC, FOOTER_MAGIC = b"CKPTSTOR", b"CKPTFOOT"
DATA_START = 4096
SUPPORTED_MAJOR = 1
SHARDED_MAJOR = 2  # 8.3: major 2 defines one more form of a sharded manifest (10.10), nothing else
PART_RE = re.compile(r"^parts/[A-Za-z0-9._\-]{1,200}\.json$")
MAX_BYTES = 2**60
MAX_DIMS = 64
CODECS = ("raw", "zstd", "shuffle+zstd")
CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}")
FILE_RE = re.compile(r"^(?!/)(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9._\-/]{1,255}$")


class FormatError(Exception):
    pass


class VersionError(FormatError):
    pass


class PickleRefused(FormatError):
    pass


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None
    offset: int
    length: int
    codec: str
    checksum: str
    block_size: int | None = None  # 6.1 (format 1.1)
    block_checksums: tuple[str, ...] | None = None


@dataclass
class Entry:
    dtype: str
    shape: tuple[int, ...]
    es: int
    chunks: list[Chunk]
    data: bytes = b""  # the entry's raw bytes, C order, little-endian elements


@dataclass(eq=False)
class Tensor:
    """What the reader returns for $tensor / $view: a dtype name, a shape and C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes
    entry: str
    is_view: bool
    param: bool = False
    requires_grad: bool = False
    device: str = "cpu"
    attrs: dict[str, Any] | None = None  # $attrs (7.4, format 1.2)


@dataclass(frozen=True)
class DType:
    name: str


@dataclass(frozen=True)
class Device:
    name: str


@dataclass(frozen=True)
class Size:
    dims: tuple[int, ...]


@dataclass
class PerRankValues:
    """What the reader returns for $per_rank (10.6): each rank's decoded container, by rank."""

    key: str
    by_rank: list[Checkpoint]


@dataclass
class Checkpoint:
    manifest: dict[str, Any]
    entries: dict[str, Entry]
    value: Any
    header_length: int
    container_length: int
    manifest_offset: int
    chunks_verified: int = 0
    blocks_verified: int = 0
    stats: dict[str, int] = field(default_factory=dict)


def _is_int(v: Any, lo: int = 0, hi: int = MAX_BYTES) -> bool:
    return type(v) is int and lo <= v <= hi


def _int_list(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_DIMS or not all(_is_int(x) for x in v):
        raise FormatError(f"{what} must be a list of at most {MAX_DIMS} ints in [0, 2**60]: {v!r}")
    return tuple(v)


def _no_constants(name: str) -> Any:
    raise FormatError(f"non-standard JSON constant {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"duplicate member {k!r}")
        out[k] = v
    return out


def _parse_version(doc: dict[str, Any], supported: int = SUPPORTED_MAJOR) -> tuple[int, int]:
    v = doc.get("format_version")
    m = re.fullmatch(r"(\d{1,6})\.(\d{1,6})", v) if isinstance(v, str) else None
    if m is None:
        raise FormatError(f"bad format_version {v!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    if major > supported:
        raise VersionError(f"format {v} is newer than {supported}.x")
    if major < 1:
        raise FormatError(f"format_version {v} was never released")
    return major, minor


def _checksum_string(v: Any, what: str) -> str:
    if not isinstance(v, str) or not CHECKSUM_RE.fullmatch(v):
        raise FormatError(f"{what}: bad checksum string {v!r}")
    return v


def _xxh3(data: bytes | memoryview) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def _parse_entry(key: str, raw: Any, kind: str, manifest_offset: int = 0) -> Entry:
    """Sections 3.3-3.5 and 6.1; ``kind`` "file" (2.4 step 5) or "sharded" (10.3) decides ``file``."""
    if not isinstance(raw, dict) or not isinstance(raw.get("chunks"), list):
        raise FormatError(f"{key}: entry must be an object with chunks")
    dtype = raw.get("dtype")
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"{key}: unknown dtype {dtype!r}")
    es = DTYPE_SIZES[dtype]
    shape = _int_list(raw.get("shape"), "shape")
    if math.prod(shape) * es > MAX_BYTES:
        raise FormatError(f"{key}: too large")
    chunks = []
    for c in raw["chunks"]:
        if not isinstance(c, dict):
            raise FormatError(f"{key}: chunk must be an object")
        offsets, sizes = _int_list(c.get("offsets"), "offsets"), _int_list(c.get("sizes"), "sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise FormatError(f"{key}: box rank differs from shape")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise FormatError(f"{key}: box outside the shape")
        file = c.get("file")
        if file is not None and (not isinstance(file, str) or not FILE_RE.match(file)):
            raise FormatError(f"{key}: unsafe file {file!r}")
        if kind == "file" and file is not None:
            raise FormatError(f"{key}: chunk file {file!r} in a single-file container")
        if kind == "sharded" and file is None:
            raise FormatError(f"{key}: chunk without a file in a sharded manifest")
        offset, length = c.get("offset"), c.get("length")
        if not (_is_int(offset) and _is_int(length) and offset + length <= MAX_BYTES):
            raise FormatError(f"{key}: bad offset/length")
        if kind == "file" and (offset < DATA_START or offset + length > manifest_offset):
            raise FormatError(f"{key}: chunk bytes [{offset}, {offset + length}) outside the data region")
        codec = c.get("codec")
        if codec not in CODECS:
            raise FormatError(f"{key}: unknown codec {codec!r}")
        if codec == "raw" and length != math.prod(sizes) * es:
            raise FormatError(f"{key}: raw chunk length {length} != box bytes")
        checksum = _checksum_string(c.get("checksum"), key)
        block_size, blocks = c.get("block_size"), c.get("block_checksums")
        if block_size is not None or blocks is not None:
            if not _is_int(block_size, 1, 2**64) or not isinstance(blocks, list):
                raise FormatError(f"{key}: block_size and block_checksums go together")
            if len(blocks) != -(-length // block_size):
                raise FormatError(f"{key}: {len(blocks)} block checksums for {length} bytes in blocks of {block_size}")
            blocks = tuple(_checksum_string(b, key) for b in blocks)
        chunks.append(Chunk(offsets, sizes, file, offset, length, codec, checksum, block_size, blocks))
    # Coverage (3.5): equal volume and no overlap between non-empty boxes.
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise FormatError(f"{key}: chunks do not cover the tensor")
    boxes = [c for c in chunks if math.prod(c.sizes)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise FormatError(f"{key}: chunks overlap")
    return Entry(dtype, shape, es, chunks)


def _parse_manifest(body: bytes, kind: str) -> tuple[dict[str, Any], int]:
    """Sections 3.1-3.2 (and 10.3 for kind "sharded"): the document and its major version."""
    try:
        doc = json.loads(body.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"manifest is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != "ckptstore":
        raise FormatError("not a ckptstore manifest")
    major, _ = _parse_version(doc, SHARDED_MAJOR if kind == "sharded" else SUPPORTED_MAJOR)
    if doc.get("byte_order", "little") != "little":
        raise FormatError("byte order")
    if doc.get("kind") != kind:
        raise FormatError(f"kind {doc.get('kind')!r} is not {kind!r}")
    tensors, pickled, meta = doc.get("tensors"), doc.get("pickled", []), doc.get("meta", {})
    if not isinstance(tensors, dict) or not isinstance(meta, dict) or "tree" not in doc:
        raise FormatError("manifest lacks tensors/meta/tree")
    if not isinstance(pickled, list) or any(not isinstance(p, str) or p not in tensors for p in pickled):
        raise FormatError("pickled must list entry keys")
    if kind == "sharded":
        if pickled:
            raise FormatError("a sharded manifest has no pickled entries")
        if not _is_int(meta.get("world_size"), 1):
            raise FormatError(f"meta.world_size {meta.get('world_size')!r} is not an int >= 1")
    return doc, major


def _verify_blocks(c: Chunk, stored: bytes, start: int) -> int:
    """6.1: verify every block of ``stored``, the chunk's stored bytes from ``start`` (a block boundary)."""
    assert c.block_size is not None and c.block_checksums is not None and start % c.block_size == 0
    n = 0
    for pos in range(0, len(stored), c.block_size):
        if _xxh3(stored[pos : pos + c.block_size]) != c.block_checksums[(start + pos) // c.block_size]:
            raise FormatError(f"block checksum mismatch at byte {start + pos} of chunk {c.offsets}")
        n += 1
    return n


def _decode_chunk(c: Chunk, stored: bytes, es: int) -> bytes:
    expected = math.prod(c.sizes) * es
    if c.codec == "raw":
        return stored
    try:
        plain = zstandard.ZstdDecompressor().decompress(stored, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise FormatError(f"bad zstd frame: {exc}") from None
    if len(plain) != expected:
        raise FormatError(f"chunk decodes to {len(plain)} bytes, expected {expected}")
    if c.codec == "shuffle+zstd" and expected:
        n = expected // es
        plain = np.frombuffer(plain, dtype=np.uint8).reshape(es, n).T.tobytes()  # unshuffle
    return plain


def _assemble(entry: Entry, read_stored: Any, verify: bool) -> tuple[int, int]:
    """Read, verify, decode and place every chunk of ``entry`` (3.5); returns (chunks, blocks) verified."""
    out = np.zeros(math.prod(entry.shape) * entry.es, dtype=np.uint8)
    grid = out.reshape(entry.shape + (entry.es,))
    chunks = blocks = 0
    for c in entry.chunks:
        stored = read_stored(c)
        if len(stored) != c.length:
            raise FormatError("truncated chunk")
        if verify:
            if _xxh3(stored) != c.checksum:
                raise FormatError(f"chunk checksum mismatch in {entry}")
            chunks += 1
            if c.block_checksums is not None:
                blocks += _verify_blocks(c, stored, 0)
        raw = np.frombuffer(_decode_chunk(c, stored, entry.es), dtype=np.uint8)
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
        grid[box] = raw.reshape(c.sizes + (entry.es,))
    entry.data = out.tobytes()
    return chunks, blocks


def read_container(buf: bytes, start: int = 0, *, allow_pickle: bool = False, verify: bool = True) -> Checkpoint:
    """Read the container that begins at ``buf[start]`` (section 2.4, then sections 3-7)."""
    available = len(buf) - start
    if available < HEADER.size:
        raise FormatError("truncated: no header")
    magic, major, _minor, _flags, length, _reserved = HEADER.unpack_from(buf, start)
    if magic != MAGIC:
        raise FormatError("not a ckptstore container")
    if major > SUPPORTED_MAJOR:
        raise VersionError(f"header major {major}")
    total = length or available
    if total > available or total < DATA_START + FOOTER.size:
        raise FormatError("truncated: container length")
    m_off, m_len, m_sum, fmagic = FOOTER.unpack_from(buf, start + total - FOOTER.size)
    if fmagic != FOOTER_MAGIC:
        raise FormatError("footer magic missing")
    if m_off < DATA_START or m_off + m_len != total - FOOTER.size:
        raise FormatError("footer does not point at the manifest")
    body = bytes(buf[start + m_off : start + m_off + m_len])
    if xxhash.xxh3_64_intdigest(body) != m_sum:
        raise FormatError("manifest checksum mismatch")
    doc, manifest_major = _parse_manifest(body, "file")
    if manifest_major != major:
        raise FormatError("header and manifest majors differ")
    entries = {k: _parse_entry(k, v, "file", m_off) for k, v in doc["tensors"].items()}
    pickled = doc.get("pickled", [])
    if pickled and not allow_pickle:
        raise PickleRefused(f"pickled entries {pickled}")
    chunks = blocks = 0
    for entry in entries.values():
        n, b = _assemble(entry, lambda c: bytes(buf[start + c.offset : start + c.offset + c.length]), verify)
        chunks, blocks = chunks + n, blocks + b
    value = _TreeDecoder(entries, set(pickled), allow_pickle).decode(doc["tree"])
    return Checkpoint(doc, entries, value, length, total, m_off, chunks, blocks)


# ---------------------------------------------------------------------------------------------
# The sharded directory (section 10)
# ---------------------------------------------------------------------------------------------


class NotACheckpoint(FormatError):
    pass


def _data_path(root: pathlib.Path, file: str | None) -> pathlib.Path:
    if file is None or not FILE_RE.match(file):  # checked by _parse_entry already
        raise FormatError(f"unsafe file {file!r}")
    return root.joinpath(*file.split("/"))  # relative to the checkpoint directory (10.3)


def _read_range(root: pathlib.Path, file: str | None, offset: int, length: int) -> bytes:
    path = _data_path(root, file)
    if not path.is_file():
        raise FormatError(f"data file {file} is missing")
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise FormatError(f"data file {file} is truncated")
    return data


def open_sharded(root: pathlib.Path) -> tuple[dict[str, Any], dict[str, Entry]]:
    """10.2-10.3 and 10.10: the committed manifest of directory ``root`` and its parsed entries
    (for a 2.0 manifest, ``tensors`` as the chunk table its part files make)."""
    path = root / "manifest.json"
    if not path.is_file():
        raise NotACheckpoint(f"{root} has no manifest.json: not a (committed) checkpoint")
    body = path.read_bytes()
    doc, major = _parse_manifest(body, "sharded")
    if major == 2:
        doc = _assemble_parted(root, body, doc)
    return doc, {k: _parse_entry(k, v, "sharded") for k, v in doc["tensors"].items()}


def _own_checksum(body: bytes, doc: dict[str, Any]) -> None:
    """10.3: the last member, over the bytes before its comma with a "}" appended."""
    tail = b',"checksum":"' + str(doc.get("checksum")).encode() + b'"}'
    if not body.rstrip().endswith(tail):
        raise FormatError("the checksum member is not the last member, compactly written")
    if _xxh3(body.rstrip()[: -len(tail)] + b"}") != _checksum_string(doc["checksum"], "manifest"):
        raise FormatError("manifest checksum mismatch")


def _box_key(key: str) -> str:
    """7.8/10.10: ``<key>#box<n>`` stands for ``<key>``."""
    m = re.fullmatch(r"(.*)#box(\d+)", key)
    return m.group(1) if m else key


def _assemble_parted(root: pathlib.Path, body: bytes, doc: dict[str, Any]) -> dict[str, Any]:
    """10.10 steps 1-4: check a 2.0 manifest, read every part file it names (checked against its
    size and checksum), and return the manifest as 10.3 has it: every entry with its chunks."""
    if "checksum" not in doc:
        raise FormatError("a 2.0 manifest must carry its own checksum")
    _own_checksum(body, doc)
    world, parts = doc["meta"]["world_size"], doc.get("parts")
    if not isinstance(parts, list) or len(parts) != world:
        raise FormatError(f"parts must list {world} part files")
    seen: set[str] = set()
    for p in parts:
        if (not isinstance(p, list) or len(p) != 3 or not isinstance(p[0], str) or not PART_RE.match(p[0])
                or not FILE_RE.match(p[0]) or not _is_int(p[1]) or p[0] in seen):
            raise FormatError(f"bad part entry {p!r}")
        _checksum_string(p[2], p[0])
        seen.add(p[0])
    tensors: dict[str, Any] = {}
    for key, e in doc["tensors"].items():
        if not isinstance(e, dict) or "chunks" in e and "writer" not in e:
            raise FormatError(f"{key}: a 2.0 entry lists chunks only beside its writer")
        w = e.get("writer")
        if w is not None and not _is_int(w, 0, world - 1):
            raise FormatError(f"{key}: writer {w!r} is not a rank below {world}")
        tensors[key] = {"dtype": e.get("dtype"), "shape": e.get("shape"), "chunks": []}
    for rank, (file, size, check) in enumerate(parts):
        path = _data_path(root, file)
        if not path.is_file():
            raise FormatError(f"part file {file} is missing")
        data = path.read_bytes()
        if len(data) != size or _xxh3(data) != check:
            raise FormatError(f"part file {file} does not match its size and checksum in the manifest")
        part = json.loads(data.decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)
        if not isinstance(part, dict) or part.get("rank") != rank or not isinstance(part.get("chunks"), dict):
            raise FormatError(f"{file} is not the part of rank {rank}")
        for name, chunks in part["chunks"].items():
            key = _box_key(name)
            if key not in tensors or not isinstance(chunks, list):
                raise FormatError(f"{file}: entry {key!r} is not in the manifest")
            if doc["tensors"][key].get("writer", rank) != rank:
                raise FormatError(f"{file}: chunks of {key!r}, which another rank wrote whole")
            tensors[key]["chunks"].extend(chunks)
    for key, e in doc["tensors"].items():
        # Chunks a 2.0 entry lists are a copy of its writer's: they must be the very same.
        if "chunks" in e and sorted(map(json.dumps, e["chunks"])) != sorted(map(json.dumps, tensors[key]["chunks"])):
            raise FormatError(f"{key}: the manifest's chunks differ from its writer's part")
    return {**doc, "tensors": tensors}


def read_sharded(root: pathlib.Path, *, verify: bool = True) -> Checkpoint:
    """Read a whole sharded checkpoint: every entry assembled from its chunks, every per-rank value."""
    doc, entries = open_sharded(root)
    chunks = blocks = 0
    for entry in entries.values():
        n, b = _assemble(entry, lambda c: _read_range(root, c.file, c.offset, c.length), verify)
        chunks, blocks = chunks + n, blocks + b
    decoder = _TreeDecoder(entries, set(), False, world_size=doc["meta"]["world_size"])
    return Checkpoint(doc, entries, decoder.decode(doc["tree"]), 0, 0, 0, chunks, blocks)


@dataclass
class BoxRead:
    data: bytes  # the box's elements, C order over its own sizes
    bytes_read: int
    blocks_verified: int
    chunks_verified: int


def read_box(root: pathlib.Path, entry: Entry, box: tuple[tuple[int, ...], tuple[int, ...]]) -> BoxRead:
    """10.7: fill ``box`` of a global tensor from the chunks that overlap it, reading for each raw chunk
    only the rows that hold the overlap, rounded out to whole blocks when the chunk has them."""
    t_off, t_size = box
    out = np.zeros(math.prod(t_size) * entry.es, dtype=np.uint8).reshape(t_size + (entry.es,))
    result = BoxRead(b"", 0, 0, 0)
    for c in entry.chunks:
        lo_o = [max(a, b) for a, b in zip(t_off, c.offsets)]
        hi_o = [min(a + s, b + z) for a, s, b, z in zip(t_off, t_size, c.offsets, c.sizes)]
        if any(h <= lo for lo, h in zip(lo_o, hi_o)) or not math.prod(c.sizes):
            continue
        if c.codec == "raw" and c.sizes:
            row_bytes = entry.es * math.prod(c.sizes[1:])
            first, count = lo_o[0] - c.offsets[0], hi_o[0] - lo_o[0]
            lo, hi = first * row_bytes, (first + count) * row_bytes
            if c.block_checksums is not None:
                bs = c.block_size
                assert bs is not None
                start, end = lo // bs * bs, min(-(-hi // bs) * bs, c.length)
                stored = _read_range(root, c.file, c.offset + start, end - start)
                result.blocks_verified += _verify_blocks(c, stored, start)
            else:
                start, end = 0, c.length
                stored = _read_range(root, c.file, c.offset, c.length)
                if _xxh3(stored) != c.checksum:
                    raise FormatError("chunk checksum mismatch")
                result.chunks_verified += 1
            result.bytes_read += end - start
            rows = np.frombuffer(stored[lo - start : hi - start], dtype=np.uint8)
            src = rows.reshape((count,) + c.sizes[1:] + (entry.es,))
            src_sel = (slice(None),) + tuple(slice(a - o, b - o) for a, b, o in zip(lo_o[1:], hi_o[1:], c.offsets[1:]))
        else:  # compressed (or 0-d): read, verify and decode the whole chunk
            stored = _read_range(root, c.file, c.offset, c.length)
            if _xxh3(stored) != c.checksum:
                raise FormatError("chunk checksum mismatch")
            result.chunks_verified += 1
            result.bytes_read += c.length
            src = np.frombuffer(_decode_chunk(c, stored, entry.es), dtype=np.uint8).reshape(c.sizes + (entry.es,))
            src_sel = tuple(slice(a - o, b - o) for a, b, o in zip(lo_o, hi_o, c.offsets))
        dst_sel = tuple(slice(a - t, b - t) for a, b, t in zip(lo_o, hi_o, t_off))
        out[dst_sel] = src[src_sel]
    result.data = out.tobytes()
    return result


def _hashable(v: Any) -> Any:
    if isinstance(v, (list, dict, set, bytearray)):
        raise FormatError(f"unhashable key or set item {v!r}")
    return v


def _b64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise FormatError("base64 must be a string")
    return base64.b64decode(s.encode("ascii"), validate=True)


def _numpy_dtype(spec: Any) -> np.dtype:
    dt = np.dtype(spec) if isinstance(spec, str) else None
    if dt is None or dt.kind not in "biufc" or dt.fields is not None:
        raise FormatError(f"numpy dtype {spec!r} is not plain numeric")
    return dt


class _TreeDecoder:
    """Section 7; with ``world_size`` set, the tree of a sharded manifest (10.3, 10.6)."""

    def __init__(
        self, entries: dict[str, Entry], pickled: set[str], allow_pickle: bool, *, world_size: int | None = None
    ) -> None:
        self.entries, self.pickled, self.allow_pickle = entries, pickled, allow_pickle
        self.world_size = world_size
        self.objects: dict[Any, Tensor] = {}

    def entry(self, key: Any) -> Entry:
        if not isinstance(key, str) or key not in self.entries:
            raise FormatError(f"tree refers to missing entry {key!r}")
        return self.entries[key]

    def decode(self, node: Any) -> Any:
        t = type(node)
        if node is None or t in (bool, int, float, str):
            return node
        if t is list:
            return [self.decode(v) for v in node]
        if t is not dict:
            raise FormatError(f"unexpected JSON value {node!r}")
        if not node:
            return {}
        tag = next(iter(node))
        if not tag.startswith("$"):
            if any(k.startswith("$") for k in node):
                raise FormatError("object mixes plain members and tags")
            return {k: self.decode(v) for k, v in node.items()}
        return self.tagged(tag, node[tag], node)

    def float_(self, v: Any) -> float:
        if type(v) is dict and list(v) == ["$float"] and v["$float"] in ("nan", "inf", "-inf"):
            return float(v["$float"])
        if type(v) in (int, float):
            return float(v)
        raise FormatError(f"not a float: {v!r}")

    def pairs(self, v: Any) -> list[tuple[Any, Any]]:
        if type(v) is not list or any(type(p) is not list or len(p) != 2 for p in v):
            raise FormatError("pairs must be [key, value] arrays")
        return [(_hashable(self.decode(k)), self.decode(x)) for k, x in v]

    def tagged(self, tag: str, v: Any, node: dict[str, Any]) -> Any:
        if self.world_size is not None and tag in ("$view", "$ndarray", "$npscalar", "$pickle"):
            raise FormatError(f"{tag} in a sharded manifest")
        if tag == "$per_rank":
            if self.world_size is None:
                raise FormatError("$per_rank in a single-file container")
            return self.per_rank(v)
        if tag == "$int":
            if type(v) is not str or not re.fullmatch(r"-?[0-9]+", v):
                raise FormatError(f"bad $int {v!r}")
            return int(v)
        if tag == "$float":
            return self.float_(node)
        if tag == "$complex":
            return complex(self.float_(v[0]), self.float_(v[1]))
        if tag == "$bytes":
            return _b64(v)
        if tag == "$bytearray":
            return bytearray(_b64(v))
        if tag == "$tuple":
            return tuple(self.decode(x) for x in v)
        if tag == "$size":
            if type(v) is not list or any(type(x) is not int for x in v):
                raise FormatError("$size holds ints")
            return Size(tuple(v))
        if tag in ("$set", "$frozenset"):
            items = [_hashable(self.decode(x)) for x in v]
            return set(items) if tag == "$set" else frozenset(items)
        if tag == "$dict":
            return dict(self.pairs(v))
        if tag == "$odict":
            out = collections.OrderedDict(self.pairs(v))
            if "meta" in node:
                out._metadata = self.decode(node["meta"])  # type: ignore[attr-defined]
            return out
        if tag == "$namedtuple":
            # Never import: synthesise the type from the field names (section 9).
            fields, values = node["fields"], node["values"]
            if type(v) is not str or type(fields) is not list or any(type(f) is not str for f in fields):
                raise FormatError("bad $namedtuple")
            name = v.partition(":")[2].rsplit(".", 1)[-1]
            cls = collections.namedtuple(name if name.isidentifier() else "Record", fields, rename=True)
            return cls(*(self.decode(x) for x in values))
        if tag == "$dtype":
            if v not in DTYPE_SIZES:
                raise FormatError(f"unknown dtype {v!r}")
            return DType(v)
        if tag == "$device":
            return Device(v)
        if tag == "$ndarray":
            dt, shape = _numpy_dtype(node["dtype"]), tuple(_int_list(node["shape"], "shape"))
            data = self.entry(v).data
            if len(data) != math.prod(shape) * dt.itemsize:
                raise FormatError("ndarray byte count")
            return np.frombuffer(data, dtype=dt).reshape(shape).copy()
        if tag == "$npscalar":
            dt, data = _numpy_dtype(v), _b64(node["b64"])
            if len(data) != dt.itemsize:
                raise FormatError("npscalar byte count")
            return np.frombuffer(data, dtype=dt)[0].copy()
        if tag == "$pickle":
            if v not in self.pickled:
                raise FormatError(f"$pickle entry {v!r} is not listed in 'pickled'")
            if not self.allow_pickle:
                raise PickleRefused(v)
            return pickle.loads(self.entry(v).data)  # noqa: S301 - explicit opt-in, test data only
        if tag == "$attrs":
            t = self.decode(v)
            if not isinstance(t, Tensor) or type(node.get("attrs")) is not dict:
                raise FormatError("$attrs wraps a tensor node and holds an attrs object")
            t.attrs = {k: self.decode(x) for k, x in node["attrs"].items()}
            return t
        if tag in ("$tensor", "$view"):
            # Identity: "obj" in a single file (7.4); the entry itself in a sharded manifest (10.3).
            obj = node.get("obj") if self.world_size is None else ("entry", v)
            if obj in self.objects:
                return self.objects[obj]
            t = self.tensor(v, node) if tag == "$tensor" else self.view(v, node)
            t.param = node.get("param") is True
            t.requires_grad = node.get("requires_grad") is True
            t.device = node.get("device", "cpu")
            if obj is not None:
                self.objects[obj] = t
            return t
        raise FormatError(f"unknown tag {tag!r}")

    def per_rank(self, key: Any) -> PerRankValues:
        """10.6: entry <key>#rank<r:05d> of every rank holds a whole single-file container."""
        if not isinstance(key, str):
            raise FormatError(f"bad $per_rank key {key!r}")
        assert self.world_size is not None
        values = []
        for r in range(self.world_size):
            e = self.entry(f"{key}#rank{r:05d}")
            if e.dtype != "uint8" or len(e.shape) != 1:
                raise FormatError(f"per-rank entry {key}#rank{r:05d} is not a uint8 vector")
            values.append(read_container(e.data))
        return PerRankValues(key, values)

    def tensor(self, key: str, node: dict[str, Any]) -> Tensor:
        e = self.entry(key)
        return Tensor(e.dtype, e.shape, e.data, key, is_view=False)

    def view(self, key: str, node: dict[str, Any]) -> Tensor:
        storage = np.frombuffer(self.entry(key).data, dtype=np.uint8)
        dtype = node["dtype"]
        if dtype not in DTYPE_SIZES:
            raise FormatError(f"unknown dtype {dtype!r}")
        es = DTYPE_SIZES[dtype]
        shape, stride, offset = _int_list(node["shape"], "shape"), _int_list(node["stride"], "stride"), node["offset"]
        if len(shape) != len(stride) or not _is_int(offset):
            raise FormatError("malformed view")
        if not all(shape):
            return Tensor(dtype, shape, b"", key, is_view=True)
        if (offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1) * es > len(storage):
            raise FormatError("view reaches past its storage")
        first = np.full(shape, offset, dtype=np.int64)  # element index of every view element, C order
        for d, (s, st) in enumerate(zip(shape, stride)):
            first = first + (np.arange(s, dtype=np.int64) * st).reshape((s,) + (1,) * (len(shape) - d - 1))
        byte_index = (first.reshape(-1, 1) * es + np.arange(es)).reshape(-1)
        return Tensor(dtype, shape, storage[byte_index].tobytes(), key, is_view=True)


# ---------------------------------------------------------------------------------------------
# Comparing what the reader found with the original objects
# ---------------------------------------------------------------------------------------------

NUMPY_EQUIVALENT = {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2", "uint32": "<u4",
    "int32": "<i4", "uint64": "<u8", "int64": "<i8", "float16": "<f2", "float32": "<f4", "float64": "<f8",
    "complex64": "<c8", "complex128": "<c16",
}  # fmt: skip


def torch_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def bfloat16_to_float32(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """Section 4: a bfloat16 is the upper 16 bits of a binary32."""
    return (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).view("<f4").reshape(shape)


def assert_same(orig: Any, got: Any, path: str = "obj") -> None:
    if isinstance(orig, torch.Tensor):
        assert isinstance(got, Tensor), path
        assert got.dtype == str(orig.dtype).removeprefix("torch."), path
        assert got.shape == tuple(orig.shape), path
        assert got.data == torch_bytes(orig), path
        assert got.param == isinstance(orig, torch.nn.Parameter), path
        assert got.requires_grad == orig.requires_grad, path
        assert got.device == str(orig.device), path
        if got.dtype in NUMPY_EQUIVALENT:
            values = np.frombuffer(got.data, dtype=NUMPY_EQUIVALENT[got.dtype]).reshape(got.shape)
            np.testing.assert_array_equal(values, orig.detach().resolve_conj().resolve_neg().numpy(), err_msg=path)
        elif got.dtype == "bfloat16":
            np.testing.assert_array_equal(
                bfloat16_to_float32(got.data, got.shape), orig.detach().float().numpy(), err_msg=path
            )
        return
    if isinstance(orig, torch.dtype):
        assert got == DType(str(orig).removeprefix("torch.")), path
        return
    if isinstance(orig, torch.device):
        assert got == Device(str(orig)), path
        return
    if isinstance(orig, torch.Size):
        assert got == Size(tuple(orig)), path
        return
    if isinstance(orig, np.ndarray):
        assert type(got) is np.ndarray and got.dtype.str == orig.dtype.str and got.shape == orig.shape, path
        np.testing.assert_array_equal(got, orig, err_msg=path)
        return
    if isinstance(orig, np.generic):
        assert type(got) is type(orig) and got.tobytes() == orig.tobytes(), path
        return
    if isinstance(orig, tuple) and hasattr(type(orig), "_fields"):
        assert type(got).__name__ == type(orig).__name__ and type(got)._fields == type(orig)._fields, path
        for f, a, b in zip(type(orig)._fields, orig, got):
            assert_same(a, b, f"{path}.{f}")
        return
    assert type(got) is type(orig), f"{path}: {type(got).__name__} != {type(orig).__name__}"
    if isinstance(orig, float) and math.isnan(orig):
        assert math.isnan(got), path
    elif isinstance(orig, float):
        assert got == orig and math.copysign(1, got) == math.copysign(1, orig), path
    elif isinstance(orig, complex):
        assert repr(got) == repr(orig), path  # nan-safe
    elif isinstance(orig, (list, tuple)):
        assert len(got) == len(orig), path
        for i, (a, b) in enumerate(zip(orig, got)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(orig, dict):
        assert list(got) == list(orig), path  # same keys, same order
        for k in orig:
            assert_same(orig[k], got[k], f"{path}[{k!r}]")
        if isinstance(orig, collections.OrderedDict) and hasattr(orig, "_metadata"):
            assert_same(orig._metadata, got._metadata, f"{path}._metadata")
    else:
        assert got == orig, path


# ---------------------------------------------------------------------------------------------
# Objects under test
# ---------------------------------------------------------------------------------------------

Point = collections.namedtuple("Point", "x y")


def make_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    tied = torch.randn(3, 2, generator=g)
    nan = float("nan")
    return {
        "model": torch.nn.Linear(3, 2).state_dict(),  # OrderedDict with _metadata
        "f32": torch.randn(3, 4, generator=g),
        "f64": torch.tensor([1.5, nan, float("inf"), -0.0], dtype=torch.float64),
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(5, 3, generator=g).bfloat16(),
        "i64": torch.tensor([0, -1, 2**62, -(2**63), 2**63 - 1], dtype=torch.int64),
        "i32": torch.arange(-6, 6, dtype=torch.int32).reshape(3, 4),
        "u8": torch.arange(0, 256, 17, dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "c64": torch.complex(torch.randn(3, generator=g), torch.randn(3, generator=g)),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-(2**40), dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "empty_bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "noncontig": torch.arange(24.0).reshape(4, 6)[:, ::2],  # sole user of its storage: compact
        "slice": torch.arange(1000, dtype=torch.int64)[10:14],
        "views": {
            "base": base,
            "row": base[1],
            "col": base[:, 2],
            "t": base.t(),
            "elem": base[3, 4],  # 0-d view
            "none": base[:, 5:],  # empty view
            "as_int": base.view(torch.int32)[2],  # another dtype: the storage entry becomes uint8
        },
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # aliases itself
        "tied_a": tied,
        "tied_b": tied,
        "param": torch.nn.Parameter(torch.randn(2, generator=g)),
        "frozen": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "grad": torch.ones(2, requires_grad=True),
        "nested": {
            "list": [1, 2.5, "s", None, True, False, (1, (2, [3]))],
            "empty_tuple": (),
            "big": 2**70,
            "neg_big": -(2**64),
            "edge": 2**53,
            "edge_plus": 2**53 + 1,
            "nan": nan,
            "inf": float("inf"),
            "ninf": float("-inf"),
            "neg0": -0.0,
            "complex": complex(1.5, nan),
            "bytes": b"\x00\xff\x10",
            "bytearray": bytearray(b"abc"),
            "set": {3, 1, 2},
            "frozenset": frozenset({"a", "b"}),
            "odd_keys": {1: "one", (2, 3): "pair", None: 0, "$x": 1},
            "empty_dict": {},
            "empty_odict": collections.OrderedDict(),
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
            "point": Point(1, [2, 3.5]),
            "unicode": "h\u00e9llo \u2603 \U0001f600",
            "key/with~slash": torch.ones(1),
        },
        "numpy": {
            "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
            "f8": np.array([[1.5, np.nan]], dtype="<f8"),
            "bool": np.array([True, False]),
            "f32": np.float32(1.5),
            "i64": np.int64(-3),
            "c64": np.complex64(1 + 2j),
        },
    }


def test_tensor_attributes_are_readable_from_the_spec(tmp_path: pathlib.Path) -> None:
    """7.4's $attrs (format 1.2): a tensor's Python attributes, and 1.1 for files without any."""
    t = torch.arange(3.0)
    t.note, t.scale = "fp8 calibrated", (0.5, 2)
    p = torch.nn.Parameter(torch.ones(2))
    p.shard = {"dim": 0}
    buf = io.BytesIO()
    ckptstore.save({"t": t, "p": p, "again": t}, buf)
    ck = read_container(buf.getvalue())
    assert ck.manifest["format_version"] == "1.2" and HEADER.unpack_from(buf.getvalue())[1:3] == (1, 2)
    got = ck.value
    assert got["t"].attrs == {"note": "fp8 calibrated", "scale": (0.5, 2)} and got["again"] is got["t"]
    assert got["p"].param and got["p"].attrs == {"shard": {"dim": 0}}


def _alignment(length: int) -> int:
    """Section 2.3: chunks of 1 MiB or more start on 4 KiB boundaries, smaller ones on 64 bytes."""
    return 4096 if length >= 1 << 20 else 64


def _container_invariants(buf: bytes, ck: Checkpoint, start: int = 0) -> None:
    """The writer-side layout rules of section 2.3 (what the reference writer promises)."""
    assert buf[start + HEADER.size : start + DATA_START] == bytes(DATA_START - HEADER.size)
    _, major, minor, flags, _, reserved = HEADER.unpack_from(buf, start)
    assert (major, minor, flags, reserved) == (1, 1, 0, 0)  # the reference writer writes 1.1 (section 8)
    assert ck.manifest_offset % 4096 == 0
    ranges = sorted((c.offset, c.length) for e in ck.entries.values() for c in e.chunks)
    end = DATA_START
    for offset, length in ranges:
        assert offset % _alignment(length) == 0 and offset >= end
        assert buf[start + end : start + offset] == bytes(offset - end)  # zero padding
        end = offset + length
    assert buf[start + end : start + ck.manifest_offset] == bytes(ck.manifest_offset - end)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd", "shuffle+zstd"])
def test_reader_recovers_everything(tmp_path: pathlib.Path, compression: str | None) -> None:
    state = make_state()
    path = tmp_path / "state.ckpt"
    ckptstore.save(state, path, compression=compression)
    buf = path.read_bytes()
    ck = read_container(buf)

    assert ck.header_length == len(buf)  # local files carry their length (2.2)
    _container_invariants(buf, ck)
    n_chunks = sum(len(e.chunks) for e in ck.entries.values())
    assert ck.chunks_verified == n_chunks > 0
    assert ck.manifest["format_version"] == "1.1" and ck.manifest["pickled"] == []
    assert ck.blocks_verified == 0  # the single-file writer writes no block checksums (6.1)
    assert_same(state, ck.value)

    # Codec choice (section 5): raw for NumPy entries; 1-byte dtypes never shuffled.
    for key, e in ck.entries.items():
        codecs = {c.codec for c in e.chunks}
        if compression is None or key.startswith("numpy/"):
            assert codecs == {"raw"}, key
        elif compression == "shuffle+zstd" and e.es == 1:
            assert codecs == {"zstd"}, key
        else:
            assert codecs == {compression}, key
        if codecs == {"raw"}:
            assert len(e.chunks) == 1 and e.chunks[0].sizes == e.shape

    got = ck.value
    # Identity (7.4): one object per "obj"; views of one storage share one entry.
    assert got["tied_a"] is got["tied_b"]
    views = got["views"]
    assert len({id(v) for v in views.values()}) == len(views)
    assert {v.entry for v in views.values()} == {"views/base#storage"}
    assert all(v.is_view for v in views.values())
    assert ck.entries["views/base#storage"].dtype == "uint8"  # mixed dtypes
    assert got["expanded"].is_view and not got["noncontig"].is_view and not got["slice"].is_view
    assert len(ck.entries["slice"].data) == 4 * 8  # only the slice is stored, not its storage
    assert got["nested"]["key/with~slash"].entry == "nested/key~1with~0slash"  # 7.8
    assert ck.manifest["tree"]["nested"]["edge"] == 2**53 and ck.manifest["tree"]["nested"]["edge_plus"] == {
        "$int": str(2**53 + 1)
    }
    assert ck.manifest["meta"]["total_bytes"] == sum(len(e.data) for e in ck.entries.values())


@pytest.mark.parametrize("compression", ["zstd", "shuffle+zstd"])
def test_compressed_tensor_split_into_slabs(compression: str) -> None:
    big = torch.arange(4300 * 1000, dtype=torch.float32).reshape(4300, 1000)  # 17.2 MB > 16 MiB
    f = io.BytesIO()
    ckptstore.save({"big": big, "small": torch.ones(3)}, f, compression=compression)
    ck = read_container(f.getvalue())
    chunks = ck.entries["big"].chunks
    assert len(chunks) == 2 and ck.chunks_verified == 3
    assert [c.offsets for c in chunks] == [(0, 0), (4194, 0)]  # floor(16 MiB / 4000 B) rows
    assert ck.value["big"].data == torch_bytes(big)


def test_every_dtype_in_the_table() -> None:
    state = {}
    for name, es in DTYPE_SIZES.items():
        t = torch.arange(6 * es, dtype=torch.uint8).view(getattr(torch, name)).reshape(2, 3)
        state[name] = t
        state[name + "_view"] = t[1]  # shares t's storage: a $view of a storage entry of this dtype
    for compression in (None, "shuffle+zstd"):
        f = io.BytesIO()
        with warnings.catch_warnings():
            # torch itself warns that complex32 is experimental when ckptstore sizes its elements.
            warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
            ckptstore.save(state, f, compression=compression)
        ck = read_container(f.getvalue())
        for name in DTYPE_SIZES:
            assert ck.value[name].dtype == name and ck.value[name].data == torch_bytes(state[name]), name
            assert ck.value[name + "_view"].data == torch_bytes(state[name + "_view"]), name
            assert ck.entries[f"{name}#storage"].dtype == name


def test_dtype_table_lists_every_torch_dtype() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some torch attributes are deprecated
        values = [getattr(torch, attr, None) for attr in dir(torch)]
    names = {str(v).removeprefix("torch.") for v in values if isinstance(v, torch.dtype)}
    names = {n for n in names if not n.startswith(("qint", "quint"))}
    assert set(DTYPE_SIZES) == names
    assert all(getattr(torch, n).itemsize == es for n, es in DTYPE_SIZES.items())


class _NonSeekable:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b: Any) -> int:
        self.data += bytes(b)
        return len(b)


def test_length_zero_means_to_the_end() -> None:
    sink = _NonSeekable()
    state = {"w": torch.randn(4, 4), "v": torch.arange(3)}
    ckptstore.save(state, sink)
    buf = bytes(sink.data)
    assert HEADER.unpack_from(buf)[4] == 0  # not patchable: length stays 0 (2.2)
    ck = read_container(buf)
    assert ck.container_length == len(buf)
    assert_same(state, ck.value)


def test_container_inside_a_stream() -> None:
    f = io.BytesIO()
    f.write(b"some prefix")
    state = {"w": torch.randn(2, 3), "n": 5}
    ckptstore.save(state, f, compression="zstd")
    f.write(b"trailing data that is not part of the container")
    buf = f.getvalue()
    ck = read_container(buf, start=len(b"some prefix"))
    assert 0 < ck.header_length < len(buf) - len(b"some prefix")
    _container_invariants(buf, ck, start=len(b"some prefix"))
    assert_same(state, ck.value)


def test_pickle_only_with_opt_in() -> None:
    f = io.BytesIO()
    ckptstore.save({"frac": fractions.Fraction(1, 3), "w": torch.ones(2)}, f, allow_pickle=True)
    buf = f.getvalue()
    with pytest.raises(PickleRefused):
        read_container(buf)
    ck = read_container(buf, allow_pickle=True)
    assert ck.manifest["pickled"] == ["frac#pickle"] and ck.manifest["tree"]["frac"] == {"$pickle": "frac#pickle"}
    e = ck.entries["frac#pickle"]
    assert e.dtype == "uint8" and [c.codec for c in e.chunks] == ["raw"]
    assert ck.value["frac"] == fractions.Fraction(1, 3)


def _rewrite_manifest(buf: bytes, edit: Any) -> bytes:
    m_off, m_len, _, _ = FOOTER.unpack_from(buf, len(buf) - FOOTER.size)
    doc = json.loads(buf[m_off : m_off + m_len])
    edit(doc)
    body = json.dumps(doc).encode()
    out = bytearray(buf[:m_off]) + body + FOOTER.pack(m_off, len(body), xxhash.xxh3_64_intdigest(body), FOOTER_MAGIC)
    out[16:24] = struct.pack("<Q", len(out))
    return bytes(out)


def test_reader_validates() -> None:
    f = io.BytesIO()
    ckptstore.save({"w": torch.arange(8.0), "x": torch.ones(2)}, f)
    buf = f.getvalue()
    ck = read_container(buf)
    chunk = ck.entries["w"].chunks[0]

    damaged = bytearray(buf)
    damaged[chunk.offset + 3] ^= 1
    with pytest.raises(FormatError, match="chunk checksum"):
        read_container(bytes(damaged))
    damaged = bytearray(buf)
    damaged[ck.manifest_offset + 10] ^= 1
    with pytest.raises(FormatError, match="manifest checksum"):
        read_container(bytes(damaged))
    with pytest.raises(FormatError, match="truncated"):
        read_container(buf[:-1])
    with pytest.raises(VersionError):
        read_container(buf[:8] + struct.pack("<H", 2) + buf[10:])
    with pytest.raises(VersionError):
        read_container(_rewrite_manifest(buf, lambda d: d.update(format_version="2.0")))
    # A newer minor version with unknown members stays readable (section 8).
    newer = _rewrite_manifest(
        buf, lambda d: (d.update(format_version="1.7", future={"x": 1}), d["tensors"]["w"]["chunks"][0].update(hint=1))
    )
    assert read_container(newer).value["w"].data == torch_bytes(torch.arange(8.0))

    def overlap(d: dict[str, Any]) -> None:
        c = d["tensors"]["w"]["chunks"][0]
        d["tensors"]["w"]["chunks"] = [dict(c, sizes=[4], length=16), dict(c, offsets=[2], sizes=[4], length=16)]

    with pytest.raises(FormatError, match="overlap"):
        read_container(_rewrite_manifest(buf, overlap))
    # A $pickle node whose entry is not listed in "pickled" is refused even with the opt-in (section 9).
    with pytest.raises(FormatError, match="not listed"):
        read_container(_rewrite_manifest(buf, lambda d: d.update(tree={"$pickle": "x"})), allow_pickle=True)
    # 1.1 sharded-only features are refused in a single file: $per_rank, a chunk file, kind "sharded".
    with pytest.raises(FormatError, match="per_rank"):
        read_container(_rewrite_manifest(buf, lambda d: d.update(tree={"$per_rank": "w"})))
    with pytest.raises(FormatError, match="chunk file"):
        read_container(_rewrite_manifest(buf, lambda d: d["tensors"]["w"]["chunks"][0].update(file="data/x.bin")))
    with pytest.raises(FormatError, match="kind"):
        read_container(_rewrite_manifest(buf, lambda d: d.update(kind="sharded")))


def test_block_checksums_in_a_single_file() -> None:
    """6.1: block members are allowed on any chunk; consistent ones are verified, others refused."""
    data = torch.arange(1000, dtype=torch.int32)  # 4000 stored bytes: blocks of 1024, the last one short
    f = io.BytesIO()
    ckptstore.save({"x": data}, f)
    buf = f.getvalue()
    c = read_container(buf).entries["x"].chunks[0]
    stored = buf[c.offset : c.offset + c.length]
    blocks = [_xxh3(stored[i : i + 1024]) for i in range(0, 4000, 1024)]

    def add(bs: Any, bl: Any) -> Any:
        return lambda d: d["tensors"]["x"]["chunks"][0].update(block_size=bs, block_checksums=bl)

    ck = read_container(_rewrite_manifest(buf, add(1024, blocks)))
    assert ck.blocks_verified == 4 and ck.value["x"].data == torch_bytes(data)
    assert read_container(_rewrite_manifest(buf, add(4096, [c.checksum]))).blocks_verified == 1  # one short block
    for bs, bl, why in [
        (1024, blocks[:3], "block checksums for"),  # ceil(4000 / 1024) = 4 blocks
        (1024, None, "go together"),
        (None, blocks, "go together"),
        (0, [], "go together"),
        (1024, blocks[:3] + ["xxh3_64:XYZ"], "block checksums for|bad checksum"),
        (1024, blocks[:3] + ["crc32:0123456789abcdef"], "bad checksum"),
    ]:
        with pytest.raises(FormatError, match=why):
            read_container(_rewrite_manifest(buf, add(bs, bl)))
    with pytest.raises(FormatError, match="block checksum mismatch"):
        read_container(_rewrite_manifest(buf, add(1024, blocks[:3] + [blocks[0]])))


def test_worked_example_is_true() -> None:
    """Section 11 was generated by ckptstore.save; it must stay what save writes."""
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    state = {
        "w": w,
        "w_t": w.t(),
        "b": torch.tensor([0.5, -1.0], dtype=torch.bfloat16),
        "step": 7,
        "betas": (0.9, 0.999),
        "best": float("nan"),
    }
    f = io.BytesIO()
    ckptstore.save(state, f)
    buf = f.getvalue()
    ck = read_container(buf)
    block = _doc_section("example-manifest-begin", "example-manifest-end")
    documented = json.loads(block[block.index("```json") + len("```json") : block.rindex("```")])
    actual = dict(ck.manifest)
    # Only "meta" (times, versions) and "writer" (the package version) change between runs.
    assert set(actual.pop("meta")) == set(documented.pop("meta"))
    assert actual.pop("writer").startswith("ckptstore ") and documented.pop("writer").startswith("ckptstore ")
    assert actual == documented
    assert ck.manifest_offset == 12288
    assert HEADER.unpack_from(buf)[:5] == (MAGIC, 1, 1, 0, len(buf))  # its length varies with meta
    # The footer figures of the example are those of the documented manifest, written compactly.
    body = json.dumps(
        json.loads(block[block.index("```json") + len("```json") : block.rindex("```")]),
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    m = re.search(
        r"footer: manifest offset 12288, length (\d+) \(`0x([0-9a-f]+)`\), XXH3-64 `0x([0-9a-f]{16})`", DOC_TEXT
    )
    assert m is not None
    digest = xxhash.xxh3_64_intdigest(body)
    assert (int(m.group(1)), int(m.group(2), 16), int(m.group(3), 16)) == (len(body), len(body), digest)
    footer_line = FOOTER.pack(12288, len(body), digest, FOOTER_MAGIC)[16:].hex()
    assert f"00003390: {' '.join(footer_line[i : i + 4] for i in range(0, 32, 4))}" in DOC_TEXT
    assert buf[4096:4112] == bytes.fromhex("0000803f000000400000404000008040")
    assert buf[8192:8196] == bytes.fromhex("003f80bf")
    assert_same(state, ck.value)
    # The shuffle example of section 11.
    raw = buf[4096:4112]
    shuffled = np.frombuffer(raw, dtype=np.uint8).reshape(4, 4).T.tobytes()
    assert shuffled == bytes.fromhex("0000000000000000800040803f404040")


# ---------------------------------------------------------------------------------------------
# Sharded directories (section 10), written by ckptstore.save_sharded in one process
# ---------------------------------------------------------------------------------------------

BLOCK = 4 << 20  # what the reference sharded writer uses (6.1, informative)


def make_sharded_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    b = torch.tensor([3, -1, 2**40], dtype=torch.int64)
    return {
        "w": torch.randn(2600, 1000, generator=g),  # 10.4 MB > 4 MiB: three blocks, the last short
        "b": b,
        "b_again": b,  # the same tensor twice: one entry, identical nodes
        "nested": {
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "bf16": torch.randn(4, generator=g).bfloat16(),
        },
        "step": 7,
        "opt": {"lr": 0.1, "betas": (0.9, 0.999)},
        "rng": ckptstore.PerRank(torch.get_rng_state()),
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("sharded") / "step-7"
    state = make_sharded_state()
    ckptstore.save_sharded(state, str(root))
    return root, state


def _json(path: pathlib.Path) -> Any:
    return json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constants, object_pairs_hook=_no_duplicates)


def test_sharded_reader_recovers_everything(sharded: tuple[pathlib.Path, dict[str, Any]]) -> None:
    root, state = sharded
    ck = read_sharded(root)
    doc = ck.manifest
    assert (doc["format"], doc["format_version"], doc["kind"]) == ("ckptstore", "2.0", "sharded")  # 10.10
    assert doc["meta"]["world_size"] == 1 and doc["pickled"] == []

    # Every tensor assembled from its chunks in the data files, every chunk and block verified.
    expected = {k: v for k, v in state.items() if k != "rng"}
    got = dict(ck.value)
    rng = got.pop("rng")
    assert_same(expected, got)
    assert got["b"] is got["b_again"]  # identity by entry (10.3)
    assert doc["tree"]["b_again"] == doc["tree"]["b"] == {"$tensor": "b"}
    assert all(list(node) == ["$tensor"] for node in (doc["tree"]["w"], doc["tree"]["nested"]["scalar"]))
    n_chunks = sum(len(e.chunks) for e in ck.entries.values())
    # One process: one box per tensor, except empty tensors, which need no chunk to be covered.
    nonempty = [e for e in ck.entries.values() if 0 not in e.shape]
    assert ck.chunks_verified == n_chunks == len(nonempty)
    assert ck.entries["nested/empty"].chunks == []
    w = ck.entries["w"].chunks[0]
    assert (w.file, w.codec, w.block_size, w.length) == ("data/rank-00000.bin", "raw", BLOCK, 2600 * 1000 * 4)
    assert w.block_checksums is not None and len(w.block_checksums) == 3 and ck.blocks_verified == 3
    others = [c for k, e in ck.entries.items() if k != "w" for c in e.chunks]
    assert all(c.block_checksums is None and c.length <= BLOCK for c in others)

    # $per_rank: entry rng#rank00000 holds a whole single-file container of rank 0's value (10.6).
    assert isinstance(rng, PerRankValues) and rng.key == "rng" and len(rng.by_rank) == 1
    entry = ck.entries["rng#rank00000"]
    assert entry.dtype == "uint8" and entry.shape == (len(entry.data),)
    inner = rng.by_rank[0]
    assert inner.manifest["kind"] == "file" and inner.header_length in (0, len(entry.data))
    assert inner.container_length == len(entry.data) and inner.chunks_verified == 1
    assert_same(state["rng"].value, inner.value)
    assert inner.value.data == torch_bytes(state["rng"].value)


def test_sharded_files_agree(sharded: tuple[pathlib.Path, dict[str, Any]]) -> None:
    """10.4-10.5, 10.10: the part file is the chunk table, named by the manifest with its size and
    checksum; chunks an entry lists are its writer's; the data file layout (informative)."""
    root, _ = sharded
    header = _json(root / "manifest.json")
    part_bytes = (root / "parts" / "rank-00000.json").read_bytes()
    assert header["parts"] == [["parts/rank-00000.json", len(part_bytes), _xxh3(part_bytes)]]
    part = _json(root / "parts" / "rank-00000.json")
    doc, _ = open_sharded(root)  # the manifest with its chunk table
    for key, entry in header["tensors"].items():
        assert set(entry) <= {"dtype", "shape", "writer", "chunks"}, key
        # One process wrote every tensor whole: each that has a chunk names rank 0 and lists it.
        chunks = doc["tensors"][key]["chunks"]
        assert entry.get("writer") == (0 if chunks else None) and entry.get("chunks", []) == chunks, key
    assert (part["rank"], part["world_size"]) == (0, 1)
    assert isinstance(part["host"], str) and _is_int(part["pid"]) and set(part["timings"]) == {"plan_s", "write_s"}
    # Tensors with no elements need no chunk, so they appear in no part file.
    assert sorted(part["chunks"]) == sorted(k for k, e in doc["tensors"].items() if e["chunks"])
    for key, entry in doc["tensors"].items():
        by_offsets = sorted(part["chunks"].get(key, []), key=lambda c: c["offsets"])
        assert entry["chunks"] == by_offsets, key  # the same JSON objects, member for member
    assert part["bytes"] == sum(c["length"] for cs in part["chunks"].values() for c in cs)
    assert doc["meta"]["ranks"] == [{k: part[k] for k in ("rank", "host", "pid", "bytes", "timings")}]
    es = {k: DTYPE_SIZES[e["dtype"]] for k, e in doc["tensors"].items()}
    assert doc["meta"]["total_bytes"] == sum(math.prod(e["shape"]) * es[k] for k, e in doc["tensors"].items())

    # The data file: no header, chunks from offset 0 (4 KiB boundaries, small ones 64 bytes apart), zeros elsewhere.
    data = (root / "data" / "rank-00000.bin").read_bytes()
    assert {c["file"] for e in doc["tensors"].values() for c in e["chunks"]} == {"data/rank-00000.bin"}
    ranges = sorted((c["offset"], c["length"]) for e in doc["tensors"].values() for c in e["chunks"])
    assert ranges[0][0] == 0 and len(data) % 4096 == 0
    end = 0
    for offset, length in ranges:
        assert offset % _alignment(length) == 0 and offset >= end
        assert data[end:offset] == bytes(offset - end)
        end = offset + length
    assert data[end:] == bytes(len(data) - end)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "data/rank-00000.bin",
        "manifest.json",
        "parts/rank-00000.json",
    ]


def test_sharded_ranged_reads_verify_whole_blocks(tmp_path: pathlib.Path) -> None:
    """10.7: the rows holding a box are one byte range, rounded out to blocks that are each verified."""
    w = torch.arange(2600 * 1000, dtype=torch.float32).reshape(2600, 1000)  # row_bytes 4000
    b = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    ckptstore.save_sharded({"w": w, "b": b}, str(tmp_path))
    _, entries = open_sharded(tmp_path)
    ew, eb = entries["w"], entries["b"]

    got = read_box(tmp_path, ew, ((1000, 0), (100, 1000)))  # bytes [4000000, 4400000): blocks 0 and 1
    assert (got.bytes_read, got.blocks_verified, got.chunks_verified) == (2 * BLOCK, 2, 0)
    assert got.data == torch_bytes(w[1000:1100])
    got = read_box(tmp_path, ew, ((2000, 10), (600, 10)))  # [8000000, 10400000): blocks 1 and 2 (short)
    assert (got.bytes_read, got.blocks_verified) == (2600 * 1000 * 4 - BLOCK, 2)
    assert got.data == torch_bytes(w[2000:, 10:20])
    got = read_box(tmp_path, ew, ((0, 999), (1, 1)))  # one element: one block
    assert (got.bytes_read, got.blocks_verified, got.data) == (BLOCK, 1, torch_bytes(w[0:1, 999:1000]))
    got = read_box(tmp_path, eb, ((1, 1), (1, 2)))  # no blocks: the whole chunk and its checksum
    assert (got.bytes_read, got.chunks_verified, got.data) == (12, 1, torch_bytes(b[1:, 1:]))

    # Damage inside block 2: reads that do not touch it still verify; those that do, and whole reads, fail.
    c = ew.chunks[0]
    path = _data_path(tmp_path, c.file)
    with open(path, "r+b") as f:
        f.seek(c.offset + 2 * BLOCK + 5)
        byte = f.read(1)
        f.seek(c.offset + 2 * BLOCK + 5)
        f.write(bytes([byte[0] ^ 1]))
    assert read_box(tmp_path, ew, ((1000, 0), (100, 1000))).data == torch_bytes(w[1000:1100])
    with pytest.raises(FormatError, match="block checksum mismatch"):
        read_box(tmp_path, ew, ((2599, 0), (1, 1000)))
    with pytest.raises(FormatError, match="checksum mismatch"):
        read_sharded(tmp_path)


def _rewrite_sharded(root: pathlib.Path, edit: Any) -> None:
    doc = json.loads((root / "manifest.json").read_bytes())
    edit(doc)
    (root / "manifest.json").write_text(json.dumps(doc), encoding="utf-8")


def test_sharded_reader_validates(tmp_path: pathlib.Path) -> None:
    """A 1.x manifest listing every chunk, as save_sharded wrote before 2.0: still read, and refused
    where it is wrong."""
    from v1_writer import downgrade

    root = tmp_path / "ck"
    ckptstore.save_sharded({"w": torch.arange(8.0), "r": ckptstore.PerRank({"seed": 5})}, str(root))
    downgrade(root, index=False)
    original = (root / "manifest.json").read_bytes()
    ck = read_sharded(root)
    assert ck.value["r"].by_rank[0].value == {"seed": 5}

    def refused(edit: Any, match: str) -> None:
        _rewrite_sharded(root, edit)
        try:
            with pytest.raises(FormatError, match=match):
                read_sharded(root)
        finally:
            (root / "manifest.json").write_bytes(original)

    def chunk(d: dict[str, Any]) -> dict[str, Any]:
        return d["tensors"]["w"]["chunks"][0]

    refused(lambda d: chunk(d).update(file=None), "without a file")
    refused(lambda d: chunk(d).update(file="../outside.bin"), "unsafe file")
    refused(lambda d: chunk(d).update(file="/etc/passwd"), "unsafe file")
    refused(lambda d: chunk(d).update(file="data/rank-00009.bin"), "missing")
    refused(lambda d: chunk(d).update(offset=chunk(d)["offset"] + 10**6), "truncated")
    refused(lambda d: d.update(kind="file"), "kind")
    refused(lambda d: d["meta"].pop("world_size"), "world_size")
    refused(lambda d: d["meta"].update(world_size="1"), "world_size")
    refused(lambda d: d["meta"].update(world_size=2), "missing entry 'r#rank00001'")
    refused(lambda d: d.update(pickled=["w"]), "pickled")
    refused(lambda d: d.update(format_version="3.0"), "newer")
    for tag in ("$view", "$ndarray", "$npscalar", "$pickle"):
        refused(lambda d, tag=tag: d["tree"].update(w={tag: "w"}), "in a sharded manifest")
    # A newer minor with unknown members stays readable (section 8).
    _rewrite_sharded(root, lambda d: (d.update(format_version="1.9", extra=1), chunk(d).update(hint=[1])))
    assert read_sharded(root).value["w"].data == torch_bytes(torch.arange(8.0))
    (root / "manifest.json").write_bytes(original)

    # No manifest.json: not a checkpoint, whatever data and parts the directory holds (10.2).
    (root / "manifest.json").unlink()
    assert (root / "data" / "rank-00000.bin").exists() and (root / "parts" / "rank-00000.json").exists()
    with pytest.raises(NotACheckpoint):
        read_sharded(root)


def _rewrite_parted(root: pathlib.Path, edit: Any) -> None:
    """A 2.0 manifest edited, its own checksum recomputed (10.3): a forgery, not damage."""
    doc = json.loads((root / "manifest.json").read_bytes())
    doc.pop("checksum")
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    (root / "manifest.json").write_bytes(body[:-1] + b',"checksum":"' + _xxh3(body).encode() + b'"}')


def test_parted_reader_validates(tmp_path: pathlib.Path) -> None:
    """10.10: what a 2.0 manifest and the part files it names must satisfy."""
    root = tmp_path / "ck"
    ckptstore.save_sharded({"w": torch.arange(8.0), "r": ckptstore.PerRank({"seed": 5})}, str(root))
    original = (root / "manifest.json").read_bytes()
    part_path = root / "parts" / "rank-00000.json"
    part = part_path.read_bytes()
    assert read_sharded(root).value["w"].data == torch_bytes(torch.arange(8.0))

    def refused(edit: Any, match: str, part_edit: Any = None) -> None:
        _rewrite_parted(root, edit)
        if part_edit is not None:
            part_edit()
        try:
            with pytest.raises(FormatError, match=match):
                read_sharded(root)
        finally:
            (root / "manifest.json").write_bytes(original)
            part_path.write_bytes(part)

    def entry(d: dict[str, Any]) -> dict[str, Any]:
        return d["tensors"]["w"]

    refused(lambda d: d.update(format_version="3.0"), "newer")
    refused(lambda d: d["parts"].append(d["parts"][0]), "parts must list 1")
    refused(lambda d: d["parts"][0].__setitem__(0, "../parts/x.json"), "bad part entry")
    refused(lambda d: d["parts"][0].__setitem__(0, "data/rank-00000.bin"), "bad part entry")
    refused(lambda d: d["parts"][0].__setitem__(1, d["parts"][0][1] + 1), "does not match its size and checksum")
    refused(lambda d: d["parts"][0].__setitem__(2, "xxh3_64:0000000000000000"), "does not match")
    refused(lambda d: None, "missing", lambda: part_path.unlink())
    refused(lambda d: None, "does not match", lambda: part_path.write_bytes(part.replace(b'"rank":0', b'"rank":1')))
    refused(lambda d: d["tensors"].pop("w"), "not in the manifest")
    refused(lambda d: entry(d).update(writer=3), "not a rank below 1")
    refused(lambda d: entry(d).pop("writer"), "only beside its writer")
    refused(lambda d: entry(d)["chunks"][0].update(offset=4096), "differ from its writer's part")
    # The checksum member is required in 2.0, and must match.
    body = original[: original.rindex(b',"checksum":')] + b"}"
    (root / "manifest.json").write_bytes(body)
    with pytest.raises(FormatError, match="must carry its own checksum"):
        read_sharded(root)
    (root / "manifest.json").write_bytes(original.replace(b'"step"', b'"stop"') if b'"step"' in original
                                         else original.replace(b'"world_size":1', b'"world_size":1 '))
    with pytest.raises(FormatError, match="checksum"):
        read_sharded(root)
    (root / "manifest.json").write_bytes(original)
    assert read_sharded(root).value["r"].by_rank[0].value == {"seed": 5}


def test_sharded_worked_example_is_true(tmp_path: pathlib.Path) -> None:
    """Section 11.2 was generated by ckptstore.save_sharded; it must stay what it writes."""
    state: dict[str, Any] = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, -2], dtype=torch.int64),
        "step": 7,
        "loader": ckptstore.PerRank({"epoch": 3, "offset": 4096}),
    }
    ckptstore.save_sharded(state, str(tmp_path / "step-7"))
    root = tmp_path / "step-7"

    def documented(name: str) -> Any:
        block = _doc_section(f"{name}-begin", f"{name}-end")
        return json.loads(block[block.index("```json") + len("```json") : block.rindex("```")])

    def mask(doc: dict[str, Any]) -> dict[str, Any]:
        # The per-rank container holds a meta of its own: its length and checksum change between runs.
        for c in doc["loader#rank00000"]["chunks"] if "loader#rank00000" in doc else ():
            assert doc["loader#rank00000"]["shape"] == c["sizes"] == [c["length"]]
            c.update(sizes=None, length=None, checksum=None)
            doc["loader#rank00000"]["shape"] = None
        return doc

    doc, actual = documented("sharded-example-manifest"), _json(root / "manifest.json")
    # The part's bytes hold its pid and timings, and the per-rank entry a meta: they change between runs.
    part_bytes = (root / "parts" / "rank-00000.json").read_bytes()
    assert actual["parts"] == [["parts/rank-00000.json", len(part_bytes), _xxh3(part_bytes)]]
    for d in (doc, actual):
        d["parts"][0][1:] = [None, None]
        assert re.fullmatch(r"xxh3_64:[0-9a-f]{16}", d.pop("layout"))
    raw = (root / "manifest.json").read_bytes()
    # The manifest's own checksum (10.3) covers meta's times, so it differs between runs too.
    assert raw.endswith(b',"checksum":"' + actual["checksum"].encode() + b'"}')
    assert checksum(raw[: raw.rindex(b',"checksum":')] + b"}") == actual.pop("checksum")
    assert re.fullmatch(r"xxh3_64:[0-9a-f]{16}", doc.pop("checksum"))
    assert set(actual.pop("meta")) == set(doc.pop("meta"))
    assert actual.pop("writer").startswith("ckptstore ") and doc.pop("writer").startswith("ckptstore ")
    mask(actual["tensors"])
    mask(doc["tensors"])
    assert actual == doc

    part, actual_part = documented("sharded-example-part"), _json(root / "parts" / "rank-00000.json")
    for p in (part, actual_part):
        for k in ("host", "pid", "bytes", "timings"):
            p.pop(k)
        for c in p["chunks"]["loader#rank00000"]:
            c.update(sizes=None, length=None, checksum=None)
    assert actual_part == part

    ck = read_sharded(root)
    assert ck.value["w"].data == torch_bytes(state["w"]) and ck.value["b"].data == torch_bytes(state["b"])
    inner = ck.value["loader"].by_rank[0]
    assert inner.value == {"epoch": 3, "offset": 4096} and inner.manifest["tensors"] == {}
    assert inner.manifest_offset == 4096 and inner.container_length == len(ck.entries["loader#rank00000"].data)
    data = (root / "data" / "rank-00000.bin").read_bytes()
    assert data[:24] == bytes.fromhex("000000000000803f0000004000004040000080400000a040")
    assert data[64:80] == bytes.fromhex("0100000000000000feffffffffffffff")
    assert data[128:136] == MAGIC and ck.entries["loader#rank00000"].chunks[0].offset == 128
    assert len(data) == 8192
