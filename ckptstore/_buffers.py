"""Zero-copy byte views of CPU tensors."""

from __future__ import annotations

from typing import Any, cast

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat memoryview of a contiguous CPU tensor's bytes (no copy)."""
    array: Any = t.reshape(-1).view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.reshape(-1).numpy()
    return cast(memoryview, memoryview(array)).cast("B")


def copy_grouped(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, in one call where torch can group them.

    ``torch._foreach_copy_`` is private to torch, and the one place ckptstore calls it: with
    thousands of small tensors the Python loop of ``copy_`` calls costs more than the bytes they
    move. A torch without it, or one that refuses a pair (a dtype with no foreach kernel), gets the
    loop; a refusal may come after some pairs were copied, and copying them again is harmless.
    """
    grouped = getattr(torch, "_foreach_copy_", None)
    if grouped is not None:
        try:
            grouped(dsts, srcs)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)
