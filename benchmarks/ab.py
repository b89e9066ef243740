"""Before and after, in one run: the same benchmark scripts on an earlier commit and on this tree,
alternating, so that a change of the engine is measured against its own baseline on the same
machine at the same time.

    python benchmarks/ab.py --before REV [--rounds 2] [--name ab] -- \\
        "bench_staging.py --repeats 5" "bench_tiers.py" "bench_loop.py --every 10"

Each round runs every script once on each side, the side that goes first alternating between
rounds. The earlier commit is checked out into a temporary git worktree and runs its own copy of
each script against its own package (PYTHONPATH), so each side measures what it was (a script the
earlier commit lacks runs from this tree, against the earlier package). For every
figure a script reports (its ``median_seconds``), the result gives each side's median over the
rounds, the run-to-run spread (the larger of the two sides' ranges over the rounds), the ratio
after/before, and whether "after" is worse by more than that spread. Figures of the baselines
(memcpy, torch.save, DCP) run the same code on both sides: their differences show the noise of
the run. Writes ``<out>/<name>.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(tree: str, script: str, out: str) -> dict[str, float]:
    argv = shlex.split(script)
    name = argv[0]
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": tree}
    script = os.path.join(tree, "benchmarks", name)
    if not os.path.exists(script):
        # A benchmark added with the change: the earlier package runs this tree's copy of it.
        script = os.path.join(HERE, name)
    cmd = [sys.executable, script, *argv[1:], "--out", out]
    print(f"$ (cd {tree}) {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    figures: dict[str, float] = {}
    for file in sorted(os.listdir(out)):
        if file.endswith(".json"):
            with open(os.path.join(out, file)) as fh:
                doc = json.load(fh)
            for key, value in (doc.get("median_seconds") or {}).items():
                figures[f"{os.path.splitext(name)[0]}/{key}"] = value
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="ab")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks"))
    ap.add_argument("scripts", nargs="+", help='benchmark scripts with their arguments, e.g. "bench_tiers.py --repeats 3"')
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    after_rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                               text=True).stdout.strip()
    work = tempfile.mkdtemp(prefix="ckptstore-ab-")
    before_tree = os.path.join(work, "before")
    subprocess.run(["git", "worktree", "add", "--detach", before_tree, rev], cwd=ROOT, check=True)
    trees = {"before": before_tree, "after": ROOT}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    t0 = time.time()
    try:
        for r in range(args.rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                figures: dict[str, float] = {}
                for i, script in enumerate(args.scripts):
                    figures.update(_run(trees[side], script, os.path.join(work, "out", side, str(r), str(i))))
                runs[side].append(figures)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before_tree], cwd=ROOT, check=False)
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for key in sorted(set(runs["before"][0]) & set(runs["after"][0])):
        b = [f[key] for f in runs["before"]]
        a = [f[key] for f in runs["after"]]
        spread = max(max(b) - min(b), max(a) - min(a))
        rows[key] = {
            "before_s": statistics.median(b), "after_s": statistics.median(a), "before_rounds": b, "after_rounds": a,
            "ratio": statistics.median(a) / statistics.median(b) if statistics.median(b) else None,
            "spread_s": spread,
            "worse_beyond_spread": statistics.median(a) - statistics.median(b) > spread,
        }
    doc = {"benchmark": args.name, "before": rev, "after": after_rev, "rounds": args.rounds, "scripts": args.scripts,
           "wall_s": round(time.time() - t0, 1), "loadavg": os.getloadavg(), "figures": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print(f"\n{'figure':58s} {'before':>10s} {'after':>10s} {'after/before':>12s}  worse beyond spread")
    for key, row in rows.items():
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        print(f"{key:58s} {row['before_s']:10.4f} {row['after_s']:10.4f} {ratio:>12s}  "
              f"{'YES' if row['worse_beyond_spread'] else 'no'}")


if __name__ == "__main__":
    main()
