"""ResumableSampler / ResumableLoader resume exactly: no sample skipped or repeated, across world sizes."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import Dataset

from ckptstore.data import STATE_VERSION, ResumableLoader, ResumableSampler
from ckptstore.errors import InvalidArgumentError, UnsupportedFormatVersionError


class IndexDataset(Dataset[torch.Tensor]):
    """Sample ``i`` is ``tensor(i)``, so every batch shows which samples it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def make(n, bs, *, rank=0, world=1, seed=0, shuffle=True, drop_last=True, **kwargs):
    sampler = ResumableSampler(
        n, batch_size=bs, seed=seed, shuffle=shuffle, rank=rank, world_size=world, drop_last=drop_last
    )
    return ResumableLoader(IndexDataset(n), sampler, **kwargs)


def take(loader, k):
    """The first ``k`` batches of a pass, as lists; the state is read inside the loop, like a checkpoint."""
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if len(out) == k:
            break
    return out


def epoch_batches(loader):
    return [batch.tolist() for batch in loader]


def flat(batches):
    return [i for b in batches for i in b]


def lockstep(loaders, steps=None):
    """Run ranks in lockstep (a step is one batch on every rank that still has one).

    Returns the global stream order (each step's batches concatenated in rank order) and the states
    after the last step, checking that all ranks agree after every step.
    """
    iters = [iter(ld) for ld in loaders]
    order, step = [], 0
    while steps is None or step < steps:
        got = [next(it, None) for it in iters]
        if all(b is None for b in got):
            break
        order += [i for b in got if b is not None for i in b.tolist()]
        step += 1
        states = [ld.state_dict() for ld in loaders]
        assert all(s == states[0] for s in states), states
    return order, loaders[0].state_dict()


# ------------------------------------------------------------------------------------------------
# 1. single rank, with and without worker prefetching
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_single_rank_resume_matches_uninterrupted_run(num_workers):
    n, bs, k = 50, 4, 5  # 12 batches per epoch, 2 samples dropped
    kwargs = {"num_workers": num_workers}
    if num_workers:
        kwargs["persistent_workers"] = True

    ref = make(n, bs, seed=7)
    expected = epoch_batches(ref) + epoch_batches(ref)

    first = make(n, bs, seed=7, **kwargs)
    seen = []
    for batch in first:  # checkpoint at step k inside the loop, while workers have prefetched ahead
        seen.append(batch.tolist())
        if len(seen) == k:
            state = first.state_dict()
            break
    assert state["epoch"] == 0 and state["cursor"] == k * bs

    resumed = make(n, bs, seed=7, **kwargs)
    resumed.load_state_dict(state)
    assert len(resumed) == 12 - k
    seen += epoch_batches(resumed)
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["cursor"] == 0
    seen += epoch_batches(resumed)
    assert seen == expected
    assert sorted(flat(expected[:12])) == sorted(ref.sampler.permutation(0)[:48].tolist())


def test_state_between_batches_counts_only_delivered_batches():
    loader = make(20, 3, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    assert loader.state_dict()["cursor"] == 0
    next(it)
    next(it)
    assert loader.state_dict()["cursor"] == 6
    # leaving the loop and iterating again continues after the last delivered batch
    rest = epoch_batches(loader)
    assert len(rest) == 6 - 2
    assert (loader.state_dict()["epoch"], loader.state_dict()["cursor"]) == (1, 0)
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)


def test_state_after_last_batch_names_next_epoch_and_set_epoch_keeps_cursor():
    loader = make(12, 4, seed=3)
    it = iter(loader)
    for _ in range(3):
        next(it)
    assert (loader.state_dict()["epoch"], loader.state_dict()["cursor"]) == (1, 0)
    with pytest.raises(StopIteration):
        next(it)

    resumed = make(12, 4, seed=3)
    resumed.load_state_dict({**loader.state_dict(), "epoch": 2, "cursor": 4})
    resumed.set_epoch(2)  # the usual epoch-loop call does not undo the resume
    assert flat(epoch_batches(resumed)) == resumed.sampler.permutation(2)[4:].tolist()
    resumed.set_epoch(5)
    assert resumed.state_dict()["cursor"] == 0 and len(resumed) == 3


# ------------------------------------------------------------------------------------------------
# 2. world size change 4 -> 2 and 4 -> 3 (ranks simulated in one process)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("new_world", "dropped_from"), [(2, 96), (3, 92)])
def test_world_size_change_neither_skips_nor_repeats(new_world, dropped_from):
    n, bs, k = 100, 4, 2
    old = [make(n, bs, rank=r, world=4, seed=11) for r in range(4)]
    before, state = lockstep(old, steps=k)
    assert state == {
        "version": STATE_VERSION, "epoch": 0, "cursor": k * 4 * bs, "seed": 11,
        "dataset_len": n, "shuffle": True, "drop_last": True,
    }  # fmt: skip

    assert old[0].ckptstore_global_state is True  # TrainState stores it once, not per rank
    new = [make(n, bs, rank=r, world=new_world, seed=11) for r in range(new_world)]
    for ld in new:
        ld.load_state_dict(state)
    after, end_state = lockstep(new)
    assert (end_state["epoch"], end_state["cursor"]) == (1, 0)

    perm = old[0].sampler.permutation(0).tolist()
    seen = before + after
    assert len(seen) == len(set(seen))
    # 100 - 32 = 68 left; 4 -> 2 ranks: 8 steps of 8, drops 4; 4 -> 3 ranks: 5 steps of 12, drops 8
    assert seen == perm[:dropped_from]
    assert set(range(n)) - set(seen) == set(perm[dropped_from:])
    assert n - dropped_from < new_world * bs


def test_world_size_and_batch_size_change_keeps_global_cursor():
    n = 64
    old = [make(n, 5, rank=r, world=3, seed=2, drop_last=False) for r in range(3)]
    before, state = lockstep(old, steps=2)  # cursor 30: not a multiple of the new global batch 8
    new = [make(n, 2, rank=r, world=4, seed=2, drop_last=False) for r in range(4)]
    for ld in new:
        ld.load_state_dict(state)
    after, _ = lockstep(new)
    assert before + after == old[0].sampler.permutation(0).tolist()


# ------------------------------------------------------------------------------------------------
# 3. order and determinism
# ------------------------------------------------------------------------------------------------


def test_order_and_determinism():
    assert flat(epoch_batches(make(10, 3, shuffle=False, drop_last=False))) == list(range(10))
    a = flat(epoch_batches(make(40, 4, seed=1)))
    b = flat(epoch_batches(make(40, 4, seed=2)))
    assert sorted(a) == sorted(b) == list(range(40)) and a != b
    assert flat(epoch_batches(make(40, 4, seed=1))) == a
    # epochs differ, and (seed, epoch) pairs do not alias as seed + epoch would
    s0, s1 = make(40, 4, seed=0).sampler, make(40, 4, seed=1).sampler
    assert s0.permutation(0).tolist() != s0.permutation(1).tolist()
    assert s0.permutation(1).tolist() != s1.permutation(0).tolist()


# ------------------------------------------------------------------------------------------------
# 4. bad input
# ------------------------------------------------------------------------------------------------


def test_bad_input():
    loader = make(30, 4)
    state = loader.state_dict()
    with pytest.raises(InvalidArgumentError, match=r"dataset_len=31.*dataset_len=30"):
        loader.load_state_dict({**state, "dataset_len": 31})
    with pytest.raises(InvalidArgumentError, match="seed=5"):
        loader.load_state_dict({**state, "seed": 5})
    with pytest.raises(UnsupportedFormatVersionError, match=f"version {STATE_VERSION + 1}.*newer ckptstore"):
        loader.load_state_dict({**state, "version": STATE_VERSION + 1})
    with pytest.raises(InvalidArgumentError, match="lacks cursor"):
        loader.load_state_dict({k: v for k, v in state.items() if k != "cursor"})
    with pytest.raises(InvalidArgumentError, match="past the end"):
        loader.load_state_dict({**state, "cursor": 31})
    for bad in (0, -1):
        with pytest.raises(InvalidArgumentError, match="batch_size must be at least 1"):
            ResumableSampler(30, batch_size=bad)
    with pytest.raises(InvalidArgumentError, match="rank 2 is outside world_size 2"):
        ResumableSampler(30, batch_size=1, rank=2, world_size=2)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        ResumableLoader(IndexDataset(30), ResumableSampler(30, batch_size=2), batch_size=4)
    with pytest.raises(InvalidArgumentError, match="in_order"):
        ResumableLoader(IndexDataset(30), ResumableSampler(30, batch_size=2), num_workers=2, in_order=False)


def test_dataset_len_mismatch_names_both_lengths():
    saved = make(100, 4).state_dict()
    with pytest.raises(InvalidArgumentError) as info:
        make(90, 4).load_state_dict(saved)
    assert "100" in str(info.value) and "90" in str(info.value)


# ------------------------------------------------------------------------------------------------
# 5. JSON round trip
# ------------------------------------------------------------------------------------------------


def test_json_round_trip_resumes_identically():
    first = make(33, 4, seed=9)
    take(first, 3)
    state = first.state_dict()
    restored = json.loads(json.dumps(state))
    assert restored == state
    a, b = make(33, 4, seed=9), make(33, 4, seed=9)
    a.load_state_dict(state)
    b.load_state_dict(restored)
    assert epoch_batches(a) + epoch_batches(a) == epoch_batches(b) + epoch_batches(b)


# ------------------------------------------------------------------------------------------------
# 6. drop_last=False: the tail is split over the ranks, each sample once
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "world", "bs", "tail_sizes"), [(23, 3, 4, [4, 4, 3]), (18, 4, 2, [1, 1, 0, 0])])
def test_drop_last_false_sees_every_sample_once(n, world, bs, tail_sizes):
    loaders = [make(n, bs, rank=r, world=world, seed=4, drop_last=False) for r in range(world)]
    per_rank = [epoch_batches(ld) for ld in loaders]
    full_steps = n // (world * bs)
    assert all(len(b) == bs for batches in per_rank for b in batches[:full_steps])
    assert [sum(len(b) for b in batches[full_steps:]) for batches in per_rank] == tail_sizes
    seen = flat(flat(per_rank))
    assert sorted(seen) == list(range(n))
    order, state = lockstep([make(n, bs, rank=r, world=world, seed=4, drop_last=False) for r in range(world)])
    assert order == loaders[0].sampler.permutation(0).tolist()
    assert (state["epoch"], state["cursor"]) == (1, 0)
    assert all(ld.state_dict() == state for ld in loaders)


def test_iterating_never_draws_from_the_global_torch_rng():
    # A DataLoader iterator draws its workers' base seed; from the global RNG that draw would shift
    # every later random number of a run resumed mid-epoch against the straight run.
    loader = ResumableLoader(list(range(10)), ResumableSampler(10, batch_size=2, seed=1))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    for _ in loader:
        break
    list(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
