"""The ``ckptstore`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .errors import CheckpointError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _open(url: str, storage_options: dict[str, Any] | None):
    from .engine.inspect import open_any

    return open_any(url, storage_options)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None, file=sys.stderr)


def cmd_inspect(args: argparse.Namespace) -> int:
    from .engine.inspect import summary

    opened = _open(args.url, args.storage_options)
    try:
        info = summary(opened)
    finally:
        opened.close()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{info['location']}: ckptstore {info['layout']} checkpoint, format {info['format_version']} ({info['writer']})")
    size = f", file {_human(info['file_bytes'])}" if info["file_bytes"] is not None else ""
    print(
        f"  {info['num_tensors']} tensors in {info['num_chunks']} chunks, {_human(info['tensor_bytes'])} of tensor data, "
        f"{_human(info['stored_bytes'])} stored{size}"
    )
    if info["layout"] == "sharded":
        print(f"  saved by {info['world_size']} ranks:")
        slow = set(info["stragglers"])
        for r in info["ranks"]:
            t = r.get("timings", {})
            flag = "  <- straggler (over 2x the median write time)" if r["rank"] in slow else ""
            print(
                f"    rank {r['rank']:5d} on {r.get('host', '?')}: wrote {_human(r.get('bytes', 0))}, "
                f"plan {t.get('plan_s', 0):.3f} s, write {t.get('write_s', 0):.3f} s{flag}"
            )
    if info["top_level_keys"] is not None:
        print(f"  top-level keys: {', '.join(map(str, info['top_level_keys']))}")
    if info["pickled"]:
        print(f"  pickled objects (need weights_only=False): {', '.join(info['pickled'])}")
    width = max([len(t["key"]) for t in info["tensors"]] + [3])
    print(f"  {'key':{width}s}  {'dtype':14s} {'shape':20s} {'bytes':>12s} chunks codec  split dims")
    for t in info["tensors"]:
        shape = "[" + ", ".join(map(str, t["shape"])) + "]"
        split = ",".join(map(str, t["split_dims"])) or "-"
        print(
            f"  {t['key']:{width}s}  {t['dtype']:14s} {shape:20s} {_human(t['bytes']):>12s} {t['chunks']:6d} "
            f"{t['codec']:6s} {split}"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .engine.inspect import scan

    opened = _open(args.url, args.storage_options)
    try:
        total = sum(c.length for e in opened.manifest.tensors.values() for c in e.chunks)
        with _progress(total, "verify") as bar:
            checked, bad = scan(opened, bar.update)
    finally:
        opened.close()
    if bad:
        print(f"{args.url}: {len(bad)} of {checked} chunks are damaged:")
        for b in bad:
            where = f"{b.file} " if b.file else ""
            print(f"  tensor {b.key!r} chunk {b.index} ({where}bytes {b.offset}..{b.offset + b.length}): {b.problem}")
        return 1
    print(f"{args.url}: sound ({checked} chunks, {_human(total)} checked)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(args.dir, mib=args.mib, use_s3=not args.no_s3, steps=args.steps)
    return 0 if result["ok"] else 1


def cmd_reshard(args: argparse.Namespace) -> int:
    from .engine.inspect import open_any
    from .engine.materialize import decode_value
    from .engine.reshard import reshard

    opened = open_any(args.src, args.storage_options)
    total = opened.manifest.total_bytes
    opened.close()
    with _progress(total, "reshard") as bar:
        report = reshard(
            args.src,
            args.dst,
            args.ranks,
            storage_options=args.storage_options,
            buffer_bytes=args.buffer_mib << 20,
            progress=bar.update,
            decode_per_rank=decode_value,
        )
    layout = "one single-file checkpoint" if args.ranks == 1 else f"{args.ranks} even Shard(0) ranks"
    print(f"{args.dst}: {report['tensors']} tensors, {_human(report['bytes'])}, laid out for {layout}")
    if report["dropped_per_rank"]:
        print(f"  per-rank values dropped (their ranks do not exist at this size): {', '.join(report['dropped_per_rank'])}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    report = convert(
        args.src,
        args.dst,
        args.to,
        storage_options=args.storage_options,
        allow_pickle=args.allow_pickle,
        progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    print(
        f"{args.dst}: {report['dst_format']} ({report['tensors']} tensors, {_human(report['bytes'])}) "
        f"from {report['src_format']} {args.src}"
    )
    for note in report.get("notes", []):
        print(f"  note: {note}")
    if report.get("dropped"):
        print(f"  dropped (the destination format cannot hold them): {', '.join(map(str, report['dropped']))}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import os
    import tempfile

    from .bench import BenchConfig, format_table, parse_size, plot, run_bench

    size = parse_size(args.size)
    any_target = args.ram or args.local or args.durable or args.peer
    local = args.local
    scratch = None
    if not any_target:  # nothing named: this machine's RAM and its temp directory's disk
        scratch = local = tempfile.mkdtemp(prefix="ckptstore-bench-", dir=os.getcwd())
    cfg = BenchConfig(
        size=size,
        ram=args.ram or not any_target,
        local=local,
        durable=args.durable,
        storage_options=args.storage_options,
        peer=args.peer,
        repeats=args.repeats,
        sweep=not args.no_sweep,
        sweep_size=parse_size(args.sweep_size) if args.sweep_size else None,
        state_size=parse_size(args.state_size) if args.state_size else None,
        ram_dir=args.ram_dir,
        progress=None,
    )
    try:
        doc = run_bench(cfg)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
    print(format_table(doc))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"  JSON: {args.json} (CheckpointStore(..., tuning={args.json!r}) applies its recommended settings)")
    if args.plot and plot(doc, args.plot):
        print(f"  plot: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptstore", description="Tiered asynchronous checkpoint storage for PyTorch.")
    parser.add_argument("--version", action="version", version=f"ckptstore {__version__}")
    parser.add_argument(
        "--storage-options",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='fsspec storage options for URLs, as JSON (e.g. \'{"anon": true}\')',
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="show what a checkpoint holds", description="Show keys, dtypes, shapes and sizes.")
    p.add_argument("url", help="checkpoint path or fsspec URL")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser(
        "verify",
        help="re-read every chunk and check its checksum",
        description="Re-read every chunk and check its checksum. Exit 0 when sound, 1 when any chunk is damaged.",
    )
    p.add_argument("url", help="checkpoint path or fsspec URL")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "reshard",
        help="rewrite a sharded checkpoint for N ranks, or consolidate it into one file",
        description="Rewrite a sharded checkpoint so that each of N even Shard(0) ranks reads one contiguous "
        "region of each tensor; --ranks 1 consolidates it into the single-file format. Streams with bounded memory.",
    )
    p.add_argument("src", help="source checkpoint directory (path or fsspec URL)")
    p.add_argument("dst", help="destination (a new directory; a file path with --ranks 1)")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks to lay the checkpoint out for")
    p.add_argument("--buffer-mib", type=int, default=256, help="staging memory for reads, in MiB (default 256)")
    p.set_defaults(func=cmd_reshard)
    p = sub.add_parser(
        "convert",
        help="convert between ckptstore, torch.save files, safetensors and DCP directories",
        description="Convert a checkpoint between formats, both ways: ckptstore (single file or sharded "
        "directory as source), torch.save files, safetensors files and torch.distributed.checkpoint directories. "
        "The destination must not exist.",
    )
    p.add_argument("src", help="source checkpoint (file, directory or fsspec URL); its format is detected")
    p.add_argument("dst", help="destination (must not exist)")
    p.add_argument("--to", required=True, choices=["ckptstore", "torch", "safetensors", "dcp"], help="destination format")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow unpickling (torch files with arbitrary objects, DCP metadata); only for files you trust",
    )
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser(
        "demo",
        help="run the main job on embedded defaults (local directory + local S3 server)",
        description="Train a small model with a CheckpointStore (local directory + a local S3 server, moto on "
        "127.0.0.1), kill the training process halfway with SIGKILL, restore in a new process and finish; check "
        "that the resumed run is bitwise equal to an uninterrupted one and report what each tier holds.",
    )
    p.add_argument("--dir", default=None, help="keep the files in this directory (default: a temp dir, removed)")
    p.add_argument("--mib", type=int, default=64, help="approximate size of model + Adam state in MiB (default 64)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60; the crash comes halfway)")
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "bench",
        help="measure each storage tier against this machine's raw ceiling, and recommend tuning",
        description="For each target, time the raw ceiling (memcpy; write+fsync and a cold read; an fsspec "
        "put/get) next to ckptstore's own tier on the same bytes, sweep write chunk size and concurrency for the "
        "local and durable tiers, and print the checkpoint cost of --state-size for `ckptstore plan`. With no "
        "target, measures RAM and a scratch directory under the current one.",
    )
    p.add_argument("--size", default="1GiB", help="bytes per measured operation (default 1GiB)")
    p.add_argument("--ram", action="store_true", help="RAM: memcpy against staging into the RAM tier")
    p.add_argument("--ram-dir", default="/dev/shm", help="where the RAM tier keeps its slots (default /dev/shm)")
    p.add_argument("--local", metavar="DIR", help="a local directory (a scratch subdirectory is made and removed)")
    p.add_argument("--durable", metavar="URL", help="an fsspec URL for the durable tier (e.g. s3://bucket/prefix)")
    p.add_argument("--peer", action="store_true", help="peer replication against raw gloo (see docs/benchmarks.md)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported (default 3)")
    p.add_argument("--no-sweep", action="store_true", help="skip the chunk size / concurrency sweep")
    p.add_argument("--sweep-size", help="bytes per sweep measurement (default: the smaller of --size and 256MiB)")
    p.add_argument("--state-size", help="state size for the checkpoint cost (default: --size), e.g. 70GiB")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (usable as CheckpointStore(tuning=OUT))")
    p.add_argument("--plot", metavar="OUT.png", help="write a PNG chart (needs matplotlib)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as exc:
        print(f"ckptstore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
