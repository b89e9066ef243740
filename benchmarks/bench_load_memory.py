"""Peak extra host memory of load_sharded against its buffer_bytes budget.

Saves a ~1.13 GiB sharded checkpoint in one process, then, in a fresh process per budget, allocates
and touches the destination tensors, and measures how far the peak resident set size rises above
that while load_sharded fills them (and, for reference, while torch.distributed.checkpoint.load
does the same).

    python benchmarks/bench_load_memory.py [--budgets-mib 16 64 256] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, resource, sys, torch
torch.set_num_threads(2)
import ckptstore
# Import what the loads import lazily, so module memory is not counted as staging memory.
import torch.distributed.checkpoint, torch.distributed.tensor, ckptstore.checkpoint.sharded
kind, path, budget, layout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# "same": destinations laid out like the saved chunks (read straight into them, no staging);
# "transposed": column-major destinations, so every byte goes through the staging buffer.
state = {f"t{i}": torch.zeros(2048, 2048) if layout == "same" else torch.zeros(2048, 2048).t() for i in range(72)}
for t in state.values():
    t.fill_(1.0)
def rss_kib():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmRSS"))
base = rss_kib()
if kind == "ckptstore":
    ckptstore.load_sharded(state, path, buffer_bytes=budget)
else:
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=path)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_peak_mib": (peak - base) / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets-mib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore

    work = tempfile.mkdtemp()
    try:
        state = {f"t{i}": torch.randn(2048, 2048) for i in range(72)}
        ckptstore.save_sharded(state, os.path.join(work, "c"))
        dcp.save(state, checkpoint_id=os.path.join(work, "d"))
        del state
        results = {}

        def child(kind: str, path: str, budget: int, layout: str) -> float:
            out = subprocess.run([sys.executable, "-c", _CHILD, kind, path, str(budget), layout],
                                 capture_output=True, text=True, check=True)
            return json.loads(out.stdout.strip().splitlines()[-1])["extra_peak_mib"]

        for layout in ("same", "transposed"):
            for mib in args.budgets_mib:
                results[f"ckptstore_{layout}_budget_{mib}MiB"] = child("ckptstore", os.path.join(work, "c"), mib << 20, layout)
            results[f"dcp_{layout}"] = child("dcp", os.path.join(work, "d"), 0, layout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"benchmark": "load_memory", "checkpoint_GiB": 72 * 2048 * 2048 * 4 / 2**30, "extra_peak_MiB": results,
              "parent_maxrss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for k, v in results.items():
        print(f"{k:28s} peak extra RSS {v:8.1f} MiB")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "load_memory.json"), "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
