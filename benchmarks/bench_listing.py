"""What a restart's look at the durable tier costs: the durable tier's committed steps listed by a
process that has s3fs imported (as the crash loop's forked ranks have), against the local
SeaweedFS server holding ``--steps`` committed steps, in fresh processes: the first listing
(the client built, then the requests), then warm ones; every step's manifest looked up
("full", what every restart did) or only the newest step's (``since``: what a restart's start
now does when its node holds that step). Seconds of wall and of the process's CPU.

    python benchmarks/bench_listing.py [--steps 100] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r'''
import asyncio, json, sys, time
url, opts, n, first = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import torch, ckptstore, s3fs  # noqa: F401
from ckptstore.tiers.directory import DirectoryTier
tier = DirectoryTier("durable", url, storage_options=opts)
def timed(**kw):
    t, c = time.perf_counter(), time.process_time()
    got = asyncio.run(tier.steps(**kw))
    return [round(time.perf_counter() - t, 3), round(time.process_time() - c, 3), len(got)]
out = {"first_" + first: timed(**({"since": n} if first == "since" else {}))}
for _ in range(3):
    out.setdefault("warm_full", []).append(timed())
    out.setdefault("warm_since", []).append(timed(since=n))
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--runs", type=int, default=2, help="fresh processes per kind of first listing")
    args = ap.parse_args()
    from ckptstore._local_s3 import start_local_s3
    from ckptstore.names import MANIFEST, step_dir

    s3 = start_local_s3(server="seaweedfs")
    try:
        for k in range(1, args.steps + 1):
            s3.client.put_object(Bucket=s3.bucket, Key=f"listing/{step_dir(k)}/{MANIFEST}", Body=b"{}")
        for _ in range(args.runs):
            for first in ("full", "since"):
                p = subprocess.run([sys.executable, "-c", _CHILD, s3.url("listing"), json.dumps(s3.storage_options),
                                    str(args.steps), first], capture_output=True, text=True, check=False)
                print(f"[wall s, cpu s, steps] {p.stdout.strip() or p.stderr[-2000:]} load {os.getloadavg()[0]:.1f}",
                      flush=True)
    finally:
        s3.stop()


if __name__ == "__main__":
    main()
