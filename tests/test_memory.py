"""Memory stays flat over many asynchronous saves: 50 CheckpointStore saves in a row (RAM, local
and durable tiers, retention on) in a process of their own, so that no other test's allocations
blur the figures. Resident memory (VmRSS) and this job's shared-memory segments in /dev/shm
(count and allocated bytes) are sampled after every save once a warm-up has filled both RAM slots
and every pool; growth must stay below one snapshot's size, and the segments must not change.
"""

from __future__ import annotations

import json
import os
import sys

import warm_python
from conftest import wipe_ram

SAVES, WARMUP = 50, 6
TENSOR = 4 << 20  # float32 elements: 16 MiB per tensor
SNAPSHOT = 2 * TENSOR * 4 + 4096  # two tensors and a small one: the bytes one save stages


def _rss() -> int:
    """Resident memory that is the process's own: anonymous pages plus mapped shared memory. File
    pages it maps (a promotion maps the step's local files to read them) are the page cache's,
    reclaimable, and would count a file being read as growth."""
    found = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssShmem"):
                found[key] = int(line.split()[1]) * 1024
    if len(found) != 2:
        raise RuntimeError("no RssAnon/RssShmem in /proc/self/status")
    return found["RssAnon"] + found["RssShmem"]


def _shm(job: str) -> tuple[int, int, int]:
    """This job's segments in /dev/shm: data segments and the bytes they hold (allocated blocks), and
    manifests (a slot's manifest is removed while the slot is restaged, so those come and go)."""
    count = size = manifests = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-"):
            try:
                st = os.stat(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                continue
            if name.endswith(".bin"):
                count += 1
                size += st.st_blocks * 512
            else:
                manifests += 1
    return count, size, manifests


def _run(job: str, root: str) -> dict:
    import torch

    from ckptstore import CheckpointStore

    state = {"a": torch.randn(TENSOR), "b": torch.randn(TENSOR), "step": torch.zeros(4, dtype=torch.int64)}
    samples = []
    with CheckpointStore(job, local=os.path.join(root, "local"), durable=os.path.join(root, "durable"),
                         durable_every=5, keep_local=2, keep_durable=2) as store:
        handle = None
        for step in range(1, SAVES + 1):
            state["a"].add_(1.0)  # every save stages changed bytes
            state["step"][0] = step
            handle = store.save(step, state)
            if step == WARMUP:
                handle.wait("local")
                handle.wait("durable")
            if step >= WARMUP:
                samples.append((step, _rss(), *_shm(job)))
        assert handle is not None
        handle.wait("local")
        samples.append((SAVES + 1, _rss(), *_shm(job)))
    return {"samples": samples, "snapshot": SNAPSHOT}


def test_fifty_async_saves_keep_memory_flat(tmp_path, job):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.run([__file__, job, str(tmp_path)], env=env, timeout=300, text=False)
    wipe_ram(job)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout.decode().splitlines()[-1])
    samples, snapshot = out["samples"], out["snapshot"]
    _, rss0, count0, shm0, _ = samples[0]
    assert count0 == 2 and shm0 >= 2 * snapshot, "both staging slots exist after the warm-up"
    growth = max(s[1] for s in samples) - rss0
    print(f"RSS after warm-up {rss0 / 2**20:.0f} MiB, largest growth over {SAVES - WARMUP} saves "
          f"{growth / 2**20:.1f} MiB (one snapshot: {snapshot / 2**20:.0f} MiB); /dev/shm {count0} segments, "
          f"{shm0 / 2**20:.0f} MiB")
    assert growth < snapshot, f"resident memory grew by {growth} bytes over {SAVES - WARMUP} saves"
    for step, _, count, shm, manifests in samples:
        assert (count, shm) == (count0, shm0), f"after save {step}: /dev/shm holds {count} segments, {shm} bytes"
        assert manifests <= count, f"after save {step}: {manifests} slot manifests for {count} slots"


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[1], sys.argv[2])))
