"""Exact data-loader resume: neither skip nor repeat a sample, even when the world size changes.

A training run that restarts from a checkpoint must continue its data stream where the checkpoint
was taken. :class:`ResumableSampler` defines one *global* sample stream per epoch, shared by all
data-parallel ranks, and :class:`ResumableLoader` counts the batches the training loop actually
received. The saved position is a *global* sample cursor, so it means the same thing under any world
size or per-rank batch size::

    sampler = ResumableSampler(len(dataset), batch_size=32, seed=1234)
    loader = ResumableLoader(dataset, sampler, num_workers=4, pin_memory=True)
    loader.load_state_dict(saved)          # optional: resume at (epoch, cursor)
    for epoch in range(loader.epoch, num_epochs):
        for batch in loader:               # one ``iter()`` is (the rest of) one epoch
            ...
            if step % 1000 == 0:
                save({"data": loader.state_dict(), ...})   # JSON-able; equal on every rank

Stream layout of epoch ``e`` (``N = dataset_len``, ``W = world_size``, ``B = batch_size``):

* the stream is a permutation of ``range(N)`` drawn by :func:`torch.randperm` from a
  :class:`torch.Generator` seeded from ``(seed, e)`` (the identity when ``shuffle=False``);
* starting at the cursor ``c``, a *global batch* is the next ``W * B`` samples of the stream, and
  rank ``r`` takes its ``r``-th contiguous slice of ``B`` samples. Concatenating the ranks' batches
  of one step in rank order gives the stream in order;
* the tail ``T = (N - c) % (W * B)`` that does not fill a global batch: with ``drop_last=True`` it
  is dropped and the epoch ends. With ``drop_last=False`` it is one last, smaller global batch, split
  into ``W`` contiguous slices in rank order whose sizes differ by at most one: with
  ``q, m = divmod(T, W)``, rank ``r`` gets ``q + 1`` samples if ``r < m`` else ``q``. If ``T < W``,
  ranks ``r >= T`` get no last batch at all (one step fewer than the others in that epoch; use
  ``drop_last=True`` where every rank must take the same number of steps).

The cursor is exact in samples and need not be a multiple of anything: after resuming, global
batches of the *current* ``W * B`` are cut from the cursor on, and the tail follows ``drop_last``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from .errors import InvalidArgumentError, UnsupportedFormatVersionError

__all__ = ["ResumableSampler", "ResumableLoader", "STATE_VERSION"]

#: Version of the dict :meth:`ResumableLoader.state_dict` returns; newer ones are refused on load.
STATE_VERSION = 1

_MASK64 = (1 << 64) - 1
_STATE_KEYS = ("version", "epoch", "cursor", "seed", "dataset_len", "shuffle", "drop_last")
# DataLoader arguments that the sampler decides; accepting them would contradict its stream.
_RESERVED_KWARGS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")


def _mix64(x: int) -> int:
    """SplitMix64 finalizer: spreads nearby inputs over the whole 64-bit range."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch.

    Mixed rather than ``seed + epoch`` (as DistributedSampler does) so that run ``seed=1`` does not
    replay the epochs of run ``seed=0`` shifted by one.
    """
    return _mix64((_mix64(seed & _MASK64) + epoch) & _MASK64)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    # bool is an int subclass, but ``batch_size=True`` is a bug, not a one.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"ResumableSampler: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"ResumableSampler: {name} must be at least {minimum}, got {value}")
    return value


class ResumableSampler(Sampler[int]):
    """This rank's share of a seeded global sample stream, starting at a resumable position.

    The position is ``(epoch, cursor)``: the cursor counts the *global* samples of the epoch already
    consumed by all ranks together. Iterating yields this rank's indices from the cursor to the end of
    the epoch (see the module docstring for the exact layout); it does not move the position itself,
    because the sampler cannot know which of the indices it yielded reached the training loop
    (DataLoader workers prefetch). :class:`ResumableLoader` moves it as batches are delivered.

    ``rank`` and ``world_size`` default to those of the initialized default process group, else 0 and 1.
    Pass the ``batch_size`` the DataLoader uses; the sampler needs it to cut global batches.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = True,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        self.dataset_len = _check_int("dataset_len", dataset_len, minimum=0)
        self.batch_size = _check_int("batch_size", batch_size, minimum=1)
        self.world_size = _check_int("world_size", world_size, minimum=1)
        self.rank = _check_int("rank", rank, minimum=0)
        if self.rank >= self.world_size:
            raise InvalidArgumentError(
                f"ResumableSampler: rank {rank} is outside world_size {world_size}; pass 0 <= rank < world_size"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidArgumentError(f"ResumableSampler: seed must be an int, got {type(seed).__name__} {seed!r}")
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._epoch = 0
        self._cursor = 0
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    # ----------------------------------------------------------------------------------------------
    # Position
    # ----------------------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next iteration draws from."""
        return self._epoch

    @property
    def cursor(self) -> int:
        """Global samples of :attr:`epoch` already consumed; the next iteration starts here."""
        return self._cursor

    @property
    def global_batch_size(self) -> int:
        """Samples one step consumes over all ranks: ``world_size * batch_size``."""
        return self.world_size * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration, like ``DistributedSampler.set_epoch``.

        Setting another epoch restarts at its first sample. Setting the *current* epoch keeps the
        cursor, so the usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop does not
        undo a mid-epoch resume.
        """
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._epoch, self._cursor = epoch, 0

    def set_position(self, epoch: int, cursor: int) -> None:
        """Continue at global sample ``cursor`` of ``epoch`` (``0 <= cursor <= dataset_len``)."""
        epoch = _check_int("epoch", epoch, minimum=0)
        cursor = _check_int("cursor", cursor, minimum=0)
        if cursor > self.dataset_len:
            raise InvalidArgumentError(
                f"ResumableSampler: cursor {cursor} is past the end of a dataset of {self.dataset_len} samples"
            )
        self._epoch, self._cursor = epoch, cursor

    # ----------------------------------------------------------------------------------------------
    # Stream
    # ----------------------------------------------------------------------------------------------

    def permutation(self, epoch: int) -> torch.Tensor:
        """The global sample stream of ``epoch``: a permutation of ``range(dataset_len)`` (int64)."""
        if not self.shuffle:
            return torch.arange(self.dataset_len, dtype=torch.int64)
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        generator = torch.Generator()
        generator.manual_seed(_epoch_seed(self.seed, epoch))
        perm = torch.randperm(self.dataset_len, generator=generator)
        self._perm_cache = (epoch, perm)
        return perm

    def num_global_batches(self) -> int:
        """Steps left in the current epoch from the cursor, counting a kept partial last batch."""
        full, tail = divmod(self.dataset_len - self._cursor, self.global_batch_size)
        return full + (1 if tail and not self.drop_last else 0)

    def _rank_span(self) -> tuple[list[tuple[int, int]], int]:
        """This rank's ``(start, stop)`` stream ranges from the cursor on, and their total length."""
        gbs, bs, r = self.global_batch_size, self.batch_size, self.rank
        full, tail = divmod(self.dataset_len - self._cursor, gbs)
        spans = [(self._cursor + k * gbs + r * bs, self._cursor + k * gbs + (r + 1) * bs) for k in range(full)]
        if tail and not self.drop_last:
            q, m = divmod(tail, self.world_size)
            start = self._cursor + full * gbs + r * q + min(r, m)
            size = q + (1 if r < m else 0)
            if size:
                spans.append((start, start + size))
        return spans, sum(stop - start for start, stop in spans)

    def __iter__(self) -> Iterator[int]:
        spans, total = self._rank_span()
        if total == 0:
            return iter(())
        perm = self.permutation(self._epoch)
        return iter(torch.cat([perm[start:stop] for start, stop in spans]).tolist())

    def __len__(self) -> int:
        """This rank's indices left in the current epoch from the current position."""
        return self._rank_span()[1]


class ResumableLoader:
    """A DataLoader over a :class:`ResumableSampler` that knows how far the training loop got.

    ``dataloader_kwargs`` go to :class:`torch.utils.data.DataLoader` (``num_workers``, ``collate_fn``,
    ``pin_memory``, ...); the batch size, order and ``drop_last`` come from the sampler. A batch counts
    as consumed when this object hands it to the loop, in the main process, so batches that workers
    prefetched but the loop never received are produced again after a resume.

    One ``iter()`` runs the rest of the current epoch; when it is exhausted the position moves to the
    start of the next epoch, so the next ``iter()`` draws the next epoch. Leaving a ``for`` loop early
    and iterating again continues after the last delivered batch. A new ``iter()`` or
    :meth:`load_state_dict` supersedes any earlier iterator of this loader.
    """

    #: The state is the same on every rank (a global cursor), so :class:`ckptstore.TrainState` stores
    #: it once rather than per rank, and a resume at another world size can load it on every rank.
    ckptstore_global_state = True

    def __init__(self, dataset: Dataset[Any], sampler: ResumableSampler, **dataloader_kwargs: Any) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise InvalidArgumentError(
                f"ResumableLoader needs a ResumableSampler, got {type(sampler).__name__}; "
                "build one with ResumableSampler(len(dataset), batch_size=...)"
            )
        reserved = sorted(k for k in _RESERVED_KWARGS if k in dataloader_kwargs)
        if reserved:
            raise InvalidArgumentError(
                f"ResumableLoader: {', '.join(reserved)} cannot be passed to the DataLoader; "
                "set batch_size, shuffle and drop_last on the ResumableSampler instead (and the loader seeds its workers from the sampler's seed)"
            )
        if dataloader_kwargs.get("in_order", True) is not True:
            raise InvalidArgumentError(
                "ResumableLoader: in_order=False lets workers deliver batches out of order, so the count of "
                "delivered batches no longer names a stream position; leave in_order at its default True"
            )
        self.sampler = sampler
        # Every DataLoader iterator draws its workers' base seed from a generator, by default the
        # global torch RNG: a run resumed mid-epoch would make that draw at the resume, where the
        # straight run made it at the epoch's start, and every random number after it (dropout...)
        # would differ. A generator of our own, seeded per epoch, keeps the global stream untouched
        # and the workers' seeds the same in both runs.
        self._seeds = torch.Generator()
        #: The wrapped DataLoader; iterate this object, not it, or nothing is counted.
        self.dataloader: DataLoader[Any] = DataLoader(
            dataset, batch_size=sampler.batch_size, sampler=sampler, drop_last=False, generator=self._seeds,
            **dataloader_kwargs,
        )
        self._generation = 0

    @property
    def epoch(self) -> int:
        """The epoch the next delivered batch belongs to."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Same as :meth:`ResumableSampler.set_epoch`: another epoch restarts, the current one is kept."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches this rank has left in the current epoch from the current position."""
        bs = self.sampler.batch_size
        return (len(self.sampler) + bs - 1) // bs

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        return _EpochIterator(self, self._generation)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch the loop received, as plain JSON-able values.

        Equal on every rank, since the cursor counts global samples; store it once (rank 0) or
        replicated. Taken right after the last batch of an epoch, it already names the next epoch.
        """
        s = self.sampler
        return {
            "version": STATE_VERSION,
            "epoch": s.epoch,
            "cursor": s.cursor,
            "seed": s.seed,
            "dataset_len": s.dataset_len,
            "shuffle": s.shuffle,
            "drop_last": s.drop_last,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at the saved ``(epoch, cursor)`` with this loader's world size and batch size.

        The data must be the same stream: ``dataset_len``, ``seed`` and ``shuffle`` must match, or a
        resume would silently feed other samples. ``drop_last`` may differ; it only decides the tail
        of an epoch, which the saved cursor has not reached.
        """
        where = "ResumableLoader.load_state_dict"
        if not isinstance(state_dict, dict):
            raise InvalidArgumentError(
                f"{where}: expected the dict state_dict() returned, got {type(state_dict).__name__}"
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise InvalidArgumentError(
                f"{where}: the state dict lacks {', '.join(missing)}; pass the dict ResumableLoader.state_dict() returned"
            )
        version = state_dict["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidArgumentError(f"{where}: version must be a positive int, got {version!r}")
        if version > STATE_VERSION:
            raise UnsupportedFormatVersionError(
                f"{where}: the data-loader state has version {version}, written by a newer ckptstore; "
                f"this one reads up to version {STATE_VERSION}. Upgrade ckptstore to resume from it."
            )
        s = self.sampler
        for key, current in (("dataset_len", s.dataset_len), ("seed", s.seed), ("shuffle", s.shuffle)):
            saved = state_dict[key]
            if saved != current or type(saved) is not type(current):
                raise InvalidArgumentError(
                    f"{where}: the checkpoint's data state has {key}={saved!r} but this loader's sampler has "
                    f"{key}={current!r}; resuming would feed other samples than the saved run. Build the "
                    f"ResumableSampler with {key}={saved!r}, or start the data stream afresh without loading it."
                )
        epoch, cursor = state_dict["epoch"], state_dict["cursor"]
        for key, value in (("epoch", epoch), ("cursor", cursor)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{where}: {key} must be a non-negative int, got {value!r}")
        if cursor > s.dataset_len:
            raise InvalidArgumentError(
                f"{where}: cursor {cursor} is past the end of the {s.dataset_len}-sample dataset"
            )
        self._generation += 1  # an iterator from before the load must not move the new position
        s.set_position(epoch, cursor)


class _EpochIterator(Iterator[Any]):
    """One pass over the rest of an epoch; moves the sampler's position per delivered batch."""

    def __init__(self, loader: ResumableLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation
        sampler = loader.sampler
        self._epoch = sampler.epoch
        self._start = sampler.cursor
        self._global_batches = sampler.num_global_batches()
        self._delivered = 0
        # Created here, not on the first next(), so workers start prefetching right away.
        loader._seeds.manual_seed(_mix64(_epoch_seed(loader.sampler.seed, loader.sampler.epoch) + 1))
        self._it: Iterator[Any] | None = iter(loader.dataloader) if self._global_batches else None
        if self._it is None:
            self._end_epoch()

    def _end_epoch(self) -> None:
        self._it = None  # drop the DataLoader iterator (and its workers)
        if self._loader._generation == self._generation:
            self._loader.sampler.set_position(self._epoch + 1, 0)

    def __next__(self) -> Any:
        if self._it is None:
            raise StopIteration
        if self._loader._generation != self._generation:
            self._it = None
            raise RuntimeError(
                "ResumableLoader: this iterator was superseded by a newer iter() or load_state_dict(); "
                "iterate the loader again to continue from its current position"
            )
        try:
            batch = next(self._it)
        except StopIteration:
            # A rank with no share of a kept partial last batch ends one step early.
            self._end_epoch()
            raise
        self._delivered += 1
        sampler = self._loader.sampler
        if self._delivered >= self._global_batches:
            self._end_epoch()
        else:
            sampler.set_position(self._epoch, self._start + self._delivered * sampler.global_batch_size)
        return batch
