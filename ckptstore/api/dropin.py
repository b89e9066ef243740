"""``ckptstore.save`` / ``ckptstore.load``: drop-in replacements for ``torch.save`` / ``torch.load``."""

from __future__ import annotations

import io
import mmap as _mmap
import pickle
import struct
import warnings
import zipfile
from typing import Any

import torch

from .._gc import gc_paused
from ..checkpoint.materialize import MapLocation, check_map_location, load_container
from ..checkpoint.single_file import write_container
from ..errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    PickleNotAllowedError,
    StorageError,
    also,
)
from ..format import container
from ..planning.flatten import plan as make_plan
from ..storage.targets import FileLike, FileObjectSource, Source, StreamSource, open_sink, open_source, resolve

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
    try:
        sink = open_sink(target)
    except StorageError as exc:
        if target.path is None:
            raise
        # torch.save reports a local file it cannot create (a directory, a missing parent, no
        # permission) as RuntimeError from its writer; handlers written for it keep working.
        raise also(StorageError, RuntimeError)(str(exc), errno=exc.errno) from None
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
    weights_only: bool | None = True,
    mmap: bool = False,
    storage_options: dict[str, Any] | None = None,
    verify: bool | None = None,
) -> Any:
    """Load what :func:`save` (or ``torch.save``) wrote to ``f``.

    ``f``: a path, PathLike, fsspec URL or binary file object; a seekable one is read where it
    stands and left past the checkpoint, an unseekable one (a pipe, a socket, an HTTP body) is read
    once into memory (docs/dropin.md).

    ``map_location`` behaves as torch.load's. ``weights_only=True`` never unpickles anything;
    ``None`` means True, as torch.load's default does. ``mmap=True`` maps a local file's tensor bytes
    instead of reading them, privately, or shared (writes reach the file) after
    ``torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)``. ``verify`` checks every
    chunk's checksum (default: True, except with ``mmap=True``, where reading everything to check it
    would defeat the mapping; run ``ckptstore verify`` for that).
    """
    check_map_location(map_location)
    if weights_only is None:
        # torch.load's signature default: it means True (a falsy None must never allow pickles).
        weights_only = True
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
            result = load_container(source, map_location, weights_only, mmap, verify, shared_mmap=mmap and _map_shared())
        elif head.startswith(_ZIP_MAGIC) or head.startswith(_LEGACY_TORCH_MAGIC):
            result = _torch_load(source, target.fileobj, map_location, weights_only, mmap)
        elif not head:
            # Also EOFError: what torch.load raises for an empty file.
            raise also(NotACheckpointError, EOFError)(f"{source.display} is empty (0 bytes): it is not a checkpoint")
        else:
            raise NotACheckpointError(
                f"{source.display} is not a checkpoint: it starts with {head[:8]!r}; ckptstore.load reads files "
                "written by ckptstore.save or torch.save"
            )
    finally:
        source.close()
    return result


def _map_shared() -> bool:
    """Whether torch.serialization.set_default_mmap_options asked for MAP_SHARED mappings."""
    return bool((torch.serialization.get_default_mmap_options() or 0) & _mmap.MAP_SHARED)


def _torch_load(source: Source, fileobj: Any, map_location: MapLocation, weights_only: bool, mmap: bool) -> Any:
    """Files written by torch.save are handed to torch.load unchanged, so migration can be gradual.
    Its refusals and read failures come back as ckptstore errors (still UnpicklingError for refused pickles)."""
    try:
        with warnings.catch_warnings():
            if weights_only:
                # torch warns that it dispatches a TorchScript archive to torch.jit.load, then refuses
                # it under weights_only=True; the refusal below says what to do instead.
                warnings.filterwarnings("ignore", message="'torch.load' received a zip file that looks like a TorchScript")
            return _torch_load_unchanged(source, fileobj, map_location, weights_only, mmap)
    except pickle.UnpicklingError as exc:
        if not weights_only or isinstance(exc, PickleNotAllowedError):
            raise
        # torch's whole explanation stays: it names the blocked global and how to allow it
        # (torch.serialization.add_safe_globals), which a first line alone loses.
        raise PickleNotAllowedError(
            f"{source.display} is a torch.save file whose pickle torch.load's weights_only=True unpickler refuses; "
            "unpickling can run arbitrary code, so load it with weights_only=False only if you trust where the "
            f"file came from, or allow the class as torch says. torch.load said:\n{str(exc).strip()}"
        ) from exc
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
        if weights_only and isinstance(exc, RuntimeError) and _is_torchscript(source, fileobj):
            raise also(PickleNotAllowedError, RuntimeError)(
                f"{source.display} is a TorchScript archive (written by torch.jit.save or ScriptModule.save), not a "
                "checkpoint of tensors; loading it runs its TorchScript code, which weights_only=True refuses. Load "
                "it with torch.jit.load, or with weights_only=False only if you trust where the file came from"
            ) from exc
        first = text.strip().splitlines()[0][:300] if text.strip() else ""
        raise CorruptCheckpointError(
            f"{source.display} starts like a torch.save file, but torch.load cannot read it "
            f"({type(exc).__name__}: {first}); the file is damaged or was not written by torch.save",
            location=source.display,
        ) from exc


def _is_torchscript(source: Source, fileobj: Any) -> bool:
    """Whether a zip file holds a TorchScript archive: its records include ``<name>/constants.pkl``
    and ``<name>/code/`` (what torch.jit.save writes and a torch.save file never has)."""
    try:
        if source.local_path is not None:
            archive = zipfile.ZipFile(source.local_path)
        elif isinstance(source, FileObjectSource):
            source.rewind()
            archive = zipfile.ZipFile(fileobj)
        else:
            archive = zipfile.ZipFile(io.BytesIO(source.read(0, source.size)))
        with archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    return any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names)


def _torch_load_unchanged(source: Source, fileobj: Any, map_location: MapLocation, weights_only: bool, mmap: bool) -> Any:
    if source.local_path is not None:
        return torch.load(source.local_path, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only, mmap=mmap)
    if isinstance(source, FileObjectSource):
        source.rewind()
        return torch.load(fileobj, map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)
    data = source.joined() if isinstance(source, StreamSource) else source.read(0, source.size)
    return torch.load(io.BytesIO(data), map_location=map_location,  # type: ignore[arg-type]
            weights_only=weights_only)


__all__ = ["save", "load", "MapLocation"]
