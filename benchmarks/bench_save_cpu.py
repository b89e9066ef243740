"""CPU seconds one save costs a training node, per configuration: what the crash loop's step times
(bench_goodput_e2e.py) pay for each checkpoint on cores the trainers also use.

Two ranks on gloo (one per "node"), ``--mib`` MiB of fp32 state per rank in 16 tensors, every byte
changed before each save; each save waits until every tier it goes to has committed. Per save and
rank: the process's CPU (every thread, user + sys; ``getrusage``) while ``save`` blocks and until the
last commit, and the local S3 server's CPU over the run divided by the saves (its process's
``/proc`` counters). Medians over the saves after two warm-up saves. Configurations:

- ``dcp``: ``torch.distributed.checkpoint.async_save`` with a reused stager to a local directory;
- ``dcp-s3``: the same to the S3 server (DCP's fsspec writer);
- ``ram``, ``local``, ``peer`` (RAM + local + one peer replica), ``full`` (``peer`` + the durable
  tier on the S3 server every ``--durable-every`` saves), ``full-dir`` (``peer`` + the durable tier
  on a local directory, as ``dcp`` writes to): ``CheckpointStore``.

    python benchmarks/bench_save_cpu.py --kinds dcp,dcp-s3,ram,local,peer,full --saves 6 --out /tmp/save-cpu

The S3 server's figure is the point of the last two of each kind: on this machine it runs on the
trainers' cores, where a real object store's CPU would be elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20
TENSORS = 16
KINDS = ("dcp", "dcp-s3", "ram", "local", "peer", "full", "full-dir")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rank(rank: int, cfg: dict[str, Any], q: Any) -> None:
    try:
        q.put((rank, _saves(rank, cfg)))
    except BaseException as exc:  # the launcher waits on the queue: tell it instead of hanging it
        q.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _saves(rank: int, cfg: dict[str, Any]) -> list[tuple[float, float]]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    flat = {f"t{rank}.{i}": torch.rand(cfg["mib"] * MIB // TENSORS // 4, generator=g) for i in range(TENSORS)}
    kind, out = cfg["kind"], []
    if kind.startswith("dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if kind == "dcp-s3":
            so = cfg["storage_options"]
            os.environ.update(AWS_ACCESS_KEY_ID=so["key"], AWS_SECRET_ACCESS_KEY=so["secret"],
                              AWS_ENDPOINT_URL=so["client_kwargs"]["endpoint_url"], AWS_DEFAULT_REGION="us-east-1")
            for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
                os.environ.pop(name, None)
        root = cfg["durable"] if kind == "dcp-s3" else cfg["root"]
        group = dist.new_group(backend="gloo")
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=False))
        for s in range(cfg["saves"]):
            for t in flat.values():
                t.add_(1.0)
            dist.barrier()
            c0 = _cpu()
            resp: Any = dcp.async_save(flat, checkpoint_id=f"{root}/step-{s}", async_stager=stager, process_group=group)
            resp.staging_completion.result()
            blocking = _cpu() - c0
            resp.upload_completion.result()
            out.append((blocking, _cpu() - c0))
        stager.close()
    else:
        from ckptstore import CheckpointStore

        ram = os.path.join(cfg["ram"], f"node{rank}")
        os.makedirs(ram, exist_ok=True)
        kw: dict[str, Any] = {"ram_dir": ram, "node": rank, "keep_local": 2}
        if kind != "ram":
            kw["local"] = os.path.join(cfg["root"], f"local{rank}")
        if kind in ("peer", "full", "full-dir"):
            kw["peer_replicas"] = 1
        if kind == "full":
            kw.update(durable=cfg["durable"], storage_options=cfg["storage_options"], durable_every=cfg["durable_every"])
        if kind == "full-dir":  # the durable tier on a directory, as DCP's: no server to pay
            kw.update(durable=os.path.join(cfg["root"], "durable"), durable_every=cfg["durable_every"])
        with CheckpointStore(cfg["job"], **kw) as store:
            for s in range(cfg["saves"]):
                for t in flat.values():
                    t.add_(1.0)
                dist.barrier()
                c0 = _cpu()
                handle = store.save(s + 1, flat)
                blocking = _cpu() - c0
                for tier in ("ram", "local", "peer", "durable"):
                    handle.wait(tier)
                out.append((blocking, _cpu() - c0))
    dist.destroy_process_group()
    return out


def _server_cpu(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--saves", type=int, default=6, help="saves per configuration (the first two are warm-up)")
    p.add_argument("--mib", type=int, default=512, help="MiB of state per rank")
    p.add_argument("--durable-every", type=int, default=1, help="full: promote every N-th save")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS) or args.saves < 3:
        p.error(f"--kinds from {', '.join(KINDS)}; --saves at least 3")
    from ckptstore._local_s3 import start_local_s3

    os.makedirs(args.out, exist_ok=True)
    s3 = start_local_s3(own_process=True)
    pid = getattr(s3._server, "pid", None)
    rows: dict[str, Any] = {}
    try:
        for i, kind in enumerate(kinds):
            root = tempfile.mkdtemp(prefix="save-cpu-", dir="/var/tmp")
            ram = tempfile.mkdtemp(prefix="save-cpu-", dir="/dev/shm")
            tag = f"savecpu{os.getpid()}x{i}"
            cfg = {"kind": kind, "saves": args.saves, "mib": args.mib, "root": root, "ram": ram, "job": tag,
                   "port": 29600 + os.getpid() % 200 + i, "durable": s3.url(tag), "durable_every": args.durable_every,
                   "storage_options": s3.storage_options}
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            server0, t0 = _server_cpu(pid), time.time()
            procs = [ctx.Process(target=_rank, args=(r, cfg, q)) for r in range(2)]
            for proc in procs:
                proc.start()
            try:
                got = dict(q.get(timeout=600) for _ in procs)
            finally:
                for proc in procs:
                    proc.join(30)
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(ram, ignore_errors=True)
            failed = {r: v for r, v in got.items() if isinstance(v, str)}
            if failed:
                raise RuntimeError(f"{kind}: {failed}")
            steady = [x for r in got.values() for x in r[2:]]
            rows[kind] = {"blocking_cpu_s": statistics.median(x[0] for x in steady),
                          "save_cpu_s": statistics.median(x[1] for x in steady),
                          "server_cpu_per_save_s": (_server_cpu(pid) - server0) / args.saves,
                          "wall_s": time.time() - t0, "loadavg": os.getloadavg()}
            print(f"{kind:7s} per save and rank: blocking {rows[kind]['blocking_cpu_s']:.3f} s CPU, until the last "
                  f"commit {rows[kind]['save_cpu_s']:.3f} s; S3 server {rows[kind]['server_cpu_per_save_s']:.3f} s "
                  f"per save (load {rows[kind]['loadavg'][0]:.1f})", flush=True)
    finally:
        s3.stop()
    doc = {"args": vars(args), "rows": rows, "python": sys.version.split()[0], "torch": torch.__version__}
    with open(os.path.join(args.out, "save_cpu.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
