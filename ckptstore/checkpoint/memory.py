"""Host buffers for loaded tensors: the one place that decides how load buffers are allocated.

Plain ``torch.empty`` on purpose. Anonymous mappings advised to use transparent huge pages fault in
far faster in fresh memory (~16 GB/s against ~2.5 GB/s measured on a warm host), but each one is
unmapped when its tensor dies, and on VMs that hand freed memory back to the host (virtio-balloon
free page reporting, as on our CI machines) touching it again costs more than the huge pages save:
a fresh-process load of 1.13 GiB measured 0.36-1.43 s with them against a steady 0.38 s without.
``torch.empty`` also lets repeated loads reuse the allocator's freed memory.
"""

from __future__ import annotations

import torch


def alloc_bytes(nbytes: int) -> torch.Tensor:
    """A writable, uninitialised 1-D uint8 CPU tensor of ``nbytes``."""
    return torch.empty(nbytes, dtype=torch.uint8)
