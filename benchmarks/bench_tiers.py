"""Tier throughput, each tier against the raw transfer of the same bytes, in the same run:

- local: persisting a staged snapshot to the local tier against a raw write + fsync;
- durable (a real S3 server, SeaweedFS, started on loopback; moto where its binary is missing):
  promoting the snapshot against boto3's transfer manager uploading the same bytes with the same
  part size and parts in flight, and restoring it (``load_sharded``, checksums verified) against
  ranged GETs of the same byte ranges, as many at once as ckptstore's reader threads, into
  preallocated memory.

Interleaved rounds (the order alternates), medians; the tiers live across the rounds, as a store's
do, and every round writes a new step.

    python benchmarks/bench_tiers.py [--layers 24] [--repeats 3] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from ckptstore import load_sharded
from ckptstore._local_s3 import start_local_s3
from ckptstore.bench import RawS3
from ckptstore.checkpoint.materialize import encode_value
from ckptstore.checkpoint.sharded import BLOCK_SIZE, build_manifest, collect
from ckptstore.checkpoint.single_file import IO_THREADS
from ckptstore.storage.s3 import S3Upload, upload_settings
from ckptstore.storage.targets import resolve
from ckptstore.tiers.directory import DirectoryTier
from ckptstore.tiers.ram import RamTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, pyplot, report  # noqa: E402 - shared by the benchmark scripts


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    load_start = os.getloadavg()
    state = make_state(args.layers)
    local_state = collect(state, 0, encode_value)
    items = [(key, t) for (key, _o, _s), t in local_state.items.items()]
    job = f"bench-{uuid.uuid4().hex[:8]}"
    tier = RamTier(job)
    staged = tier.stage(1, items)
    tier.checksums(staged, block_size=BLOCK_SIZE)
    snap = tier.snapshot(staged, 1, {})
    slot_bytes = tier._slots[staged.slot].buffer[: staged.layout.total]
    n = staged.layout.total
    # What a restore asks the durable tier for: one ranged read of each chunk's bytes.
    ranges = sorted((c["offset"], c["length"]) for cs in snap.chunks.values() for c in cs if c["length"])
    work = tempfile.mkdtemp(dir=args.dir)
    s3 = start_local_s3()
    # One filesystem object for the run, as a store's durable tier keeps one (the local server's
    # options skip fsspec's instance cache, which would build an S3 client per call).
    options = {k: v for k, v in s3.storage_options.items() if k != "skip_instance_cache"}
    upload = upload_settings() or S3Upload()
    fs = resolve(s3.url(""), options).fs
    received = torch.zeros(n, dtype=torch.uint8)
    raw = RawS3(fs, f"{s3.bucket}/raw.bin", memoryview(slot_bytes.numpy()), memoryview(received.numpy()), upload,
                ranges, IO_THREADS)
    local_tier = DirectoryTier("local", os.path.join(work, "local"))
    durable_tier = DirectoryTier("durable", s3.url("steps"), storage_options=options)
    restored = copy.deepcopy(state)
    for t in _tensors(restored):
        t.zero_()
    steps = iter(range(1, 1 << 30))
    last: dict[str, int] = {}

    def persist(target: DirectoryTier) -> None:
        """What the store's pipeline does per tier and step: this rank's files, then the manifest."""
        step = next(steps)
        s = dataclasses.replace(snap, step=step)
        part = target.put_sync(s)
        target.commit_sync(step, build_manifest(local_state.tree, local_state.tensors, [part], 1))
        last[target.name] = step

    def raw_write() -> None:
        path = os.path.join(work, "raw.bin")
        with open(path, "wb") as fh:
            fh.write(memoryview(slot_bytes.numpy()))
            fh.flush()
            os.fsync(fh.fileno())

    def restore() -> None:
        load_sharded(restored, durable_tier.display(last["durable"]), storage_options=options)

    ops = [("raw_write_fsync", raw_write), ("local_persist", lambda: persist(local_tier)),
           ("raw_s3_transfer_upload", raw.put), ("durable_promote", lambda: persist(durable_tier)),
           ("raw_s3_ranged_get", raw.get), ("durable_restore", restore)]
    results: dict[str, list[float]] = {name: [] for name, _ in ops}
    try:
        for _name, fn in ops:  # warm-up: first touches, connections, thread pools
            fn()
        for r in range(args.repeats):
            # Raw and ckptstore side by side for each operation; odd rounds run ckptstore first.
            pairs = [ops[i : i + 2] for i in range(0, len(ops), 2)]
            for name, fn in [op for pair in pairs for op in (pair if r % 2 == 0 else pair[::-1])]:
                if name == "raw_s3_ranged_get":
                    received.zero_()
                elif name == "durable_restore":
                    for t in _tensors(restored):
                        t.zero_()
                t0 = time.perf_counter()
                fn()
                results[name].append(time.perf_counter() - t0)
            if not torch.equal(received, slot_bytes):
                raise RuntimeError("the raw ranged GETs delivered other bytes than were uploaded")
            for got, want in zip(_tensors(restored), _tensors(state)):
                if not torch.equal(got, want):
                    raise RuntimeError("load_sharded from the durable tier delivered other bytes than were saved")
            for name in os.listdir(os.path.join(work, "local")):
                shutil.rmtree(os.path.join(work, "local", name), ignore_errors=True)
    finally:
        raw.close()
        s3.stop()
        tier.close(unlink=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    # Throughput ratios: higher is better.
    ratios = {
        "local_persist_vs_raw": med["raw_write_fsync"] / med["local_persist"],
        "durable_promote_vs_raw": med["raw_s3_transfer_upload"] / med["durable_promote"],
        "durable_restore_vs_raw": med["raw_s3_ranged_get"] / med["durable_restore"],
    }
    doc = report("tiers", n, args.repeats, results, ratios, args.out, s3_server=s3.kind,
                 durable_baseline={**raw.describe(), "promotion_part_bytes": upload.part_size,
                                   "promotion_concurrency": upload.max_in_flight, "restore_threads": IO_THREADS},
                 loadavg_start=load_start)
    _plot(doc, os.path.join(args.out, "tiers.png"))


def _plot(doc: dict[str, Any], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    gbs = doc["GB_per_s"]
    rows = [("local write", "raw_write_fsync", "local_persist", "local_persist_vs_raw"),
            ("durable promote", "raw_s3_transfer_upload", "durable_promote", "durable_promote_vs_raw"),
            ("durable restore", "raw_s3_ranged_get", "durable_restore", "durable_restore_vs_raw")]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    for ax, part in ((axes[0], rows[:1]), (axes[1], rows[1:])):
        x = range(len(part))
        ax.bar([i - 0.2 for i in x], [gbs[r[1]] for r in part], 0.4, label="raw")
        ax.bar([i + 0.2 for i in x], [gbs[r[2]] for r in part], 0.4, label="ckptstore")
        for i, r in enumerate(part):
            ax.annotate(f"{doc['ratios'][r[3]]:.2f}x", (i + 0.2, gbs[r[2]]), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), [r[0] for r in part], fontsize=8)
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=8)
    axes[0].set_title("local disk", fontsize=9)
    axes[1].set_title(f"S3 ({doc.get('s3_server')}): raw = boto3, same part size and concurrency", fontsize=9)
    load = doc["machine"]["loadavg"]
    fig.suptitle(f"{doc['GiB']:.2f} GiB, medians of {doc['repeats']}, load average {load[0]:.1f} at the end "
                 f"({doc['machine']['cpus']} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
