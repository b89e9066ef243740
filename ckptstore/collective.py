"""The ranks of a job acting together, and the one way they agree on an outcome.

:class:`Group` is a torch.distributed process group, or this process alone. :func:`agree` runs a
piece of work on every rank and lets every rank learn every outcome: all ranks get the list of
results, or all ranks raise, so no rank is ever left waiting in a collective that the others
skipped. A failure keeps its class across ranks (see :func:`ckptstore.errors.collective_error`).
:func:`concur_async` is the same agreement for work whose results only this rank needs: success
costs one all-reduced flag, whatever the number of ranks. :func:`counting` counts what a process
receives through its groups (tests and benchmarks of the per-save control plane).

:func:`store_groups` creates the gloo groups a CheckpointStore runs on: collectives of the store
never travel on the trainer's own group (often NCCL, and busy with the trainer's work).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import os
import pickle
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import RankFailure, collective_error


class Traffic:
    """What this process received through the store's collectives while :func:`counting`: bytes
    (as the transport carries them: an object all-gather pads every rank's message to the largest,
    a ring all-reduce receives at most twice the tensor, recursive doubling the tensor once per
    message step it receives) and collectives, by group role."""

    def __init__(self) -> None:
        self.received = 0
        self.calls = 0
        self.by_role: dict[str, int] = {}
        # Collectives by group role: at thousands of ranks each ring all-reduce is 2 x (ranks - 1)
        # message steps however few its bytes, so their number is the latency to keep down.
        self.calls_by_role: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, role: str, nbytes: int) -> None:
        with self._lock:
            self.received += nbytes
            self.calls += 1
            self.by_role[role] = self.by_role.get(role, 0) + nbytes
            self.calls_by_role[role] = self.calls_by_role.get(role, 0) + 1


_traffic: Traffic | None = None


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Count what this process receives through every :class:`Group` while inside (for tests and
    benchmarks: the counting pickles each message once more, so it is off otherwise)."""
    global _traffic
    previous, _traffic = _traffic, Traffic()
    try:
        yield _traffic
    finally:
        _traffic = previous


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj))


DOUBLING_FROM = 8
"""The number of ranks from which :meth:`Group.max_int64` uses recursive doubling over point-to-point
messages instead of gloo's ring all-reduce (benchmarks/bench_allreduce.py measures both)."""


_FLAG_TAG = 0x5F1A6
"""The tag of recursive doubling's messages: apart from any other point-to-point traffic on a group."""

_SWAP_TAG = 0x5F1A7
"""The tag of :meth:`Group.swap_int64`'s messages (the replica check's neighbours)."""


class Group:
    """The ranks taking part: a torch.distributed process group, or this process alone."""

    def __init__(self, process_group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.role = ""  # which of a store's groups this is (StoreGroups), for what counting() reports
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            self.pg, self.rank, self.world = None, 0, 1
        else:
            self.pg = process_group
            self.rank = dist.get_rank(process_group)
            self.world = dist.get_world_size(process_group)

    @classmethod
    def solo(cls) -> Group:
        """This process alone, even when torch.distributed is initialized."""
        group = cls.__new__(cls)
        import torch.distributed as dist

        group._dist, group.pg, group.rank, group.world, group.role = dist, None, 0, 1, ""
        return group

    def global_rank(self, rank: int) -> int:
        """The rank in the default group of this group's ``rank``."""
        return rank if self.pg is None else self._dist.get_global_rank(self.pg, rank)

    def gather_to_root(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (an empty list elsewhere)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self.global_rank(0), group=self.pg)
        if _traffic is not None and out:
            _traffic.add(self.role, 8 * (self.world - 1) + (self.world - 1) * max(map(_size, out)))
        return out or []

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=self.global_rank(0), group=self.pg)
        if _traffic is not None and self.rank != 0:
            _traffic.add(self.role, 8 + _size(box[0]))
        return box[0]

    def from_senders(self, obj: Any, senders: list[int]) -> dict[int, Any]:
        """The ``obj`` of each rank in ``senders`` on rank 0 (an empty dict elsewhere), point to point:
        unlike a gather, ranks that have nothing to say send nothing, and nothing is padded to the
        largest message."""
        if self.world == 1 or not senders:
            return {0: obj} if 0 in senders else {}
        if self.rank == 0:
            out = {0: obj} if 0 in senders else {}
            for r in senders:
                if r != 0:
                    box: list[Any] = [None]
                    self._dist.recv_object_list(box, src=self.global_rank(r), group=self.pg)
                    out[r] = box[0]
                    if _traffic is not None:
                        _traffic.add(self.role, 8 + _size(box[0]))
            return out
        if self.rank in senders:
            self._dist.send_object_list([obj], dst=self.global_rank(0), group=self.pg)
        return {}

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self.pg)
        if _traffic is not None:
            _traffic.add(self.role, 8 * (self.world - 1) + (self.world - 1) * max(map(_size, out)))
        return out

    def all_to_all(self, recv: Any, send: Any, recv_sizes: list[int], send_sizes: list[int]) -> None:
        """Bytes from every rank to every rank: ``send`` (uint8) cut by ``send_sizes`` (one span per
        rank, in rank order), received into ``recv`` cut by ``recv_sizes``."""
        if self.world == 1:
            recv.copy_(send)
            return
        self._dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                                     group=self.pg)
        if _traffic is not None:
            _traffic.add(self.role, sum(recv_sizes))

    def send_bytes(self, messages: dict[int, bytes]) -> dict[int, bytes]:
        """``messages[r]`` to each rank ``r`` named, and what each rank sent this one (only those
        that sent something): one all_to_all of the sizes (an int64 per rank) and one of the bytes,
        so a rank receives what was sent to it and the sizes, never what went to other ranks."""
        if self.world == 1:
            return {0: messages[0]} if messages.get(0) else {}
        import torch

        sizes = [len(messages.get(r, b"")) for r in range(self.world)]
        got = torch.empty(self.world, dtype=torch.int64)
        self.all_to_all(got.view(torch.uint8), torch.tensor(sizes, dtype=torch.int64).view(torch.uint8),
                        [8] * self.world, [8] * self.world)
        recv_sizes = [int(n) for n in got.tolist()]
        send = torch.frombuffer(bytearray(b"".join(messages.get(r, b"") for r in range(self.world))) or
                                bytearray(1), dtype=torch.uint8)[:sum(sizes)]
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        self.all_to_all(recv, send, recv_sizes, sizes)
        out: dict[int, bytes] = {}
        at = 0
        data = recv.numpy().tobytes()
        for r, n in enumerate(recv_sizes):
            if n:
                out[r] = data[at:at + n]
            at += n
        return out

    def max_int64(self, values: list[int]) -> list[int]:
        """The element-wise maximum over the ranks of ``values`` (int64; negate one for a minimum),
        a few bytes whatever the number of ranks, in at most log2(ranks) + 2 message steps on gloo from
        :data:`DOUBLING_FROM` ranks on (see :meth:`_doubling_max`), one all-reduce below that."""
        if self.world == 1:
            return list(values)
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        if self.world >= DOUBLING_FROM and self._gloo():
            received = self._doubling_max(t)
        else:
            self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.pg)
            received = 2 * t.numel()
        if _traffic is not None:
            _traffic.add(self.role, received * t.element_size())
        return [int(v) for v in t.tolist()]

    def swap_int64(self, send: dict[int, list[int]], recv: dict[int, int]) -> dict[int, list[int]]:
        """Point to point: ``send[r]`` (int64s) to each rank ``r`` named, and ``recv[r]`` int64s from
        each rank ``r`` named, every message posted before any is waited for (two ranks that name
        each other cannot wait on each other). The callers know the lengths, so nothing else travels:
        a rank's cost is its own messages, whatever the number of ranks."""
        if self.world == 1 or (not send and not recv):
            return {}
        import torch

        pg: Any = self.pg if self.pg is not None else self._dist.group.WORLD
        into = {r: torch.empty(n, dtype=torch.int64) for r, n in sorted(recv.items())}
        out = {r: torch.tensor(v, dtype=torch.int64) for r, v in sorted(send.items())}
        works = [pg.recv([t], r, _SWAP_TAG) for r, t in into.items()] + [pg.send([t], r, _SWAP_TAG)
                                                                         for r, t in out.items()]
        for work in works:
            work.wait()
        if _traffic is not None:
            _traffic.add(self.role, 8 * sum(recv.values()))
        return {r: [int(v) for v in t.tolist()] for r, t in into.items()}

    def group_ranks(self, global_ranks: Iterable[int]) -> tuple[int, ...]:
        """This group's ranks of the default group's ``global_ranks``."""
        if self.pg is None:
            return tuple(global_ranks)
        return tuple(self._dist.get_group_rank(self.pg, g) for g in global_ranks)

    def _gloo(self) -> bool:
        """Whether CPU tensors travel point to point on this group (gloo, alone or beside NCCL)."""
        try:
            return "gloo" in str(self._dist.get_backend(self.pg))
        except (RuntimeError, ValueError):
            return False

    def _doubling_max(self, t: Any) -> int:
        """``t`` becomes the element-wise maximum over the ranks by recursive doubling; returns the
        elements this rank received.

        gloo's all-reduce is a ring: 2 x (ranks - 1) message steps one after the other, however few
        the bytes (8,190 at 4,096 ranks, a few hundred milliseconds for a flag). Here the ranks
        beyond the largest power of two ``p`` fold into a partner below it, the ``p`` ranks swap
        with the rank that differs in one bit per round (log2(p) rounds), and the partners hand the
        result back: log2(p) steps, 2 more when the world is not a power of two (12 at 4,096 ranks,
        14 at 16,384). Every rank takes the same steps in the same order, so a dead peer fails this
        rank's receive after the group's timeout, as it fails a ring."""
        import torch

        # The group's own send and recv (group ranks, no wrapper): torch.distributed.isend/recv
        # cost several times more CPU per message in their Python layers, and a round here is two
        # messages.
        pg: Any = self.pg if self.pg is not None else self._dist.group.WORLD
        n, rank = self.world, self.rank
        p = 1 << (n.bit_length() - 1)
        buf = torch.empty_like(t)

        def swap(peer: int, send: bool, recv: bool, into: Any) -> None:
            works = ([pg.recv([into], peer, _FLAG_TAG)] if recv else []) + ([pg.send([t], peer, _FLAG_TAG)] if send else [])
            for work in works:
                work.wait()

        if rank >= p:  # fold in, then take the result
            swap(rank - p, True, False, t)
            swap(rank - p, False, True, t)
            return t.numel()
        received = 0
        if rank + p < n:
            swap(rank + p, False, True, buf)
            torch.maximum(t, buf, out=t)
            received += t.numel()
        bit = 1
        while bit < p:
            swap(rank ^ bit, True, True, buf)  # t changes only after both messages are done
            torch.maximum(t, buf, out=t)
            received += t.numel()
            bit <<= 1
        if rank + p < n:
            swap(rank + p, True, False, t)
        return received


def failure_record(rank: int, exc: BaseException) -> dict[str, Any]:
    """How ``exc`` travels to the other ranks: a plain dict (see :class:`~ckptstore.errors.RankFailure`)."""
    return dataclasses.asdict(RankFailure.of(rank, exc, socket.gethostname()))


def failures_from(records: list[dict[str, Any] | None]) -> dict[int, RankFailure]:
    """The failures among gathered records (None where a rank did not fail), by rank."""
    return {r["rank"]: RankFailure(**r) for r in records if r is not None}


def _status(rank: int, fn: Callable[[], Any]) -> tuple[dict[str, Any], BaseException | None]:
    try:
        return {"ok": True, "value": fn()}, None
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
        return _failed(rank, exc), exc


def _failed(rank: int, exc: BaseException) -> dict[str, Any]:
    return {"ok": False, "failure": failure_record(rank, exc)}


def settle(what: str, statuses: list[dict[str, Any]], rank: int, local: BaseException | None, *,
           own_error_first: bool = False) -> list[Any]:
    """Every rank's value, or the error all ranks raise (see :func:`agree`)."""
    failures = failures_from([s.get("failure") for s in statuses if not s["ok"]])
    if not failures:
        return [s.get("value") for s in statuses]
    if local is not None and (len(statuses) == 1 or (own_error_first and len(failures) == 1)):
        raise local  # this rank's own error, as raised: it alone failed, and it says best what and where
    if own_error_first and local is None:
        detail = "; ".join(f"rank {f.rank}: {f.message}" for f in sorted(failures.values(), key=lambda f: f.rank))
        message = f"{what} failed on other ranks: {detail}"
    else:
        message = f"{what} failed: " + "; ".join(f.describe() for f in sorted(failures.values(), key=lambda f: f.rank))
    raise collective_error(message, failures, local=local) from local


def agree(group: Group, what: str, fn: Callable[[], Any], *, own_error_first: bool = False) -> list[Any]:
    """Run ``fn`` on this rank, then learn every rank's outcome: every rank returns the list of all
    ranks' results, or every rank raises.

    The error raised is a :class:`~ckptstore.errors.CollectiveError` that names each failing rank and
    carries their failures (of their class, when they share one). In a single process, and with
    ``own_error_first`` on a rank that alone failed, the rank's own exception is raised unchanged;
    with ``own_error_first`` the other ranks' message says the save "failed on other ranks"."""
    status, local = _status(group.rank, fn)
    statuses = group.all_gather(status) if group.world > 1 else [status]
    return settle(what, statuses, group.rank, local, own_error_first=own_error_first)


async def agree_async(group: Group, what: str, work: Callable[[], Awaitable[Any]]) -> list[Any]:
    """:func:`agree` on an event loop: ``work()`` is awaited here (blocking work is handed to a thread
    by the caller, with ``asyncio.to_thread``); the exchange of outcomes runs in a thread."""
    local: BaseException | None = None
    try:
        status: dict[str, Any] = {"ok": True, "value": await work()}
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        local, status = exc, _failed(group.rank, exc)
    statuses = await asyncio.to_thread(group.all_gather, status) if group.world > 1 else [status]
    return settle(what, statuses, group.rank, local)


async def concur_async(group: Group, what: str, work: Callable[[], Awaitable[Any]]) -> Any:
    """:func:`agree_async` for work whose results nobody else needs: returns this rank's result
    once every rank succeeded, and raises what :func:`agree_async` raises otherwise. Success costs
    one all-reduce of a flag, whatever the number of ranks; only a failure gathers every rank's
    outcome, to name each failing rank and keep its class."""
    return (await concur_max_async(group, what, work, []))[0]


async def concur_max_async(group: Group, what: str, work: Callable[[], Awaitable[Any]],
                           values: list[int] | Callable[[], list[int]]) -> tuple[Any, list[int]]:
    """:func:`concur_async` that also returns the element-wise maximum over the ranks of
    ``values`` (int64), carried in the same all-reduce as the success flag; a callable gives them
    once ``work`` is over (failed or not: the same number on every rank)."""
    local: BaseException | None = None
    status: dict[str, Any]
    try:
        status = {"ok": True, "value": await work()}
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        local, status = exc, _failed(group.rank, exc)
    if callable(values):
        values = values()
    if group.world == 1:
        return settle(what, [status], group.rank, local)[0], list(values)
    reduced = await asyncio.to_thread(group.max_int64, [0 if status["ok"] else 1, *values])
    if not reduced[0]:
        return status["value"], reduced[1:]
    statuses = await asyncio.to_thread(group.all_gather, status)
    return settle(what, statuses, group.rank, local)[group.rank], reduced[1:]


@dataclass(frozen=True)
class StoreGroups:
    """The gloo groups of one CheckpointStore, over the ranks of its process group.

    ``trainer`` carries what the trainer's thread agrees on (each save, each restore); ``fast``,
    ``durable`` and ``peer`` each belong to one background lane (collectives of one group must
    keep one order on every rank, and the lanes run independently); ``transfer`` carries only the
    point-to-point bytes of a restore, because gloo numbers point-to-point and collective messages
    in one tag space. ``peer`` waits at most ``peer_timeout_s``, the others ``timeout_s``."""

    trainer: Group
    fast: Group
    durable: Group
    peer: Group
    transfer: Group

    @property
    def rank(self) -> int:
        return self.trainer.rank

    def release(self) -> None:
        """Destroy the store's own groups (never the caller's), once no thread of the store is in a
        collective on them: the caller's ``destroy_process_group()`` then has none of ours left to
        shut down, so it can never do so under a transfer still in flight. Groups the caller
        already destroyed (with the world) are passed over."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        seen: set[int] = set()
        for group in (self.trainer, self.fast, self.durable, self.peer, self.transfer):
            if group.pg is None or id(group.pg) in seen:
                continue
            seen.add(id(group.pg))
            try:
                dist.destroy_process_group(group.pg)
            except ValueError:
                pass  # no longer registered: destroyed with the world already

    @property
    def world(self) -> int:
        return self.trainer.world


# How torch asks gloo to connect a pair of ranks at its first message instead of connecting every
# pair when the group is created. new_group takes no gloo options, so the variable is the only way in;
# torch reads it when it creates a group's gloo device.
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def lazy_gloo() -> Iterator[None]:
    """Gloo groups created inside connect their ranks on demand. A store's five groups, each a full
    mesh, held 5 x (world - 1) connections per rank from the start (20,475 per rank, about 164,000
    per eight-rank node, at 4,096 ranks) and took seconds per group to connect; its collectives (rings) and
    point-to-point reads (the owners a restore asks) touch a few peers each. A value the caller set
    is left as it is."""
    if LAZY_GLOO in os.environ:
        yield
        return
    os.environ[LAZY_GLOO] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_GLOO, None)


def store_groups(process_group: Any, timeout_s: float, peer_timeout_s: float) -> StoreGroups:
    group = Group(process_group)
    if group.world == 1:
        solo = Group.solo()
        return StoreGroups(solo, solo, solo, solo, solo)
    import torch.distributed as dist

    kwargs: dict[str, Any] = {"backend": "gloo", "timeout": datetime.timedelta(seconds=timeout_s)}
    ranks = None
    if process_group is not None:
        ranks = dist.get_process_group_ranks(process_group)
        if len(ranks) < dist.get_world_size():
            kwargs["use_local_synchronization"] = True  # only the members take part in creating it
    # Created in one order on every rank (new_group is itself collective).
    with lazy_gloo():
        trainer, fast, durable, transfer = (Group(dist.new_group(ranks=ranks, **kwargs)) for _ in range(4))
        kwargs["timeout"] = datetime.timedelta(seconds=peer_timeout_s)
        peer = Group(dist.new_group(ranks=ranks, **kwargs))
    for group, role in ((trainer, "trainer"), (fast, "fast"), (durable, "durable"), (peer, "peer"),
                        (transfer, "transfer")):
        group.role = role
    return StoreGroups(trainer, fast, durable, peer, transfer)
