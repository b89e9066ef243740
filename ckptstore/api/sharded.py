"""``save_sharded`` / ``load_sharded``: collective, layout-independent checkpoints of distributed state."""

from __future__ import annotations

from typing import Any

from .._gc import gc_paused
from ..checkpoint import index as _index
from ..checkpoint import sharded as _engine
from ..checkpoint.materialize import decode_value, encode_value
from ..checkpoint.sharded import PerRank
from ..train_state import TrainState


@gc_paused
def save_sharded(
    state_dict: Any,
    url: Any,
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> None:
    """Save a state dict as one sharded checkpoint: a collective, every rank calls it with its own state.

    Leaves may be DTensors (each rank writes its own shard), plain tensors (replicated: written once,
    the writes spread over the ranks), :class:`PerRank` values (stored per rank), and plain values.
    ``url`` is a directory path or fsspec URL. Rank 0 writes ``manifest.json`` last, after every rank's
    data is durable; a directory without it is not a checkpoint. An existing checkpoint at ``url`` is
    only replaced with ``overwrite=True``. Without a process group, this process saves alone.
    A :class:`~ckptstore.TrainState` is saved as its state dict.
    """
    _engine.save(
        state_dict.state_dict() if isinstance(state_dict, TrainState) else state_dict,
        url,
        process_group=process_group,
        storage_options=storage_options,
        overwrite=overwrite,
        encode_per_rank=encode_value,
    )


@gc_paused
def load_sharded(
    state_dict: Any,
    url: Any,
    *,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    strict: bool = True,
    per_rank: str = "error",
    buffer_bytes: int = _engine.DEFAULT_READ_BUFFER,
) -> None:
    """Load a sharded checkpoint into ``state_dict`` in place, whatever layout it has now.

    Tensors and DTensors are filled in their existing storage with exactly the elements this rank
    holds (reading only those byte ranges, at most ``buffer_bytes`` staged at once). When several
    ranks need bytes of one stored chunk (another sharding, replicated tensors) and the group's
    backend carries CPU tensors (gloo), one of them reads it and sends the others their slices, so
    each stored byte is read once across the ranks. Collective: every rank calls it. Other leaves are
    replaced by the saved values; keys the checkpoint lacks raise unless ``strict=False``. Per-rank
    values come back to the same rank index; when the world size changed they raise, unless
    ``per_rank="skip"`` keeps the current ones. A :class:`~ckptstore.TrainState` is restored whole,
    its RNG states last.
    """
    if isinstance(state_dict, TrainState):
        skeleton = state_dict.skeleton()
        load_sharded(skeleton, url, process_group=process_group, storage_options=storage_options, strict=strict,
                     per_rank=per_rank, buffer_bytes=buffer_bytes)
        state_dict.load_skeleton(skeleton)
        return
    _engine.load(
        state_dict,
        url,
        process_group=process_group,
        storage_options=storage_options,
        strict=strict,
        per_rank=per_rank,
        buffer_bytes=buffer_bytes,
        decode_per_rank=decode_value,
        plan=_index.load_plan,
    )


__all__ = ["save_sharded", "load_sharded", "PerRank"]
