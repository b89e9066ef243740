"""Goodput measured end to end: a real training job in a real crash loop, four ways.

A supervisor runs a 2-rank gloo training job (a 2-stage pipeline of ``--layers`` x Linear(H, H) per
rank, Adam: with the defaults 22 layers of 2048, the checkpointed state is 1.03 GiB in all, and a
step takes ~0.2-0.5 s on this VM) for ``--window`` seconds of wall time, and restarts it after every
failure, as torchrun's elastic agent does (a failed rank takes the whole group down; every rank is
started again). Failures come from a seeded schedule (exponential or ``--weibull SHAPE`` inter-arrival
times of mean ``--mtbf``; classes drawn from ``--mix``): ``crash`` SIGKILLs one rank, ``node``
SIGKILLs one rank and wipes its "node" (its RAM directory, its local directory, its node agent).
Rank r runs on node r, so peers replicate to the other node.

Configurations (every one saves the same flat state of tensors every ``k`` steps):

- ``torch.save``: each rank ``torch.save``s its part to a shared directory (a stand-in for a shared
  file system, which node losses leave intact), fsyncs and renames it; rank 0 commits the step with
  a marker after a barrier. Synchronous.
- ``dcp``: ``torch.distributed.checkpoint.async_save`` to the shared directory with a reused
  ``DefaultStager`` on a gloo group of its own; the save blocks until staging is done (and until the
  previous upload finished).
- ``dcp-s3``: the same ``async_save``, to the object store the ckptstore configurations promote to
  (DCP's fsspec writer, chosen by DCP itself from the ``s3://`` checkpoint id): both then pay the
  same server for their durable copies, which on this machine runs on the trainers' cores.
- ``ckptstore-local``: ``CheckpointStore`` with a local directory per node and the durable tier on
  SeaweedFS (``durable_every=1``); its RAM segments are wiped at every failure, so it restores from
  local or durable only.
- ``ckptstore-full``: RAM + local + one peer replica + durable (``durable_every=4``) + the node agent.
- ``ckptstore-full-dir``: the same, with the durable tier on the shared directory ``torch.save`` and
  ``dcp`` write to: the pairing with ``dcp`` by destination, as ``ckptstore-full`` pairs with
  ``dcp-s3``. On this machine the S3 server runs on the trainers' two cores (in a deployment it is
  remote), so a configuration that uploads to it pays the server's CPU as well as its own.

Rank 0 and the supervisor write one event log per run (``<out>/<config>/events.jsonl``), which
``ckptstore goodput LOG... --simulate`` splits into productive time, checkpoint stalls, lost work,
restart and reload, and replays in the simulator from the measured costs and the actual failure
times. ``--interval plan`` reads what a save of each configuration cost training in an earlier
measurement (``--cost-from DIR|JSON...``: its blocking time plus, with the default ``--plan-cost
total``, the slowdown of the steps it overlapped) and saves at Daly's interval (what ``ckptstore
plan`` prints) for that cost and ``--mtbf``; a number is a fixed common interval in seconds,
converted to steps with ``--step-s``.

    python benchmarks/bench_goodput_e2e.py --configs torch.save,dcp,ckptstore-local,ckptstore-full \\
        --interval 20 --window 300 --mtbf 50 --seed 1 --out /tmp/e2e-fixed
    python benchmarks/bench_goodput_e2e.py ... --interval plan --cost-from /tmp/e2e-fixed --out /tmp/e2e-plan
    ckptstore goodput /tmp/e2e-fixed/*/events.jsonl --simulate
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import faulthandler
import functools
import glob
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agents import agent_pids  # noqa: E402 - shared by the benchmark scripts

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIGS = ("torch.save", "dcp", "dcp-s3", "ckptstore-local", "ckptstore-full", "ckptstore-full-dir")
# What each configuration's copies survive, for the simulator's replay ("*": every failure class).
TIERS: dict[str, list[str]] = {
    "torch.save": ["durable"],
    "dcp": ["durable"],
    "dcp-s3": ["durable"],
    "ckptstore-local": ["local:survives=crash", "durable"],
    "ckptstore-full": ["ram:survives=crash", "local:survives=crash", "peer:survives=crash+node", "durable:every=4"],
    "ckptstore-full-dir": ["ram:survives=crash", "local:survives=crash", "peer:survives=crash+node", "durable:every=4"],
}


def tiers_of(name: str, local_every: int) -> list[str]:
    """The tiers of a configuration, its local tier every ``local_every``-th save (``--local-every``)
    unless its peers take every save: a replicated save always goes to the local tier too."""
    tiers = TIERS[name]
    if any(t.startswith("peer") and "every=" not in t for t in tiers):
        return list(tiers)
    return [t + f",every={local_every}" if t.startswith("local:") and local_every > 1 and name.startswith("ckptstore-full")
            else t for t in tiers]


WORLD = 2
# A rank's exit status when the job cannot go on by itself: its restore found no sound copy of a step
# the tiers list, or a save was refused (a step the job rolled back past and saves again).
UNRECOVERABLE = 3
START_OVER = "unrecoverable"  # the kill record's class then (ckptstore.goodput.simulate.START_OVER)


# ------------------------------------------------------------------------------ the trainer (one rank)


def build(cfg: dict[str, Any], rank: int) -> tuple[Any, Any, dict[str, Any]]:
    """Stage ``rank`` of the pipeline, its Adam (state created up front, so a restore fills it in
    place) and the flat state every configuration saves: distinct keys per rank. Nothing is
    initialised here: a restore overwrites every byte, and :func:`initialise` fills a fresh start."""
    import torch

    width, layers = cfg["width"], cfg["layers"] // WORLD
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (
        torch.nn.utils.skip_init(torch.nn.Linear, width, width), torch.nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    flat: dict[str, Any] = {}
    for name, p in model.named_parameters():
        st = opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p)}
        flat[f"s{rank}.{name}"] = p.data
        for k, v in st.items():
            flat[f"s{rank}.{name}.{k}"] = v
    return model, opt, flat


def initialise(model: Any, opt: Any, rank: int) -> None:
    import torch

    torch.manual_seed(1000 + rank)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    for st in opt.state.values():
        for v in st.values():
            v.zero_()


def batch(cfg: dict[str, Any], step: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step * 2 + rank)
    return torch.randn(cfg["batch"], cfg["width"], generator=g)


def train_step(cfg: dict[str, Any], rank: int, step: int, model: Any, opt: Any) -> None:
    """One pipeline step: rank 0 sends its activations forward, rank 1 its input gradient back."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        x = batch(cfg, step, 0)
        h = model(x)
        dist.send(h.detach(), 1)
        grad = torch.empty_like(h)
        dist.recv(grad, 1)
        h.backward(grad)
    else:
        h = torch.empty(cfg["batch"], cfg["width"])
        dist.recv(h, 0)
        h.requires_grad_(True)
        loss = torch.nn.functional.mse_loss(model(h), batch(cfg, step, 1))
        loss.backward()
        dist.send(h.grad, 0)
    opt.step()
    opt.zero_grad(set_to_none=False)


def digest(flat: dict[str, Any]) -> str:
    from ckptstore.format.checksum import checksum

    return checksum("".join(checksum(t.contiguous().view(-1).numpy().view("uint8").data) for t in flat.values()).encode())


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _append_quick(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def uses_s3(config: str) -> bool:
    return config in ("ckptstore-local", "ckptstore-full", "dcp-s3")


def _committed(root: str, marker: str) -> list[int]:
    """The steps under ``root`` whose directory holds ``marker`` (written last: the commit)."""
    return sorted(int(n[5:]) for n in os.listdir(root)
                  if n.startswith("step-") and os.path.exists(os.path.join(root, n, marker)))


# ------------------------------------------------------------------------------ where the CPU goes


def _thread_cpu(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name (``/proc``'s comm) and CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    stat = fh.read()
                fields = stat[stat.rindex(")") + 2:].split()  # fields from the state on (the 3rd)
                out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick)
    return out


def _process_cpu(pid: int) -> float | None:
    """CPU seconds of ``pid`` and of the threads it has ended."""
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / tick
    return None


def _label(name: str) -> str:
    """A thread's kind: a pool's workers (``prefix_3``) counted together."""
    return re.sub(r"_\d+$", "", name)


def _cpu_log(path: str, attempt: int, rank: int, every_s: float) -> None:
    """A daemon thread that appends this process's CPU by thread every ``every_s`` (cumulative
    seconds per thread id; Python's thread names where the thread is a Python one). Call it from
    the trainer's thread."""

    # A forked rank's threading module may still hold the zygote's id for its main thread.
    trainer = threading.get_native_id()

    def sample() -> None:
        while True:
            names = {t.native_id: t.name for t in threading.enumerate()}
            names[trainer] = "MainThread"
            threads = {tid: [_label(names.get(tid) or f"native:{comm}"), cpu] for tid, (comm, cpu) in _thread_cpu().items()}
            with open(path, "a") as fh:
                fh.write(json.dumps({"t": time.time(), "pid": os.getpid(), "rank": rank, "attempt": attempt,
                                     "total": _process_cpu(os.getpid()), "threads": threads}) + "\n")
            time.sleep(every_s)

    threading.Thread(target=sample, name="bench-cpu-log", daemon=True).start()


class TorchSave:
    """Each rank's part in a file of its own, fsynced and renamed; a marker by rank 0 commits the step."""

    tier = "durable"

    def __init__(self, cfg: dict[str, Any], rank: int, flat: dict[str, Any], on_commit: Any) -> None:
        self.root, self.rank, self.flat, self.on_commit = cfg["shared"], rank, flat, on_commit
        os.makedirs(self.root, exist_ok=True)

    def restore(self) -> int | None:
        import torch

        steps = _committed(self.root, "COMMIT")
        if not steps:
            return None
        loaded = torch.load(os.path.join(self.root, f"step-{steps[-1]:08d}", f"rank-{self.rank}.pt"), mmap=True)
        for k, t in self.flat.items():
            t.copy_(loaded[k])
        return steps[-1]

    def save(self, step: int) -> None:
        import torch
        import torch.distributed as dist

        d = os.path.join(self.root, f"step-{step:08d}")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"rank-{self.rank}.pt")
        with open(path + ".tmp", "wb") as fh:
            torch.save(self.flat, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(path + ".tmp", path)
        dist.barrier()
        if self.rank == 0:
            _append(os.path.join(d, "COMMIT"), {"step": step})
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            self.on_commit(step, self.tier)
            for old in sorted(n for n in os.listdir(self.root) if n.startswith("step-"))[:-2]:
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def close(self) -> None:
        pass


class Dcp:
    """DCP's async_save with one reused stager, on a gloo group of its own (its upload thread runs
    collectives while the trainer's own send/recv run on the default group)."""

    tier = "durable"

    def __init__(self, cfg: dict[str, Any], rank: int, flat: dict[str, Any], on_commit: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.rank, self.flat, self.on_commit = rank, flat, on_commit
        self.fs: Any = None
        if cfg["config"] == "dcp-s3":
            import fsspec

            # DCP picks its fsspec writer from the checkpoint id alone; botocore takes the endpoint
            # and the credentials from the environment.
            so = cfg["storage_options"]
            os.environ.update(AWS_ACCESS_KEY_ID=so["key"], AWS_SECRET_ACCESS_KEY=so["secret"],
                              AWS_ENDPOINT_URL=so["client_kwargs"]["endpoint_url"],
                              AWS_DEFAULT_REGION=so["client_kwargs"].get("region_name", "us-east-1"))
            for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):  # the options' own, or none
                os.environ.pop(name, None)
            if so.get("token"):
                os.environ["AWS_SESSION_TOKEN"] = so["token"]
            self.fs, _ = fsspec.url_to_fs(cfg["durable"])
            self.root = cfg["durable"]
        else:
            self.root = cfg["shared"]
            os.makedirs(self.root, exist_ok=True)
        self.group = dist.new_group(backend="gloo")
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.pending: Any = None

    def restore(self) -> int | None:
        import torch.distributed.checkpoint as dcp

        steps = self._steps()  # DCP writes .metadata last, on the coordinator
        if not steps:
            return None
        dcp.load(self.flat, checkpoint_id=f"{self.root}/step-{steps[-1]:08d}", process_group=self.group)
        return steps[-1]

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.pending is not None:
            self.pending.result()  # one upload in flight: the stager's buffers are reused
        resp = dcp.async_save(self.flat, checkpoint_id=f"{self.root}/step-{step:08d}",
                              async_stager=self.stager, process_group=self.group)
        resp.staging_completion.result()
        self.pending = resp.upload_completion
        if self.rank == 0:
            self.pending.add_done_callback(lambda f, step=step: f.exception() is None and self._committed(step))

    def _steps(self) -> list[int]:
        if self.fs is None:
            return _committed(self.root, ".metadata")
        self.fs.invalidate_cache()
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)] if self.fs.exists(self.root) else []
        return sorted(int(n[5:]) for n in names
                      if n.startswith("step-") and self.fs.exists(f"{self.root}/{n}/.metadata"))

    def _committed(self, step: int) -> None:
        self.on_commit(step, self.tier)
        if self.fs is not None:
            for old in self._steps()[:-2]:
                self.fs.rm(f"{self.root}/step-{old:08d}", recursive=True)
            return
        for old in sorted(n for n in os.listdir(self.root) if n.startswith("step-"))[:-2]:
            shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def close(self) -> None:
        self.stager.close()


class Store:
    """A CheckpointStore per rank, on node ``rank`` (its own RAM and local directories)."""

    def __init__(self, cfg: dict[str, Any], rank: int, flat: dict[str, Any], on_commit: Any) -> None:
        import concurrent.futures

        from ckptstore import CheckpointStore

        full = cfg["config"].startswith("ckptstore-full")
        node = cfg["nodes"][rank]
        self.flat, self.on_commit = flat, on_commit
        # The engine's own default unless asked (an engine without the option is run as it is).
        nice = {} if cfg.get("background_nice") is None else {"background_nice": cfg["background_nice"]}
        self.store = CheckpointStore(
            cfg["job"], local=node["local"], durable=cfg["durable"], durable_every=4 if full else 1,
            storage_options=cfg["storage_options"], ram_dir=node["ram"], node=rank, keep_local=2,
            # Two steps, as the torch.save and DCP baselines keep: a 20-minute window promotes
            # ~80 GiB, and the disk filled at 12.6 min with the default (every step kept).
            keep_durable=2,
            peer_replicas=1 if full else 0, agent=full, timeout_s=300, durable_timeout_s=240, **nice,
            **({"local_every": cfg["local_every"]} if full and cfg.get("local_every", 1) > 1 else {}))
        self.watch = concurrent.futures.ThreadPoolExecutor(1) if rank == 0 else None
        self.tier: str | None = None
        self.found: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda r: self.found.extend(re.findall(r"restored step \d+ from the (\S+) tier", r.getMessage()))
        logging.getLogger("ckptstore").addHandler(handler)
        # Warnings and worse go to the rank's output file as before this handler was added: a
        # restore that skips a step says why there, and the check's findings can be traced to it.
        loud = logging.StreamHandler()
        loud.setLevel(logging.WARNING)
        logging.getLogger("ckptstore").addHandler(loud)
        logging.getLogger("ckptstore").setLevel(logging.INFO)

    def restore(self) -> int | None:
        step = self.store.restore(self.flat)
        self.tier = self.found[-1] if self.found else None
        return step

    def save(self, step: int) -> None:
        handle = self.store.save(step, self.flat)
        if self.watch is not None:
            # Each tier's commit is logged when it happens: waiting for the tiers in turn logged a
            # step's RAM commit only after the previous step's durable upload (tens of seconds),
            # which moved the measured latencies and the newest step each failure found committed.
            for tier, future in handle._futures.items():  # the tiers this step goes to
                if future is not None:
                    future.add_done_callback(functools.partial(self._committed, handle.step, tier))

    def _committed(self, step: int, tier: str, future: Any) -> None:
        # A dropped (overtaken) promotion's future resolves to the newer step that was committed
        # instead: only a tier's own commit of this step is logged as one.
        if not future.cancelled() and future.exception() is None and future.result() == step:
            self.watch.submit(self.on_commit, step, tier)  # one thread writes the log, in order

    def close(self) -> None:
        self.store.close()


BACKENDS = {"torch.save": TorchSave, "dcp": Dcp, "dcp-s3": Dcp, "ckptstore-local": Store, "ckptstore-full": Store,
            "ckptstore-full-dir": Store}


def worker(cfg_path: str, rank: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ckptstore.errors import CheckpointError, InvalidArgumentError
    from ckptstore.goodput.events import EventLog

    with open(cfg_path) as fh:
        cfg = json.load(fh)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` shows where a rank is
    torch.set_num_threads(1)
    phases = [("begin", time.time())]
    if cfg.get("cpu_log"):
        _cpu_log(os.path.join(cfg["dir"], f"cpu-{rank}.jsonl"), cfg["attempt"], rank, cfg["cpu_log"])
    dist.init_process_group("gloo", init_method=f"file://{cfg['rendezvous']}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    phases.append(("rendezvous", time.time()))
    model, opt, flat = build(cfg, rank)
    phases.append(("model", time.time()))
    log = EventLog(cfg["events"]) if rank == 0 else None

    def on_commit(step: int, tier: str) -> None:
        if log is not None:
            log.write("commit", step=step, tier=tier)

    backend = BACKENDS[cfg["config"]](cfg, rank, flat, on_commit)
    phases.append(("checkpointer", time.time()))
    began = time.time()
    try:
        step = backend.restore()
    except CheckpointError as exc:  # nothing this job can resume from: an operator starts it over
        if log is not None:
            log.write("unrecoverable", error=str(exc)[:2000])
            log.close()
        print(f"cannot restore: {exc}", flush=True)
        os._exit(UNRECOVERABLE)
    if step is None:
        initialise(model, opt, rank)
    if log is not None:
        log.write("restore", step=step, seconds=round(time.time() - began, 6), tier=backend.tier if step else None,
                  phases={name: round(t - phases[0][1], 3) for name, t in phases[1:]})
    if cfg["verify"]:
        _append(os.path.join(cfg["dir"], f"resumed-{rank}.jsonl"),
                {"attempt": cfg["attempt"], "step": step, "digest": digest(flat)})
    step = step or 0
    while True:
        step += 1
        t = time.perf_counter()
        train_step(cfg, rank, step, model, opt)
        if log is not None:
            log.write("tick", step=step, step_s=round(time.perf_counter() - t, 6))
        if step % cfg["every"] == 0:
            if cfg["verify"]:  # before the save: a step may be committed, and restored, before save returns
                _append(os.path.join(cfg["dir"], f"saved-{rank}.jsonl"),
                        {"attempt": cfg["attempt"], "step": step, "digest": digest(flat)})
            t = time.perf_counter()
            try:
                backend.save(step)
            except InvalidArgumentError as exc:  # a step the job cannot save again: an operator starts it over
                if log is not None:
                    log.write("unrecoverable", error=str(exc)[:2000])
                    log.close()
                print(f"cannot save: {exc}", flush=True)
                os._exit(UNRECOVERABLE)
            if log is not None:
                log.write("save", step=step, blocking_s=round(time.perf_counter() - t, 6))


# ------------------------------------------------------------------------------ checks of a run


def _records(path: str) -> list[dict[str, Any]]:
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]
    return []


def check(run_dir: str) -> list[str]:
    """What one configuration's run must hold to, from its event log and (``--verify``) the digests
    its ranks recorded at every save and after every restore; returns the violations.

    - every restart resumed bitwise: the digest of each rank's state after its restore equals the
      digest of that rank's state when the step was saved;
    - no failure lost a committed step: each restore got a step at least as new as the newest one
      committed, before the failure, at a tier that survives every failure since (a commit whose
      record a dying rank 0 did not write yet can only make the restored step newer);
    - the accounting adds up: its parts sum to the wall time, and the steps' own compute time fits
      in its productive and lost time."""
    from ckptstore.goodput.events import account, read_events
    from ckptstore.goodput.simulate import tier_from_spec

    events = read_events(os.path.join(run_dir, "events.jsonl"))
    acc = account(events)
    problems = []
    parts = [acc.productive, acc.checkpoint, acc.lost, acc.restart, acc.reload]
    if min(parts) < 0 or abs(sum(parts) - acc.wall) > 1e-6:
        problems.append(f"the accounting does not add up: {parts} vs wall {acc.wall}")
    computed = sum(float(t["step_s"]) for r in acc.runs for t in r.ticks)
    if computed > acc.productive + acc.lost + 1e-3:
        problems.append(f"{computed:.3f} s of steps do not fit in {acc.productive + acc.lost:.3f} s of productive "
                        f"and lost time")
    setup = next(e for e in events if e["event"] == "setup")
    tiers = {t.name: t for t in map(tier_from_spec, setup["tiers"])}
    commits = [c for r in acc.runs for c in r.commits if c.get("tier") in tiers]
    kills = [e for e in events if e["event"] == "kill"]
    saved = [{(d["step"]): d["digest"] for d in _records(os.path.join(run_dir, f"saved-{r}.jsonl"))} for r in range(WORLD)]
    resumed = [{d["attempt"]: d for d in _records(os.path.join(run_dir, f"resumed-{r}.jsonl"))} for r in range(WORLD)]
    for attempt, run in enumerate(acc.runs, 1):
        if run.resumed_at is None:
            continue
        before = [k for k in kills if k["t"] < run.start]
        over = max((k["t"] for k in before if k["class"] == START_OVER), default=0.0)
        newest = None
        for c in commits:
            if c["t"] < over:
                continue
            after = [k for k in before if k["t"] > c["t"]]
            if c["t"] < run.start and all(tiers[c["tier"]].keeps(k["class"]) for k in after):
                newest = c["step"] if newest is None else max(newest, c["step"])
        if newest is not None and (run.restored is None or run.restored < newest):
            problems.append(f"run {attempt} restored step {run.restored}, but step {newest} was committed where "
                            f"the failures since left it")
        for rank in range(WORLD):
            got = resumed[rank].get(attempt)
            if got is None:
                if setup.get("verify", True) and any(resumed):
                    problems.append(f"run {attempt}: rank {rank} recorded no digest after its restore")
                continue
            if got["step"] != run.restored:
                problems.append(f"run {attempt}: rank {rank} restored step {got['step']}, rank 0 {run.restored}")
            elif got["step"] is not None and saved[rank].get(got["step"]) != got["digest"]:
                problems.append(f"run {attempt}: rank {rank}'s state after restoring step {got['step']} is not the "
                                f"state it saved ({got['digest']} != {saved[rank].get(got['step'])})")
    return problems


# ------------------------------------------------------------------------------ the supervisor


def schedule(mtbf: float, horizon: float, seed: int, weibull: float | None, mix: dict[str, float]) -> list[dict]:
    """Failure times (seconds from the window's start), each with a class and the rank it strikes."""
    import math

    import numpy as np

    rng = np.random.default_rng(seed)
    classes = sorted(mix)
    probs = np.array([mix[c] for c in classes]) / sum(mix.values())
    scale = mtbf / math.gamma(1.0 + 1.0 / weibull) if weibull else mtbf
    out, t = [], 0.0
    while True:
        t += float(scale * (rng.weibull(weibull) if weibull else rng.exponential()))
        if t >= horizon:
            return out
        out.append({"at": round(t, 3), "class": classes[rng.choice(len(classes), p=probs)],
                    "rank": int(rng.integers(WORLD))})


def _kill(pid: int, group: bool = True) -> None:
    # The process itself too: a rank just forked may not have made its own group yet.
    for kill in (os.killpg, os.kill) if group else (os.kill,):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def _wait_dead(pid: int, timeout: float = 30.0) -> None:
    """Until ``pid`` is gone or a zombie: after that it writes nothing more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.005)
    raise RuntimeError(f"process {pid} did not die within {timeout} s of SIGKILL")


class Zygote:
    """A process that imported torch, ckptstore and s3fs once and forks every rank of every run
    (each in a session of its own, like a launched one): a restart here then costs what it costs a
    job whose launcher keeps warm processes (rendezvous, building the model, the restore), not the
    imports, which take 5-20 s per process on this loaded 2-core machine and would dwarf everything
    else at a time-compressed MTBF of a minute. ``--launch exec`` starts every rank afresh instead."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--zygote"], env=_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.lock = threading.Lock()
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != "ready\n":  # its imports are done: no window pays for them
            raise RuntimeError(f"the zygote did not start (exit status {self.proc.wait()})")

    def fork(self, config: str, output: str, exits: str) -> list[int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:  # supervisors of configurations run side by side (--parallel)
            self.proc.stdin.write(json.dumps({"config": config, "output": output, "exits": exits}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died (exit status {self.proc.wait()})")
        return [int(p) for p in json.loads(line)]

    def close(self) -> None:
        _kill(self.proc.pid)
        self.proc.wait()


def zygote_main() -> None:
    import select
    import traceback

    import torch  # noqa: F401 - imported once, before forking
    import torch.distributed.checkpoint  # noqa: F401

    import ckptstore.cli  # noqa: F401
    from ckptstore.goodput.events import EventLog  # noqa: F401

    with contextlib.suppress(ImportError):
        import s3fs  # noqa: F401
    # The optimizer's first construction imports torch._dynamo (3.5 s of CPU here); single-threaded
    # (OMP_NUM_THREADS=1), this starts no thread, so the children fork from a clean state.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    print("ready", flush=True)
    exits: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        while exits:  # reap; a rank that exits unless killed is reported
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            if code != -signal.SIGKILL:
                _append(exits[pid], {"pid": pid, "code": code})
            exits.pop(pid, None)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        req = json.loads(line)
        pids = []
        for rank in range(WORLD):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.setsid()
                    fd = os.open(req["output"].format(rank=rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    worker(req["config"], rank)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            exits[pid] = req["exits"]
            pids.append(pid)
        print(json.dumps(pids), flush=True)


class Supervisor:
    def __init__(self, name: str, out: str, args: argparse.Namespace, every: int, s3: Any, zygote: Zygote | None) -> None:
        self.name, self.args, self.every = name, args, every
        self.dir = os.path.join(out, name)
        os.makedirs(self.dir, exist_ok=True)
        tag = uuid.uuid4().hex[:8]
        self.nodes = [{"local": os.path.join(self.dir, f"node{r}", "local"),
                       "ram": os.path.join(args.ram_root, f"ckptstore-e2e-{tag}-node{r}")} for r in range(WORLD)]
        for n in self.nodes:
            os.makedirs(n["local"], exist_ok=True)
            os.makedirs(n["ram"], exist_ok=True)
        self.cfg = {"config": name, "dir": self.dir, "events": os.path.join(self.dir, "events.jsonl"),
                    "shared": os.path.join(self.dir, "shared"), "nodes": self.nodes, "job": f"e2e-{tag}",
                    "durable": (os.path.join(self.dir, "shared", f"e2e-{tag}") if name == "ckptstore-full-dir" else
                                f"{args.durable.rstrip('/')}/e2e-{tag}" if args.durable else
                                s3.url(f"e2e-{tag}") if s3 is not None and uses_s3(name) else None),
                    "storage_options": (None if not uses_s3(name) else json.loads(args.storage_options) if args.durable
                                        else s3.storage_options if s3 is not None else None),
                    "width": args.width, "layers": args.layers, "batch": args.batch, "seed": args.seed,
                    "every": every, "verify": args.verify, "background_nice": args.background_nice,
                    "local_every": args.local_every,
                    "cpu_log": args.cpu_log}
        self.tiers = tiers_of(name, args.local_every)
        self.procs: list[subprocess.Popen] = []
        self.pids: list[int] = []
        self.zygote = zygote
        self.lost: list[str] = []  # the lost nodes' directories, removed when the window ends
        self.s3_pid = getattr(getattr(s3, "_server", None), "pid", None) if uses_s3(name) else None

    def launch(self, attempt: int) -> None:
        cfg = dict(self.cfg, attempt=attempt, rendezvous=os.path.join(self.dir, f"rendezvous-{attempt}"))
        path = os.path.join(self.dir, f"run-{attempt}.json")
        with open(path, "w") as fh:
            json.dump(cfg, fh)
        output = os.path.join(self.dir, f"output-{attempt}-{{rank}}.txt")
        if self.zygote is not None:
            self.pids = self.zygote.fork(path, output, os.path.join(self.dir, "exits.jsonl"))
            return
        self.procs = []
        for rank in range(WORLD):
            with open(output.format(rank=rank), "wb") as out:
                self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", path, str(rank)],
                                                   env=_env(), stdin=subprocess.DEVNULL, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        self.pids = [p.pid for p in self.procs]

    def exited(self) -> tuple[int, int] | None:
        """A rank that exited without being killed, and its exit status."""
        if self.zygote is None:
            return next(((r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None), None)
        found = [(self.pids.index(e["pid"]), e["code"]) for e in _records(os.path.join(self.dir, "exits.jsonl"))
                 if e["pid"] in self.pids]
        if found and not any(code == UNRECOVERABLE for _, code in found):
            time.sleep(1.0)  # the other rank's exit, which may say why, is reaped a moment later
            found = [(self.pids.index(e["pid"]), e["code"]) for e in _records(os.path.join(self.dir, "exits.jsonl"))
                     if e["pid"] in self.pids]
        return next((f for f in found if f[1] == UNRECOVERABLE), found[0] if found else None)

    def saved(self, failure: dict[str, Any] | None) -> bool:
        """Whether this attempt has committed a step where ``failure`` leaves it (``--defer``)."""
        from ckptstore.goodput.simulate import tier_from_spec

        pid = self.pids[0] if self.pids else None
        keeps = {t.name for t in map(tier_from_spec, self.tiers) if failure is None or t.keeps(failure["class"])}
        return any(e["event"] == "commit" and e.get("pid") == pid and e.get("tier") in keeps
                   for e in _records(self.cfg["events"]))

    def start_over(self) -> None:
        """What an operator does when a restart cannot restore: a new job (name, durable prefix)
        on emptied nodes. Every step saved so far is lost."""
        self.kill_all()
        for r in range(WORLD):
            self.wipe_node(r)
        tag = uuid.uuid4().hex[:8]
        self.cfg["job"] = f"e2e-{tag}"
        if self.cfg["durable"]:
            self.cfg["durable"] = self.cfg["durable"].rsplit("/", 1)[0] + f"/e2e-{tag}"

    def kill(self, rank: int) -> None:
        _kill(self.pids[rank])
        _wait_dead(self.pids[rank])

    def kill_all(self) -> None:
        for rank in range(len(self.pids)):
            self.kill(rank)
        for p in self.procs:
            p.wait()

    def wipe_node(self, rank: int, ram_only: bool = False) -> None:
        """The node's RAM and local directories are lost (and its agent): a replacement node starts
        with empty ones at once. Deleting a gigabyte of files is not part of a real node loss, so
        the old directories are moved aside (one rename each): a local one is removed when the
        window ends, a RAM one at once by a thread at the lowest priority. A RAM directory kept
        until the end held its segments in /dev/shm, which cannot be paged out: ckptstore-local
        sets aside both nodes' at every failure, 2-3 GB each time, and 9 failures of a 20-minute
        window filled this machine's 24 GiB (the kernel's OOM killer took a rank at 751 s)."""
        node = self.nodes[rank]
        if not ram_only:
            for pid in agent_pids(node["ram"]):
                _kill(pid, group=False)
                _wait_dead(pid)
            self.lost.append(self._set_aside(node["local"]))
        gone = self._set_aside(node["ram"])
        threading.Thread(target=_remove_quietly, args=(gone,), daemon=True, name="bench-remove").start()

    @staticmethod
    def _set_aside(path: str) -> str:
        gone = f"{path}.lost-{uuid.uuid4().hex[:8]}"
        os.rename(path, gone)
        os.makedirs(path)
        return gone

    def run(self, failures: list[dict], window: float) -> dict[str, Any]:
        from ckptstore.goodput.events import EventLog

        log = EventLog(self.cfg["events"])
        log.write("setup", config=self.name, tiers=self.tiers, every=self.every, window_s=window, verify=self.args.verify,
                  schedule=failures, mtbf_s=self.args.mtbf, weibull=self.args.weibull, state_bytes=state_bytes(self.args),
                  loadavg=os.getloadavg())
        t0 = time.time()
        attempt, pending, next_load = 0, list(failures), 0.0
        sampling = threading.Event()
        if self.args.cpu_log:
            threading.Thread(target=self._sample_others, args=(sampling,), daemon=True).start()
        kills = []
        try:
            while True:
                attempt += 1
                log.write("start", attempt=attempt)
                self.launch(attempt)
                until = t0 + (pending[0]["at"] if pending else window)
                until = min(until, t0 + window) if not self.args.defer else until
                while time.time() < until or (self.args.defer and not self.saved(pending[0] if pending else None)):
                    if time.time() >= next_load:  # the machine's load, throughout the window
                        log.write("load", loadavg=os.getloadavg())
                        next_load = time.time() + 15.0
                    exited = self.exited()
                    if exited is not None and exited[1] == UNRECOVERABLE:
                        log.write("kill", **{"class": START_OVER, "rank": exited[0]})
                        self.start_over()
                        break
                    if exited is not None:
                        raise RuntimeError(f"{self.name}: rank {exited[0]} exited with status {exited[1]} "
                                           f"unasked:\n{self.output(attempt, exited[0])}")
                    time.sleep(0.02)
                else:
                    exited = None
                if exited is not None:
                    continue
                if not pending or (pending[0]["at"] >= window and not self.args.defer):
                    log.write("end", loadavg=os.getloadavg())
                    break
                f = pending.pop(0)
                self.kill(f["rank"])
                log.write("kill", **{"class": f["class"], "rank": f["rank"], "scheduled": round(t0 + f["at"], 6)})
                kills.append(dict(f, t=time.time()))
                self.kill_all()  # the elastic agent takes the rest of the group down
                if f["class"] == "node":
                    self.wipe_node(f["rank"])
                if self.name == "ckptstore-local":  # no RAM tier to restart from
                    for r in range(WORLD):
                        self.wipe_node(r, ram_only=True)
        finally:
            sampling.set()
            self.kill_all()
            for n in self.nodes:
                for pid in agent_pids(n["ram"]):
                    _kill(pid, group=False)
            log.close()
        # The lost nodes' directories go once the window is over, not when the whole benchmark
        # ends: RAM directories set aside at every failure are gigabytes of /dev/shm each, and a run
        # of several configurations kept them all (20 GB of shared memory, and the kernel's OOM
        # killer took a rank of the fifth configuration).
        self.remove_lost()
        for n in self.nodes:  # its processes and agents are gone: the RAM tier's segments too
            shutil.rmtree(n["ram"], ignore_errors=True)
        return {"attempts": attempt, "kills": kills}

    def _sample_others(self, stop: threading.Event) -> None:
        """The CPU of the processes beside the ranks (``--cpu-log``): the node agents, the S3 server
        and the supervisor, in ``cpu-others.jsonl``."""
        while not stop.is_set():
            procs = {os.getpid(): ["supervisor", _process_cpu(os.getpid())]}
            if self.s3_pid is not None:
                procs[self.s3_pid] = ["s3-server", _process_cpu(self.s3_pid)]
            for r, n in enumerate(self.nodes):
                for pid in agent_pids(n["ram"]):
                    procs[pid] = [f"agent-node{r}", _process_cpu(pid)]
            _append_quick(os.path.join(self.dir, "cpu-others.jsonl"), {"t": time.time(), "procs": procs})
            stop.wait(self.args.cpu_log)

    def output(self, attempt: int, rank: int) -> str:
        with open(os.path.join(self.dir, f"output-{attempt}-{rank}.txt"), errors="replace") as fh:
            return fh.read()[-4000:]

    def remove_lost(self) -> None:
        for path in self.lost:
            shutil.rmtree(path, ignore_errors=True)
        self.lost.clear()

    def cleanup(self) -> None:
        self.remove_lost()
        for n in self.nodes:
            shutil.rmtree(n["ram"], ignore_errors=True)
        if not self.args.keep:
            for name in ("shared", "node0", "node1"):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)


def _remove_quietly(path: str) -> None:
    """Remove ``path`` from a thread of the lowest priority, off the restarts' cores as far as the
    scheduler allows (freeing a gigabyte of shared memory takes ~0.1 s of CPU)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    shutil.rmtree(path, ignore_errors=True)


def state_bytes(args: argparse.Namespace) -> int:
    per_layer = args.width * args.width + args.width
    return 3 * 4 * per_layer * args.layers + 4 * 2 * args.layers  # params, exp_avg, exp_avg_sq; Adam's step


@contextlib.contextmanager
def object_store(needed: bool, nice: int = 0) -> Iterator[Any]:
    """The local S3 server, ``nice`` steps below this process's priority (every thread it has; the
    ones it starts later inherit it): it stands for a remote object store, whose CPU is not the
    training node's."""
    if not needed:
        yield None
        return
    from ckptstore._local_s3 import start_local_s3

    s3 = start_local_s3(own_process=True)
    pid = getattr(s3._server, "pid", None)
    if nice > 0 and pid is not None:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), min(19, os.getpriority(os.PRIO_PROCESS, int(tid)) + nice))
    try:
        yield s3
    finally:
        s3.stop()


def save_cost(name: str, sources: list[str]) -> dict[str, float]:
    """What a save of ``name`` cost training in an earlier measurement, per save: ``blocking`` (the
    mean time ``save`` blocked), ``slowdown`` (the steps' excess over the median step, which for an
    asynchronous checkpoint is mostly the steps slowed while it is in flight) and ``step`` (the
    median step). ``sources``: earlier ``--out`` directories or JSON files holding this benchmark's
    reports; the last one that measured ``name`` counts."""
    from ckptstore.goodput.events import account, read_events

    found = None
    for src in sources:
        if os.path.isdir(src):
            path = os.path.join(src, name, "events.jsonl")
            if os.path.exists(path):
                acc = account(read_events(path))
                per = acc.per_save()
                if per is not None:
                    found = {"checkpoint_s": per[0], "slowdown_s": per[1], "saves": 1, "step_s": acc.step_s,
                             "from": path}
        else:
            with open(src) as fh:
                stack: list[Any] = [json.load(fh)]
            reports = []
            while stack:  # every report in the file, in document order
                node = stack.pop(0)
                # A report at another configuration's (common) step time would charge its own
                # slower steps to its saves: only those at its own median step count.
                if (isinstance(node, dict) and node.get("config") == name and "slowdown_s" in node
                        and node.get("step", "the median step") == "the median step"):
                    reports.append({**node, "from": src})
                elif isinstance(node, dict):
                    stack[:0] = list(node.values())
                elif isinstance(node, list):
                    stack[:0] = node
            found = reports[-1] if reports else found
    if found is None or not found.get("saves") or not found.get("step_s"):
        raise SystemExit(f"--cost-from: no measurement of {name!r} with saves and step times in {sources}: run it "
                         f"at a fixed interval first (its --out), or name a JSON file with its report")
    return {"blocking": found["checkpoint_s"] / found["saves"],
            "slowdown": max(0.0, found["slowdown_s"]) / found["saves"], "step": found["step_s"], "from": found["from"]}


def planned_every(name: str, args: argparse.Namespace) -> int:
    """Daly's interval for what a save of this configuration cost in ``--cost-from``: its blocking
    time alone (``--plan-cost blocking``, what ``interval="auto"`` sees) or with the slowdown of the
    steps it overlapped (``total``, what it takes from training)."""
    from ckptstore.goodput.planner import daly

    c = save_cost(name, args.cost_from)
    cost = c["blocking"] + (c["slowdown"] if args.plan_cost == "total" else 0.0)
    tau = daly(cost, args.mtbf)
    every = max(1, round(tau / c["step"]))
    print(f"{name}: measured per save {c['blocking']:.3f} s blocking + {c['slowdown']:.3f} s slowdown, step "
          f"{c['step']:.3f} s (from {c['from']}); planned on {args.plan_cost} {cost:.3f} s -> `ckptstore plan "
          f"--ckpt-cost {cost:.3f}s --mtbf {args.mtbf:g}s`: every {tau:.1f} s of training = {every} steps", flush=True)
    return every


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--interval", default="20", help="seconds of training between saves, or 'plan' (with --cost-from)")
    p.add_argument("--cost-from", nargs="+", metavar="SRC",
                   help="earlier --out directories or report JSON files: each configuration's measured cost, for "
                        "--interval plan")
    p.add_argument("--plan-cost", choices=("total", "blocking"), default="total",
                   help="plan on a save's blocking time plus the slowdown of the steps it overlaps (total), or on "
                        "the blocking time alone")
    p.add_argument("--every", type=int, default=None, help="a fixed interval in steps (instead of --interval)")
    p.add_argument("--step-s", type=float, default=0.3, help="the step time that converts --interval to steps")
    p.add_argument("--window", type=float, default=300.0, help="wall seconds per configuration")
    p.add_argument("--mtbf", type=float, default=50.0, help="mean seconds between failures")
    p.add_argument("--weibull", type=float, default=None, metavar="SHAPE", help="Weibull inter-arrivals (same mean)")
    p.add_argument("--mix", default="crash=0.5,node=0.5", help="failure classes and weights")
    p.add_argument("--seed", type=int, default=1, help="seeds the failure schedule and the training data")
    p.add_argument("--layers", type=int, default=22, help="Linear layers in all (half per rank)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--verify", action="store_true", help="digest the state at every save and every restore")
    p.add_argument("--durable", metavar="URL", help="an S3 prefix to use instead of starting a SeaweedFS server")
    p.add_argument("--storage-options", default="{}", help="JSON storage options for --durable")
    p.add_argument("--ram-root", default="/dev/shm", help="where the nodes' RAM directories go")
    p.add_argument("--defer", action="store_true",
                   help="hold each failure (and the window's end) until the run has committed a step where that "
                        "failure leaves it: for tests on a busy machine, where a run may not get that far in time")
    p.add_argument("--parallel", action="store_true", help="run the configurations side by side, not one by one")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (default: only the logs stay)")
    p.add_argument("--launch", choices=("fork", "exec"), default="fork",
                   help="fork ranks from a process that imported torch once (default), or start each afresh")
    p.add_argument("--background-nice", type=int, default=None, metavar="N",
                   help="the stores' background_nice (default: the engine's own)")
    p.add_argument("--local-every", type=int, default=1, metavar="K",
                   help="the full configurations' local_every (default 1). Their peers take every save, and a "
                        "replicated save always goes to the local tier, so since 5fda85d it skips none; the "
                        "session-14 windows in docs/goodput.md ran the first version (99c2702), which skipped them")
    p.add_argument("--s3-nice", type=int, default=0, metavar="N",
                   help="run the local S3 server N steps below the job's priority (it stands for a remote store)")
    p.add_argument("--cpu-log", type=float, default=0.0, metavar="S",
                   help="sample the CPU of every rank's threads, the agents and the S3 server every S seconds "
                        "(cpu-*.jsonl; `--cpu-breakdown DIR` splits it by idle and in-flight steps)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from ckptstore.goodput.simulate import mix_from_spec

    # A SIGTERM (timeout, a batch system) unwinds through the finally clauses that kill the ranks,
    # the agents, the zygote and the object store, and remove the RAM directories.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configuration(s) {unknown}: choose from {', '.join(CONFIGS)}")
    if args.interval == "plan" and not args.cost_from:
        p.error("--interval plan needs --cost-from (an earlier --out)")
    failures = schedule(args.mtbf, args.window, args.seed, args.weibull, mix_from_spec(args.mix))
    print(f"{len(failures)} failures in {args.window:g} s: "
          + ", ".join(f"{f['at']:.1f}s {f['class']} r{f['rank']}" for f in failures), flush=True)
    os.makedirs(args.out, exist_ok=True)
    results = {}
    zygote = Zygote() if args.launch == "fork" else None
    needs_s3 = any(uses_s3(n) for n in names) and not args.durable
    with object_store(needs_s3, args.s3_nice) as s3, contextlib.ExitStack() as stack:
        if zygote is not None:
            stack.callback(zygote.close)
        supervisors = []
        for name in names:
            every = (planned_every(name, args) if args.interval == "plan" else args.every if args.every
                     else max(1, round(float(args.interval) / args.step_s)))
            supervisors.append(Supervisor(name, args.out, args, every, s3, zygote))
            stack.callback(supervisors[-1].cleanup)

        def run(sup: Supervisor) -> None:
            results[sup.name] = sup.run(failures, args.window)
            # What every restart must hold to (a committed step never lost, the accounting adding
            # up; bitwise resumes with --verify), checked on the log of the run just measured.
            problems = check(os.path.join(args.out, sup.name))
            results[sup.name]["problems"] = problems
            print(f"{sup.name}: every {sup.every} steps, {results[sup.name]['attempts']} runs"
                  + "".join(f"\n  PROBLEM: {p}" for p in problems), flush=True)

        if args.parallel:  # the same schedule at the same instants: each sees the others' load
            with concurrent.futures.ThreadPoolExecutor(len(supervisors)) as pool:
                for f in [pool.submit(run, sup) for sup in supervisors]:
                    f.result()
        else:
            for sup in supervisors:
                run(sup)
    with open(os.path.join(args.out, f"schedule-{'+'.join(names)}.json"), "w") as fh:
        json.dump({"failures": failures, "args": vars(args), "results": results}, fh, indent=1)
    return 0


def _in_flight(events: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], list[tuple[float, float]]]]:
    """Each run's records (rank 0's ticks, saves and commits) and the spans of time in which one of
    its saves was in flight: from the call to the last tier it committed to, or to the run's next
    save or its end when no commit was recorded."""
    by_pid: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("event") in ("tick", "save", "commit"):
            by_pid.setdefault(e.get("pid"), []).append(e)
    out = []
    for records in by_pid.values():
        saves = [e for e in records if e["event"] == "save"]
        end = max(e["t"] for e in records)
        spans = []
        for i, sv in enumerate(saves):
            commits = [c["t"] for c in records if c["event"] == "commit" and c.get("step") == sv["step"]]
            until = max(commits) if commits else (saves[i + 1]["t"] if i + 1 < len(saves) else end)
            spans.append((sv["t"] - float(sv.get("blocking_s", 0.0)), until))
        out.append((records, spans))
    return out


def cpu_breakdown(run_dir: str) -> dict[str, dict[str, dict[str, float]]]:
    """Cores used by each kind of thread (per rank) and each process beside the ranks, while no
    save is in flight (``idle``) and while one is (``in_flight``), from ``--cpu-log``'s samples: an
    interval between two samples counts as idle when it overlaps no save in flight."""
    spans = sorted(span for _records, sp in _in_flight(_records(os.path.join(run_dir, "events.jsonl"))) for span in sp)

    def kind(a: float, b: float) -> str:
        return "in_flight" if any(x < b and a < y for x, y in spans) else "idle"

    out: dict[str, dict[str, dict[str, float]]] = {}

    def add(source: str, key: str, part: str, value: float) -> None:
        out.setdefault(source, {}).setdefault(key, {"idle": 0.0, "in_flight": 0.0})[part] += value

    for path in sorted(glob.glob(os.path.join(run_dir, "cpu-*.jsonl"))):
        by_pid: dict[Any, list[dict[str, Any]]] = {}
        for r in _records(path):
            by_pid.setdefault(r.get("pid", "others"), []).append(r)
        others = path.endswith("cpu-others.jsonl")
        for recs in by_pid.values():
            for prev, cur in zip(recs, recs[1:]):
                part = kind(prev["t"], cur["t"])
                source = "others" if others else f"rank{cur['rank']}"
                add(source, "(seconds)", part, cur["t"] - prev["t"])
                items = cur["procs"] if others else cur["threads"]
                before = prev["procs"] if others else prev["threads"]
                for tid, (label, cpu) in items.items():
                    was = before.get(tid)
                    if cpu is None or (was is not None and was[1] is None):
                        continue
                    add(source, label, part, cpu - (was[1] if was is not None else cpu))
    return out


def print_cpu_breakdown(paths: list[str]) -> int:
    for run_dir in paths:
        print(f"{run_dir}: cores used while no save is in flight / while one is")
        for source, labels in cpu_breakdown(run_dir).items():
            secs = labels.pop("(seconds)", {"idle": 0.0, "in_flight": 0.0})
            print(f"  {source} ({secs['idle']:.0f} s idle, {secs['in_flight']:.0f} s in flight)")
            for label, v in sorted(labels.items(), key=lambda kv: -kv[1]["idle"] - kv[1]["in_flight"]):
                idle = v["idle"] / secs["idle"] if secs["idle"] else 0.0
                busy = v["in_flight"] / secs["in_flight"] if secs["in_flight"] else 0.0
                if idle >= 0.001 or busy >= 0.001:
                    print(f"    {label:32s} {idle:6.3f} / {busy:6.3f}")
    return 0


def steps_in_flight(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How much the training steps slow down while a save is persisting in the background: the
    median step time of the steps that overlap a save in flight (from its call to the last tier it
    committed to, or to the run's next save or its end when a commit was never recorded) against
    that of the others. Rank 0's steps (ticks) and commits, run by run."""
    busy, idle = [], []
    for records, spans in _in_flight(events):
        ticks = [e for e in records if e["event"] == "tick"]
        for tk in ticks:
            t0, t1 = tk["t"] - float(tk["step_s"]), tk["t"]
            (busy if any(a < t1 and t0 < b for a, b in spans) else idle).append(float(tk["step_s"]))
    med = statistics.median
    return {"steps_in_flight": len(busy), "steps_idle": len(idle),
            "median_in_flight_s": med(busy) if busy else None, "median_idle_s": med(idle) if idle else None,
            "slowdown": (med(busy) / med(idle) - 1.0) if busy and idle else None}


def print_steps_in_flight(paths: list[str]) -> int:
    for path in paths:
        r = steps_in_flight(_records(path))
        fmt = lambda v: "-" if v is None else f"{v:.3f} s"  # noqa: E731
        print(f"{path}: {r['steps_idle']} steps without a save in flight, median {fmt(r['median_idle_s'])}; "
              f"{r['steps_in_flight']} with one, median {fmt(r['median_in_flight_s'])}"
              + ("" if r["slowdown"] is None else f" ({100 * r['slowdown']:+.1f}%)"))
    return 0


AFTER_RESTORE = ((0.0, 15.0), (15.0, 30.0), (30.0, float("inf")))


def steps_after_restore(events: list[dict[str, Any]]) -> dict[str, tuple[int, float | None]]:
    """The median step by seconds since the run's restore returned (0-15, 15-30, 30 and more):
    whether the steps right after a restart are slower than the later ones (work a restart
    leaves running beside the trainer), rank 0's steps."""
    since: float | None = None
    spans: dict[str, list[float]] = {f"{a:g}-{b:g} s": [] for a, b in AFTER_RESTORE}
    for e in events:
        if e["event"] == "restore":
            since = float(e["t"])
        elif e["event"] == "tick" and since is not None:
            age = float(e["t"]) - since
            for a, b in AFTER_RESTORE:
                if a <= age < b:
                    spans[f"{a:g}-{b:g} s"].append(float(e["step_s"]))
    return {k: (len(v), statistics.median(v) if v else None) for k, v in spans.items()}


def print_steps_after_restore(paths: list[str]) -> int:
    for path in paths:
        spans = steps_after_restore(_records(path))
        print(f"{path}: median step by time since the restore: " + ", ".join(
            f"{k} {'-' if m is None else f'{m:.3f} s'} ({n} steps)" for k, (n, m) in spans.items()))
    return 0


def steps_reached(events: list[dict[str, Any]], at_s: list[float]) -> dict[float, int]:
    """The step rank 0 had reached at each of ``at_s`` seconds after the log's first record: work a
    failure loses is trained again, so the step reached is the training done by then, whichever
    configuration ran and however its time was spent (0 before the first step)."""
    t0 = float(events[0]["t"]) if events else 0.0
    ticks = [(float(e["t"]) - t0, int(e["step"])) for e in events if e["event"] == "tick"]
    out: dict[float, int] = {}
    for at in at_s:
        out[at] = next((step for t, step in reversed(ticks) if t <= at), 0)
    return out


def print_steps_reached(argv: list[str]) -> int:
    """``--steps-reached T1,T2,... LOG...``: the step each log's job had reached at those seconds."""
    at_s = [float(v) for v in argv[0].split(",")]
    for path in argv[1:]:
        got = steps_reached(_records(path), at_s)
        print(f"{path}: step reached at " + ", ".join(f"{t:g} s {n}" for t, n in got.items()))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote_main()
    elif sys.argv[1:2] == ["--cpu-breakdown"]:
        sys.exit(print_cpu_breakdown(sys.argv[2:]))
    elif sys.argv[1:2] == ["--steps-in-flight"]:
        sys.exit(print_steps_in_flight(sys.argv[2:]))
    elif sys.argv[1:2] == ["--steps-after-restore"]:
        sys.exit(print_steps_after_restore(sys.argv[2:]))
    elif sys.argv[1:2] == ["--steps-reached"]:
        sys.exit(print_steps_reached(sys.argv[2:]))
    elif len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
