"""Scale in ranks: how the control plane of a save and the reads of a restore grow with the world.

Runs the real code paths with real collectives and tiny tensors, at 8 to 256 ranks on one machine:
every rank is a thread of this process, the ranks talk through torch's threaded process group
(one process group per thread, collectives that hand Python objects between threads), so a
world of 256 costs threads, not 256 processes of ~300 MB. Measured, per world size and tensors
per rank:

- ``store``: a ``CheckpointStore`` with a RAM tier and a local tier (on tmpfs, so the disk stays
  out of it) saving a state of DTensors ``Shard(0)`` over all ranks (FSDP-like: every rank holds a
  slice of every tensor), three saves of the same structure, then ``restore`` of the last step;
- ``sharded``: ``save_sharded`` of the same kind of state, then ``load_sharded`` resharded twice:
  into ``Shard(1)`` DTensors (column slices of the saved row slabs) and into an uneven
  ``Shard(0)`` (rows cut as a world of one rank less cuts them, given as ``GlobalBox`` targets);
- ``plan``: the pure planning code at 1,024, 4,096 and 16,384 ranks on synthesized parts, no
  collectives: the manifest every rank builds in the store's RAM commit (``build_manifest``), its
  JSON size and parse, one rank's read plan (``chunks_needed``) for both resharded loads, and the
  coordinator's structure agreement (``union_verdict`` + ``merge_structures``) with pipeline stages
  of 8 ranks.

Per rank, the figures are CPU seconds of that rank's own threads (the trainer's thread, and the
store's loop thread and its executor's threads for the background RAM commit), read from each
thread's CPU clock: the ranks share two cores and one interpreter, so wall time measures the world,
not the rank. Rank 0 is reported apart: it is the coordinator, and in the threaded group its
thread also copies every rank's data of each collective (gloo spreads that over the ranks).
Metadata bytes are counted at ckptstore's ``Group`` (every collective it issues through
``self._dist``): the pickled bytes each rank sends and decodes, and the tensor bytes of tensor
collectives; bytes read come from wrapping the opener of every chunk file a load or restore reads.

The growth of each figure is fitted on a log-log scale (least squares: the exponent in world size
at the largest tensor count, and in tensors per rank at the smallest world) and extrapolated to
4,096 and 16,384 ranks at 10,000 tensors per rank. A figure is flagged where it must not grow
with the world and does (exponent above 0.1 for byte counts, 0.2 for CPU times, and at least
1.5x from the smallest world to the largest), and every load whose bytes read across ranks exceed
1.05x the checkpoint's data.

``--count-calls`` adds the work each rank's code does, counted in function calls on the rank's
threads (a profile hook), for the steady save, the restore, ``save_sharded`` and each load: a
count does not grow with the load or with the number of threads sharing the cores, so where a
CPU figure grows with the world and its count does not, the growth is the harness's contention,
and where the count grows, the code does more work. The hook slows every call several times:
such a run's CPU figures are not figures.

Cells run smallest first; a cell whose predicted duration (from the growth fitted on the cells
of its kind already run) would exceed ``--cell-budget-s``, or take the run past
``--budget-s``, is skipped and recorded with its prediction, so the same command finishes on
slow code and covers more on fast code.

    python benchmarks/bench_ranks.py                      # default grid, ~15 min on 2 loaded cores
    python benchmarks/bench_ranks.py --long               # 8-256 ranks, 1,000-50,000 tensors, hours
    python benchmarks/bench_ranks.py --worlds 8 16 --tensors 200 --plan-ranks 1024 --name ranks_try
    python benchmarks/bench_ranks.py --compare docs/benchmarks/ranks_before.json docs/benchmarks/ranks_after.json

Writes ``<out>/<name>.json`` (tagged with the commit) and ``<out>/ranks.png``; ``--compare`` plots
a before JSON against an after JSON without measuring.

The threaded process group is torch's private testing module
(``torch.testing._internal.distributed.multi_threaded_pg``); everything that touches it is in
:class:`ThreadedWorld`, the one place to change when torch moves it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, pyplot  # noqa: E402 - shared by the benchmark scripts

from ckptstore import collective as _collective  # noqa: E402
from ckptstore.checkpoint import sharded as _sharded  # noqa: E402
from ckptstore.format.manifest import parse_manifest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAPOLATE_TO = (4096, 16384)
EXTRAPOLATE_TENSORS = 10_000
TARGETS = {  # what the figures should stay under at 4,096 ranks x 10,000 tensors
    "store.control_plane_cpu_s": 0.05,
    "store.meta_recv_bytes": 1 << 20,
}


# ------------------------------------------------------------------------------------------ threads as ranks


class ThreadedWorld:
    """Threads of this process as the ranks of one job, through torch's threaded process group.

    The group is private to torch's tests, so this class is the only place that touches it, and it
    adapts four things for a CheckpointStore: a rank's world is thread-local in that module, and a
    store runs collectives on threads of its own (its event loop, ``asyncio.to_thread``), so a thread
    inherits the world of the thread that started it; ``store_groups`` asks ``new_group`` for gloo
    groups, which become threaded groups here (the same collectives, between the threads); the
    group registry is made per thread (as torch's own threaded tests do); and a group's name is
    remembered when it is made, since destroying a subgroup asks the group for a name it has just
    removed."""

    def __init__(self) -> None:
        self._installed = False
        self._failures: list[tuple[int, BaseException]] = []

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """A rank that raises inside this block stops the world at once. Entered inside a
        ``with CheckpointStore(...)`` (so it exits first): otherwise the store's close runs its
        collectives (the promotion flag) on the failing rank while the other ranks wait in another
        group's collective, a hang that hides the error (gloo would time out; threads never do). The
        store's collectives then end in SystemExit on every rank, and the rank's own error is the
        one :meth:`run` reports."""
        try:
            yield
        except BaseException as exc:
            self._fail(current_rank(), exc)
            raise

    def _fail(self, rank: int, exc: BaseException) -> None:
        if not any(e is exc for _, e in self._failures):
            self._failures.append((rank, exc))
        self.mtpg.ProcessLocalGroup.exception_handle(exc)

    def install(self) -> None:
        if self._installed:
            return
        # Imported here: importing it registers the "threaded" backend, which only a run needs.
        from torch.testing._internal.distributed import multi_threaded_pg as mtpg

        self.mtpg = mtpg
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        mtpg._install_threaded_pg()

        class InheritedWorld(mtpg.ThreadLocalWorld):
            def _get_world(self) -> Any:
                tls = mtpg.ThreadLocalWorld._world
                if not hasattr(tls, "world"):
                    inherited = getattr(threading.current_thread(), "_bench_world", None)
                    if inherited is not None:
                        tls.world = inherited
                return super()._get_world()

        dist.distributed_c10d._world = InheritedWorld()
        real_start = threading.Thread.start

        def start(thread: threading.Thread) -> None:
            tls = mtpg.ThreadLocalWorld._world
            parent = threading.current_thread()
            if hasattr(tls, "world"):
                thread._bench_world = tls.world  # type: ignore[attr-defined]
            if hasattr(parent, "_bench_rank") and not thread.name.startswith("ckptstore-io"):
                thread._bench_rank = parent._bench_rank  # type: ignore[attr-defined]
                RANK_THREADS.setdefault(parent._bench_rank, []).append(thread)  # type: ignore[attr-defined]
            real_start(thread)

        real_new_group = dist.new_group

        def new_group(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("backend") == "gloo":
                kwargs["backend"] = "threaded"
            pg = real_new_group(*args, **kwargs)
            if isinstance(pg, mtpg.ProcessLocalGroup):
                pg._bench_name = mtpg.ProcessLocalGroup.pg_name.fget(pg)  # type: ignore[attr-defined]
            return pg

        real_pg_name = mtpg.ProcessLocalGroup.pg_name

        def pg_name(pg: Any) -> str:
            try:
                return real_pg_name.fget(pg)
            except KeyError:
                return pg._bench_name

        self._saved = (real_start, real_new_group, real_pg_name)
        threading.Thread.start = start  # type: ignore[method-assign]
        dist.new_group = new_group
        mtpg.ProcessLocalGroup.pg_name = property(pg_name)
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        real_start, real_new_group, real_pg_name = self._saved
        threading.Thread.start = real_start  # type: ignore[method-assign]
        dist.new_group = real_new_group
        self.mtpg.ProcessLocalGroup.pg_name = real_pg_name
        self.mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        self._installed = False

    def run(self, world: int, fn: Callable[[int], Any], timeout_s: float = 3600.0) -> list[Any]:
        """``fn(rank)`` on ``world`` threads, each rank of one threaded process group; every rank's
        result, or the first failure raised."""
        self.install()
        self.mtpg.ProcessLocalGroup.reset()
        store = dist.HashStore()
        results: list[Any] = [None] * world
        failures: list[tuple[int, BaseException]] = []
        self._failures = failures

        def main(rank: int) -> None:
            threading.current_thread()._bench_rank = rank  # type: ignore[attr-defined]
            RANK_MAIN[rank] = threading.current_thread()
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - reported by the caller, the other ranks woken
                self._fail(rank, exc)
            finally:
                dist.destroy_process_group()

        RANK_THREADS.clear()
        RANK_MAIN.clear()
        threads = [threading.Thread(target=main, args=(r,), name=f"rank-{r}") for r in range(world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"a world of {world} thread-ranks did not finish in {timeout_s:.0f} s")
        if failures:
            # The ranks the first failure stopped raise SystemExit from their collectives: the
            # failure that stopped them is the one to report.
            first = [f for f in failures if not isinstance(f[1], SystemExit)] or failures
            rank, exc = sorted(first, key=lambda f: f[0])[0]
            raise RuntimeError(f"rank {rank} of {world} failed: {type(exc).__name__}: {exc}") from exc
        return results


RANK_THREADS: dict[int, list[threading.Thread]] = {}
RANK_MAIN: dict[int, threading.Thread] = {}


def thread_cpu(thread: threading.Thread) -> float:
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, ProcessLookupError):
        return 0.0


def background_cpu(rank: int) -> float:
    """CPU seconds so far of the threads the rank's thread started (its store's loop and workers);
    threads that ended take their seconds with them, which is why they are read at each phase."""
    return sum(thread_cpu(t) for t in RANK_THREADS.get(rank, []))


# ------------------------------------------------------------------------------------------ counting


class _Calls:
    """Python and C function calls made on one thread, counted by its profile hook."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def hit(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.n += 1


def _first_call(frame: Any, event: str, arg: Any) -> None:
    # Each thread's first profile event gives it a counter of its own, so counting takes no lock
    # and a rank's calls are the sum over the threads that are its own (RANK_MAIN, RANK_THREADS).
    calls = _Calls()
    threading.current_thread()._bench_calls = calls  # type: ignore[attr-defined]
    sys.setprofile(calls.hit)
    calls.hit(frame, event, arg)


COUNTING_CALLS = False


def count_calls() -> None:
    """Count every function call of every thread started from now on (``--count-calls``).

    A call count is the work a rank's code does, whatever the load: CPU clocks of thread-ranks
    sharing two cores and one interpreter grow with the number of threads (GIL hand-offs, caches)
    even where the code's work does not, and the count separates the two. The hook slows every
    call several times, so a counting run's CPU figures are not figures."""
    global COUNTING_CALLS
    COUNTING_CALLS = True
    threading.setprofile(_first_call)


def rank_calls(rank: int) -> int:
    threads = [RANK_MAIN[rank]] if rank in RANK_MAIN else []
    return sum(getattr(t, "_bench_calls", _Calls()).n for t in threads + RANK_THREADS.get(rank, []))


class Meter:
    """Metadata bytes per rank, counted at ckptstore's Group, and bytes read per rank."""

    OBJECT_OPS = {"all_gather_object", "gather_object", "broadcast_object_list", "send_object_list",
                  "recv_object_list", "scatter_object_list"}

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[int, dict[str, float]] = {}
        self.tls = threading.local()

    def reset(self) -> None:
        self.counts = {}

    def add(self, rank: int, **values: float) -> None:
        with self.lock:
            c = self.counts.setdefault(rank, {})
            for k, v in values.items():
                c[k] = c.get(k, 0) + v

    def snapshot(self, rank: int) -> dict[str, float]:
        with self.lock:
            out = dict(self.counts.get(rank, {}))
        if COUNTING_CALLS:
            out["calls"] = rank_calls(rank)
        return out

    def overhead(self, rank: int) -> float:
        return self.snapshot(rank).get("overhead_cpu_s", 0.0)


METER = Meter()


def current_rank() -> int:
    return getattr(threading.current_thread(), "_bench_rank", -1)


class CountingDist:
    """``torch.distributed`` as ckptstore's Group sees it, counting what each collective moves."""

    TENSOR_OPS = {"all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "gather", "scatter", "send",
                  "recv", "isend", "irecv", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                  "all_to_all_single", "batch_isend_irecv", "reduce"}

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._real, name)
        if name in Meter.OBJECT_OPS:
            return self._objects(name, fn)
        if name in self.TENSOR_OPS:
            return self._tensors(name, fn)
        return fn

    def _objects(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tls = METER.tls
            tls.op, tls.sent, tls.decoded = name, [], []
            try:
                return fn(*args, **kwargs)
            finally:
                t = time.thread_time()
                sent, decoded = tls.sent, tls.decoded
                tls.op = None
                own = sent[0] if sent and name in ("all_gather_object", "gather_object") and decoded else 0
                wire = max(decoded, default=0) * len(decoded) if name == "all_gather_object" else sum(decoded)
                METER.add(current_rank(), meta_sent_bytes=sum(sent), meta_recv_bytes=sum(decoded) - own,
                          meta_wire_recv_bytes=max(0, wire - own), collectives=1,
                          overhead_cpu_s=time.thread_time() - t)
        return call

    def _tensors(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            nbytes = 0
            for a in [*args, *kwargs.values()]:
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if isinstance(t, torch.Tensor):
                        nbytes += t.numel() * t.element_size()
            METER.add(current_rank(), meta_tensor_bytes=nbytes, collectives=1)
            return out
        return call


class CountingSource:
    """A chunk file's Source that counts the bytes read through it for the rank that opened it."""

    def __init__(self, real: Any, rank: int) -> None:
        self._real, self._rank = real, rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _count(self, n: int) -> None:
        METER.add(self._rank, read_bytes=n, reads=1)

    def memory(self) -> None:
        # A RAM slot mapped in this process would be copied from by slicing, which nothing here can
        # count: the harness reads it through readinto instead (the same bytes, counted).
        return None

    def readinto(self, offset: int, out: memoryview) -> None:
        self._count(len(out))
        self._real.readinto(offset, out)

    def read(self, offset: int, length: int) -> bytes:
        self._count(length)
        return self._real.read(offset, length)

    def readv_into(self, offset: int, bufs: list[memoryview]) -> None:
        self._count(sum(len(b) for b in bufs))
        self._real.readv_into(offset, bufs)

    def read_many(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        self._count(sum(n for _, n in ranges))
        return self._real.read_many(ranges)


PEAKS: dict[int, int] = {}  # rank -> the largest round of the cooperative reads of its last load


def install_counters() -> None:
    """Wrap the collectives ckptstore's Group issues, and the chunk reads of every load and restore
    (all of them go through ``read_targets``), in this process only."""
    if getattr(install_counters, "done", False):
        return
    c10d = dist.distributed_c10d
    real_o2t, real_t2o = c10d._object_to_tensor, c10d._tensor_to_object

    def object_to_tensor(obj: Any, device: Any, group: Any) -> Any:
        out = real_o2t(obj, device, group)
        if getattr(METER.tls, "op", None):
            METER.tls.sent.append(int(out[0].numel()))
        return out

    def tensor_to_object(tensor: Any, size: Any, group: Any) -> Any:
        if getattr(METER.tls, "op", None):
            METER.tls.decoded.append(int(size))
        return real_t2o(tensor, size, group)

    c10d._object_to_tensor, c10d._tensor_to_object = object_to_tensor, tensor_to_object

    # Every Group gets the counting stand-in, however it is made (its constructor or solo()).
    real_init = _collective.Group.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self._dist = CountingDist(dist)

    _collective.Group.__init__ = init  # type: ignore[method-assign]
    if isinstance(_collective.Group.__dict__.get("solo"), classmethod):
        real_solo = _collective.Group.__dict__["solo"].__func__

        def solo(cls: Any, *args: Any, **kwargs: Any) -> Any:
            group = real_solo(cls, *args, **kwargs)
            group._dist = CountingDist(dist)
            return group

        _collective.Group.solo = classmethod(solo)  # type: ignore[method-assign, assignment]

    real_read_targets = _sharded.read_targets

    def read_targets(where: str, open_file: Any, *args: Any, **kwargs: Any) -> Any:
        rank = current_rank()
        return real_read_targets(where, lambda rel: CountingSource(open_file(rel), rank), *args, **kwargs)

    _sharded.read_targets = read_targets  # load_manifest and the restore call it through the module
    install_restore_phases()
    real_read_small = _sharded.Directory.read_small

    def read_small(self: Any, rel: str) -> bytes:
        body = real_read_small(self, rel)
        METER.add(current_rank(), manifest_read_bytes=len(body))
        return body

    _sharded.Directory.read_small = read_small  # type: ignore[method-assign]
    try:
        from ckptstore.checkpoint import coop as _coop
    except ImportError:  # the code before cooperative reads
        _coop = None
    if _coop is not None:
        # A load's exchange makes only this rank's part of the plan (coop.read; the code before
        # session 10 made the whole plan on every rank, coop.plan): either holds this rank's peak.
        def peak(real: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = real(*args, **kwargs)
                rank = current_rank()
                if out is not None and rank < len(out.peak_bytes):
                    PEAKS[rank] = max(PEAKS.get(rank, 0), out.peak_bytes[rank])
                return out
            return wrapped

        if hasattr(_coop, "read"):
            _coop.read = peak(_coop.read)
        else:
            _coop.plan = peak(_coop.plan)
    install_counters.done = True  # type: ignore[attr-defined]


RESTORE_PHASES = {  # Restorer's steps of a restore -> the figure their trainer-thread CPU goes to
    "_held_steps": "restore_list_cpu_s",  # the steps every tier of every node holds
    "_inventory": "restore_inventory_cpu_s",  # what this node holds of the step (documents parsed)
    "get_manifest": "restore_plan_cpu_s",  # the manifest planned from the rank's own part
    "chunks_needed": "restore_plan_cpu_s",  # the files the load reads, fetched where the node lacks them
    "_load": "restore_load_cpu_s",  # the load: reads, checks and copies into the state
}


def install_restore_phases() -> None:
    """Time each step of a restore on the thread that runs it (thread CPU, per rank), by wrapping
    the Restorer's methods and the functions restore.py calls by name; a step a version of the code
    lacks is left out."""
    from ckptstore.engine import restore as _restore

    def timed(fn: Callable[..., Any], figure: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                METER.add(current_rank(), **{figure: time.thread_time() - t})
        return call

    for name, figure in RESTORE_PHASES.items():
        owner: Any = _restore.Restorer if hasattr(_restore.Restorer, name) else _restore
        fn = getattr(owner, name, None)
        if fn is not None:
            setattr(owner, name, timed(fn, figure))


# ------------------------------------------------------------------------------------------ states


def mesh_of(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def dtensor(local: torch.Tensor, mesh: Any, placement: Any, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)


def chunk_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's cut of ``n`` into ``parts`` (DTensor's Shard): (start, length) of part ``i``."""
    size = -(-n // parts)
    start = min(n, size * i)
    return start, max(0, min(n, start + size) - start)


def fill(rank: int, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, (rank * 7 + i) % 251, dtype=dtype)


# ------------------------------------------------------------------------------------------ cells


def summary(per_rank: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    values = [r[key] for r in per_rank if key in r]
    if not values:
        return None
    rest = [r[key] for r in per_rank[1:] if key in r] or values
    return {"median": statistics.median(rest), "max": max(rest), "rank0": per_rank[0].get(key, values[0])}


# Thread-ranks per simulated node in the store cells (0: every rank on one node, as before). Each
# node has a RAM directory and a local directory of its own, so what a rank finds of its node (the
# restore's inventory, the local manifest) covers its node's ranks, as on a cluster, not the world.
RANKS_PER_NODE = 0


def store_cell(world: int, tensors: int, tmp: str, saves: int = 3) -> dict[str, Any]:
    """CheckpointStore with a RAM and a local tier: ``saves`` saves of one structure, then restore."""
    from torch.distributed.tensor import Shard

    from ckptstore import CheckpointStore

    job = f"benchranks-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the pid: a test finds what this run left
    per_node = RANKS_PER_NODE if 0 < RANKS_PER_NODE < world else world
    nodes = -(-world // per_node)

    def node_dirs(rank: int) -> tuple[str, str]:
        if nodes == 1:
            return os.path.join(tmp, "local"), "/dev/shm"
        node = rank // per_node
        return os.path.join(tmp, f"local-n{node}"), os.path.join("/dev/shm", f"{job}-n{node}")
    rows, cols = 2 * world, 8
    shape = (rows, cols)
    manifest_info: dict[str, Any] = {}

    def rank_main(rank: int) -> dict[str, Any]:
        me = threading.current_thread()
        mesh = mesh_of(world)
        local_dir, ram_dir = node_dirs(rank)
        os.makedirs(ram_dir, exist_ok=True)
        where = {} if nodes == 1 else {"ram_dir": ram_dir, "node": f"n{rank // per_node}"}
        start, n = chunk_range(rows, world, rank)
        state = {f"layers.{i}.w": dtensor(fill(rank, i, (n, cols), torch.float32), mesh, Shard(0), shape)
                 for i in range(tensors)}
        out: dict[str, Any] = {}
        late: list[int] = []
        with CheckpointStore(job, local=local_dir, keep_local=2, ram_budget_bytes=None, **where) as store, \
                WORLD.failing_together():
            for step in range(1, saves + 1):
                marks: dict[str, tuple[float, float, dict[str, float]]] = {}

                def mark(name: str, marks: dict[str, Any] = marks, step: int = step) -> None:
                    marks[name] = (thread_cpu(me), background_cpu(rank), METER.snapshot(rank))
                    if name == "ram" and threading.current_thread() is me:
                        late.append(step)

                mark("start")
                t = time.perf_counter()
                handle = store.save(step, state)
                wall = time.perf_counter() - t
                mark("saved")
                # The RAM commit's future, to read the clocks the moment it resolves (on the store's loop,
                # before the local tier starts); without it, after wait("ram"), a little late.
                ram = getattr(handle, "_futures", {}).get("ram")
                if ram is not None:
                    ram.add_done_callback(lambda _f: mark("ram"))
                else:
                    handle.wait("ram")
                    mark("ram")
                handle.wait("local")
                mark("local")
                first = step == 1
                prefix = "first_" if first else ""
                if not first and step != saves:
                    continue
                (c0, b0, m0), (c1, b1, m1) = marks["start"], marks["saved"]
                c2, b2, m2 = marks.get("ram", marks["saved"])
                c3, b3, m3 = marks["local"]
                oh = lambda a, b: b.get("overhead_cpu_s", 0.0) - a.get("overhead_cpu_s", 0.0)  # noqa: E731
                out[f"{prefix}save_cpu_s"] = c1 - c0 - oh(m0, m1)
                out[f"{prefix}save_wall_s"] = wall
                out[f"{prefix}ram_commit_cpu_s"] = max(0.0, b2 - b0)
                out[f"{prefix}local_commit_cpu_s"] = max(0.0, b3 - b2)
                out[f"{prefix}control_plane_cpu_s"] = out[f"{prefix}save_cpu_s"] + out[f"{prefix}ram_commit_cpu_s"]
                if COUNTING_CALLS:
                    out[f"{prefix}save_calls"] = m1["calls"] - m0["calls"]
                    out[f"{prefix}control_plane_calls"] = m2["calls"] - m0["calls"]
                for k in ("meta_sent_bytes", "meta_recv_bytes", "meta_wire_recv_bytes", "meta_tensor_bytes",
                          "collectives"):
                    out[f"{prefix}{k}"] = m3.get(k, 0) - m0.get(k, 0)
                    out[f"{prefix}blocking_{k}"] = m1.get(k, 0) - m0.get(k, 0)
                    out[f"{prefix}ram_{k}"] = m2.get(k, 0) - m1.get(k, 0)
                out["ram_mark_late"] = step in late
            segs = glob.glob(os.path.join(ram_dir, f"ckptstore-{job}-r{rank:05d}-s*.json"))
            out["ram_manifest_bytes"] = max((os.path.getsize(p) for p in segs), default=0)
            # Restore the last step into fresh tensors of the same layout.
            target = {k: dtensor(torch.zeros(n, cols), mesh, Shard(0), shape) for k in state}
            dist.barrier()
            c0, b0, m0 = thread_cpu(me), background_cpu(rank), METER.snapshot(rank)
            found = store.restore(target)
            c1, b1, m1 = thread_cpu(me), background_cpu(rank), METER.snapshot(rank)
            if found != saves or not all(torch.equal(target[k].to_local(), state[k].to_local()) for k in state):
                raise AssertionError(f"rank {rank}: the restore of step {saves} is not bitwise equal to what was saved")
            out["restore_cpu_s"] = c1 - c0 + b1 - b0 - (m1.get("overhead_cpu_s", 0) - m0.get("overhead_cpu_s", 0))
            out["restore_read_bytes"] = m1.get("read_bytes", 0) - m0.get("read_bytes", 0)
            if COUNTING_CALLS:
                out["restore_calls"] = m1["calls"] - m0["calls"]
            for figure in sorted(set(RESTORE_PHASES.values())):
                out[figure] = m1.get(figure, 0.0) - m0.get(figure, 0.0)
            out["restore_meta_recv_bytes"] = m1.get("meta_recv_bytes", 0) - m0.get("meta_recv_bytes", 0)
            # Tensor collectives (flags, the restore's all_to_alls of box names and chunks): the
            # buffers handed to them, sent and received alike, so an upper bound on what was received.
            out["restore_meta_tensor_bytes"] = m1.get("meta_tensor_bytes", 0) - m0.get("meta_tensor_bytes", 0)
            out["own_bytes"] = sum(t.to_local().numel() * 4 for t in state.values())
            if rank == world // 2 and nodes == 1:  # several nodes' local directories hold parts, no manifest
                # The local tier commits a format 2.0 manifest (part files named, not chunks), which
                # parse_manifest refuses: read_manifest assembles it from the parts, as a load does.
                path = os.path.join(local_dir, f"step-{saves:012d}")
                read0 = METER.snapshot(rank).get("manifest_read_bytes", 0)
                t = time.thread_time()
                manifest = _sharded.read_manifest(_sharded.Directory(path, None))
                out["manifest_parse_cpu_s"] = time.thread_time() - t
                t = time.thread_time()
                _sharded.chunks_needed(target, manifest, path, rank, world)
                out["load_plan_cpu_s"] = time.thread_time() - t
                # What load_sharded plans with when the step has its index (a store's tiers write
                # one): the index and this rank's own part, not the assembled manifest above.
                from ckptstore.checkpoint.index import plan_spread
                t = time.thread_time()
                own = plan_spread(_sharded.Directory(path, None).read_small, target, rank, world, path)
                out["index_plan_cpu_s"] = time.thread_time() - t
                if own is None or own.planned != "own":
                    raise AssertionError(f"rank {rank}: the step's index did not plan its own part ({own})")
                manifest_info.update(manifest_bytes=os.path.getsize(os.path.join(path, "manifest.json")),
                                     manifest_read_bytes=METER.snapshot(rank).get("manifest_read_bytes", 0) - read0,
                                     checkpoint_bytes=sum(e.nbytes for e in manifest.tensors.values()))
            dist.barrier()
        return out

    try:
        per_rank = WORLD.run(world, rank_main)
    except BaseException:
        # A failed rank's store closes without releasing its RAM segments (its close stopped in a
        # collective): they would stay in /dev/shm. A store that succeeded removes its own, which
        # the tests check, so this is the failure's path only.
        for seg in glob.glob(f"/dev/shm/ckptstore-{job}-*") + glob.glob(f"/dev/shm/{job}-n*/ckptstore-{job}-*"):
            with contextlib.suppress(OSError):
                os.remove(seg)
        raise
    finally:
        for d in glob.glob(f"/dev/shm/{job}-n*"):
            shutil.rmtree(d, ignore_errors=True)
    manifest_info["ranks_per_node"] = per_node
    return finish_cell("store", world, tensors, per_rank, manifest_info)


def sharded_cell(world: int, tensors: int, tmp: str) -> dict[str, Any]:
    """save_sharded of Shard(0) DTensors, then load_sharded into Shard(1) and into an uneven Shard(0)."""
    from torch.distributed.tensor import Replicate, Shard

    from ckptstore import load_sharded, save_sharded
    from ckptstore.checkpoint.sharded import GlobalBox

    rows, cols = 2 * world, world
    shape = (rows, cols)
    info: dict[str, Any] = {}
    where = os.path.join(tmp, "sharded")

    def rank_main(rank: int) -> dict[str, Any]:
        me = threading.current_thread()
        mesh = mesh_of(world)
        start, n = chunk_range(rows, world, rank)
        state = {f"layers.{i}.w": dtensor(fill(rank, i, (n, cols), torch.uint8), mesh, Shard(0), shape)
                 for i in range(tensors)}
        out: dict[str, Any] = {}
        for attempt in ("warm", "timed"):
            url = f"{where}-{attempt}"
            c0, m0 = thread_cpu(me), METER.snapshot(rank)
            save_sharded(state, url)
            c1, m1 = thread_cpu(me), METER.snapshot(rank)
        out["save_cpu_s"] = c1 - c0 - (m1.get("overhead_cpu_s", 0) - m0.get("overhead_cpu_s", 0))
        if COUNTING_CALLS:
            out["save_calls"] = m1["calls"] - m0["calls"]
        for k in ("meta_sent_bytes", "meta_recv_bytes", "meta_wire_recv_bytes"):
            out[f"save_{k}"] = m1.get(k, 0) - m0.get(k, 0)
        url = f"{where}-timed"
        # The loads: column slices of the saved row slabs, and rows cut as by a world of one rank less.
        c_start, c_n = chunk_range(cols, world, rank)
        u_start, u_n = chunk_range(rows, world - 1, rank) if rank < world - 1 else (0, 0)
        loads = {
            "shard1": lambda: {k: dtensor(torch.zeros(rows, c_n, dtype=torch.uint8), mesh, Shard(1), shape)
                               for k in state},
            "shard0_uneven": lambda: {k: GlobalBox(torch.zeros(u_n, cols, dtype=torch.uint8) if u_n else None,
                                                   (u_start, 0), shape, torch.uint8) for k in state},
            "replicate": lambda: {k: dtensor(torch.zeros(rows, cols, dtype=torch.uint8), mesh, Replicate(), shape)
                                  for k in state},
        }
        for name, make in loads.items():
            target = make()
            dist.barrier()
            PEAKS.pop(rank, None)
            c0, m0 = thread_cpu(me), METER.snapshot(rank)
            load_sharded(target, url)
            c1, m1 = thread_cpu(me), METER.snapshot(rank)
            # What the exchange holds at once on this rank (read + sent + received in its fullest
            # round; the code before it has none): the rank's peak beyond what read_targets stages.
            out[f"{name}_exchange_peak_bytes"] = PEAKS.get(rank, 0)
            for i, (k, v) in enumerate(target.items()):
                got = v.to_local() if hasattr(v, "to_local") else v.tensor
                if got is None:
                    continue
                lo, length = (u_start, u_n) if name == "shard0_uneven" else (0, rows)
                want = torch.cat([fill(r, i, (chunk_range(rows, world, r)[1], cols), torch.uint8)
                                  for r in range(world)])[lo:lo + length]
                if name == "shard1":
                    want = want[:, c_start:c_start + c_n]
                if not torch.equal(got, want):
                    raise AssertionError(f"rank {rank}: {name} load of {k} is not bitwise equal to what was saved")
                if i >= 3:
                    break  # a few keys checked per rank: the check is not the benchmark
            out[f"{name}_cpu_s"] = c1 - c0 - (m1.get("overhead_cpu_s", 0) - m0.get("overhead_cpu_s", 0))
            out[f"{name}_read_bytes"] = m1.get("read_bytes", 0) - m0.get("read_bytes", 0)
            if COUNTING_CALLS:
                out[f"{name}_calls"] = m1["calls"] - m0["calls"]
            out[f"{name}_manifest_read_bytes"] = m1.get("manifest_read_bytes", 0) - m0.get("manifest_read_bytes", 0)
            out[f"{name}_meta_recv_bytes"] = m1.get("meta_recv_bytes", 0) - m0.get("meta_recv_bytes", 0)
            if rank == world // 2:
                directory = _sharded.Directory(url, None)
                t = time.thread_time()
                manifest = _sharded.read_manifest(directory)
                out["manifest_parse_cpu_s"] = time.thread_time() - t
                t = time.thread_time()
                _sharded.chunks_needed(target, manifest, url, rank, world)
                out[f"{name}_plan_cpu_s"] = time.thread_time() - t
                info.update(manifest_bytes=os.path.getsize(os.path.join(url, "manifest.json")),
                            checkpoint_bytes=sum(e.nbytes for e in manifest.tensors.values()))
        dist.barrier()
        return out

    per_rank = WORLD.run(world, rank_main)
    cell = finish_cell("sharded", world, tensors, per_rank, info)
    for name in ("shard1", "shard0_uneven", "replicate"):
        total = sum(r[f"{name}_read_bytes"] for r in per_rank)
        cell[f"{name}_read_bytes_all_ranks"] = total
        cell[f"{name}_read_ratio"] = total / max(1, info["checkpoint_bytes"])
    return cell


def finish_cell(kind: str, world: int, tensors: int, per_rank: list[dict[str, Any]],
                info: dict[str, Any]) -> dict[str, Any]:
    keys = sorted({k for r in per_rank for k in r if isinstance(r[k], (int, float)) and not isinstance(r[k], bool)})
    cell: dict[str, Any] = {"kind": kind, "world": world, "tensors": tensors, **info,
                            "per_rank": {k: summary(per_rank, k) for k in keys}}
    if kind == "store" and world > 1 and not any(r.get("collectives") for r in per_rank):
        # Counting happens where ckptstore's Group calls torch.distributed (self._dist); a Group that
        # stopped going through it would make every metadata figure read zero, not small.
        cell["warning"] = "no collective was counted: Group no longer calls torch.distributed through self._dist"
        print(f"WARNING: {kind} {world}x{tensors}: {cell['warning']}", flush=True)
    late = sum(1 for r in per_rank if r.get("ram_mark_late"))
    if late:
        cell["note"] = (f"{late} rank(s) saw their RAM commit end before save() returned: their background split "
                        "(RAM commit / local) is approximate")
    return cell


def plan_cell(ranks: int, tensors: int) -> dict[str, Any]:
    """The pure planning code on synthesized parts of ``ranks`` ranks, each holding a Shard(0) slice
    of ``tensors`` tensors of shape (2 x ranks, ranks): what every rank builds, parses and plans."""
    from ckptstore.checkpoint.sharded import GlobalBox, build_manifest, chunks_needed, merge_structures, union_verdict

    rows, cols = 2 * ranks, ranks
    keys = [f"layers.{i}.w" for i in range(tensors)]
    tree = {k: {"$tensor": k} for k in keys}
    table = {k: ("uint8", (rows, cols)) for k in keys}
    parts = []
    for r in range(ranks):
        start, n = chunk_range(rows, ranks, r)
        chunks = {k: [{"offsets": [start, 0], "sizes": [n, cols], "file": f"data/rank-{r:05d}.bin",
                       "offset": i * n * cols, "length": n * cols, "codec": "raw", "checksum": f"xxh3_64:{r:08x}{i:08x}",
                       "block_size": None, "block_checksums": None}] for i, k in enumerate(keys)}
        parts.append({"rank": r, "host": "h", "pid": 1, "bytes": n * cols * tensors, "chunks": chunks,
                      "timings": {}})
    out: dict[str, Any] = {"kind": "plan", "world": ranks, "tensors": tensors}
    big = ranks * tensors >= 100_000  # a full collection costs more than a small cell itself
    if big:
        gc.collect()
    t = time.thread_time()
    manifest = build_manifest(tree, table, parts, ranks)
    out["build_manifest_cpu_s"] = time.thread_time() - t
    del parts
    t = time.thread_time()
    body = manifest.to_json_bytes()
    out["manifest_encode_cpu_s"] = time.thread_time() - t
    out["manifest_bytes"] = len(body)
    del manifest
    if big:
        gc.collect()
    t = time.thread_time()
    manifest = parse_manifest(body, where="synthesized")
    out["manifest_parse_cpu_s"] = time.thread_time() - t
    del body
    rank = ranks // 2
    c_start, c_n = chunk_range(cols, ranks, rank)
    u_start, u_n = chunk_range(rows, ranks - 1, rank)
    for name, target in (
        ("shard1", {k: GlobalBox(torch.empty(rows, c_n, dtype=torch.uint8), (0, c_start), (rows, cols), torch.uint8)
                    for k in keys}),
        ("shard0_uneven", {k: GlobalBox(torch.empty(u_n, cols, dtype=torch.uint8), (u_start, 0), (rows, cols),
                                        torch.uint8) for k in keys}),
    ):
        t = time.thread_time()
        needed = chunks_needed(target, manifest, "synthesized", rank, ranks)
        out[f"{name}_plan_cpu_s"] = time.thread_time() - t
        out[f"{name}_chunks_read"] = len(needed)
    del manifest
    # The coordinator's agreement: pipeline stages of 8 ranks, each stage holding its own keys.
    stages = max(1, ranks // 8)
    per_stage = max(1, tensors // stages)
    tables = [(s * 8, f"d{s}", {f"s{s}.{k}": ("uint8", [rows, cols], "all") for k in keys[:per_stage]})
              for s in range(stages)]
    shared = [(s * 8, {"tree": {k: {"$tensor": k} for k in tab},
                       "tensors": {k: (v[0], tuple(v[1])) for k, v in tab.items()}}) for s, (_, _, tab) in
              enumerate(tables)]
    t = time.thread_time()
    union_verdict(tables)
    merge_structures(shared, "synthesized")
    out["agree_merge_cpu_s"] = time.thread_time() - t
    out["agree_stages"] = stages
    return out


def index_cell(ranks: int, tensors: int) -> dict[str, Any]:
    """The index beside a durable manifest (checkpoint/index.py) at ``ranks`` ranks, each holding a
    Shard(0) slice of ``tensors`` tensors of shape (2 x ranks, 64): the coordinator's build of it,
    its size, and one rank's plan at the layout it saved (index parse, its own part, the plan),
    with the bytes it reads. The manifest itself is not built (at these sizes it is gigabytes):
    the coordinator is given the tensor table and every rank's part, as a commit has them."""
    from ckptstore.checkpoint.index import build_index, plan_from_index
    from ckptstore.checkpoint.sharded import GlobalBox
    from ckptstore.format.checksum import checksum
    from ckptstore.format.manifest import Manifest, TensorEntry
    from ckptstore.names import INDEX

    rows, cols = 2 * ranks, 64
    keys = [f"layers.{i}.w" for i in range(tensors)]
    rank = ranks // 2

    def part_of(r: int) -> dict[str, Any]:
        start, n = chunk_range(rows, ranks, r)
        return {k: [{"offsets": [start, 0], "sizes": [n, cols], "file": f"data/rank-{r:05d}.bin",
                     "offset": i * n * cols, "length": n * cols, "codec": "raw",
                     "checksum": f"xxh3_64:{r:08x}{i:08x}", "block_size": None, "block_checksums": None}]
                for i, k in enumerate(keys)}

    own = json.dumps({"rank": rank, "chunks": part_of(rank)}, separators=(",", ":")).encode()
    shared_chunks = {k: [] for k in keys}  # every other rank's part, as the coordinator walks it: its keys
    parts = [{"rank": r, "chunks": part_of(r) if r == rank else shared_chunks, "part_file": f"parts/rank-{r:05d}.json",
              "part_checksum": checksum(own) if r == rank else "xxh3_64:0000000000000000"} for r in range(ranks)]
    header = Manifest(kind="sharded", tensors={k: TensorEntry("uint8", (rows, cols)) for k in keys},
                      tree={k: {"$tensor": k} for k in keys}, meta={"world_size": ranks})
    out: dict[str, Any] = {"kind": "index", "world": ranks, "tensors": tensors}
    t = time.thread_time()
    body = build_index(header, parts, "xxh3_64:0000000000000000")
    out["index_build_cpu_s"] = time.thread_time() - t
    assert body is not None
    del parts, shared_chunks
    out["index_bytes"] = len(body)
    out["own_part_bytes"] = len(own)
    files = {INDEX: body, f"parts/rank-{rank:05d}.json": own}
    read: dict[str, int] = {}

    def reader(rel: str) -> bytes:
        read[rel] = read.get(rel, 0) + len(files[rel])  # a KeyError: a part this rank must not need
        return files[rel]

    start, n = chunk_range(rows, ranks, rank)
    target = {k: GlobalBox(torch.empty(n, cols, dtype=torch.uint8), (start, 0), (rows, cols), torch.uint8)
              for k in keys}
    gc.collect()
    t = time.perf_counter()
    c = time.thread_time()
    planned = plan_from_index(reader, target, rank, ranks, "synthesized")
    out["index_plan_cpu_s"] = time.thread_time() - c
    out["index_plan_s"] = time.perf_counter() - t
    assert planned is not None and all(len(planned.tensors[k].chunks) == 1 for k in keys)
    out["index_plan_read_bytes"] = sum(read.values())
    return out


def commit_cell(ranks: int, tensors: int, tmp: str) -> dict[str, Any]:
    """The durable coordinator's commit at ``ranks`` ranks, each holding a Shard(0) slice of
    ``tensors`` tensors of shape (2 x ranks, 64), on synthesized parts, no collectives: what it
    receives (each rank's message pickled by its sender, as a gather does, and unpickled here: the
    gather's cost at the coordinator), the manifest's build, encoding and parse-back (never commit
    what a reader would refuse), and its write (a file on ``tmp``, fsynced). With format 2.0 a rank
    sends a summary of its part (``part_summary``, timed on one rank: every rank pays it, in
    parallel), the coordinator builds the manifest that names the part files, and one rank's plan
    from that manifest and its own part is timed too. Before it (the code of main 11adc5d, which
    has no ``part_summary``), a rank sends its whole part and the coordinator builds the manifest of
    every chunk and the index beside it."""
    import pickle

    from ckptstore.checkpoint import sharded as _sh
    from ckptstore.checkpoint.index import build_index, plan_from_index
    from ckptstore.checkpoint.sharded import GlobalBox
    from ckptstore.format.checksum import checksum
    from ckptstore.format.manifest import layout_digest, parse_manifest
    from ckptstore.names import INDEX, MANIFEST

    parted = hasattr(_sh, "part_summary")
    rows, cols = 2 * ranks, 64
    keys = [f"layers.{i}.w" for i in range(tensors)]
    rank = ranks // 2

    def part_of(r: int) -> dict[str, Any]:
        start, n = chunk_range(rows, ranks, r)
        chunks = {k: [{"offsets": [start, 0], "sizes": [n, cols], "file": f"data/rank-{r:05d}.bin",
                       "offset": i * n * cols, "length": n * cols, "codec": "raw",
                       "checksum": f"xxh3_64:{r:08x}{i:08x}", "block_size": None, "block_checksums": None}]
                  for i, k in enumerate(keys)}
        return {"rank": r, "world_size": ranks, "host": "node", "pid": 1000 + r, "bytes": n * cols * tensors,
                "chunks": chunks, "timings": {"write_s": 0.1, "stage_s": 0.01, "hash_s": 0.01}}

    own_part = part_of(rank)
    own_body = json.dumps(own_part, separators=(",", ":")).encode()
    shared = {"tree": {k: {"$tensor": k} for k in keys}, "tensors": {k: ("uint8", (rows, cols)) for k in keys},
              "layouts": None}
    out: dict[str, Any] = {"kind": "commit", "world": ranks, "tensors": tensors, "format": "2.0" if parted else "1.x"}
    messages: list[bytes] = []
    if parted:
        from ckptstore.engine.pipeline import parted_step_manifest
        from ckptstore.format.manifest import parse_sharded

        t = time.thread_time()
        mine = _sh.part_summary({**own_part, "part_file": f"parts/rank-{rank:05d}.json",
                                 "part_size": len(own_body), "part_checksum": checksum(own_body)})
        out["rank_summary_cpu_s"] = time.thread_time() - t
        for r in range(ranks):
            # Ranks of one Shard(0) structure differ in their numbers, not in their summary's shape;
            # rank 0 holds the origin of every tensor.
            start, n = chunk_range(rows, ranks, r)
            summary = {**mine, "rank": r, "pid": 1000 + r, "bytes": n * cols * tensors,
                       "part_file": f"parts/rank-{r:05d}.json", "layout": f"xxh3_64:{r:016x}",
                       "origin": [(k, [n, cols]) for k in keys] if r == 0 else []}
            if r == rank:
                summary = mine
            messages.append(pickle.dumps(summary))
    else:
        for r in range(ranks):
            part = own_part if r == rank else part_of(r)
            messages.append(pickle.dumps({**part, "part_file": f"parts/rank-{r:05d}.json",
                                          "part_checksum": "xxh3_64:0000000000000000"}))
    out["received_bytes"] = sum(len(m) for m in messages)
    gc.collect()
    t = time.thread_time()
    received = [pickle.loads(m) for m in messages]
    out["gather_cpu_s"] = time.thread_time() - t
    del messages
    t = time.thread_time()
    if parted:
        body = parted_step_manifest(shared, received, ranks, job="bench", step=1, cadence={"durable": 0, "peer": 0})
        out["build_encode_cpu_s"] = time.thread_time() - t
        t = time.thread_time()
        parse_sharded(body, where="synthesized")
        out["parse_back_cpu_s"] = time.thread_time() - t
        index_body = None
    else:
        from ckptstore.engine.pipeline import step_manifest

        manifest = step_manifest(shared, received, ranks, job="bench", step=1, cadence={"durable": 0, "peer": 0})
        body = manifest.to_json_bytes()
        out["build_encode_cpu_s"] = time.thread_time() - t
        t = time.thread_time()
        parse_manifest(body, where="synthesized")
        out["parse_back_cpu_s"] = time.thread_time() - t
        t = time.thread_time()
        index_body = build_index(manifest, received, layout_digest(manifest))
        out["index_cpu_s"] = time.thread_time() - t
        del manifest
    del received
    out["manifest_bytes"] = len(body)
    t0, t = time.perf_counter(), time.thread_time()
    for name, data in ((MANIFEST, body), (INDEX, index_body)):
        if data is not None:
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
    out["write_cpu_s"] = time.thread_time() - t
    out["write_s"] = time.perf_counter() - t0
    out["coordinator_cpu_s"] = sum(out.get(k, 0.0) for k in ("gather_cpu_s", "build_encode_cpu_s", "parse_back_cpu_s",
                                                             "index_cpu_s", "write_cpu_s"))
    if parted:
        files = {MANIFEST: body, f"parts/rank-{rank:05d}.json": own_body}
        read: dict[str, int] = {}

        def reader(rel: str) -> bytes:
            if rel not in files:
                raise FileNotFoundError(rel)  # index.json: a format 2.0 step has none
            read[rel] = read.get(rel, 0) + len(files[rel])
            return files[rel]

        start, n = chunk_range(rows, ranks, rank)
        target = {k: GlobalBox(torch.empty(n, cols, dtype=torch.uint8), (start, 0), (rows, cols), torch.uint8)
                  for k in keys}
        gc.collect()
        t = time.thread_time()
        planned = plan_from_index(reader, target, rank, ranks, "synthesized")
        out["rank_plan_cpu_s"] = time.thread_time() - t
        assert planned is not None and all(len(planned.tensors[k].chunks) == 1 for k in keys)
        out["rank_plan_read_bytes"] = sum(read.values())
    return out


WORLD = ThreadedWorld()


# ------------------------------------------------------------------------------------------ growth


PER_RANK_FIGURES = {  # (cell kind, figure, summary, must stay flat in world size)
    "store.control_plane_cpu_s": ("store", "control_plane_cpu_s", "median", True),
    "store.save_cpu_s": ("store", "save_cpu_s", "median", True),
    "store.ram_commit_cpu_s": ("store", "ram_commit_cpu_s", "median", True),
    "store.meta_recv_bytes": ("store", "meta_recv_bytes", "median", True),
    "store.meta_sent_bytes": ("store", "meta_sent_bytes", "median", True),
    "store.coordinator_cpu_s": ("store", "control_plane_cpu_s", "rank0", False),
    "store.ram_manifest_bytes": ("store", "ram_manifest_bytes", "median", True),
    "store.load_plan_cpu_s": ("store", "load_plan_cpu_s", "rank0", True),
    "store.index_plan_cpu_s": ("store", "index_plan_cpu_s", "rank0", True),
    "store.restore_cpu_s": ("store", "restore_cpu_s", "median", True),
    "store.restore_plan_cpu_s": ("store", "restore_plan_cpu_s", "median", True),
    "store.restore_load_cpu_s": ("store", "restore_load_cpu_s", "median", True),
    "store.restore_meta_recv_bytes": ("store", "restore_meta_recv_bytes", "median", True),
    "store.restore_meta_tensor_bytes": ("store", "restore_meta_tensor_bytes", "median", True),
    "store.manifest_bytes": ("store", "manifest_bytes", None, False),
    "sharded.save_cpu_s": ("sharded", "save_cpu_s", "median", True),
    "sharded.save_meta_recv_bytes": ("sharded", "save_meta_recv_bytes", "median", True),
    "sharded.shard1_plan_cpu_s": ("sharded", "shard1_plan_cpu_s", "rank0", True),
    "sharded.shard0_uneven_plan_cpu_s": ("sharded", "shard0_uneven_plan_cpu_s", "rank0", True),
    "sharded.shard1_manifest_read_bytes": ("sharded", "shard1_manifest_read_bytes", "median", True),
    "sharded.shard1_read_ratio": ("sharded", "shard1_read_ratio", None, True),
    "sharded.shard0_uneven_read_ratio": ("sharded", "shard0_uneven_read_ratio", None, True),
    "sharded.replicate_read_ratio": ("sharded", "replicate_read_ratio", None, True),
    "sharded.shard1_exchange_peak_bytes": ("sharded", "shard1_exchange_peak_bytes", "max", True),
    "sharded.replicate_exchange_peak_bytes": ("sharded", "replicate_exchange_peak_bytes", "max", True),
    "sharded.manifest_bytes": ("sharded", "manifest_bytes", None, False),
    "plan.build_manifest_cpu_s": ("plan", "build_manifest_cpu_s", None, True),
    "plan.manifest_parse_cpu_s": ("plan", "manifest_parse_cpu_s", None, True),
    "plan.manifest_bytes": ("plan", "manifest_bytes", None, False),
    "plan.shard1_plan_cpu_s": ("plan", "shard1_plan_cpu_s", None, True),
    "plan.shard0_uneven_plan_cpu_s": ("plan", "shard0_uneven_plan_cpu_s", None, True),
    "plan.agree_merge_cpu_s": ("plan", "agree_merge_cpu_s", None, False),
    # --count-calls: the work of a rank's code in calls, which the load does not inflate.
    "store.control_plane_calls": ("store", "control_plane_calls", "median", True),
    "store.save_calls": ("store", "save_calls", "median", True),
    "store.restore_calls": ("store", "restore_calls", "median", True),
    "sharded.save_calls": ("sharded", "save_calls", "median", True),
    "sharded.shard0_uneven_calls": ("sharded", "shard0_uneven_calls", "median", True),
    # A column slice of row slabs meets every slab: one piece per rank per tensor, by the layout.
    "sharded.shard1_calls": ("sharded", "shard1_calls", "median", False),
    "sharded.replicate_calls": ("sharded", "replicate_calls", "median", False),
    "commit.coordinator_cpu_s": ("commit", "coordinator_cpu_s", None, False),
    "commit.manifest_bytes": ("commit", "manifest_bytes", None, False),
    "commit.rank_plan_cpu_s": ("commit", "rank_plan_cpu_s", None, True),
}


def value_of(cell: dict[str, Any], figure: str, which: str | None) -> float | None:
    if which is None:
        v = cell.get(figure)
    else:
        s = cell.get("per_rank", {}).get(figure)
        # The mid rank alone times the load plan; it is in "rank0" only when the world is 1.
        v = None if s is None else (s["max"] if figure.endswith("plan_cpu_s") or figure.endswith("parse_cpu_s")
                                    else max(s["max"], s["rank0"]) if figure.endswith("peak_bytes") else s[which])
    return float(v) if isinstance(v, (int, float)) else None


def fit(points: list[tuple[float, float]]) -> float | None:
    """The exponent of a power law through ``points`` (x, y), least squares on log-log."""
    import numpy as np

    pts = [(x, y) for x, y in points if x > 0 and y is not None and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    xs, ys = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(xs, ys, 1)[0])


def growth(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the exponent in world size (at the largest tensor count measured at two worlds or
    more) and in tensors per rank (at the smallest world), extrapolations, and flags."""
    out: dict[str, Any] = {}
    for name, (kind, figure, which, flat) in PER_RANK_FIGURES.items():
        mine = [c for c in cells if c.get("kind") == kind and not c.get("skipped")]
        pts = [(c["world"], c["tensors"], value_of(c, figure, which)) for c in mine]
        pts = [(w, t, v) for w, t, v in pts if v is not None]
        if not pts:
            continue
        by_t: dict[int, list[tuple[int, float]]] = {}
        by_w: dict[int, list[tuple[int, float]]] = {}
        for w, t, v in pts:
            by_t.setdefault(t, []).append((w, v))
            by_w.setdefault(w, []).append((t, v))
        t_fix = max((t for t, p in by_t.items() if len({w for w, _ in p}) >= 2), default=None)
        w_fix = min((w for w, p in by_w.items() if len({t for t, _ in p}) >= 2), default=None)
        a = fit([(float(w), v) for w, v in by_t[t_fix]]) if t_fix is not None else None
        b = fit([(float(t), v) for t, v in by_w[w_fix]]) if w_fix is not None else None
        row: dict[str, Any] = {"world_exponent": a, "world_exponent_at_tensors": t_fix, "tensor_exponent": b,
                               "tensor_exponent_at_world": w_fix, "must_stay_flat": flat}
        anchor_w, anchor_t, anchor_v = max(pts, key=lambda p: (p[0], p[1]))
        row["anchor"] = {"world": anchor_w, "tensors": anchor_t, "value": anchor_v}
        if a is not None:
            # Without a tensor sweep a cost is taken as linear in tensors per rank; a ratio of
            # bytes read to the checkpoint's does not scale with the tensors at all.
            beta = b if b is not None else (0.0 if figure.endswith("ratio") else 1.0)
            row["extrapolated"] = {
                f"{w}x{EXTRAPOLATE_TENSORS}": anchor_v * (w / anchor_w) ** a * (EXTRAPOLATE_TENSORS / anchor_t) ** beta
                for w in EXTRAPOLATE_TO}
            if b is None:
                row["extrapolation_note"] = "no tensor sweep: assumed " + (
                    "flat" if figure.endswith("ratio") else "linear") + " in tensors per rank"
        if flat and a is not None and t_fix is not None:
            ws = sorted(by_t[t_fix])
            ratio = ws[-1][1] / ws[0][1] if ws[0][1] > 0 else math.inf
            # Bytes and calls do not move with the load: a smaller rise is already the code's.
            limit = 0.1 if ("bytes" in figure or "ratio" in figure or figure.endswith("calls")) else 0.2
            if figure.endswith("read_ratio"):
                grows = any(v > 1.05 for _, v in ws)
                row["flag"] = grows and f"bytes read across ranks reach {max(v for _, v in ws):.2f}x the checkpoint (limit 1.05x)"
            else:
                grows = a > limit and ratio >= 1.5
                row["flag"] = grows and (f"grows with world size: exponent {a:.2f}, x{ratio:.1f} from {ws[0][0]} to "
                                         f"{ws[-1][0]} ranks at {t_fix} tensors per rank")
        target = TARGETS.get(name)
        if target is not None and "extrapolated" in row:
            row["target"] = target
            row["over_target_at"] = [k for k, v in row["extrapolated"].items() if v > target]
        out[name] = row
    return out


# ------------------------------------------------------------------------------------------ the run


def commit_tag() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    # The package's own newest commit says which code was measured (the harness may be newer).
    return {"commit": git("rev-parse", "HEAD"), "describe": git("log", "-1", "--format=%h %s"),
            "code_commit": git("log", "-1", "--format=%H", "--", "ckptstore"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def predicted(kind: str, world: int, tensors: int, done: list[dict[str, Any]]) -> float | None:
    """Seconds a cell should take, from the cells of its kind already run (None: nothing to go on).
    Until two cells give a fit, a run cell grows as world x world x tensors (every rank handles
    every rank's metadata) and a planning cell as world x tensors (one rank's view of the world)."""
    mine = [c for c in done if c["kind"] == kind and not c.get("skipped") and "error" not in c]
    if not mine:
        return None
    a = fit([(c["world"], c["seconds"]) for c in mine if c["tensors"] == tensors])
    b = fit([(c["tensors"], c["seconds"]) for c in mine if c["world"] == world])
    a = (1.0 if kind in ("plan", "index", "commit") else 2.0) if a is None else max(a, 0.5)
    b = 1.0 if b is None else max(b, 0.5)
    ref = max(mine, key=lambda c: c["seconds"])
    return ref["seconds"] * (world / ref["world"]) ** a * (tensors / ref["tensors"]) ** b


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    install_counters()
    if args.count_calls:
        count_calls()
    tag = commit_tag()  # at the start: what was measured, even if the checkout moves during the run
    started = time.perf_counter()
    cells: list[dict[str, Any]] = []
    jobs: list[tuple[str, int, int, float]] = []
    # Each kind gets its share of the run's budget (and what the kinds before it left unused), so
    # a slow kind cannot crowd out the others.
    for i, kind in enumerate(args.kinds):
        share = args.budget_s * (i + 1) / len(args.kinds)
        if kind == "plan":
            jobs += [("plan", w, t, share) for t in args.plan_tensors for w in args.plan_ranks]
        elif kind == "index":
            jobs += [("index", w, t, share) for t in args.index_tensors for w in args.plan_ranks]
        elif kind == "commit":
            jobs += [("commit", w, t, share) for t in args.commit_tensors for w in args.plan_ranks]
        else:
            grid = {(w, args.tensors[0]) for w in args.worlds} | {(args.worlds[0], t) for t in args.tensors}
            jobs += [(kind, w, t, share) for w, t in sorted(grid, key=lambda p: (p[0] * p[1], p[0]))]
    for kind, world, tensors, until in jobs:
        guess = predicted(kind, world, tensors, cells)
        elapsed = time.perf_counter() - started
        if guess is not None and (guess > args.cell_budget_s or elapsed + guess > until):
            cells.append({"kind": kind, "world": world, "tensors": tensors, "skipped": True,
                          "predicted_s": round(guess, 1),
                          "why": f"predicted {guess:.0f} s (cell budget {args.cell_budget_s:.0f} s, "
                                 f"{until - elapsed:.0f} s left of this kind's share of the run)"})
            print(f"{kind:8s} world {world:6d} x {tensors:6d} tensors: skipped, predicted {guess:.0f} s", flush=True)
            continue
        tmp = tempfile.mkdtemp(prefix="bench-ranks-", dir=args.dir)
        load0 = os.getloadavg()[0]
        t = time.perf_counter()
        c = time.process_time()
        try:
            METER.reset()
            if kind == "store":
                cell = store_cell(world, tensors, tmp)
            elif kind == "sharded":
                cell = sharded_cell(world, tensors, tmp)
            elif kind == "index":
                cell = index_cell(world, tensors)
            elif kind == "commit":
                cell = commit_cell(world, tensors, tmp)
            else:
                cell = plan_cell(world, tensors)
        except Exception as exc:  # noqa: BLE001 - recorded, the rest of the grid goes on
            cell = {"kind": kind, "world": world, "tensors": tensors, "error": f"{type(exc).__name__}: {exc}"}
            print(f"{kind} {world}x{tensors} failed: {cell['error']}", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if time.perf_counter() - t > 5:
                gc.collect()
        cell["seconds"] = round(time.perf_counter() - t, 3)
        cell["process_cpu_s"] = round(time.process_time() - c, 3)
        cell["loadavg_1min"] = [load0, os.getloadavg()[0]]
        cells.append(cell)
        print(f"{kind:8s} world {world:6d} x {tensors:6d} tensors: {cell['seconds']:7.1f} s "
              f"(process CPU {cell['process_cpu_s']:.1f} s, load {load0:.1f})", flush=True)
    WORLD.uninstall()
    return {
        "benchmark": "ranks",
        "schema": "ckptstore-bench-ranks/1",
        **tag,
        "argv": sys.argv[1:],
        "started_unix": round(time.time() - (time.perf_counter() - started), 1),
        "seconds": round(time.perf_counter() - started, 1),
        "mode": "threads: every rank a thread of one process, torch's threaded process group",
        "count_calls": COUNTING_CALLS,
        "cells": cells,
        "growth": growth(cells),
        "machine": machine(),
    }


# ------------------------------------------------------------------------------------------ report


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "calls":
        return f"{v:,.0f} calls"
    if unit == "B":
        for u, s in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if v >= 1 << s:
                return f"{v / (1 << s):.1f} {u}"
        return f"{v:.0f} B"
    return f"{v:.2f}{unit}"


def unit_of(figure: str) -> str:
    return "B" if "bytes" in figure else "x" if "ratio" in figure else "calls" if figure.endswith("calls") else "s"


def print_report(doc: dict[str, Any]) -> None:
    print(f"\ncommit {doc.get('describe', '?')}{' (dirty)' if doc.get('dirty') else ''}; "
          f"load average at the end {doc['machine']['loadavg']}")
    print(f"{'figure':38s} {'exp. world':>10s} {'exp. tensors':>12s} {'at 4096x10k':>12s} {'at 16384x10k':>13s}  flag")
    for name, row in doc["growth"].items():
        unit = unit_of(name)
        ex = row.get("extrapolated", {})
        a, b = row["world_exponent"], row["tensor_exponent"]
        print(f"{name:38s} {'-' if a is None else f'{a:.2f}':>10s} {'-' if b is None else f'{b:.2f}':>12s} "
              f"{fmt(ex.get('4096x10000'), unit):>12s} {fmt(ex.get('16384x10000'), unit):>13s}  {row.get('flag') or ''}")


MARKDOWN_CELLS = [  # (column, cell kind, figure, summary, unit)
    ("control plane per rank, steady save (CPU)", "store", "control_plane_cpu_s", "median", "s"),
    ("of it: save() blocking", "store", "save_cpu_s", "median", "s"),
    ("of it: background RAM commit", "store", "ram_commit_cpu_s", "median", "s"),
    ("rank 0 (coordinator)", "store", "control_plane_cpu_s", "rank0", "s"),
    ("metadata received per rank per save", "store", "meta_recv_bytes", "median", "B"),
    ("metadata sent per rank per save", "store", "meta_sent_bytes", "median", "B"),
    ("manifest", "store", "manifest_bytes", None, "B"),
    ("RAM copy of the manifest per rank", "store", "ram_manifest_bytes", "median", "B"),
    ("restore per rank (CPU)", "store", "restore_cpu_s", "median", "s"),
    ("restore: listing the steps held", "store", "restore_list_cpu_s", "median", "s"),
    ("restore: the node's copies of the step", "store", "restore_inventory_cpu_s", "median", "s"),
    ("restore: planning the load", "store", "restore_plan_cpu_s", "median", "s"),
    ("restore: the load", "store", "restore_load_cpu_s", "median", "s"),
    ("restore: metadata received per rank (objects)", "store", "restore_meta_recv_bytes", "median", "B"),
    ("restore: tensor collectives' buffers per rank", "store", "restore_meta_tensor_bytes", "median", "B"),
    ("one rank's load plan (chunks_needed)", "store", "load_plan_cpu_s", "max", "s"),
    ("one rank's load plan from the index (load_sharded's)", "store", "index_plan_cpu_s", "max", "s"),
    ("calls per rank, steady save's control plane", "store", "control_plane_calls", "median", "calls"),
    ("of it: save() blocking", "store", "save_calls", "median", "calls"),
    ("calls per rank, restore", "store", "restore_calls", "median", "calls"),
]
MARKDOWN_SHARDED = [
    ("save_sharded per rank (CPU)", "sharded", "save_cpu_s", "median", "s"),
    ("manifest read per rank", "sharded", "shard1_manifest_read_bytes", "median", "B"),
    ("load plan Shard(1), one rank", "sharded", "shard1_plan_cpu_s", "max", "s"),
    ("load plan uneven Shard(0), one rank", "sharded", "shard0_uneven_plan_cpu_s", "max", "s"),
    ("read across ranks / checkpoint, Shard(1)", "sharded", "shard1_read_ratio", None, "x"),
    ("read across ranks / checkpoint, uneven Shard(0)", "sharded", "shard0_uneven_read_ratio", None, "x"),
    ("read across ranks / checkpoint, Replicate", "sharded", "replicate_read_ratio", None, "x"),
    ("load Shard(1) per rank (CPU)", "sharded", "shard1_cpu_s", "median", "s"),
    ("load Replicate per rank (CPU)", "sharded", "replicate_cpu_s", "median", "s"),
    ("exchange held at once, Shard(1), largest rank", "sharded", "shard1_exchange_peak_bytes", "max", "B"),
    ("exchange held at once, Replicate, largest rank", "sharded", "replicate_exchange_peak_bytes", "max", "B"),
    ("calls per rank, save_sharded", "sharded", "save_calls", "median", "calls"),
    ("calls per rank, load Shard(1)", "sharded", "shard1_calls", "median", "calls"),
    ("calls per rank, load uneven Shard(0)", "sharded", "shard0_uneven_calls", "median", "calls"),
    ("calls per rank, load Replicate", "sharded", "replicate_calls", "median", "calls"),
]
MARKDOWN_PLAN = [
    ("build_manifest (every rank, RAM commit)", "plan", "build_manifest_cpu_s", None, "s"),
    ("manifest JSON", "plan", "manifest_bytes", None, "B"),
    ("parse_manifest", "plan", "manifest_parse_cpu_s", None, "s"),
    ("read plan Shard(1), one rank", "plan", "shard1_plan_cpu_s", None, "s"),
    ("read plan uneven Shard(0), one rank", "plan", "shard0_uneven_plan_cpu_s", None, "s"),
    ("agreement: union + merge (coordinator)", "plan", "agree_merge_cpu_s", None, "s"),
]


def markdown(doc: dict[str, Any]) -> str:
    """The tables of docs/benchmarks.md ("Scale: ranks") from one run's JSON."""
    lines = []
    for rows in (MARKDOWN_CELLS, MARKDOWN_SHARDED, MARKDOWN_PLAN):
        kind = rows[0][1]
        cells = sorted((c for c in doc["cells"] if c["kind"] == kind and not c.get("skipped") and "error" not in c),
                       key=lambda c: (c["tensors"], c["world"]))
        if not cells:
            continue
        lines.append("| " + kind + " | " + " | ".join(f"{c['world']:,} x {c['tensors']:,}" for c in cells) + " |")
        lines.append("|---" * (len(cells) + 1) + "|")
        for label, _k, figure, which, unit in rows:
            vals = []
            for c in cells:
                if which is None:
                    v = c.get(figure)
                else:
                    s = c.get("per_rank", {}).get(figure)
                    v = None if s is None else s[which]
                vals.append(fmt(v, unit) if unit != "x" else ("-" if v is None else f"{v:.2f}x"))
            if unit == "calls" and set(vals) == {"-"}:
                continue  # counted only with --count-calls
            lines.append(f"| {label} | " + " | ".join(vals) + " |")
        lines.append("")
    skipped = [c for c in doc["cells"] if c.get("skipped")]
    if skipped:
        lines.append("Skipped (predicted over budget): " + ", ".join(
            f"{c['kind']} {c['world']:,} x {c['tensors']:,} ({c['predicted_s']:.0f} s)" for c in skipped) + ".")
        lines.append("")
    lines.append("| figure | exponent in ranks | exponent in tensors | at 4,096 x 10,000 | at 16,384 x 10,000 | flag |")
    lines.append("|---|---|---|---|---|---|")
    for name, row in doc["growth"].items():
        unit = unit_of(name)
        ex = row.get("extrapolated", {})
        a, b = row["world_exponent"], row["tensor_exponent"]
        def show(v: float | None, unit: str = unit) -> str:
            return ("-" if v is None else f"{v:,.2f}x") if unit == "x" else fmt(v, unit)

        b_text = "-" if b is None else f"{b:.2f}"
        if b is None and "extrapolated" in row:
            b_text = "(1, assumed)"
        lines.append(f"| `{name}` | {'-' if a is None else f'{a:.2f}'} | {b_text} | {show(ex.get('4096x10000'))} | "
                     f"{show(ex.get('16384x10000'))} | {row.get('flag') or ''} |")
    return "\n".join(lines)


PLOT_FIGURES = [  # (panel title, figure, unit)
    ("store: control plane per rank (CPU)", "store.control_plane_cpu_s", "s"),
    ("store: metadata received per rank per save", "store.meta_recv_bytes", "B"),
    ("manifest size", "store.manifest_bytes", "B"),
    ("one rank's load plan (CPU)", "sharded.shard1_plan_cpu_s", "s"),
    ("bytes read across ranks / checkpoint", "sharded.shard1_read_ratio", "x"),
    ("pure planning (CPU)", "plan.manifest_parse_cpu_s", "s"),
]


def plot(docs: list[tuple[str, dict[str, Any]]], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    styles = ["-o", "--s", ":^"]
    for ax, (title, name, unit) in zip(axes.flat, PLOT_FIGURES):
        kind, figure, which, _flat = PER_RANK_FIGURES[name]
        extra = []
        if name == "sharded.shard1_read_ratio":
            extra = [("sharded.shard0_uneven_read_ratio", "uneven Shard(0)")]
        if name == "plan.manifest_parse_cpu_s":
            extra = [("plan.build_manifest_cpu_s", "build"), ("plan.shard1_plan_cpu_s", "plan Shard(1)")]
        if name == "sharded.shard1_plan_cpu_s":
            extra = [("store.load_plan_cpu_s", "store")]
        for i, (label, doc) in enumerate(docs):
            main_label = {"plan.manifest_parse_cpu_s": " parse", "sharded.shard1_plan_cpu_s": " Shard(1)",
                          "sharded.shard1_read_ratio": " Shard(1)"}.get(name, "")
            for series, sub in [(name, main_label)] + [(n, f" {lab}") for n, lab in extra]:
                k, f, w, _ = PER_RANK_FIGURES[series]
                cells = [c for c in doc["cells"] if c.get("kind") == k and not c.get("skipped") and "error" not in c]
                if not cells:
                    continue
                counts = sorted({c["tensors"] for c in cells}, key=lambda t: -sum(1 for c in cells if c["tensors"] == t))
                t_fix = counts[0]
                # One point per world: of merged runs, the later run's cell stands.
                by_world = {c["world"]: value_of(c, f, w) for c in cells if c["tensors"] == t_fix}
                pts = [(x, y) for x, y in sorted(by_world.items()) if y]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)],
                            label=f"{label}{sub} ({t_fix} tensors/rank)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("ranks")
        ax.set_ylabel({"s": "seconds", "B": "bytes", "x": "ratio", "calls": "calls"}[unit])
        if unit == "x":
            ax.axhline(1.05, color="grey", lw=0.8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("ckptstore: scale in ranks (" + " vs ".join(
        f"{lab}: {doc.get('describe', '?')[:40]}" for lab, doc in docs) + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000],
                    help="tensors per rank: the first at every world, the others at the smallest world")
    ap.add_argument("--plan-ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--plan-tensors", type=int, nargs="+", default=[10, 40])
    ap.add_argument("--index-tensors", type=int, nargs="+", default=[1000, 10000],
                    help="tensors per rank of the index cells (--kinds index), at each of --plan-ranks")
    ap.add_argument("--kinds", nargs="+", default=["plan", "store", "sharded"],
                    choices=["plan", "index", "commit", "store", "sharded"])
    ap.add_argument("--commit-tensors", type=int, nargs="+", default=[100, 1000, 10000],
                    help="tensors per rank of the commit kind (the durable coordinator's commit), at --plan-ranks")
    ap.add_argument("--budget-s", type=float, default=840.0, help="no cell starts that would end the run after this")
    ap.add_argument("--cell-budget-s", type=float, default=300.0, help="no cell predicted to take longer starts")
    ap.add_argument("--long", action="store_true",
                    help="8-256 ranks at 1,000 tensors, 1,000-50,000 tensors at 8 ranks, planning up to 1,000 "
                         "tensors, budgets of hours")
    ap.add_argument("--dir", default="/dev/shm", help="where the tiers and checkpoints go (tmpfs: the disk stays out)")
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="store cells: thread-ranks per simulated node, each node with RAM and local directories "
                         "of its own (default 0: every rank on one node)")
    ap.add_argument("--count-calls", action="store_true",
                    help="count every function call per rank (the *_calls figures: work that the load does not "
                         "inflate); the hook slows every call, so this run's CPU figures are not figures")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("--name", default="ranks", help="the JSON is <out>/<name>.json")
    ap.add_argument("--plot", default=None, help="plot path (default <out>/ranks.png)")
    ap.add_argument("--no-plot", action="store_true", help="write the JSON only")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="plot these JSONs (before, after) and exit")
    ap.add_argument("--markdown", action="store_true", help="with --compare: print each run's tables as Markdown")
    ap.add_argument("--labels", nargs="+", help="with --compare: one label per JSON (default before, after); "
                    "runs with the same label are plotted as one series (a default run and a longer store run)")
    args = ap.parse_args(argv)
    global RANKS_PER_NODE
    RANKS_PER_NODE = args.ranks_per_node
    if args.long:
        args.worlds, args.tensors = [8, 16, 32, 64, 128, 256], [1000, 5000, 10000, 50000]
        args.plan_tensors = [10, 100, 1000]
        args.budget_s, args.cell_budget_s = 6 * 3600.0, 3600.0
    plot_path = args.plot or os.path.join(args.out, "ranks.png")
    if args.compare:
        docs = []
        for i, path in enumerate(args.compare):
            with open(path) as fh:
                doc = json.load(fh)
            label = (args.labels[i] if args.labels and i < len(args.labels) else
                     ["before", "after"][i] if len(args.compare) == 2 else os.path.basename(path))
            docs.append((label, doc))
            print(markdown(doc) if args.markdown else "", end="\n" if args.markdown else "")
            print_report(doc)
        merged: dict[str, dict[str, Any]] = {}
        for label, doc in docs:
            if label in merged:
                merged[label] = {**merged[label], "cells": merged[label]["cells"] + doc["cells"]}
            else:
                merged[label] = doc
        if plot(list(merged.items()), plot_path):
            print(f"wrote {plot_path}")
        return 0
    doc = run_grid(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print_report(doc)
    print(f"wrote {path}")
    if not args.no_plot and plot([(args.name, doc)], plot_path):
        print(f"wrote {plot_path}")
    failed = [c for c in doc["cells"] if "error" in c]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
