"""``ckptstore.save`` / ``ckptstore.load``: drop-in replacements for ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import torch

from .._gc import gc_paused
from ..checkpoint.materialize import MapLocation, load_container
from ..checkpoint.single_file import write_container
from ..errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
)
from ..format import container
from ..planning.flatten import plan as make_plan
from ..storage.targets import FileLike, FileObjectSource, Source, open_sink, open_source, resolve

_ZIP_MAGIC = b"PK\x03\x04"
# torch's legacy (pre-1.6) format starts with the pickled magic number 0x1950a86a20f9469cfc6c.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


@gc_paused
def save(
    obj: Any,
    f: FileLike,
    *,
    compression: str | None = None,
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save ``obj`` to ``f`` (a path, PathLike, binary file object or fsspec URL) as one file.

    ``compression``: None (raw, mmap-able), ``"zstd"``, or ``"shuffle+zstd"`` (byte-shuffle floats first).
    ``allow_pickle``: store objects outside the supported set pickled (loading them needs
    ``weights_only=False``); without it they raise :class:`UnsupportedObjectError` naming their path,
    and nothing is written.
    """
    target = resolve(f, storage_options)
    the_plan = make_plan(obj, compression=compression, allow_pickle=allow_pickle)
    sink = open_sink(target)
    try:
        write_container(the_plan, sink)
    except BaseException:
        sink.abort()
        raise


@gc_paused
def load(
    f: FileLike,
    map_location: MapLocation = None,
    *,
    weights_only: bool = True,
    mmap: bool = False,
    storage_options: dict[str, Any] | None = None,
    verify: bool | None = None,
) -> Any:
    """Load what :func:`save` (or ``torch.save``) wrote to ``f``.

    ``map_location`` behaves as torch.load's. ``weights_only=True`` never unpickles anything.
    ``mmap=True`` maps a local file's tensor bytes instead of reading them. ``verify`` checks every
    chunk's checksum (default: True, except with ``mmap=True``, where reading everything to check it
    would defeat the mapping; run ``ckptstore verify`` for that).
    """
    target = resolve(f, storage_options)
    source = open_source(target)
    try:
        if mmap and source.local_path is None:
            raise InvalidArgumentError(
                f"mmap=True needs a local file path, but {source.display} is not a local file; "
                "load without mmap, or copy the file to local disk first"
            )
        head = source.read(0, min(len(_LEGACY_TORCH_MAGIC), source.size))
        if head.startswith(container.MAGIC):
            result = load_container(source, map_location, weights_only, mmap, verify)
        elif head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC):
            result = _torch_load(source, target.fileobj, map_location, weights_only, mmap)
        elif not head:
            raise NotACheckpointError(f"{source.display} is empty (0 bytes): it is not a checkpoint")
        else:
            raise NotACheckpointError(
                f"{source.display} is not a checkpoint: it starts with {head[:8]!r}; ckptstore.load reads files "
                "written by ckptstore.save or torch.save"
            )
    finally:
        source.close()
    return result


def _torch_load(source: Source, fileobj: Any, map_location: MapLocation, weights_only: bool, mmap: bool) -> Any:
    """Files written by torch.save are handed to torch.load unchanged, so migration can be gradual.
    Its refusals and read failures come back as ckptstore errors (still UnpicklingError for refused pickles)."""
    try:
        return _torch_load_unchanged(source, fileobj, map_location, weights_only, mmap)
    except pickle.UnpicklingError as exc:
        if not weights_only or isinstance(exc, PickleNotAllowedError):
            raise
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise PickleNotAllowedError(
            f"{source.display} is a torch.save file whose pickle torch.load's weights_only=True unpickler refuses "
            f"({first}); unpickling can run arbitrary code, so load it with weights_only=False only if you trust "
            "where the file came from"
        ) from None
    except EOFError:
        raise CorruptCheckpointError(
            f"{source.display} is a torch.save file that ends too early (truncated)", location=source.display
        ) from None
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            AssertionError, ZeroDivisionError, struct.error) as exc:
        # A damaged torch.save file fails inside torch.load with whatever its parsers raise (fuzzing
        # found IndexError, UnicodeDecodeError, AssertionError, struct and zip errors). Device placement failures
        # are torch's own and stay as torch.load raises them.
        text = str(exc)
        if isinstance(exc, RuntimeError) and any(w in text for w in ("device", "CUDA", "cuda", "map_location")):
            raise
        first = text.strip().splitlines()[0][:300] if text.strip() else ""
        raise CorruptCheckpointError(
            f"{source.display} starts like a torch.save file, but torch.load cannot read it "
            f"({type(exc).__name__}: {first}); the file is damaged or was not written by torch.save",
            location=source.display,
        ) from exc


def _torch_load_unchanged(source: Source, fileobj: Any, map_location: MapLocation, weights_only: bool, mmap: bool) -> Any:
    if source.local_path is not None:
        return torch.load(source.local_path, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only, mmap=mmap)
    if isinstance(source, FileObjectSource):
        source.rewind()
        return torch.load(fileobj, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)
    import io

    return torch.load(io.BytesIO(source.read(0, source.size)), map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)


__all__ = ["save", "load", "MapLocation"]
