"""``CheckpointStore(tuning=...)``: the write settings ``ckptstore bench --json`` recommends, checked.

It lives in the storage layer, beside the :class:`WriteTuning` it fills, so that the engine reads a
tuning file without importing the bench tool that writes one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import InvalidArgumentError
from .direct import ALIGN
from .targets import READ_PIECE, WriteTuning

_TUNING_KEYS = {
    "local": {"chunk_bytes": "local_chunk_bytes", "concurrency": "local_concurrency"},
    "durable": {"part_bytes": "s3_part_bytes", "concurrency": "s3_concurrency"},
}
_LIMITS = {
    "local_chunk_bytes": (64 << 10, READ_PIECE, "between 64 KiB and 32 MiB (the engine hands the sink pieces of "
                          "at most 32 MiB) and a multiple of 4096"),
    "local_concurrency": (1, 64, "between 1 and 64 (more than the engine's I/O threads, 4-8, has no effect)"),
    "s3_part_bytes": (5 << 20, 5 << 30, "between 5 MiB and 5 GiB (S3's limits)"),
    "s3_concurrency": (1, 64, "between 1 and 64"),
}


def load_tuning(tuning: Any) -> WriteTuning:
    """Read ``tuning=``: the path of a ``ckptstore bench --json`` file, or a dict shaped like its
    ``"recommended"`` section (``{"local": {"chunk_bytes", "concurrency"}, "durable": {"part_bytes",
    "concurrency"}}``; the whole bench document is accepted too). Raises InvalidArgumentError
    naming the file and the field for anything else."""
    where = "tuning"
    if isinstance(tuning, (str, os.PathLike)):
        where = f"tuning file {os.fspath(tuning)!r}"
        try:
            with open(tuning, encoding="utf-8") as fh:
                tuning = json.load(fh)
        except FileNotFoundError:
            raise InvalidArgumentError(
                f"{where} does not exist; write one with `ckptstore bench --json FILE`, or pass tuning=None"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"cannot read {where}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(
                f"{where} is not valid JSON ({exc}); write it with `ckptstore bench --json FILE`"
            ) from None
    if not isinstance(tuning, dict):
        raise InvalidArgumentError(
            f"{where} must be a bench JSON file path or a dict, not {type(tuning).__name__}"
        )
    if "recommended" in tuning:
        tuning = tuning["recommended"]
        if not isinstance(tuning, dict):
            raise InvalidArgumentError(f"{where}: 'recommended' must be an object, not {type(tuning).__name__}")
    unknown = sorted(set(tuning) - set(_TUNING_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"{where}: unknown section(s) {unknown}; the sections are 'local' and 'durable' (as written by "
            "`ckptstore bench --json`)"
        )
    values: dict[str, int | None] = {}
    for section, keys in _TUNING_KEYS.items():
        body = tuning.get(section)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise InvalidArgumentError(f"{where}: '{section}' must be an object, not {type(body).__name__}")
        bad = sorted(set(body) - set(keys))
        if bad:
            raise InvalidArgumentError(f"{where}: unknown key(s) {bad} in '{section}'; allowed: {sorted(keys)}")
        for key, attr in keys.items():
            value = body.get(key)
            if value is None:
                continue
            low, high, rule = _LIMITS[attr]
            if (not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high
                    or (attr == "local_chunk_bytes" and value % ALIGN)):
                raise InvalidArgumentError(f"{where}: {section}.{key} must be an integer {rule}, not {value!r}")
            values[attr] = value
    return WriteTuning(**values)


__all__ = ["load_tuning"]
