"""What every benchmark script shares: the reference state, and one way to report results."""

from __future__ import annotations

import json
import os
import platform
import statistics
from typing import Any

import torch

import ckptstore


def make_state(layers: int) -> dict:
    """The reference state of the issues: ``layers`` x Linear(2048, 2048) and their Adam state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 2048)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def prime_page_cache(path: str) -> None:
    """Read ``path`` once through the page cache (ckptstore writes with O_DIRECT, which leaves its
    files uncached), so that "warm" figures compare loading, not disk reads."""
    with open(path, "rb", buffering=0) as fh:
        while fh.read(64 << 20):
            pass


# What the benchmarks' job names start with (their RAM segments are ckptstore-<job>-...): a caller
# that runs them beside other benchmarks (tests/test_bench.py) picks a prefix of its own and counts
# only its own run's segments. It must start with "bench".
JOB_PREFIX = os.environ.get("CKPTSTORE_BENCH_JOB_PREFIX", "bench")


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ckptstore": ckptstore.__version__,
        "platform": platform.platform(),
        # This VM's 2 cores are shared: the load average says how busy they were when the run ended.
        "loadavg": os.getloadavg(),
    }


def report(
    name: str,
    nbytes: int,
    repeats: int,
    results: dict[str, list[float]],
    ratios: dict[str, float],
    out_dir: str,
    **extra: Any,
) -> dict[str, Any]:
    """Print medians (with the spread), GB/s and ratios; write ``<out_dir>/<name>.json``."""
    med = {k: statistics.median(v) for k, v in results.items()}
    doc = {
        "benchmark": name,
        "bytes": nbytes,
        "GiB": nbytes / 2**30,
        "repeats": repeats,
        "seconds": results,
        "median_seconds": med,
        "GB_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratios": ratios,
        **extra,
        "machine": machine(),
    }
    width = max(len(k) for k in [*med, *ratios])
    print(f"{name}: {nbytes / 2**30:.2f} GiB, medians of {repeats}")
    for k, v in med.items():
        print(f"  {k:{width}s} {v:8.3f} s [{min(results[k]):.3f}-{max(results[k]):.3f}] {nbytes / v / 1e9:7.2f} GB/s")
    for k, v in ratios.items():
        print(f"  {k:{width}s} {v:6.2f}x")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump(doc, fh, indent=2)
    return doc


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, or None (with a note) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return None
    return plt


def spawn_ranks(world: int, target: Any, *args: Any, what: str = "") -> None:
    """Run ``target(rank, world, init, *args)`` on ``world`` fresh processes (spawned: no state of
    this one leaks into them), ``init`` a file:// rendezvous for their process group in the
    directory of ``args[0]`` when it is one, else in the temporary directory; raise when a rank
    failed (its traceback is on stderr)."""
    import multiprocessing as mp
    import tempfile
    import uuid

    where = args[0] if args and isinstance(args[0], str) and os.path.isdir(args[0]) else tempfile.gettempdir()
    init = f"file://{where}/init-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, init, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed{' (' + what + ')' if what else ''} at world {world}")
