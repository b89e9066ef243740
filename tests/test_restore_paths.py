"""The host side of a restore from RAM after the manifest is known: the reader threads take jobs
as they finish one (the caller's thread among them) and an error in any of them reaches the
caller, once no job is left running; each source's bytes in memory are looked up once per read,
not per job; a RAM document's part is checked once while its file is unchanged, and a document
damaged since is still refused. Real /dev/shm segments; every restore is checked bitwise."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.checkpoint import single_file
from ckptstore.checkpoint.single_file import run_all
from ckptstore.tiers import ram


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 32, generator=g) for i in range(12)}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_run_all_raises_a_pool_threads_error_once_nothing_runs():
    caller = threading.get_ident()
    failed = threading.Event()
    lock = threading.Lock()
    running: list[int] = []
    started: list[int] = []
    raised: list[BaseException] = []

    def fn(i: int) -> None:
        with lock:
            running.append(i)
            started.append(i)
        try:
            if threading.get_ident() == caller:
                failed.wait(5)  # the caller is busy with its own item while a pool thread fails
                time.sleep(0.05)
            elif not raised:
                raised.append(ValueError(f"item {i} on a pool thread"))
                failed.set()
                raise raised[0]
            else:
                time.sleep(0.01)
        finally:
            with lock:
                running.remove(i)

    items = list(range(200))
    with pytest.raises(ValueError) as info:
        run_all(fn, items)
    assert info.value is raised[0]  # the worker's own exception object, as raised there
    assert running == []  # returned only once no call was left running
    count = len(started)
    time.sleep(0.1)
    assert len(started) == count < len(items)  # nothing started after the failure, nor after the return


def test_run_all_raises_the_earliest_failed_items_error():
    def fn(i: int) -> None:
        if i == 1:
            time.sleep(0.2)
            raise KeyError("item 1")
        if i == 3:
            raise KeyError("item 3")

    # Item 1 is taken before item 3 (items are taken in order) and fails after it.
    assert single_file.IO_THREADS >= 4
    with pytest.raises(KeyError, match="item 1"):
        run_all(fn, list(range(8)))


def test_run_all_runs_every_item_once_on_the_callers_thread_too():
    caller = threading.get_ident()
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(i: int) -> None:
        time.sleep(0.002)
        with lock:
            seen.append((i, threading.get_ident()))

    run_all(fn, list(range(40)))
    assert sorted(i for i, _t in seen) == list(range(40))
    assert any(t == caller for _i, t in seen)


def test_run_all_from_every_pool_thread_at_once_completes():
    """Callers that are themselves the pool's threads (all of them at once) never wait for a
    helper that no thread is left to run: each finishes its items alone."""
    pool = single_file.io_pool()
    ready = threading.Barrier(single_file.IO_THREADS)
    done: list[int] = []
    lock = threading.Lock()

    def outer(n: int) -> None:
        ready.wait(10)  # every pool thread is a caller before any helper is submitted

        def fn(i: int) -> None:
            with lock:
                done.append(i)

        run_all(fn, list(range(n * 10, n * 10 + 10)))

    futures = [pool.submit(outer, n) for n in range(single_file.IO_THREADS)]
    for f in futures:
        f.result(timeout=20)
    assert sorted(done) == list(range(10 * single_file.IO_THREADS))


def test_a_restore_from_ram_looks_up_the_slots_memory_once(job, tmp_path, monkeypatch):
    """Before, every job asked its source for its bytes in memory (an fstat and a narrow), and
    worked out its direct destination twice: 12 lookups for these 12 tensors."""
    saved = _state(1)
    calls: list[str] = []
    real = ram.SegmentSource.memory

    def counted(self):
        calls.append(self.display)
        return real(self)

    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(1, saved).wait("local")
        monkeypatch.setattr(ram.SegmentSource, "memory", counted)
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert store.restore(out) == 1
        assert _equal(out, saved)
        assert len(calls) == 1, calls  # one source (the rank's slot), looked up once


def _doc_of(job: str, step: int) -> str:
    for name in sorted(os.listdir("/dev/shm")):
        if name.startswith(f"ckptstore-{job}-") and name.endswith(".json"):
            with open(os.path.join("/dev/shm", name)) as fh:
                if json.load(fh).get("step") == step:
                    return os.path.join("/dev/shm", name)
    raise AssertionError(f"no RAM document of step {step}")


def test_a_ram_part_is_checked_once_and_a_damaged_one_is_refused(job, tmp_path, monkeypatch, caplog):
    """A restore lists the RAM tier twice (its inventory, the restored step's meta): the part a
    document holds is re-encoded and checked only when the document's file changed. A document
    rewritten with a part that no longer matches its checksum is refused, and the restore falls
    back to the local tier, bitwise."""
    saved = _state(2)
    checked: list[int] = []
    real = ram.extra_checksum

    def counted(extra):
        checked.append(1)
        return real(extra)

    monkeypatch.setattr(ram, "extra_checksum", counted)
    with CheckpointStore(job, local=tmp_path / "local") as store:
        store.save(1, saved).wait("local")
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert store.restore(out) == 1 and _equal(out, saved)
        first = len(checked)
        assert store.restore(out) == 1 and _equal(out, saved)
        assert store.restore(out) == 1 and _equal(out, saved)
        assert len(checked) == first, checked  # before: twice more per restore

        path = _doc_of(job, 1)
        with open(path) as fh:
            doc = json.load(fh)
        doc["extra"]["meta"]["tampered"] = 1  # the checksum field left as it was
        with open(path, "w") as fh:  # a new size and modification time: the file is read again
            json.dump(doc, fh)
        out = {k: torch.zeros_like(v) for k, v in saved.items()}
        with caplog.at_level(logging.INFO, "ckptstore"):
            assert store.restore(out) == 1
        assert _equal(out, saved)
        assert "does not match its checksum" in caplog.text
        assert any("restored step 1 from the local tier" in r.getMessage() for r in caplog.records), caplog.text
