"""What the framework adapters (ckptstore.dcp, ckptstore.lightning, ckptstore.hf) share."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CheckpointError


class MissingDependencyError(CheckpointError, ImportError):
    """An adapter's framework is not installed; the message names the pip extra that adds it."""


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise MissingDependencyError naming ``pip install ckptstore[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{what} needs the {module.split('.')[0]!r} package, which is not installed: "
            f"pip install 'ckptstore[{extra}]'"
        ) from exc


def next_step(store: Any) -> int:
    """The step after the newest one ``store`` saved or restored; a store that has done neither
    asks its tiers for the newest step they hold (a restart must not reuse a committed step)."""
    last = store.last_step if store.last_step is not None else store.latest_step()
    return 0 if last is None else last + 1
