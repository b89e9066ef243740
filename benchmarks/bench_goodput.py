"""Goodput figures for docs/goodput.md: the planner's model against the failure simulator, the seed's
production example side by side, and how far the formulas go when failures are not exponential.

The planner and the simulator are pure arithmetic (numpy, vectorised over trials), so those parts run
in seconds on any machine and are deterministic (seeded). ``--sdc-mib N`` also measures what the
replica check costs a real save: two ranks (gloo over loopback) save N MiB of replicated tensors
with sdc="off" and sdc="warn", and the blocking time and the background time to the RAM commit are
compared. ``--events-demo`` runs a small job for real (a training loop of sleeps with
``interval="auto"``, killed twice with os._exit and resumed) and draws ``ckptstore goodput``'s plot of
its event log (events.png). Writes goodput.json and the PNGs under --out.

    python benchmarks/bench_goodput.py [--trials 2000] [--sdc-mib 256] [--events-demo] [--out docs/goodput]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from common import machine, pyplot

from ckptstore.goodput import planner
from ckptstore.goodput.simulate import Config, seed_example, simulate

DAY, H, MIN = 86400.0, 3600.0, 60.0


def interval_sweep(trials: int) -> dict:
    """Waste against interval for the seed's example (cost 1 min, MTBF 3 h), with and without a
    10-minute restart: the exact model, the first-order formula and the simulation with its CI."""
    cost, mtbf = 1 * MIN, 3 * H
    out: dict = {"cost_s": cost, "mtbf_s": mtbf, "young_s": planner.young(cost, mtbf), "daly_s": planner.daly(cost, mtbf),
                 "curves": {}}
    for restart in (0.0, 10 * MIN):
        taus = [m * MIN for m in (3, 5, 8, 12, 16, 19, 24, 30, 40, 55, 75)]
        sims = []
        for i, tau in enumerate(taus):
            r = simulate(Config("sweep", tau + cost, cost, restart), mtbf=mtbf, work=21 * DAY, trials=trials, seed=100 + i)
            sims.append({"tau_s": tau, "waste": 1 - r.goodput, "ci95": [1 - r.ci95[1], 1 - r.ci95[0]],
                         "exact": planner.waste(tau, cost, mtbf, restart).total,
                         "first_order": planner.first_order_waste(tau, cost, mtbf, restart)})
        out["curves"][f"restart_{int(restart)}s"] = sims
    return out


def seed_comparison(trials: int) -> dict:
    llama = planner.mtbf_from_rate(419, 54 * DAY, 16384, 4096)
    out = {}
    for label, mtbf in (("llama3_rate_4096_gpus", llama), ("mtbf_4.5h", 4.5 * H)):
        out[label] = {"mtbf_s": mtbf, "results": [simulate(c, mtbf=mtbf, work=21 * DAY, trials=trials, seed=1).to_json()
                                                  for c in seed_example()]}
    return out


def weibull_limits(trials: int) -> dict:
    """The same MTBF (3 h), exponential against Weibull shape 0.7 (failures that cluster, as HPC logs
    show): where the optimum moves and how much goodput the formula's interval leaves."""
    cost, mtbf, restart = 1 * MIN, 3 * H, 10 * MIN
    out: dict = {}
    for shape in (None, 0.7):
        rows = []
        for i, m in enumerate((5, 10, 15, 19, 25, 35, 50, 70)):
            r = simulate(Config("w", m * MIN + cost, cost, restart), mtbf=mtbf, work=21 * DAY, trials=trials,
                         seed=200 + i, weibull=shape)
            rows.append({"tau_s": m * MIN, "goodput": r.goodput, "ci95": list(r.ci95)})
        out["exponential" if shape is None else f"weibull_{shape}"] = rows
    return out


def _sdc_worker(rank: int, world: int, init: str, mib: int, repeats: int, out: str) -> None:
    import tempfile

    import torch
    import torch.distributed as dist

    import ckptstore

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(mib * (1 << 20) // 4 // 8, generator=g) for i in range(8)}  # replicated
    results = {}
    for policy in ("off", "warn"):
        job = f"bench-sdc-{policy}-{init.rsplit('-', 1)[-1]}"
        with tempfile.TemporaryDirectory() as tmp, ckptstore.CheckpointStore(job, local=tmp, sdc=policy) as store:
            blocking, to_ram = [], []
            for step in range(repeats + 1):
                t0 = time.perf_counter()
                h = store.save(step, state)
                t1 = time.perf_counter()
                h.wait("ram")
                t2 = time.perf_counter()
                h.wait("local")
                if step:  # the first save faults the slots in
                    blocking.append(t1 - t0)
                    to_ram.append(t2 - t0)
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptstore-{job}-r{rank:05d}-"):
                os.unlink(os.path.join("/dev/shm", name))
        results[policy] = {"blocking_s": blocking, "to_ram_commit_s": to_ram}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def sdc_cost(mib: int, repeats: int = 5) -> dict:
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sdc.json")
        init = f"file://{tmp}/pg-{os.getpid()}"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_sdc_worker, args=(r, 2, init, mib, repeats, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        with open(out) as fh:
            raw = json.load(fh)
    med = {p: {k: statistics.median(v) for k, v in r.items()} for p, r in raw.items()}
    return {"mib": mib, "ranks": 2, "repeats": repeats, "seconds": raw, "median_s": med,
            "blocking_ratio": med["warn"]["blocking_s"] / med["off"]["blocking_s"],
            "to_ram_ratio": med["warn"]["to_ram_commit_s"] / med["off"]["to_ram_commit_s"]}


_DEMO_RUN = """
import os, sys, time, torch, ckptstore
local, job, crash_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
state = {"w": torch.zeros(4 << 20), "step": 0}
with ckptstore.CheckpointStore(job, local=local, events=True, interval="auto", mtbf=40.0) as store:
    first = store.restore(state)
    step = 0 if first is None else first + 1
    while step < 400:
        time.sleep(0.05)  # a training step
        state["w"] += 1
        state["step"] = step
        if store.should_save(step):
            store.save(step, state)
        if step == crash_at:
            time.sleep(0.3)
            os._exit(9)  # a failure: no close()
        step += 1
"""


def event_log_demo(out_dir: str) -> dict:
    import subprocess
    import sys
    import tempfile

    from ckptstore.goodput.events import account, plot, read_events

    job = f"bench-events-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "local")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for crash_at in (150, 260, -1):
            subprocess.run([sys.executable, "-c", _DEMO_RUN, local, job, str(crash_at)], env=env, check=crash_at < 0)
            time.sleep(2.0)  # detection and rescheduling
        acc = account(read_events(os.path.join(local, "events.jsonl")))
        plot(acc, os.path.join(out_dir, "events.png"), title="a 400-step job killed twice")
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ckptstore-{job}-"):
                os.unlink(os.path.join("/dev/shm", name))
    return acc.to_json()


def plots(doc: dict, out_dir: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sweep = doc["interval_sweep"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for key, color in (("restart_0s", "#1f77b4"), ("restart_600s", "#d62728")):
        rows = sweep["curves"][key]
        x = [r["tau_s"] / 60 for r in rows]
        label = "no restart" if key == "restart_0s" else "10 min restart"
        ax.plot(x, [r["exact"] * 100 for r in rows], color=color, label=f"Daly's model, {label}")
        ax.plot(x, [r["first_order"] * 100 for r in rows], color=color, ls=":", label=f"first order, {label}")
        ax.errorbar(x, [r["waste"] * 100 for r in rows],
                    yerr=[[(r["waste"] - r["ci95"][0]) * 100 for r in rows], [(r["ci95"][1] - r["waste"]) * 100 for r in rows]],
                    fmt="o", color=color, ms=3, capsize=2, label=f"simulation (95% CI), {label}")
    ax.axvline(sweep["young_s"] / 60, color="gray", ls="--", lw=1)
    ax.axvline(sweep["daly_s"] / 60, color="black", ls="-.", lw=1)
    ax.text(sweep["young_s"] / 60 + 0.5, 33, "Young", fontsize=8, color="gray")
    ax.text(sweep["daly_s"] / 60 - 5.5, 33, "Daly", fontsize=8)
    ax.set_xscale("log")
    ticks = [3, 5, 10, 20, 40, 75]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("training time between checkpoints (min)")
    ax.set_ylabel("waste (% of wall clock)")
    ax.set_ylim(0, 36)
    ax.set_title("Checkpoint cost 1 min, MTBF 3 h: model, first-order formula, simulation", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "interval.png"), dpi=110)
    plt.close(fig)

    colors = {"useful": "#2ca02c", "checkpoint": "#1f77b4", "lost": "#ff7f0e", "restart": "#d62728"}
    cases = doc["seed_example"]
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 1.6 * len(cases) + 0.8), sharex=True)
    for ax, (label, case) in zip(axes, cases.items()):
        for i, r in enumerate(case["results"]):
            left = 0.0
            for name, share in r["fractions"].items():
                ax.barh(i, share * 100, left=left, color=colors[name], label=name if i == 0 else None)
                left += share * 100
            ax.text(101, i, f"{r['goodput'] * 100:.1f}%", va="center", fontsize=8)
        ax.set_yticks(range(len(case["results"])), [r["name"] for r in case["results"]], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"MTBF {case['mtbf_s'] / 3600:.3g} h" + (" (Llama 3's rate on 4,096 GPUs)" if "llama" in label else ""),
                     fontsize=9)
    axes[0].legend(ncol=4, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.15), frameon=False)
    axes[-1].set_xlim(0, 112)
    axes[-1].set_xlabel("% of wall-clock time (21 days of training)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "seed.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for key, color in (("exponential", "#1f77b4"), ("weibull_0.7", "#9467bd")):
        rows = doc["weibull"][key]
        ax.errorbar([r["tau_s"] / 60 for r in rows], [r["goodput"] * 100 for r in rows],
                    yerr=[[(r["goodput"] - r["ci95"][0]) * 100 for r in rows], [(r["ci95"][1] - r["goodput"]) * 100 for r in rows]],
                    fmt="o-", ms=3, capsize=2, color=color, label=key.replace("_", " shape "))
    ax.axvline(planner.daly(60, 3 * H) / 60, color="black", ls="-.", lw=1, label="Daly's interval")
    ax.set_xlabel("training time between checkpoints (min)")
    ax.set_ylabel("goodput (%)")
    ax.set_title("Same MTBF (3 h), cost 1 min, restart 10 min: exponential vs Weibull failures", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "weibull.png"), dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--sdc-mib", type=int, default=0, help="also measure the replica check on N MiB (0: skip)")
    parser.add_argument("--events-demo", action="store_true", help="also run a real job with two crashes")
    parser.add_argument("--out", default="docs/goodput")
    args = parser.parse_args()
    t0 = time.perf_counter()
    doc = {"benchmark": "goodput", "trials": args.trials, "interval_sweep": interval_sweep(args.trials),
           "seed_example": seed_comparison(args.trials), "weibull": weibull_limits(args.trials)}
    doc["seconds"] = time.perf_counter() - t0
    if args.sdc_mib:
        doc["sdc"] = sdc_cost(args.sdc_mib)
    os.makedirs(args.out, exist_ok=True)
    if args.events_demo:
        doc["events_demo"] = event_log_demo(args.out)
    doc["machine"] = machine()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "goodput.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
    plots(doc, args.out)
    sweep = doc["interval_sweep"]
    print(f"goodput: {doc['seconds']:.1f} s for all simulations ({args.trials} trials each)")
    print(f"  Young {sweep['young_s'] / 60:.2f} min, Daly {sweep['daly_s'] / 60:.2f} min (cost 1 min, MTBF 3 h)")
    for key, rows in sweep["curves"].items():
        worst = max(abs(r["waste"] - r["exact"]) / max(r["ci95"][1] - r["waste"], 1e-12) * 1.96 for r in rows)
        print(f"  {key}: simulation vs model, largest gap {worst:.2f} standard errors")
    for label, case in doc["seed_example"].items():
        print(f"  seed example, {label} (MTBF {case['mtbf_s'] / 3600:.3g} h): "
              + ", ".join(f"{r['name']} {r['goodput'] * 100:.1f}%" for r in case["results"]))
    for key, rows in doc["weibull"].items():
        best = max(rows, key=lambda r: r["goodput"])
        print(f"  {key}: best {best['goodput'] * 100:.2f}% at {best['tau_s'] / 60:.0f} min")
    if "sdc" in doc:
        sdc = doc["sdc"]
        for policy, m in sdc["median_s"].items():
            print(f"  sdc={policy}: {sdc['mib']} MiB replicated on 2 ranks: save blocks {m['blocking_s']:.3f} s, "
                  f"RAM commit after {m['to_ram_commit_s']:.3f} s")
        print(f"  replica check: blocking x{sdc['blocking_ratio']:.2f}, to the RAM commit x{sdc['to_ram_ratio']:.2f}")
    if "events_demo" in doc:
        e = doc["events_demo"]
        print(f"  event log demo: {e['runs']} runs, {e['failures']} failures, goodput {e['goodput'] * 100:.1f}% "
              + ", ".join(f"{k} {v * 100:.1f}%" for k, v in e["fractions"].items()))


if __name__ == "__main__":
    main()
