"""Chunk checksums.

xxh3-64 (the ``xxhash`` package) runs at ~30 GB/s on one core here, so checking every chunk on
every load costs a small fraction of the read itself. A checksum is written as ``"xxh3_64:<16 hex>"``;
the prefix leaves room for another algorithm in a later format version (readers of format 1.x
refuse any other prefix).
"""

from __future__ import annotations

import re

import xxhash

from ..errors import CorruptCheckpointError

ALGORITHM = "xxh3_64"
_PREFIX = ALGORITHM + ":"
_PATTERN = re.compile(r"xxh3_64:[0-9a-f]{16}")
CHECKSUM_FORM = _PATTERN  # for readers that check many checksum strings in one loop


def checksum(data: bytes | bytearray | memoryview) -> str:
    return _PREFIX + xxhash.xxh3_64_hexdigest(data)


def validate_checksum_string(value: object, *, where: str) -> str:
    if not isinstance(value, str) or not _PATTERN.fullmatch(value):
        raise CorruptCheckpointError(
            f"{where}: checksum {value!r} is not of the form '{_PREFIX}<16 lowercase hex digits>'", location=where
        )
    return value


def hasher() -> xxhash.xxh3_64:
    """An incremental hasher whose digest, fed a chunk's bytes in pieces, equals :func:`checksum` of
    them whole: a reader hashes each piece right after copying it, while it is still in the cache."""
    return xxhash.xxh3_64()


def verify_digest(digest: str, expected: str, *, location: str, key: str) -> None:
    """:func:`verify` for a hex digest already computed (by :func:`hasher`)."""
    _check(_PREFIX + digest, expected, location=location, key=key)


def verify(data: bytes | bytearray | memoryview, expected: str, *, location: str, key: str) -> None:
    _check(checksum(data), expected, location=location, key=key)


def _check(actual: str, expected: str, *, location: str, key: str) -> None:
    if actual != expected:
        raise CorruptCheckpointError(
            f"checksum mismatch for tensor {key!r} in {location}: stored {expected}, read {actual}. "
            "The file was damaged after it was written; restore it from another copy.",
            location=location,
            key=key,
        )
