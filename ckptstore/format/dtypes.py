"""Canonical dtype names used in manifests (little-endian element layout)."""

from __future__ import annotations

import warnings

import torch

from ..errors import CorruptCheckpointError


def _canonical_table() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    with warnings.catch_warnings():
        # dir(torch) includes deprecated attributes whose access warns; we only want dtypes.
        warnings.simplefilter("ignore")
        values = [getattr(torch, attr, None) for attr in dir(torch)]
    for value in values:
        if not isinstance(value, torch.dtype):
            continue
        name = str(value).removeprefix("torch.")
        if name.startswith(("qint", "quint")):
            continue  # quantized dtypes carry scale/zero-point outside their bytes
        # Aliases (torch.float, torch.half, ...) collapse onto the canonical name torch prints.
        table[name] = value
    return table


NAME_TO_DTYPE: dict[str, torch.dtype] = _canonical_table()
DTYPE_TO_NAME: dict[torch.dtype, str] = {d: n for n, d in NAME_TO_DTYPE.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest name of ``dtype``, or None when the format cannot store it (quantized dtypes)."""
    return DTYPE_TO_NAME.get(dtype)


def dtype_from_name(name: object, *, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in NAME_TO_DTYPE:
        raise CorruptCheckpointError(
            f"{where}: unknown dtype {name!r}; this build of torch ({torch.__version__}) knows "
            f"{', '.join(sorted(NAME_TO_DTYPE))}. Upgrade torch if the checkpoint uses a newer dtype.",
            location=where,
        )
    return NAME_TO_DTYPE[name]


def element_size(dtype: torch.dtype) -> int:
    # dtype.itemsize needs no allocation (allocating complex32 warns "experimental").
    return dtype.itemsize
