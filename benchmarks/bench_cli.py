"""`ckptstore bench` on this machine: RAM, a local directory and a durable tier on a local S3
server (SeaweedFS, a real S3 server on loopback; moto where its binary is missing), writing
docs/benchmarks/bench.json and bench.png; with --durable-only, the durable tier alone (its raw
baseline: boto3's transfer manager and ranged GETs with ckptstore's part size and concurrency),
writing bench-durable.json and bench-durable.png.

    python benchmarks/bench_cli.py [--size 1GiB] [--sweep-size 64MiB] [--repeats 3] [--state-size 70GiB]
                                   [--dir DIR] [--peer] [--durable-only] [--out docs/benchmarks]

Everything after the options above is passed to `ckptstore bench` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ckptstore._local_s3 import start_local_s3
from ckptstore.cli import main as cli


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--sweep-size", default="64MiB")
    ap.add_argument("--repeats", default="3")
    ap.add_argument("--state-size", default="70GiB")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="the local directory measured (a real disk)")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--durable-only", action="store_true", help="measure the durable tier alone")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    args, rest = ap.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    s3 = start_local_s3(own_process=True)
    try:
        name = "bench-durable" if args.durable_only else "bench"
        return cli(["--storage-options", json.dumps(s3.storage_options), "bench", "--size", args.size,
                    *([] if args.durable_only else ["--ram", "--local", args.dir]),
                    "--durable", s3.url("bench"), "--repeats", args.repeats,
                    "--sweep-size", args.sweep_size, "--state-size", args.state_size,
                    *(["--peer"] if args.peer else []),
                    "--json", os.path.join(args.out, f"{name}.json"), "--plot", os.path.join(args.out, f"{name}.png"),
                    *rest])
    finally:
        s3.stop()


if __name__ == "__main__":
    sys.exit(main())
