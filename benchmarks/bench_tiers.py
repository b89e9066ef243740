"""Tier throughput: persisting a staged snapshot to the local tier against a raw write+fsync of
the same bytes, and promoting it to the durable tier (S3 through s3fs, on a local moto server)
against a raw s3fs put of the same bytes to the same endpoint, in the same run.

    python benchmarks/bench_tiers.py [--layers 24] [--repeats 3] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch

from ckptstore._local_s3 import start_local_s3
from ckptstore.checkpoint.materialize import encode_value
from ckptstore.checkpoint.sharded import BLOCK_SIZE, build_manifest, collect
from ckptstore.tiers.directory import DirectoryTier
from ckptstore.tiers.ram import RamTier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_state, report  # noqa: E402 - shared by the benchmark scripts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    state = make_state(args.layers)
    local_state = collect(state, 0, encode_value)
    items = [(key, t) for (key, _o, _s), t in local_state.items.items()]
    job = f"bench-{uuid.uuid4().hex[:8]}"
    tier = RamTier(job)
    staged = tier.stage(1, items)
    tier.checksums(staged, block_size=BLOCK_SIZE)
    snap = tier.snapshot(staged, 1, {})

    def persist(root: str, storage_options: dict | None = None) -> None:
        """What the store's pipeline does per tier and step: this rank's files, then the manifest."""
        target = DirectoryTier("bench", root, storage_options=storage_options)
        part = target.put_sync(snap)
        target.commit_sync(snap.step, build_manifest(local_state.tree, local_state.tensors, [part], 1))
    slot_bytes = tier._slots[staged.slot].buffer[: staged.layout.total]
    n = staged.layout.total
    blob = slot_bytes.numpy()
    work = tempfile.mkdtemp(dir=args.dir)
    s3 = start_local_s3()
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options)
    results: dict[str, list[float]] = {k: [] for k in ("raw_write_fsync", "local_persist", "raw_s3_put", "durable_promote")}
    try:
        for r in range(args.repeats):
            def raw_write(r: int = r) -> None:
                path = os.path.join(work, f"raw{r}")
                with open(path, "wb") as fh:
                    fh.write(memoryview(blob))
                    fh.flush()
                    os.fsync(fh.fileno())

            def local_persist(r: int = r) -> None:
                persist(os.path.join(work, f"local{r}"))

            def raw_put(r: int = r) -> None:
                with fs.open(f"{s3.bucket}/raw{r}", "wb") as fh:
                    fh.write(memoryview(blob))

            def promote(r: int = r) -> None:
                persist(s3.url(f"steps{r}"), s3.storage_options)

            order = [("raw_write_fsync", raw_write), ("local_persist", local_persist), ("raw_s3_put", raw_put),
                     ("durable_promote", promote)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                fn()
                results[name].append(time.perf_counter() - t)
    finally:
        s3.stop()
        tier.close(unlink=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    # Throughput ratios: higher is better.
    report(
        "tiers",
        n,
        args.repeats,
        results,
        {
            "local_persist_vs_raw": med["raw_write_fsync"] / med["local_persist"],
            "durable_promote_vs_raw_put": med["raw_s3_put"] / med["durable_promote"],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
