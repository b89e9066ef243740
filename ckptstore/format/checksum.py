"""Chunk checksums.

xxh3-64 (the ``xxhash`` package) runs at ~30 GB/s on one core here, so checking every chunk on
every load costs a small fraction of the read itself. A checksum is written as ``"xxh3_64:<16 hex>"``
so that other algorithms can be added without a format break.
"""

from __future__ import annotations

import xxhash

from ..errors import CorruptCheckpointError

ALGORITHM = "xxh3_64"
_PREFIX = ALGORITHM + ":"


def checksum(data: bytes | bytearray | memoryview) -> str:
    return _PREFIX + xxhash.xxh3_64_hexdigest(data)


def validate_checksum_string(value: object, *, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(_PREFIX) or len(value) != len(_PREFIX) + 16:
        raise CorruptCheckpointError(
            f"{where}: checksum {value!r} is not of the form '{_PREFIX}<16 hex digits>'", location=where
        )
    try:
        int(value[len(_PREFIX):], 16)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: checksum {value!r} is not hexadecimal", location=where) from None
    return value


def verify(data: bytes | bytearray | memoryview, expected: str, *, location: str, key: str) -> None:
    actual = checksum(data)
    if actual != expected:
        raise CorruptCheckpointError(
            f"checksum mismatch for tensor {key!r} in {location}: stored {expected}, read {actual}. "
            "The file was damaged after it was written; restore it from another copy.",
            location=location,
            key=key,
        )
