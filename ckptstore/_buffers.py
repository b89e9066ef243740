"""Zero-copy byte views of CPU tensors."""

from __future__ import annotations

from typing import Any, cast

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat memoryview of a contiguous CPU tensor's bytes (no copy)."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.reshape(-1).numpy()
    return cast(memoryview, memoryview(array)).cast("B")
