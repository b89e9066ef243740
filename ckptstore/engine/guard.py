"""The restore's collectives, with a transport failure turned into an error that says what to do.

A restore runs dozens of collectives on the store's trainer group. When another rank dies or
stops answering, gloo raises a bare ``RuntimeError`` ("Connection closed by peer", "Timed out
waiting ...") from whichever collective this rank was in, which tells the caller neither which
step was being restored nor that nothing was damaged. :class:`Guarded` is that group with each
collective's transport failure raised as a :class:`~ckptstore.errors.CollectiveError` (also a
``RuntimeError``, so handlers written for the raw error still catch it) whose message the
restore writes (:meth:`Restorer._broken`), chained from gloo's.

:func:`broadcast_from` is a broadcast from any rank (``Group.broadcast`` sends rank 0's), counted
as :func:`ckptstore.collective.counting` counts the others.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from .. import collective
from ..collective import Group
from ..errors import CollectiveError

_T = TypeVar("_T")


class Guarded(Group):
    """``inner`` (the same process group, rank and counting), whose collectives raise
    ``broken(exc)`` from gloo's ``RuntimeError`` instead of it."""

    def __init__(self, inner: Group, broken: Callable[[BaseException], Exception]) -> None:
        # Not Group.__init__: the same group as ``inner``, not a new lookup of the default one.
        self.__dict__.update(inner.__dict__)
        self._broken = broken

    def guard(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return fn(*args)
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise  # already said (a collective within a collective: send_bytes's all_to_alls)
            raise self._broken(exc) from exc

    def gather_to_root(self, obj: Any) -> list[Any]:
        return self.guard(super().gather_to_root, obj)

    def broadcast(self, obj: Any) -> Any:
        return self.guard(super().broadcast, obj)

    def from_senders(self, obj: Any, senders: list[int]) -> dict[int, Any]:
        return self.guard(super().from_senders, obj, senders)

    def all_gather(self, obj: Any) -> list[Any]:
        return self.guard(super().all_gather, obj)

    def all_to_all(self, recv: Any, send: Any, recv_sizes: list[int], send_sizes: list[int]) -> None:
        self.guard(super().all_to_all, recv, send, recv_sizes, send_sizes)

    def max_int64(self, values: list[int]) -> list[int]:
        return self.guard(super().max_int64, values)


def _broadcast(group: Group, obj: Any, src: int) -> Any:
    box = [obj]
    group._dist.broadcast_object_list(box, src=group.global_rank(src), group=group.pg)
    traffic = collective._traffic
    if traffic is not None and group.rank != src:
        traffic.add(group.role, 8 + len(pickle.dumps(box[0])))
    return box[0]


def broadcast_from(group: Group, obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` on every rank of ``group`` (collective)."""
    if group.world == 1:
        return obj
    if src == 0:
        return group.broadcast(obj)
    if isinstance(group, Guarded):
        return group.guard(_broadcast, group, obj, src)
    return _broadcast(group, obj, src)
