"""The benchmark suite in one run: ckptstore against torch.save/torch.load, safetensors and
torch.distributed.checkpoint, side by side, medians over interleaved repeats with the spread shown.

Each part is one of the scripts next to this file, run in a fresh process (so no part inherits
another's memory or threads), writing its JSON and PNG to ``--out``:

    dropin   bench_dropin.py   ckptstore.save/load vs torch.save/load (plain, mmap) and safetensors
    sharded  bench_sharded.py  save_sharded/load_sharded vs DCP with 1, 2, 4 ranks, and a reshard load
    async    bench_staging.py  CheckpointStore.save blocking vs the memcpy floor, DCP async_save
                               (DefaultStager; thread and process executors) and torch.save; time to
                               local disk and to durable (moto S3)
    scale    bench_scale.py    the drop-in and blocking figures from 64 MiB to 4 GiB and 10 to 100,000 tensors
    loop     bench_loop.py     training-loop step-time overhead at several checkpoint intervals
    tiers    bench_tiers.py    (extra) local/durable tier throughput against raw transfers (S3: SeaweedFS,
                               boto3's transfer manager and ranged GETs with the same part size and concurrency)
    peer     bench_peer.py     (extra) peer replication against raw gloo, restore from peers
    restore  bench_restore.py  (extra) CheckpointStore.restore from RAM against the memcpy floor, and from
                               the local tier (page cache dropped) against a raw read of the same files

Then it writes ``suite.json`` (every part's headline ratios, its status and wall time) and
``suite.png`` to ``--out``, and prints a summary table.

    python benchmarks/run.py                 # the full suite, ~40 minutes on 2 cores: docs/benchmarks/
    python benchmarks/run.py --quick         # a tiny version of every part (~3 minutes), to a temp dir
    python benchmarks/run.py --only dropin async --out /tmp/b
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine, pyplot  # noqa: E402 - shared by the benchmark scripts

DEFAULT_PARTS = ("dropin", "sharded", "async", "scale", "loop")
EXTRA_PARTS = ("tiers", "peer", "restore")
LOOP_INTERVALS = {"full": (5, 10, 20), "quick": (2, 4)}


def commands(mode: str, out: str, work: str | None, repeats: int | None = None,
             loop_rounds: int | None = None) -> dict[str, list[list[str]]]:
    """Per part, the script invocations (argv after the interpreter) of this mode; ``repeats`` and
    ``loop_rounds`` override the mode's rounds (to fit a time budget)."""
    full = mode == "full"

    def reps(default_full: int) -> str:
        return str(repeats if repeats else default_full if full else 1)

    d = ["--dir", work] if work else []
    layers = ["--layers", "24" if full else "1"]
    loops = []
    for every in LOOP_INTERVALS[mode]:
        loops.append(["bench_loop.py", "--every", str(every), "--steps", str(every), "--cases", "a",
                      "--rounds", str(loop_rounds or (8 if full else 2)), "--name", f"loop-every{every}", *d,
                      *([] if full else ["--layers", "2", "--batch", "4"])])
    return {
        "dropin": [["bench_dropin.py", *layers, "--repeats", reps(5), *d]],
        "sharded": [["bench_sharded.py", *layers, "--repeats", reps(3), "--worlds",
                     *(["1", "2", "4"] if full else ["1", "2"]), *d]],
        "async": [["bench_staging.py", *layers, "--repeats", reps(5), *d]],
        "scale": [["bench_scale.py", "--repeats", reps(3), *d,
                   *(["--sizes-mib", "64", "256", "1024", "4096", "--counts", "10", "100", "1000", "10000", "100000"]
                     if full else ["--sizes-mib", "4", "16", "--counts", "10", "100", "--count-total-mib", "4"])]],
        "loop": loops,
        "tiers": [["bench_tiers.py", *layers, "--repeats", reps(3), *d]],
        "peer": [["bench_peer.py", *(["--repeats", "5"] if full else ["--mib", "16", "--repeats", "1",
                                                                        "--restore-mib", "16", "--restore-repeats", "1"])]],
        "restore": [["bench_restore.py", *layers, "--repeats", reps(5), *d]],
    }


def _load(out: str, name: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out, f"{name}.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _spread(doc: dict[str, Any], key: str) -> str:
    s = doc["seconds"][key]
    return f"{min(s):.3f}-{max(s):.3f}"


def headlines(part: str, out: str) -> dict[str, Any]:
    """The figures a reader looks for first: ratios (>1 is ckptstore faster, unless named *_vs_floor)
    with the medians and spreads they come from."""
    if part == "sharded":
        doc = _load(out, part)
        if doc is None:
            return {}
        flat: dict[str, Any] = {"ratios": {}, "median_seconds": {}, "spread_seconds": {}}
        for world, entry in doc["worlds"].items():
            for k, v in entry["ratios"].items():
                flat["ratios"][f"{world}_ranks_{k}"] = v
            for k, v in entry["median_seconds"].items():
                flat["median_seconds"][f"{world}_ranks_{k}"] = v
                s = entry["seconds"][k]
                flat["spread_seconds"][f"{world}_ranks_{k}"] = f"{min(s):.3f}-{max(s):.3f}"
        return flat
    if part in ("dropin", "tiers", "peer", "restore"):
        doc = _load(out, part)
        if doc is None:
            return {}
        return {"ratios": doc["ratios"], "median_seconds": doc["median_seconds"],
                "spread_seconds": {k: _spread(doc, k) for k in doc["seconds"]}}
    if part == "async":
        doc = _load(out, "staging")
        if doc is None:
            return {}
        return {"ratios": doc["ratios"], "median_seconds": doc["median_seconds"],
                "spread_seconds": {k: _spread(doc, k) for k in doc["seconds"]}}
    if part == "scale":
        doc = _load(out, "scale")
        if doc is None:
            return {}
        rows = {}
        for kind in ("by_size", "by_count"):
            for row in doc[kind]:
                tag = f"{kind}: {row['bytes'] / 2**20:.0f} MiB in {row['tensors']} tensors"
                rows[tag] = row.get("ratios") or {"skipped": row.get("skipped")}
        return {"ratios_by_state": rows}
    if part == "loop":
        found = {}
        for every in sorted({*LOOP_INTERVALS["full"], *LOOP_INTERVALS["quick"]}):
            doc = _load(out, f"loop-every{every}")
            if doc is None:
                continue
            c = doc["cases"]["a"]
            found[f"every {every} steps"] = {
                "overhead_pct": c["overhead_pct"],
                "overhead_pct_per_round": c["overhead_pct_per_round"],
                "save_blocking_median_s": c["save_blocking_s"]["median"],
                "kept_up": c["kept_up"],
            }
        return {"loop_overhead": found}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes and one round per part (a smoke run)")
    ap.add_argument("--only", nargs="+", choices=[*DEFAULT_PARTS, *EXTRA_PARTS], help="run only these parts")
    ap.add_argument("--extra", action="store_true", help="also run the extra parts (tiers, peer, restore)")
    ap.add_argument("--out", default=None, help="results directory (default: docs/benchmarks, or a temp dir with --quick)")
    ap.add_argument("--dir", default=None, help="where the parts write their checkpoints (a real disk)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of every part (default: 5 or 3 full, 1 quick)")
    ap.add_argument("--loop-rounds", type=int, default=None, help="rounds per loop interval (default: 8 full, 2 quick)")
    ap.add_argument("--summarize", action="store_true",
                    help="run nothing: rebuild suite.json/png from the parts' JSON already in --out")
    ap.add_argument("--note", action="append", default=[], metavar="PART=TEXT",
                    help="with --summarize: record where a part's figures come from (e.g. an earlier run)")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    out = args.out or (tempfile.mkdtemp(prefix="ckptstore-bench-quick-") if args.quick
                       else os.path.join(HERE, "..", "docs", "benchmarks"))
    os.makedirs(out, exist_ok=True)
    parts = args.only or [*DEFAULT_PARTS, *(EXTRA_PARTS if args.extra else ())]
    cmds = commands(mode, out, args.dir, args.repeats, args.loop_rounds)
    suite: dict[str, Any] = {"benchmark": "suite", "mode": mode, "parts": {}, "started": time.time()}
    failed: list[str] = []
    if args.summarize:
        # Parts from several runs (e.g. one per time budget): what each run recorded, else "ok".
        previous = _load(out, "suite") or {"parts": {}}
        suite.update({k: v for k, v in previous.items() if k not in ("parts", "machine")})
        for part in [*DEFAULT_PARTS, *EXTRA_PARTS]:
            found = headlines(part, out)
            if not found or not any(found.values()):
                continue
            body = previous["parts"].get(part, {"status": "ok", "wall_s": 0.0, "commands": []})
            suite["parts"][part] = {**{k: body[k] for k in ("status", "wall_s", "commands") if k in body}, **found}
        for note in args.note:
            part, _, text = note.partition("=")
            if part in suite["parts"]:
                suite["parts"][part]["note"] = text
        parts = []
    for part in parts:
        t0 = time.perf_counter()
        status = "ok"
        for argv in cmds[part]:
            cmd = [sys.executable, os.path.join(HERE, argv[0]), *argv[1:], "--out", out]
            print(f"== {part}: {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd, cwd=os.path.join(HERE, "..")).returncode != 0:
                status = "failed"
                failed.append(part)
                break
        suite["parts"][part] = {"status": status, "wall_s": round(time.perf_counter() - t0, 1),
                                "commands": [" ".join(["python", f"benchmarks/{a[0]}", *a[1:]]) for a in cmds[part]],
                                **headlines(part, out)}
    suite["machine"] = suite.get("machine") or machine()
    with open(os.path.join(out, "suite.json"), "w") as fh:
        json.dump(suite, fh, indent=2)
    print(f"\nsuite ({mode}) -> {out}")
    for part, body in suite["parts"].items():
        print(f"  {part:8s} {body['status']:6s} {body['wall_s']:7.1f} s  {body.get('note', '')}")
        for k, v in (body.get("ratios") or {}).items():
            print(f"      {k:45s} {v:7.2f}x")
        for tag, rs in (body.get("ratios_by_state") or {}).items():
            print(f"      {tag:36s} " + ", ".join(f"{k} {v:.2f}x" if isinstance(v, float) else f"{k}: {v}"
                                                  for k, v in rs.items()))
        for tag, lo in (body.get("loop_overhead") or {}).items():
            print(f"      {tag:15s} overhead {lo['overhead_pct']:+.2f}% (save blocks {lo['save_blocking_median_s']:.3f} s, "
                  f"kept up: {lo['kept_up']})")
    plot(suite, os.path.join(out, "suite.png"))
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def plot(suite: dict[str, Any], path: str) -> None:
    """One chart of the headline speed-ups (higher is better for ckptstore), one bar per ratio."""
    plt = pyplot()
    if plt is None:
        return
    labels, values = [], []
    for part, body in suite["parts"].items():
        for k, v in (body.get("ratios") or {}).items():
            if "speedup" in k or k.endswith("_vs_raw"):
                labels.append(f"{part}: {k}")
                values.append(v)
            elif k.startswith(("store_save_vs_dcp", "store_to_local_vs")):
                labels.append(f"{part}: 1 / {k}")  # a time ratio: inverted so that higher is better
                values.append(1 / v)
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(labels) + 1.2))
    ax.barh(range(len(labels)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ckptstore speed-up over the baseline (medians; >1: ckptstore faster)")
    ax.set_title(f"Benchmark suite ({suite['mode']}), {suite['machine']['cpus']} CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
