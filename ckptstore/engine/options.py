"""A CheckpointStore's options: one frozen object, checked as a whole before the store creates
anything (a process group, a thread, a file, a network connection).

The constructor's keyword arguments map onto :class:`StoreOptions` and its three sub-options
(:class:`PeerOptions`, :class:`DurableOptions`, :class:`GoodputOptions`); every error names the
argument, the value and what would work.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..goodput.planner import parse_duration
from ..names import valid_job
from ..storage.targets import WriteTuning
from ..storage.tuning import load_tuning
from ..tiers.ram import RAM_FALLBACKS

POLICIES = ("block", "skip")
SDC_MODES = ("off", "warn", "raise")
MAX_NICE = 19  # the lowest scheduling priority Linux has


@dataclass(frozen=True)
class PeerOptions:
    """Replicas of each rank's snapshot on ranks of other nodes (``replicas=0``: none)."""

    replicas: int = 0
    every: int = 1
    timeout_s: float = 60.0
    to_local: bool = False
    node: Any = None


@dataclass(frozen=True)
class DurableOptions:
    """The durable tier (``url=None``: none), what is promoted to it and how long a promotion may take."""

    url: str | None = None
    every: int = 10
    keep: int | None = None
    compression: str | None = None
    timeout_s: float = 540.0
    storage_options: dict[str, Any] | None = None


@dataclass(frozen=True)
class GoodputOptions:
    """Interval planning (``interval`` in seconds or ``"auto"``), the event log and the replica check."""

    interval: float | str | None = None
    mtbf_s: float | None = None
    events: bool | str = False
    sdc: str = "off"


@dataclass(frozen=True)
class StoreOptions:
    job: str
    local: str | None
    keep_local: int | None
    ram_budget_bytes: int | None
    ram_dir: str
    ram_fallback: str | None
    policy: str
    frozen: Callable[[str], bool] | None
    refresh_every: int
    timeout_s: float
    tuning: WriteTuning | None
    agent: bool
    background_nice: int
    peer: PeerOptions
    durable: DurableOptions
    goodput: GoodputOptions
    local_every: int = 1  # every local_every-th snapshot goes to the local tier (and every promoted or replicated one)

    @classmethod
    def from_arguments(
        cls,
        job: str,
        *,
        local: str | os.PathLike[str] | None,
        durable: str | None,
        durable_every: int,
        keep_local: int | None,
        keep_durable: int | None,
        ram_budget_bytes: int | None,
        ram_dir: str,
        ram_fallback: str | None,
        storage_options: dict[str, Any] | None,
        process_group: Any,
        policy: str,
        durable_compression: str | None,
        frozen: Callable[[str], bool] | None,
        refresh_every: int,
        timeout_s: float,
        peer_replicas: int,
        peer_every: int,
        node: Any,
        peer_timeout_s: float,
        peer_to_local: bool,
        interval: str | float | None,
        mtbf: str | float | None,
        events: bool | str | os.PathLike[str],
        sdc: str,
        durable_timeout_s: float | None,
        tuning: str | os.PathLike[str] | dict[str, Any] | None,
        agent: bool,
        background_nice: int = 0,
        local_every: int = 1,
    ) -> StoreOptions:
        """Check every argument of ``CheckpointStore(...)``; raises InvalidArgumentError for the first
        that cannot work. Reads the tuning file, and asks ``process_group`` its size, nothing more."""
        if not valid_job(job):
            raise InvalidArgumentError(f"job {job!r} must be 1-100 characters of letters, digits, '.', '_' or '-'")
        write_tuning = _tuning(tuning)
        if policy not in POLICIES:
            raise InvalidArgumentError(f"policy must be 'block' or 'skip', not {policy!r}")
        for name, value, optional in (("durable_every", durable_every, False), ("keep_local", keep_local, True),
                                      ("keep_durable", keep_durable, True), ("refresh_every", refresh_every, False),
                                      ("peer_every", peer_every, False), ("local_every", local_every, False)):
            if (value is not None or not optional) and not _positive_int(value):
                raise InvalidArgumentError(f"{name} must be a positive int (or None where allowed), not {value!r}")
        if ram_budget_bytes is not None and not _positive_int(ram_budget_bytes):
            raise InvalidArgumentError(f"ram_budget_bytes must be a positive int or None, not {ram_budget_bytes!r}")
        if durable_compression not in (None, "zstd"):
            raise InvalidArgumentError(f"durable_compression must be None or 'zstd', not {durable_compression!r}")
        for name, seconds in (("timeout_s", timeout_s), ("peer_timeout_s", peer_timeout_s)):
            if not _positive_number(seconds):
                raise InvalidArgumentError(f"{name} must be a positive number of seconds, not {seconds!r}")
        if durable_timeout_s is None:
            durable_timeout_s = 0.9 * timeout_s
        if not _positive_number(durable_timeout_s):
            raise InvalidArgumentError(f"durable_timeout_s must be a positive number of seconds, not {durable_timeout_s!r}")
        if durable_timeout_s >= timeout_s and _world(process_group) > 1:
            # Past timeout_s the other ranks' collective waiting on this promotion fails and breaks
            # the group; the promotion must give up first, so that every rank learns why.
            raise InvalidArgumentError(
                f"durable_timeout_s={durable_timeout_s} must be below timeout_s={timeout_s} in a process group"
            )
        if not isinstance(peer_replicas, int) or isinstance(peer_replicas, bool) or peer_replicas < 0:
            raise InvalidArgumentError(f"peer_replicas must be a non-negative int, not {peer_replicas!r}")
        if peer_to_local and local is None:
            raise InvalidArgumentError("peer_to_local=True keeps replicas in the local directory: pass local= too")
        if frozen is not None and not callable(frozen):
            raise InvalidArgumentError(f"frozen must be a function of a tensor's key (or None), not {type(frozen).__name__}")
        if not os.path.isdir(ram_dir):
            raise InvalidArgumentError(f"ram_dir {ram_dir!r} is not a directory (use a tmpfs such as /dev/shm)")
        if ram_fallback not in RAM_FALLBACKS:
            raise InvalidArgumentError(
                f"ram_fallback must be None (a save whose staging slot ram_dir cannot hold fails) or 'private' "
                f"(stage in process memory instead), not {ram_fallback!r}"
            )
        if ram_fallback == "private" and local is None and durable is None:
            # Private staging memory dies with the process: without a lower tier nothing would be kept.
            raise InvalidArgumentError("ram_fallback='private' persists snapshots to the lower tiers only: pass local= "
                                       "or durable= too")
        if durable is not None and not isinstance(durable, (str, os.PathLike)):
            raise InvalidArgumentError(f"durable must be a path or an fsspec URL (or None), not {type(durable).__name__}")
        if not isinstance(agent, bool):
            raise InvalidArgumentError(f"agent must be True or False, not {agent!r}")
        if agent:
            agent_linger()  # the environment's, refused here before anything is made
        if agent and local is None and durable is None:
            raise InvalidArgumentError("agent=True persists RAM snapshots a dead trainer left to the local and durable "
                                       "tiers: pass local= or durable= too")
        if (not isinstance(background_nice, int) or isinstance(background_nice, bool)
                or not 0 <= background_nice <= MAX_NICE):
            raise InvalidArgumentError(f"background_nice must be an int from 0 (the trainer's own priority) to "
                                       f"{MAX_NICE} (the lowest), not {background_nice!r}")
        if agent and ram_fallback == "private":
            raise InvalidArgumentError("agent=True reads the snapshots the RAM tier leaves in ram_dir, which "
                                       "ram_fallback='private' keeps in process memory: use one or the other")
        local_path = os.fspath(local) if local is not None else None
        return cls(
            job=job,
            local=local_path,
            keep_local=keep_local,
            ram_budget_bytes=ram_budget_bytes,
            ram_dir=ram_dir,
            ram_fallback=ram_fallback,
            policy=policy,
            frozen=frozen,
            refresh_every=refresh_every,
            timeout_s=float(timeout_s),
            tuning=write_tuning,
            agent=agent,
            background_nice=background_nice,
            peer=PeerOptions(peer_replicas, peer_every, float(peer_timeout_s), peer_to_local, node),
            durable=DurableOptions(os.fspath(durable) if durable is not None else None, durable_every, keep_durable,
                                   durable_compression, float(durable_timeout_s), storage_options),
            goodput=_goodput(interval, mtbf, events, sdc, local_path),
            local_every=local_every,
        )


def _goodput(interval: Any, mtbf: Any, events: Any, sdc: Any, local: str | None) -> GoodputOptions:
    if sdc not in SDC_MODES:
        raise InvalidArgumentError(f"sdc must be 'off', 'warn' or 'raise', not {sdc!r}")
    planned: float | str | None = None
    if interval == "auto":
        if mtbf is None:
            raise InvalidArgumentError("interval='auto' plans from the mean time between failures: pass mtbf= "
                                       "(seconds or a duration such as '3h')")
        planned = "auto"
    elif interval is not None:
        planned = parse_duration(interval, "interval")
        if planned <= 0:
            raise InvalidArgumentError(f"interval must be positive, not {interval!r}")
    mtbf_s = parse_duration(mtbf, "mtbf") if mtbf is not None else None
    if mtbf_s is not None and mtbf_s <= 0:
        raise InvalidArgumentError(f"mtbf must be positive, not {mtbf!r}")
    if events is True and local is None:
        raise InvalidArgumentError("events=True keeps the event log in the local directory: pass local= too, "
                                   "or events=PATH")
    if events is None:
        events = False
    if events is not False and events is not True:
        events = os.fspath(events)
    return GoodputOptions(planned, mtbf_s, events, sdc)


def _tuning(tuning: Any) -> WriteTuning | None:
    """``tuning=``: the settings ``ckptstore bench`` recommends (its JSON file, or a dict)."""
    return None if tuning is None else load_tuning(tuning)


def _world(process_group: Any) -> int:
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# Seconds a store-started agent lingers with no store open before it exits and gives the persisted
# RAM segments back (``ckptstore agent --linger``; its default when unset).
AGENT_LINGER_ENV = "CKPTSTORE_AGENT_LINGER_S"


def agent_linger() -> str | None:
    """The environment's linger for a store-started agent, as the agent's ``--linger`` takes it
    (None: the agent's default); raises InvalidArgumentError naming the variable when it is not
    a number of seconds, 0 or more."""
    linger = os.environ.get(AGENT_LINGER_ENV)
    if linger is None:
        return None
    try:
        ok = float(linger) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise InvalidArgumentError(f"{AGENT_LINGER_ENV}={linger!r}: the node agent's linger must be a number of "
                                   "seconds, 0 or more (or unset: 60)")
    return linger
