"""The one exception tree of ckptstore.

Every error the package raises on purpose derives from :class:`CheckpointError`, so
``except ckptstore.CheckpointError`` catches them all. Where a builtin exception type
is the natural one for callers (``FileNotFoundError``, ``ValueError``, ``TypeError``,
``OSError``) the ckptstore error subclasses it as well, so existing handlers keep
working when ckptstore replaces ``torch.save``/``torch.load``::

    CheckpointError
    ├── CheckpointNotFoundError      (also FileNotFoundError)  nothing at that path
    ├── NotACheckpointError          (also ValueError)         a file that is no checkpoint at all
    ├── CorruptCheckpointError                                 checksum mismatch, truncation, bad footer/manifest
    ├── UnsupportedFormatVersionError                          written by a newer major format version
    ├── UnsupportedObjectError       (also TypeError)          save refused an object under allow_pickle=False
    ├── PickleNotAllowedError        (also pickle.UnpicklingError) load refused pickled content under weights_only=True
    ├── UnknownProtocolError         (also ValueError)         fsspec protocol unknown or not installed
    ├── StorageError                 (also OSError)            the destination failed: full, read-only, denied
    ├── CheckpointExistsError        (also FileExistsError)    another writer committed that step first
    ├── InvalidArgumentError         (also ValueError)         an argument that cannot work (mmap on a stream, ...)
    └── CollectiveError                                        an operation of every rank failed on some of them
        └── BackgroundError                                    the background pipeline failed (raised at the next call)

Each message says what was wrong, where, and what to do about it.

Where ``torch.save``/``torch.load`` raise another class for the same misuse (``AttributeError``
for an ``f`` that is no file, ``EOFError`` for an empty file, ``IsADirectoryError`` for a
directory, ``RuntimeError`` for a TorchScript archive under ``weights_only=True``), the error is
also of torch's class: :func:`also` makes that class (docs/dropin.md lists the cases).

A :class:`CollectiveError` carries ``failures``, one :class:`RankFailure` (exception class, message,
host, location) per rank that failed. When every failing rank failed with the same class, the
error is an instance of that class too: a StorageError on two ranks reaches every rank as an
error that is both a CollectiveError and a StorageError, so ``except StorageError`` still works.
A failure of the background pipeline reaches the trainer the same way, with its original class.
"""

from __future__ import annotations

import builtins as _builtins
import errno as _errno
import pickle as _pickle
from dataclasses import dataclass as _dataclass
from typing import Any as _Any
from typing import TypeVar as _TypeVar

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "NotACheckpointError",
    "CorruptCheckpointError",
    "UnsupportedFormatVersionError",
    "UnsupportedObjectError",
    "PickleNotAllowedError",
    "UnknownProtocolError",
    "StorageError",
    "CheckpointExistsError",
    "InvalidArgumentError",
    "CollectiveError",
    "RankFailure",
]


class CheckpointError(Exception):
    """Root of every error ckptstore raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no checkpoint at the given location."""

    def __init__(self, message: str) -> None:
        # FileNotFoundError's OSError constructor would reformat a single argument;
        # keep the message exactly as written.
        super().__init__(message)
        self.errno = _errno.ENOENT

    def __str__(self) -> str:
        return str(self.args[0])


class NotACheckpointError(CheckpointError, ValueError):
    """The location holds something that is not a checkpoint in any format ckptstore reads."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is damaged: a checksum mismatch, a truncated file, a bad footer or manifest.

    ``location`` names the file (or object) and ``key`` the tensor, when known.
    """

    def __init__(self, message: str, *, location: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.location = location
        self.key = key


class UnsupportedFormatVersionError(CheckpointError):
    """The checkpoint was written by a newer, incompatible major format version."""


class UnsupportedObjectError(CheckpointError, TypeError):
    """``save`` met an object it cannot store without pickle, and pickle was not allowed."""


class PickleNotAllowedError(CheckpointError, _pickle.UnpicklingError):
    """The checkpoint holds pickled objects and the caller did not opt in to unpickling.

    Also an ``UnpicklingError``: what ``torch.load(weights_only=True)`` raises for the same refusal."""


class UnknownProtocolError(CheckpointError, ValueError):
    """The URL's protocol is unknown to fsspec, or its implementation is not installed."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the storage failed (disk full, read-only, permission denied, ...).

    ``errno`` carries the underlying OS error number when there was one.
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno  # type: ignore[assignment]

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Something is already committed where this writer meant to create it: of two writers committing
    the same step, the one that came second gets this, and the first one's files are untouched.

    ``location`` names the file or object that exists.
    """

    def __init__(self, message: str, *, location: str | None = None) -> None:
        super().__init__(message)  # one argument: OSError's constructor keeps it as the message
        self.errno = _errno.EEXIST
        self.location = location

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidArgumentError(CheckpointError, ValueError):
    """An argument that cannot work, for example ``mmap=True`` on an in-memory stream."""


# Attributes of the classes above that a rebuilt error carries over (the file, the tensor, the errno).
_ATTRS = ("location", "key", "errno")


@_dataclass(frozen=True)
class RankFailure:
    """How one rank failed: its exception's class (``module.QualName``), message, host and location."""

    rank: int
    type: str
    message: str
    host: str = ""
    location: str | None = None
    key: str | None = None
    errno: int | None = None

    @classmethod
    def of(cls, rank: int, exc: BaseException, host: str = "") -> RankFailure:
        kind = type(exc)
        return cls(rank, f"{kind.__module__}.{kind.__qualname__}", str(exc), host,
                   *(_plain(getattr(exc, a, None)) for a in _ATTRS))

    def describe(self) -> str:
        where = f"rank {self.rank} ({self.host})" if self.host else f"rank {self.rank}"
        return f"{where}: {self.message}"


def _plain(value: _Any) -> _Any:
    return value if value is None or isinstance(value, (str, int)) else str(value)


class CollectiveError(CheckpointError):
    """An operation that every rank runs together failed on some ranks.

    ``failures`` maps each failing rank to its :class:`RankFailure`. Raised by every rank, so no
    rank is left waiting in a collective; see the module docstring for the class it also takes on.
    """

    failures: dict[int, RankFailure]
    _carried: type[BaseException] | None = None  # the class a mixed subclass takes on (see carrying)

    def __init__(self, message: str, failures: dict[int, RankFailure] | None = None, **attrs: _Any) -> None:
        # One argument: OSError's constructor (StorageError's base) keeps it as the message.
        super().__init__(message)
        self.failures = dict(failures or {})
        for name in _ATTRS:
            setattr(self, name, attrs.get(name))

    def __str__(self) -> str:
        return str(self.args[0])


class BackgroundError(CollectiveError):
    """A failure of the background pipeline (hashing, committing, persisting, promoting a step),
    raised to the trainer at its next ``save``, ``wait`` or ``close``, with its original class."""


_MIXED: dict[tuple[type, type], type] = {}
_ALSO: dict[tuple[type, type], type] = {}


_E = _TypeVar("_E", bound=CheckpointError)


def _reduce_also(err: BaseException) -> tuple:
    # The mixed class has its base's name, under which pickle finds the base, not it: pickle the
    # two classes it was made of instead (an error may cross a process boundary).
    base, cls = type(err).__bases__
    state = dict(err.__dict__)
    if isinstance(err, OSError):
        state["errno"] = err.errno  # a slot of OSError's, not in __dict__
    return _rebuild_also, (base, cls, err.args, state)


def _rebuild_also(base: type[_E], cls: type[BaseException], args: tuple, state: dict) -> _E:
    kind = also(base, cls)
    err = kind.__new__(kind, *args)
    err.args = args
    for name, value in state.items():
        setattr(err, name, value)
    return err


def also(base: type[_E], cls: type[BaseException]) -> type[_E]:
    """``base`` that is also a ``cls``: the class ``torch.save``/``torch.load`` raise for the same
    misuse, so that a handler written for torch keeps catching ckptstore's error. The class keeps
    ``base``'s name, so messages, ``RankFailure.type`` and :func:`class_named` still say ``base``."""
    if issubclass(base, cls) or not issubclass(cls, Exception):
        return base
    key = (base, cls)
    if key not in _ALSO:
        try:
            mixed = type(base.__name__, (base, cls), {"__module__": base.__module__,
                                                      "__qualname__": base.__qualname__,
                                                      "__reduce__": _reduce_also})
            mixed("a message")  # every caller passes one; some classes' constructors want more (UnicodeDecodeError)
            _ALSO[key] = mixed
        except TypeError:  # incompatible layouts or constructors, no consistent MRO: the base alone
            _ALSO[key] = base
    return _ALSO[key]


def carrying(base: type[CollectiveError], cls: type[BaseException] | None) -> type[CollectiveError]:
    """``base`` mixed with ``cls`` (an instance is both), or ``base`` itself when they cannot mix."""
    if cls is None or issubclass(base, cls):
        return base
    if not issubclass(cls, Exception):
        return base  # KeyboardInterrupt and the like are never rebuilt
    key = (base, cls)
    if key not in _MIXED:
        try:
            _MIXED[key] = type(cls.__name__, (base, cls), {"__module__": cls.__module__, "_carried": cls})
        except TypeError:  # incompatible layouts (a C extension's exception): the base alone
            _MIXED[key] = base
    return _MIXED[key]


def class_named(name: str) -> type[BaseException] | None:
    """The exception class ``module.QualName`` of a failure another rank reported: only
    ckptstore's own classes and builtins are looked up (nothing is imported on a peer's word)."""
    module, _, qualname = name.rpartition(".")
    if module == __name__:
        cls = globals().get(qualname)
    elif module == "builtins":
        cls = getattr(_builtins, qualname, None)
    else:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def collective_error(message: str, failures: dict[int, RankFailure], *, base: type[CollectiveError] = CollectiveError,
                     local: BaseException | None = None) -> CollectiveError:
    """The error every rank raises for ``failures``: of their common class when they share one
    (``local``, this rank's own exception, gives the class when it is not ckptstore's or a builtin)."""
    kinds = {f.type for f in failures.values()}
    cls = None
    if len(kinds) == 1:
        (kind,) = kinds
        if local is not None and f"{type(local).__module__}.{type(local).__qualname__}" == kind:
            cls = type(local)
        else:
            cls = class_named(kind)
    first = min(failures.values(), key=lambda f: f.rank) if failures else None
    attrs = {a: getattr(first, a) for a in _ATTRS} if first is not None and len(kinds) == 1 else {}
    return carrying(base, cls)(message, failures, **attrs)


def background_error(step: int, exc: BaseException) -> CollectiveError:
    """What the trainer sees of a background failure of ``step``: the original's class, message,
    location and per-rank failures, under a message that says which step failed."""
    failures = getattr(exc, "failures", None) or {0: RankFailure.of(0, exc)}
    cls = type(exc)._carried if isinstance(exc, CollectiveError) else type(exc)
    attrs = {a: getattr(exc, a, None) for a in _ATTRS}
    err = carrying(BackgroundError, cls)(f"an earlier background save (step {step}) failed: {exc}", failures, **attrs)
    err.__cause__ = exc
    return err
