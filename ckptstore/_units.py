"""Byte sizes as people write them (``"5GB"``, ``"256MiB"``) and as the tools print them.

One parser and one formatter, so that ``ckptstore bench --size``, ``hf.export_safetensors(max_shard_size=)``
and every printed size agree on what a unit means.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import InvalidArgumentError

# KB, MB, ... are powers of 1000 and KiB, MiB, ... powers of 1024, as Hugging Face and disk
# vendors read them; so "5GB" is the 5 * 10**9 bytes that from_pretrained's max_shard_size means.
_SCALE = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d*\.?\d+)\s*([a-zA-Z]*)\s*")
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_size(size: Any, what: str | None = None) -> int:
    """Bytes from ``4096``, ``"4096"``, ``"64 MiB"``, ``"2.5GB"`` (10**9) or ``"1GiB"`` (2**30).

    A positive number with an optional unit, in any case: B, K/KB, M/MB, G/GB, T/TB (powers of
    1000) or KiB, MiB, GiB, TiB (powers of 1024). Fractions of a byte are dropped, but a positive
    size is at least 1 byte. ``what`` (an argument's name) starts the InvalidArgumentError raised
    for anything else."""
    prefix = f"{what}: " if what else ""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise InvalidArgumentError(f"{prefix}a size must be positive, not {size}")
        return size
    m = _SIZE.fullmatch(str(size))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SCALE:
        raise InvalidArgumentError(
            f"{prefix}cannot read {size!r} as a size: write a number of bytes, optionally with a unit: B, KB, MB, "
            "GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB or 256MiB"
        )
    number = float(m.group(1))
    if number <= 0:
        raise InvalidArgumentError(f"{prefix}a size must be positive, not {size!r}")
    return max(1, int(number * _SCALE[unit]))


def format_bytes(n: float) -> str:
    """``4096`` -> ``"4 KiB"``, ``3 << 29`` -> ``"1.5 GiB"``: three significant digits of the largest
    binary unit that keeps the number at 1 or more; under 1 KiB, whole bytes."""
    for unit, scale in _BINARY:
        if abs(n) >= scale:
            value = n / scale
            # From 100 up three digits are the whole number, and "g" would write 1000-1023 as 1e+03.
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n:.0f} B"
