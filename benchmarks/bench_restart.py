"""What a restart costs, phase by phase: a 2-rank gloo job with the full store (RAM + local + peer
replicas + durable on a local SeaweedFS server + the node agent) is started, saves a few steps,
is killed with SIGKILL (both ranks), and is started again, ``--rounds`` times. Each rank of every
start times, from the moment the launcher spawned it: the imports, the process group, the store's
construction (split into its parts), the restore (split likewise), the first two saves' blocking
time and the median blocking of the three saves after them (steady: slots mapped and warm), each
save starting once the one before it is persisted (as with training steps between saves); the
round's figure per phase is the slower rank's.

    python benchmarks/bench_restart.py [--layers 4] [--rounds 3] [--out /tmp/restart]

Each rank is a node of its own (its own RAM and local directories, so the peer replicas cross
nodes); nothing is wiped between rounds but the processes (a crash, not a node loss), or with
``--node-loss`` node 0 is lost before every restart too (its RAM and local directories and its
agent gone: a replaced node, which restores from node 1's replicas). Writes
<out>/restart.json (restart-node-loss.json). Before and after a change, in one run: PYTHONPATH=<other tree> on a second run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agents import agent_pids  # noqa: E402 - shared by the benchmark scripts

WORLD = 2
_SAVES = 5  # after each start: the first two, and three steady ones (their median)

# (module, class or None, attribute, phase): what each rank times inside the store.
_SPANS = [
    ("ckptstore.engine.store", None, "store_groups", "construct.groups"),
    ("ckptstore.engine.store", None, "RamTier", "construct.ram_tier"),
    ("ckptstore.engine.store", None, "DirectoryTier", "construct.directory_tiers"),
    ("ckptstore.engine.store", None, "PeerTier", "construct.peer_tier"),
    ("ckptstore.engine.store", None, "start_agent", "construct.agent"),
    ("ckptstore.engine.store", None, "Pipeline", "construct.pipeline"),
    ("ckptstore.engine.store", None, "GoodputTracker", "construct.tracker"),
    ("ckptstore.engine.store", "CheckpointStore", "_sweep", "construct.sweep"),
    ("ckptstore.engine.store", "CheckpointStore", "_start_durable", "construct.durable_start"),
    ("ckptstore.engine.store", "CheckpointStore", "_swept", "save.sweep_wait"),
    ("ckptstore.engine.restore", "Restorer", "newest_held", "construct.newest_held"),
    ("ckptstore.engine.restore", "Restorer", "newest", "restore.find_and_load"),
    ("ckptstore.engine.restore", "Restorer", "meta_of", "restore.meta"),
    # Rank 0's answers from its listing of the durable tier: the time blocked on it (the restore's
    # wait for the start's listing, mostly); see also "listing.ready" in _instrument().
    ("ckptstore.engine.restore", "Restorer", "_durable_steps", "listing.wait"),
    ("ckptstore.engine.store", "CheckpointStore", "_drop_dead_branch", "restore.dead_branch"),
    ("ckptstore.engine.pipeline", "Pipeline", "promote_restored", "restore.promote"),
    # Mapping a RAM slot's segment (reserving and faulting in its pages), on whichever thread does it.
    ("ckptstore.tiers.ram", None, "_map_segment", "slots.map_any_thread"),
    # The trainer's part of a save, reported per save (saveN.*): see worker().
    ("ckptstore.engine.pipeline", "Pipeline", "_collect", "save.collect"),
    ("ckptstore.engine.pipeline", "Pipeline", "_vote", "save.vote"),
    ("ckptstore.engine.pipeline", "Pipeline", "_plan", "save.plan"),
    ("ckptstore.engine.pipeline", "Pipeline", "_wait_for_slot", "save.wait_for_slot"),
    ("ckptstore.tiers.ram", "RamTier", "_slot", "save.slot"),
    ("ckptstore.tiers.ram", "RamTier", "stage", "save.stage"),
]


def _instrument(spans: dict[str, float]) -> None:
    """Wrap each span's callable (a class is called like a function) so that it adds its time."""
    import importlib

    for module, cls, name, phase in _SPANS:
        owner: Any = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        real = getattr(owner, name, None)
        if real is None:
            continue  # not in this version of the engine

        def timed(*a: Any, _real: Callable[..., Any] = real, _phase: str = phase, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                spans[_phase] = spans.get(_phase, 0.0) + time.perf_counter() - t

        setattr(owner, name, timed)

    # When rank 0's listing of the durable tier, started at the store's start, came back: seconds
    # from that start (the restore waits for it unless it was back by the end of the restore's load).
    from ckptstore.engine.store import CheckpointStore

    real_start = CheckpointStore._start_durable

    def start_durable(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        listed = real_start(self, *a, **k)
        listed.add_done_callback(lambda _f: spans.__setitem__("listing.ready", time.perf_counter() - t))
        return listed

    CheckpointStore._start_durable = start_durable  # type: ignore[method-assign]


def worker(cfg: dict[str, Any], rank: int) -> None:
    spawned = float(os.environ["BENCH_SPAWNED_AT"])
    marks: dict[str, float] = {}
    spans: dict[str, float] = {}
    t = time.time()
    marks["python_start"] = t - spawned
    import torch
    import torch.distributed as dist

    import ckptstore  # noqa: F401 - timed with the imports

    if cfg.get("preimport_s3fs"):
        import s3fs  # noqa: F401 - as a launcher that keeps warm processes has (the crash loop's zygote)

    marks["imports"] = time.time() - t
    _instrument(spans)
    from ckptstore import CheckpointStore

    t = time.time()
    dist.init_process_group("gloo", init_method=f"file://{cfg['rendezvous']}", rank=rank, world_size=WORLD)
    marks["process_group"] = time.time() - t
    torch.manual_seed(rank)
    layers = [torch.nn.Linear(cfg["width"], cfg["width"]) for _ in range(cfg["layers"])]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, cfg["width"])).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    node = cfg["nodes"][rank]
    t = time.time()
    store = CheckpointStore(cfg["job"], local=node["local"], durable=cfg["durable"], durable_every=4,
                            storage_options=cfg["storage_options"], ram_dir=node["ram"], node=rank, keep_local=2,
                            peer_replicas=1, agent=True, timeout_s=300, durable_timeout_s=240,
                            **({} if cfg.get("background_nice") is None else {"background_nice": cfg["background_nice"]}))
    marks["construct"] = time.time() - t
    t = time.time()
    found = store.restore(state)
    marks["restore"] = time.time() - t
    marks["resumed_after_spawn"] = time.time() - spawned
    # Training before the first save (a crash loop trains ``--every`` steps first): a GPU's work,
    # during which the host's cores are free for the store's background work.
    time.sleep(cfg.get("gap_s", 0.0))
    step = found or 0
    steady = []
    for i in range(_SAVES):
        step += 1
        before = {k: v for k, v in spans.items() if k.startswith("save.")}
        t = time.time()
        handle = store.save(step, state)
        blocked = time.time() - t
        if i < 2:
            marks[f"save{i + 1}_blocking"] = blocked
            for k, v in spans.items():
                if k.startswith("save.") and k != "save.sweep_wait":
                    marks[f"save{i + 1}.{k[5:]}"] = v - before.get(k, 0.0)
        else:
            steady.append(blocked)
        # A crash loop trains between saves: each save here starts once the previous one is
        # persisted everywhere it goes, so its blocking is its own, not a wait for the last one.
        for tier in ("local", "peer", "durable"):
            handle.wait(tier)
    marks["steady_save_blocking"] = statistics.median(steady)
    out = {"rank": rank, "restored": found, "marks": marks, "spans": spans}
    path = os.path.join(cfg["work"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(out, fh)
    os.rename(path + ".tmp", path)  # the launcher reads it once it exists: whole, never half-written
    time.sleep(3600)  # until the launcher kills it, as a failure does


def _round(cfg: dict[str, Any], script: str) -> list[dict[str, Any]]:
    for r in range(WORLD):
        path = os.path.join(cfg["work"], f"rank{r}.json")
        if os.path.exists(path):
            os.unlink(path)
    if os.path.exists(cfg["rendezvous"]):
        os.unlink(cfg["rendezvous"])
    env = {**os.environ, "BENCH_SPAWNED_AT": repr(time.time())}
    procs = [subprocess.Popen([sys.executable, script, "--worker", str(r), "--cfg", cfg["cfg_path"]], env=env)
             for r in range(WORLD)]
    deadline = time.time() + 600
    try:
        while not all(os.path.exists(os.path.join(cfg["work"], f"rank{r}.json")) for r in range(WORLD)):
            if any(p.poll() is not None for p in procs) or time.time() > deadline:
                raise RuntimeError(f"a rank exited or hung: {[p.poll() for p in procs]}")
            time.sleep(0.05)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    out = []
    for r in range(WORLD):
        with open(os.path.join(cfg["work"], f"rank{r}.json")) as fh:
            out.append(json.load(fh))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="Linear(width, width) layers per rank, with Adam")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="restarts measured (after the first start)")
    ap.add_argument("--background-nice", type=int, default=None, metavar="N",
                    help="the stores' background_nice (default: the engine's own)")
    ap.add_argument("--preimport-s3fs", action="store_true",
                    help="import s3fs with torch and ckptstore, before the clock of the store starts (as the "
                         "crash loop's zygote has)")
    ap.add_argument("--gap", type=float, default=0.0, metavar="S",
                    help="seconds of (simulated, GPU) training between the restore and the first save (default 0)")
    ap.add_argument("--node-loss", action="store_true",
                    help="lose node 0 (RAM, local directory, agent) before every restart, not only the processes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks"))
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        with open(args.cfg) as fh:
            worker(json.load(fh), args.worker)
        return
    from ckptstore._local_s3 import start_local_s3

    s3 = start_local_s3(server="seaweedfs")  # first: a server that does not start leaves no directories
    work = tempfile.mkdtemp(prefix="bench-restart-")
    ram_root = tempfile.mkdtemp(prefix="bench-restart-", dir="/dev/shm")
    job = f"restart-{uuid.uuid4().hex[:8]}"
    cfg = {"job": job, "work": work, "rendezvous": os.path.join(work, "rendezvous"), "layers": args.layers,
           "background_nice": args.background_nice, "preimport_s3fs": args.preimport_s3fs, "gap_s": args.gap,
           "width": args.width, "durable": s3.url(job), "storage_options": s3.storage_options,
           "nodes": [{"local": os.path.join(work, f"node{r}", "local"), "ram": os.path.join(ram_root, f"node{r}")}
                     for r in range(WORLD)]}
    for node in cfg["nodes"]:
        os.makedirs(node["ram"], exist_ok=True)
    cfg["cfg_path"] = os.path.join(work, "cfg.json")
    with open(cfg["cfg_path"], "w") as fh:
        json.dump(cfg, fh)
    rounds: list[dict[str, Any]] = []
    try:
        for i in range(args.rounds + 1):
            if i and args.node_loss:
                _lose_node(cfg["nodes"][0])
            ranks = _round(cfg, os.path.abspath(__file__))
            phases: dict[str, float] = {}
            for r in ranks:
                for k, v in {**r["marks"], **r["spans"]}.items():
                    phases[k] = max(phases.get(k, 0.0), v)
            rounds.append({"restored": [r["restored"] for r in ranks], "phases": phases,
                           "loadavg": os.getloadavg()})
            print(f"start {i}: restored {rounds[-1]['restored']}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(phases.items())), flush=True)
    finally:
        _wait_for_agents(ram_root, timeout_s=5.0)  # what the last kill left is not measured: they linger, and go
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ram_root, ignore_errors=True)
    restarts = rounds[1:]
    keys = sorted({k for r in restarts for k in r["phases"]})
    median = {k: statistics.median(r["phases"].get(k, 0.0) for r in restarts) for k in keys}
    doc = {"benchmark": "restart", "node_loss": args.node_loss, "gap_s": args.gap, "layers": args.layers, "width": args.width,
           "rounds": rounds,
           "median_restart_seconds": median, "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "pythonpath": os.environ.get("PYTHONPATH", "")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "restart-node-loss.json" if args.node_loss else "restart.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    print("median of the restarts: " + ", ".join(f"{k} {v:.3f}" for k, v in median.items()))


def _lose_node(node: dict[str, str]) -> None:
    """The node is replaced: its agent, RAM directory and local directory are gone."""
    for pid in agent_pids(node["ram"]):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(node["ram"], ignore_errors=True)
    shutil.rmtree(node["local"], ignore_errors=True)
    os.makedirs(node["ram"])


def _wait_for_agents(ram_root: str, timeout_s: float = 60.0) -> None:
    """The node agents (started by the stores, detached) exit by themselves once no store of the
    job is open and nothing is left to persist: wait for that before their directories go."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and agent_pids(ram_root):
        time.sleep(0.5)
    for pid in agent_pids(ram_root):  # still there: this run started it, this run ends it
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
