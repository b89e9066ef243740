"""Drop-in benchmark: ckptstore.save/load against torch.save/torch.load and safetensors on the same state, same run.

The state is the one of shared/reference/anchors_cpu.py: 24 Linear(2048, 2048) layers plus Adam state
(~1.13 GiB). Figures:

- save: time to a durable file (write + fsync for torch.save; ckptstore.save fsyncs itself);
- cold load: the first load in a fresh process (fresh memory must be page-faulted in), with the
  file in the page cache; each library gets its own fresh process;
- cold load from disk: the same after dropping the page cache (needs root; the benchmark fails
  loudly where it cannot), the restart-after-a-crash case;
- warm load: repeated loads in one process (freed memory is reused);
- mmap load: torch.load(mmap=True) against ckptstore.load(mmap=True).

With ``--stream`` it measures only the load of an unseekable stream (a pipe that a thread fills from
the file, in the page cache): ``ckptstore.load(pipe)``, which reads the stream once into memory,
against ``torch.load(io.BytesIO(pipe.read()))``, what torch.load needs for the same bytes (it
refuses a pipe); the same state saved by each library, warm, alternating which goes first.

safetensors (save_file / load_file of the same tensors, flattened to dotted keys) runs in the same
rounds: its loads read the bytes (backend="pread") except in the mmap row (its default backend);
the libraries rotate which goes first round by round.

ckptstore verifies every chunk's xxh3 checksum on save-then-load (not with mmap, as documented).
Writes JSON and a PNG under docs/benchmarks/ by default.

    python benchmarks/bench_dropin.py [--layers 24] [--repeats 3] [--out docs/benchmarks]
    python benchmarks/bench_dropin.py --stream [--layers 8] [--repeats 7]   # prints; writes dropin_stream.json
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

import ckptstore

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, prime_page_cache, pyplot, report  # noqa: E402 - shared by the benchmark scripts


def nbytes(state: dict) -> int:
    seen, total = set(), 0
    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                seen.add(id(x))
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(state)
    return total


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def timed_once(fn) -> float:
    """Seconds for one call; a child process reports its own load time (imports excluded)."""
    gc.collect()
    t = time.perf_counter()
    child = fn()
    elapsed = time.perf_counter() - t
    return child if isinstance(child, float) else elapsed


_CHILD = r"""
import sys, time, json
import torch, ckptstore
torch.set_num_threads(2)
kind, path = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if kind == "torch":
    obj = torch.load(path, weights_only=True)
elif kind == "safetensors":
    from safetensors.torch import load_file
    obj = load_file(path, backend="pread")  # its default maps the file lazily: see load_mmap
else:
    obj = ckptstore.load(path)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt}))
"""


def drop_page_cache() -> bool:
    """Drop the page cache (root only); False where that is not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def cold_load(kind: str, path: str, drop_cache: bool = False) -> float:
    if drop_cache:
        if not drop_page_cache():
            raise PermissionError("cannot drop the page cache here (needs root)")
    else:
        # ckptstore writes with O_DIRECT, so its file is not cached after a save: put both files in
        # the page cache so this figure compares loading, not disk reads.
        prime_page_cache(path)
    res = subprocess.run([sys.executable, "-c", _CHILD, kind, path], capture_output=True, text=True, check=True)
    return float(json.loads(res.stdout.strip().splitlines()[-1])["seconds"])


def flatten(x, prefix: str = "") -> dict:
    """The state as safetensors takes it: one flat dict of tensors, keys joined with dots."""
    out = {}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else []
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, (dict, list, tuple)):
            out.update(flatten(v, key + "."))
    return out


def bitwise_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def stream_load(kind: str, path: str) -> float:
    """Seconds to load ``path`` through a pipe: the writer thread feeds it while the caller reads."""
    r, w = os.pipe()

    def feed() -> None:
        with open(path, "rb") as src, open(w, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    feeder = threading.Thread(target=feed)
    gc.collect()
    t = time.perf_counter()
    feeder.start()
    with open(r, "rb") as f:
        obj = torch.load(io.BytesIO(f.read())) if kind == "torch" else ckptstore.load(f)
    elapsed = time.perf_counter() - t
    feeder.join()
    del obj
    return elapsed


def stream_main(args: argparse.Namespace) -> None:
    state = make_state(args.layers)
    size = nbytes(state)
    work = args.dir or tempfile.mkdtemp(prefix="ckptstore-bench-stream-")
    paths = {"torch": os.path.join(work, "state.pt"), "ckptstore": os.path.join(work, "state.ckpt")}
    torch.save(state, paths["torch"])
    ckptstore.save(state, paths["ckptstore"])
    del state
    for p in paths.values():
        prime_page_cache(p)
    times: dict[str, list[float]] = {"torch": [], "ckptstore": []}
    for kind in times:
        stream_load(kind, paths[kind])  # warm-up: imports, first page faults
    for i in range(args.repeats):
        for kind in (("torch", "ckptstore") if i % 2 == 0 else ("ckptstore", "torch")):
            times[kind].append(stream_load(kind, paths[kind]))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "what": "load from a pipe: ckptstore.load(pipe) vs torch.load(io.BytesIO(pipe.read()))",
        "state_bytes": size,
        "repeats": args.repeats,
        "seconds": times,
        "median_s": med,
        "GBps": {k: size / v / 1e9 for k, v in med.items()},
        "ckptstore_speed_vs_torch": med["torch"] / med["ckptstore"],
        "loadavg_before": os.getloadavg(),
    }
    print(json.dumps(out, indent=2))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dropin_stream.json"), "w") as f:
            json.dump(out, f, indent=2)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="Linear(2048, 2048) layers (default 24; 8 with --stream)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stream", action="store_true", help="measure only the load of an unseekable stream")
    ap.add_argument("--dir", default=None, help="where to write the checkpoint files (default: a temp dir)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.stream:
        args.layers = args.layers or 8
        stream_main(args)
        return
    args.layers = args.layers or 24
    state = make_state(args.layers)
    n = nbytes(state)
    d = tempfile.mkdtemp(dir=args.dir)
    tpath, cpath, spath = os.path.join(d, "t.pt"), os.path.join(d, "c.ckpt"), os.path.join(d, "s.safetensors")
    from safetensors.torch import load_file, save_file

    flat = flatten(state)
    results: dict[str, list[float]] = {}
    try:
        def tsave():
            torch.save(state, tpath)
            fsync_path(tpath)

        def csave():
            ckptstore.save(state, cpath)

        def ssave():
            save_file(flat, spath)
            fsync_path(spath)

        # Interleaved rounds, rotating which library goes first, after one unmeasured warm-up
        # of each: this VM's page-cache writes and fresh-memory faults vary from run to run, and
        # interleaving exposes every library to the same conditions.
        tsave()
        csave()
        ssave()
        variants = {
            "save": {"torch": tsave, "ckptstore": csave, "safetensors": ssave},
            "load_cold": {lib: (lambda lib=lib, p=p: cold_load(lib, p))
                          for lib, p in (("torch", tpath), ("ckptstore", cpath), ("safetensors", spath))},
            "load_cold_disk": {lib: (lambda lib=lib, p=p: cold_load(lib, p, drop_cache=True))
                               for lib, p in (("torch", tpath), ("ckptstore", cpath), ("safetensors", spath))},
            "load_warm": {"torch": lambda: torch.load(tpath, weights_only=True), "ckptstore": lambda: ckptstore.load(cpath),
                          "safetensors": lambda: load_file(spath, backend="pread")},
            # safetensors' default backend maps the file (tensors fault their pages in on use):
            # the mmap row; the other rows read the bytes (backend="pread"), as torch and ckptstore do.
            "load_mmap": {"torch": lambda: torch.load(tpath, weights_only=True, mmap=True),
                          "ckptstore": lambda: ckptstore.load(cpath, mmap=True),
                          "safetensors": lambda: load_file(spath)},
        }
        loaded = ckptstore.load(cpath)
        assert bitwise_equal(state, loaded), "ckptstore round trip is not bitwise equal"
        del loaded
        loaded = load_file(spath)
        assert bitwise_equal(dict(sorted(flat.items())), dict(sorted(loaded.items()))), "safetensors round trip"
        del loaded
        for name, fns in variants.items():
            for lib in fns:
                results[f"{lib}_{name}"] = []
            for r in range(args.repeats):
                order = list(fns.items())
                k = r % len(order)
                for lib, fn in order[k:] + order[:k]:
                    if name == "load_warm":  # the cold-disk rounds before left the files out of the cache
                        prime_page_cache({"torch": tpath, "ckptstore": cpath, "safetensors": spath}[lib])
                    results[f"{lib}_{name}"].append(timed_once(fn))
        file_sizes = {"torch": os.path.getsize(tpath), "ckptstore": os.path.getsize(cpath),
                      "safetensors": os.path.getsize(spath)}
    finally:
        shutil.rmtree(d, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        "save_speedup_vs_torch": med["torch_save"] / med["ckptstore_save"],
        "cold_load_speedup_vs_torch": med["torch_load_cold"] / med["ckptstore_load_cold"],
        "cold_disk_load_speedup_vs_torch": med["torch_load_cold_disk"] / med["ckptstore_load_cold_disk"],
        "warm_load_speedup_vs_torch": med["torch_load_warm"] / med["ckptstore_load_warm"],
        "mmap_load_speedup_vs_torch": med["torch_load_mmap"] / med["ckptstore_load_mmap"],
        "save_speedup_vs_safetensors": med["safetensors_save"] / med["ckptstore_save"],
        "cold_load_speedup_vs_safetensors": med["safetensors_load_cold"] / med["ckptstore_load_cold"],
        "cold_disk_load_speedup_vs_safetensors": med["safetensors_load_cold_disk"] / med["ckptstore_load_cold_disk"],
        "warm_load_speedup_vs_safetensors": med["safetensors_load_warm"] / med["ckptstore_load_warm"],
        "mmap_load_speedup_vs_safetensors": med["safetensors_load_mmap"] / med["ckptstore_load_mmap"],
    }
    doc = report("dropin", n, args.repeats, results, ratios, args.out, file_sizes=file_sizes,
                 checksums_verified_on_load=True)
    plot(doc, os.path.join(args.out, "dropin.png"))


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    groups = ["save", "load_cold", "load_cold_disk", "load_warm", "load_mmap"]
    gbps = report["GB_per_s"]
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(groups))
    for i, (lib, label) in enumerate((("torch", "torch.save / torch.load"), ("safetensors", "safetensors"),
                                      ("ckptstore", "ckptstore"))):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [gbps.get(f"{lib}_{g}", 0) for g in groups], 0.27, label=label)
    ax.set_xticks(list(xs), ["save\n(+fsync)", "load, fresh\nprocess", "load, fresh\nprocess, disk", "load,\nwarm", "load,\nmmap"])
    ax.set_ylabel("GB/s (higher is better)")
    ax.set_yscale("log")
    ax.set_title(f"Drop-in save/load, {report['GiB']:.2f} GiB model + Adam state, {report['machine']['cpus']} CPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
