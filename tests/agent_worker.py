"""A trainer that tests/test_agent.py kills right after ``save`` returns (``python agent_worker.py CONFIG RANK``).

It saves steps ``1 .. last - 1`` and waits for each to reach the tiers it goes to, then arms a
crash point (``ram.committed`` of step ``last`` holds back the local write: the process dies
once the step is committed in RAM, before any byte of it reaches the local tier) and saves step
``last``. If the save completes instead, it exits 3, which the test reports as a point never
reached. With ``world`` > 1 the ranks form a gloo group over loopback; ``nodes`` gives each
rank's simulated node (its own RAM directory and local directory).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from ckptstore import CheckpointStore, _faults
from ckptstore.engine.options import AGENT_LINGER_ENV


def state(step: int) -> dict:
    """The same on every rank (plain tensors are replicated: each is written by one rank, so every
    rank of a 4-rank job writes one of the four)."""
    g = torch.Generator().manual_seed(500 + step)
    return {
        "model": {"a": torch.randn(512, 1024, generator=g), "b": torch.randn(384, 1024, generator=g),
                  "c": torch.randint(-(2**40), 2**40, (256, 512), generator=g, dtype=torch.int64),
                  "d": torch.randn(300, 700, generator=g).to(torch.bfloat16)},
        "extra": {"step": step, "note": f"step {step}"},
    }


def agent_processes(job: str) -> int:
    """How many node agents of ``job`` run on this machine (by their command lines)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"ckptstore.cli" in argv and b"agent" in argv and job.encode() in argv:
            count += 1
    return count


def main() -> None:
    if sys.argv[1] == "--zygote":
        zygote()
        return
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    train(cfg, int(sys.argv[2]))


def train(cfg: dict, rank: int) -> None:
    world = cfg["world"]
    torch.set_num_threads(1)
    node = cfg["nodes"][rank]  # the simulated node: its own RAM and local directories (keyed by str(node) in JSON)
    if world > 1:
        dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world)
    if "agent_linger_s" in cfg:
        os.environ[AGENT_LINGER_ENV] = str(cfg["agent_linger_s"])
    store = CheckpointStore(cfg["job"], local=cfg["local"][str(node)], durable=cfg["durable"],
                            durable_every=cfg["durable_every"], ram_dir=cfg["ram"][str(node)], node=node,
                            storage_options=cfg["storage_options"], agent=cfg.get("agent", False),
                            local_every=cfg.get("local_every", 1))
    last = cfg["last"]
    for step in range(1, last):
        handle = store.save(step, state(step))
        handle.wait("local")
        handle.wait("durable")
    store._drain()  # retention of the earlier steps is done too: only the armed save is in flight
    if cfg.get("count_agents"):
        with open(os.path.join(cfg["out"], f"agents-{rank}"), "w") as fh:
            fh.write(str(agent_processes(cfg["job"])))
    if world > 1:
        dist.barrier()
    _faults.arm(cfg["point"], str(last))
    store.save(last, state(last))  # returns once staged; the background run dies at the point
    store._drain()
    sys.exit(3)


def zygote() -> None:
    """Import torch and ckptstore once, then fork every process a test asks for: trainer ranks and
    ``ckptstore agent`` command lines (each a process of its own, killed or exiting like a launched
    one; only the imports are shared). Importing torch costs seconds per process on a loaded 2-core
    machine, and the two-node test starts six. Nothing here runs a torch operation or starts a
    thread before forking, so the children start from a clean state. One JSON request per line on
    stdin: ``{"trainers": CONFIG_PATH, "ranks": N}`` or ``{"agents": [argv, ...], "arm": [point, where]
    or null}`` (the ``ckptstore`` arguments of each agent, and a crash point to arm in them), each answered
    with one line: ``{"status": [...], "stderr": [...]}``, a child's exit code (negative: its signal)
    and what it wrote to stderr (agents also get ``stdout``)."""
    import tempfile

    from ckptstore import cli  # noqa: F401 - imported once here, before forking, like torch

    try:
        import s3fs  # noqa: F401 - the durable tier's client, seconds to import too; nothing of it runs yet
    except ImportError:
        pass

    for line in sys.stdin:
        request = json.loads(line)
        outputs, pids = [], []
        if "trainers" in request:
            with open(request["trainers"]) as fh:
                cfg = json.load(fh)
            jobs = [lambda cfg=cfg, rank=rank: train(cfg, rank) for rank in range(request["ranks"])]
        else:
            arm = request.get("arm")
            jobs = [lambda argv=argv, arm=arm: agent(argv, arm) for argv in request["agents"]]
        for job in jobs:
            out, err = tempfile.mkstemp(), tempfile.mkstemp()
            outputs.append((out[1], err[1]))
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.dup2(out[0], 1)
                    os.dup2(err[0], 2)
                    job()
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            os.close(out[0])
            os.close(err[0])
            pids.append(pid)
        status = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        texts = []
        for out_path, err_path in outputs:
            with open(out_path) as o, open(err_path) as e:
                texts.append((o.read(), e.read()))
            os.unlink(out_path)
            os.unlink(err_path)
        print(json.dumps({"status": status, "stdout": [t[0] for t in texts], "stderr": [t[1] for t in texts]}),
              flush=True)


def agent(argv: list[str], arm: list[str] | None) -> None:
    from ckptstore import cli

    if arm:
        _faults.arm(*arm)
    sys.exit(cli.main(argv))


if __name__ == "__main__":
    main()
