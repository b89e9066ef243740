"""Step-time overhead of checkpointing a training loop with CheckpointStore (the end-to-end
figure): the same loop with and without ``store.save`` every ``--every`` steps, same process, same run.

Design (a 2-core CPU box with no GPU; the whole script takes ~4-5 minutes):

- The state is a real training state: ``--layers`` x Linear(2048, 2048) (22 layers: 92 M fp32
  parameters) trained by Adam, so the checkpoint (parameters + exp_avg + exp_avg_sq, plus Adam's
  step counters) is ~1.03 GiB. Every step is a genuine step on the *whole* model: forward and
  backward of a ``--batch`` x 2048 batch, then ``Adam.step`` over all parameters (which rewrites
  every checkpointed byte, so each save copies changed data). Gradients are zeroed in place, so
  the loop reuses warm buffers, as a real loop does.
- Checkpointed loop: after the optimizer step of every ``--every``-th step the loop calls
  ``store.save(step, {"model": ..., "optim": ...})``, which copies the state into a reused RAM
  slot (/dev/shm) and returns; checksumming, committing in RAM and persisting to the local tier (a
  directory on the real disk, checked not to be tmpfs) run in the background, as does retention
  (``keep_local=3``). A round is a whole number of checkpoint intervals and each interval's save
  falls on its first step (steps 1, 11, ... of the round), so every save's persistence overlaps
  the rest of its interval inside the timed round, as in a long run's steady state.
- Case (a), a loop that leaves a core free, as a GPU-bound loop does (its CPU thread mostly waits
  for the device): the training compute runs with ``torch.set_num_threads(1)``; ckptstore's
  background work may use the other core. Target: under 5% step-time overhead.
- Case (b), a CPU-bound loop: ``torch.set_num_threads(2)``, both cores train, so background
  persistence competes with the training. Reported, no target.
- Per case: one unmeasured warm-up round of each loop (the checkpointed one saves twice, touching
  both RAM slots), then ``--rounds`` interleaved rounds of ``--steps`` steps (default: 12 rounds
  of one 10-step interval each), alternating which loop goes first. Short rounds pair each
  checkpointed round with a baseline round run seconds apart: this VM's step time drifts by 2x
  or more when its host (or another process on its 2 cores) is busy, and a paired ratio cancels
  that. The loops reuse the same warm buffers and RAM slots throughout (this VM returns freed
  memory to its host and pages out memory idle for ~60 s). After each checkpointed round the
  store is drained (untimed, so nothing overlaps the next baseline round); that wait is reported
  as ``tail_s`` and is ~0 when persistence kept up. The 1-minute load average and the CPU time
  the host stole from the VM (/proc/stat) are recorded per round as noise indicators.

Reported per case: mean and median step time of each loop; the overhead = median over rounds of
(checkpointed round's mean step / same round's baseline mean step) - 1 (pairs adjacent in time
cancel the VM's drift), the ratio of the pooled means, and a cross-check without the baseline
rounds (each checkpoint interval against its own steps after the snapshot was on disk); the
blocking time of ``save`` (building the state dicts + staging); whether background persistence
kept up: each snapshot was persisted locally before the step at which the next save is due, and
no save found its RAM slot still busy (which under ``policy="block"`` would have made it wait);
and the persistence latency (from ``save`` returning to the snapshot being committed on disk,
observed at step granularity, so an upper bound).

    python benchmarks/bench_loop.py [--layers 22] [--batch 32] [--steps 10] [--rounds 12] [--every 10]
                                    [--dir DIR] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from ckptstore.engine.store import CheckpointStore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JOB_PREFIX, pyplot, report  # noqa: E402 - shared by the benchmark scripts

CASES = {
    "a": (1, "1 training thread (a core left free, as in a GPU-bound loop)"),
    "b": (2, "2 training threads (CPU-bound: training and persistence share the cores)"),
}
TARGET_OVERHEAD_PCT = {"a": 5.0}


def fs_type(path: str) -> tuple[str, str]:
    """(mount point, file system type) holding ``path``, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("", "unknown")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                _dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fstype)
    except OSError:
        pass
    return best


class Trainer:
    """A Linear(2048, 2048) stack trained by Adam on a fixed batch; one ``step`` is a full step."""

    def __init__(self, layers: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, 2048)
        self.step()  # creates the gradients and Adam's state: every later step reuses them

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        self.model(self.x).square().mean().backward()
        self.opt.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def nbytes(self) -> int:
        s = self.state()
        n = sum(t.numel() * t.element_size() for t in s["model"].values())
        for per_param in s["optim"]["state"].values():
            n += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
        return n


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs from /proc/stat: time the host took from this VM."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def run_round(trainer: Trainer, steps: int, store: CheckpointStore | None, every: int, first_step: int) -> dict[str, Any]:
    """``steps`` timed steps; with a store, a save after each step i with i % every == 1 % every."""
    gc.collect()
    steal0, total0 = cpu_ticks()
    times: list[float] = []
    saves: list[dict[str, Any]] = []
    pending: list[tuple[Any, float, dict[str, Any]]] = []  # (handle, when save returned, its record)
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        trainer.step()
        if store is not None and i % every == 1 % every:
            rec: dict[str, Any] = {
                "step_in_round": i,
                # Public API check: the previous snapshot is already on disk when the next save starts.
                "previous_persisted": all(h.done("local") for h, _, _ in pending) if saves else None,
            }
            ts = time.perf_counter()
            handle = store.save(first_step + i, trainer.state())
            te = time.perf_counter()
            rec["blocking_s"] = te - ts
            # The public record of a wait for the RAM slot (the snapshot before it still persisting).
            rec["slot_busy"] = handle.waited_s > 1e-3
            rec["skipped"] = handle.skipped
            saves.append(rec)
            pending.append((handle, te, rec))
        t1 = time.perf_counter()
        times.append(t1 - t0)
        for h, t_ret, rec in list(pending):  # not timed: a cheap poll of the handles
            if h.done("local"):
                h.wait("local")  # re-raises a background failure
                rec["persist_latency_s"] = t1 - t_ret
                rec["persist_latency_steps"] = i - rec["step_in_round"]
                pending.remove((h, t_ret, rec))
    out: dict[str, Any] = {"step_s": times, "mean_step_s": statistics.fmean(times), "median_step_s": statistics.median(times),
                           "loadavg_1min": os.getloadavg()[0]}
    steal1, total1 = cpu_ticks()
    out["steal_pct"] = 100 * (steal1 - steal0) / (total1 - total0) if total1 > total0 else None
    if store is not None:
        t = time.perf_counter()
        for h, _, rec in pending:
            h.wait("local")
            rec["persist_latency_s"] = None  # not persisted within the round
        store._drain()  # retention too: nothing from this round may overlap the next one
        out["tail_s"] = time.perf_counter() - t
        out["last_persisted_in_round"] = not pending
        out["saves"] = saves
    return out


def summarize(case: str, rounds: list[dict[str, dict[str, Any]]], every: int) -> dict[str, Any]:
    base = [r["baseline"] for r in rounds]
    ckpt = [r["checkpointed"] for r in rounds]
    base_steps = [t for r in base for t in r["step_s"]]
    ckpt_steps = [t for r in ckpt for t in r["step_s"]]
    saves = [s for r in ckpt for s in r["saves"]]
    paired = [c["mean_step_s"] / b["mean_step_s"] for b, c in zip(base, ckpt)]
    lat = [s["persist_latency_s"] for s in saves if s.get("persist_latency_s") is not None]
    prev = [s["previous_persisted"] for s in saves if s["previous_persisted"] is not None]
    # Persisted before the step at which the next save is due (polled at the end of each step).
    in_time = [s.get("persist_latency_steps") is not None and s["persist_latency_steps"] < every for s in saves]
    busy = [s["slot_busy"] for s in saves if s["slot_busy"] is not None]
    overhead = (statistics.median(paired) - 1) * 100
    # Cross-check that does not use the baseline rounds: each checkpoint interval against its own
    # steps after the snapshot was on disk (seconds apart, so the VM's drift mostly cancels; it
    # misses a cost that would last the whole interval).
    within = []
    for r in ckpt:
        for sv in r["saves"]:
            start = sv["step_in_round"] - 1
            interval = r["step_s"][start : start + every]
            quiet = interval[1 + (sv.get("persist_latency_steps") or every) :]
            if len(interval) == every and len(quiet) >= 3:
                within.append(sum(interval) / (len(interval) * statistics.median(quiet)) - 1)
    target = TARGET_OVERHEAD_PCT.get(case)
    return {
        "threads": CASES[case][0],
        "description": CASES[case][1],
        "checkpoint_every": every,
        "baseline": {
            "mean_step_s": statistics.fmean(base_steps),
            "median_step_s": statistics.median(base_steps),
            "round_mean_step_s": [r["mean_step_s"] for r in base],
        },
        "checkpointed": {
            "mean_step_s": statistics.fmean(ckpt_steps),
            "median_step_s": statistics.median(ckpt_steps),
            "round_mean_step_s": [r["mean_step_s"] for r in ckpt],
        },
        "overhead_pct": overhead,
        "overhead_pct_per_round": [(p - 1) * 100 for p in paired],
        "overhead_pct_pooled_means": (statistics.fmean(ckpt_steps) / statistics.fmean(base_steps) - 1) * 100,
        "overhead_pct_within_interval": statistics.median(within) * 100 if within else None,
        "target_overhead_pct": target,
        "target_met": None if target is None else overhead < target,
        "save_blocking_s": {
            "median": statistics.median(s["blocking_s"] for s in saves),
            "mean": statistics.fmean(s["blocking_s"] for s in saves),
            "max": max(s["blocking_s"] for s in saves),
            "all": [s["blocking_s"] for s in saves],
        },
        "saves": len(saves),
        "saves_skipped": sum(bool(s["skipped"]) for s in saves),
        "saves_finding_slot_busy": sum(busy) if busy else None,
        "persisted_before_next_save_due": f"{sum(in_time)}/{len(in_time)}",
        "previous_snapshot_persisted_at_next_save": f"{sum(prev)}/{len(prev)}" if prev else None,
        "kept_up": all(in_time) and all(prev) and not any(busy),
        "persist_latency_s_upper_bound": {"median": statistics.median(lat), "max": max(lat)} if lat else None,
        "tail_s_after_rounds": [r["tail_s"] for r in ckpt],
        "loadavg_1min_per_round": {"baseline": [r["loadavg_1min"] for r in base],
                                   "checkpointed": [r["loadavg_1min"] for r in ckpt]},
        "steal_pct_per_round": {"baseline": [r["steal_pct"] for r in base], "checkpointed": [r["steal_pct"] for r in ckpt]},
        # Every timed step of each loop, rounds concatenated in order, for the plot.
        "trace": {"baseline": base_steps, "checkpointed": ckpt_steps,
                  "save_steps": [j * len(r["step_s"]) + s["step_in_round"] for j, r in enumerate(ckpt) for s in r["saves"]]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round (a multiple of --every)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds of each loop, per case")
    ap.add_argument("--every", type=int, default=10, help="one checkpoint per this many steps")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    ap.add_argument("--dir", default=None, help="parent of the local tier's directory (a real disk, not tmpfs)")
    ap.add_argument("--ram-dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    ap.add_argument("--name", default="loop", help="results go to <out>/<name>.json and .png")
    args = ap.parse_args()
    if args.steps % args.every:
        ap.error("--steps must be a multiple of --every (one save per interval)")
    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="ckptstore-bench-loop-", dir=args.dir)
    mount, fstype = fs_type(work)
    if fstype in ("tmpfs", "ramfs"):
        shutil.rmtree(work, ignore_errors=True)
        sys.exit(f"{work} is on {fstype} ({mount}): the local tier must be a real disk; pass --dir")
    print(f"local tier under {work} ({fstype} at {mount})")
    torch.set_num_threads(CASES[args.cases[0]][0])
    trainer = Trainer(args.layers, args.batch)
    nbytes = trainer.nbytes()
    job = f"{JOB_PREFIX}-loop-{uuid.uuid4().hex[:8]}"
    store = None
    next_step = 0
    cases: dict[str, Any] = {}
    try:
        store = CheckpointStore(job, local=os.path.join(work, "local"), keep_local=3, ram_dir=args.ram_dir, policy="block")
        for case in args.cases:
            torch.set_num_threads(CASES[case][0])
            print(f"case {case}: {CASES[case][1]}", flush=True)
            run_round(trainer, args.every, None, args.every, 0)  # warm-up, not measured
            run_round(trainer, 2 * args.every, store, args.every, next_step)  # touches both RAM slots
            next_step += 2 * args.every
            rounds: list[dict[str, dict[str, Any]]] = []
            for r in range(args.rounds):
                order = ["baseline", "checkpointed"] if r % 2 == 0 else ["checkpointed", "baseline"]
                res: dict[str, dict[str, Any]] = {}
                for name in order:
                    if name == "baseline":
                        res[name] = run_round(trainer, args.steps, None, args.every, 0)
                    else:
                        res[name] = run_round(trainer, args.steps, store, args.every, next_step)
                        next_step += args.steps
                    tail = f", drained in {res[name]['tail_s']:.3f} s" if "tail_s" in res[name] else ""
                    steal = res[name]["steal_pct"]
                    print(f"  round {r} {name:12s} mean step {res[name]['mean_step_s']:.3f} s (load "
                          f"{res[name]['loadavg_1min']:.1f}, steal {steal if steal is not None else float('nan'):.1f}%){tail}",
                          flush=True)
                rounds.append(res)
            cases[case] = summarize(case, rounds, args.every)
    finally:
        if store is not None:
            store.close()
        for f in os.listdir(args.ram_dir):
            if f.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join(args.ram_dir, f))
        shutil.rmtree(work, ignore_errors=True)

    results: dict[str, list[float]] = {}
    ratios: dict[str, float] = {}
    for case, c in cases.items():
        results[f"{case}_baseline_round_mean_step"] = c["baseline"]["round_mean_step_s"]
        results[f"{case}_checkpointed_round_mean_step"] = c["checkpointed"]["round_mean_step_s"]
        results[f"{case}_save_blocking"] = c["save_blocking_s"]["all"]
        ratios[f"{case}_checkpointed_vs_baseline_step"] = 1 + c["overhead_pct"] / 100
    doc = report(
        args.name,
        nbytes,
        args.rounds,
        results,
        ratios,
        args.out,
        note="GB_per_s is meaningful for *_save_blocking only (checkpointed bytes / blocking time)",
        config={"layers": args.layers, "batch": args.batch, "steps_per_round": args.steps, "rounds": args.rounds,
                "checkpoint_every": args.every, "keep_local": 3, "policy": "block", "ram_dir": args.ram_dir,
                "local_tier_fs": fstype, "local_tier_mount": mount},
        cases=cases,
        wall_s=time.perf_counter() - started,
    )
    print(f"\nloop: {nbytes / 2**30:.2f} GiB checkpointed every {args.every} steps; {args.rounds} rounds x {args.steps} steps")
    for case, c in cases.items():
        b, k, s = c["baseline"], c["checkpointed"], c["save_blocking_s"]
        target = f" (target < {c['target_overhead_pct']:.0f}%: {'met' if c['target_met'] else 'NOT met'})" if c["target_overhead_pct"] else ""
        print(f"  case {case}, {c['description']}")
        print(f"    step s, mean / median: baseline {b['mean_step_s']:.3f} / {b['median_step_s']:.3f}, "
              f"checkpointed {k['mean_step_s']:.3f} / {k['median_step_s']:.3f}")
        print(f"    overhead {c['overhead_pct']:+.2f}% (rounds: {', '.join(f'{p:+.2f}%' for p in c['overhead_pct_per_round'])}; "
              f"pooled means {c['overhead_pct_pooled_means']:+.2f}%){target}")
        if c["overhead_pct_within_interval"] is not None:
            print(f"    cross-check, each interval against its own steps after persisting: {c['overhead_pct_within_interval']:+.2f}%")
        lat = c["persist_latency_s_upper_bound"]
        persisted = f"; persisted within {lat['median']:.2f} s median, {lat['max']:.2f} s max" if lat else ""
        print(f"    save blocks median {s['median']:.3f} s (max {s['max']:.3f}); kept up: {c['kept_up']} "
              f"(persisted before the next save was due {c['persisted_before_next_save_due']}, "
              f"slot busy {c['saves_finding_slot_busy']}, skipped {c['saves_skipped']}){persisted}")
    print(f"  wall time {doc['wall_s']:.0f} s")
    plot(doc, os.path.join(args.out, f"{args.name}.png"))


def plot(doc: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = doc["cases"]
    fig, axes = plt.subplots(1, 1 + len(cases), figsize=(4 + 4.5 * len(cases), 3.8),
                             gridspec_kw={"width_ratios": [1] + [1.6] * len(cases)})
    ax = axes[0]
    xs = range(len(cases))
    base = [c["baseline"]["mean_step_s"] for c in cases.values()]
    ckpt = [c["checkpointed"]["mean_step_s"] for c in cases.values()]
    ax.bar([x - 0.2 for x in xs], base, 0.4, label="no checkpoints")
    ax.bar([x + 0.2 for x in xs], ckpt, 0.4, label=f"save every {doc['config']['checkpoint_every']} steps")
    for x, c, h in zip(xs, cases.values(), ckpt):
        ax.annotate(f"{c['overhead_pct']:+.1f}%", (x + 0.2, h), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [f"({k}) {c['threads']} thread{'s' if c['threads'] > 1 else ''}" for k, c in cases.items()])
    ax.set_ylabel("mean step time, s (lower is better)")
    ax.set_ylim(0, max(base + ckpt) * 1.35)
    ax.legend(fontsize=8, loc="upper right")
    for ax, (k, c) in zip(axes[1:], cases.items()):
        tr = c["trace"]
        steps = range(1, len(tr["baseline"]) + 1)
        ax.plot(steps, tr["baseline"], label="no checkpoints", lw=1)
        ax.plot(steps, tr["checkpointed"], label="checkpointed", lw=1)
        for s in tr["save_steps"]:
            ax.axvline(s, color="grey", lw=0.6, ls=":")
        ax.set_title(f"({k}) every timed step, rounds in order (dotted: saves)", fontsize=9)
        ax.set_xlabel("timed step (the two loops' rounds alternate in time)", fontsize=9)
        ax.set_ylim(bottom=0)
    axes[1].set_ylabel("step time, s")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Training loop, {doc['GiB']:.2f} GiB model + Adam state checkpointed with CheckpointStore, "
                 f"{doc['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
