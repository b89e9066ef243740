"""The node agent: a RAM snapshot whose trainer died is persisted as the store would have.

Real processes, real /dev/shm, real SIGKILL: trainers (tests/agent_worker.py) are killed right
after ``save`` returns, once the step is committed in RAM and before the local tier got a byte of
it; agents run as ``ckptstore agent ... --once`` processes; the job then restarts "on another
node" (the old RAM and local directories wiped) and restores from the durable tier, bitwise.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_same

from ckptstore import CheckpointStore, load_sharded
from ckptstore.engine.agent import NodeAgent, hold_agent_lock
from ckptstore.names import agent_lock, step_dir
from ckptstore.tiers.directory import DirectoryTier, committed_steps
from ckptstore.tiers.ram import owner_record

sys.path.insert(0, os.path.dirname(__file__))
from agent_worker import state  # noqa: E402 - the worker's own state, so both sides agree on the bytes

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "agent_worker.py"


@pytest.fixture
def shm():
    """A directory of its own in /dev/shm for the simulated nodes' RAM directories."""
    path = Path("/dev/shm") / f"ckptstore-agent-test-{uuid.uuid4().hex[:10]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


def run_trainers(tmp_path: Path, cfg: dict[str, Any], *, timeout: float = 240) -> None:
    """Start every rank of a job, wait for all of them, and check each died by SIGKILL at its point."""
    cfg = {"storage_options": None, "init": f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex[:8]}",
           "out": str(tmp_path), **cfg}
    path = tmp_path / f"trainer-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(cfg))
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(path), str(rank)], env=_env(), cwd=tmp_path,
                              stderr=subprocess.PIPE, text=True) for rank in range(cfg["world"])]
    try:
        errors = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, err) in enumerate(zip(procs, errors)):
        assert p.returncode == -signal.SIGKILL, f"rank {rank} was not killed at {cfg['point']} (exit {p.returncode}):\n{err}"


def agent_argv(job: str, ram: Path, local: Path | None, durable: str | None, storage_options: Any = None) -> list[str]:
    argv = [sys.executable, "-m", "ckptstore.cli", "agent", job, "--ram-dir", str(ram), "--once"]
    argv += ["--local", str(local)] if local is not None else []
    argv += ["--durable", durable] if durable is not None else []
    argv += ["--storage-options", json.dumps(storage_options)] if storage_options else []
    return argv


def run_agents(argvs: list[list[str]], *, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run agents side by side (one per simulated node), as on a real job's nodes."""
    procs = [subprocess.Popen(a, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argvs]
    out = []
    for a, p in zip(argvs, procs):
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        out.append(subprocess.CompletedProcess(a, p.returncode, stdout, stderr))
    return out


def durable_steps(url: str, storage_options: Any = None) -> list[int]:
    return DirectoryTier("durable", url, storage_options=storage_options).steps_sync()


def assert_loads(url: str, step: int, storage_options: Any = None) -> None:
    """The committed step at ``url`` loads through the reference loader, bitwise."""
    loaded = state(0)
    load_sharded(loaded, f"{url}/{step_dir(step)}", storage_options=storage_options)
    assert_same(loaded, state(step), f"step {step} at {url}")


# ------------------------------------------------------------------------------ the main case


@pytest.mark.timeout(600)  # six processes that import torch: minutes on a loaded 2-core machine
def test_agents_persist_what_killed_trainers_left_on_two_nodes(tmp_path, shm, s3, job):
    """2 nodes x 2 ranks on gloo, SIGKILLed once step 1 is committed in RAM (its local write held
    back): one agent per node (--once) writes it to each node's local directory and to the durable
    tier (the last agent to find every part commits the manifest); the job restarts elsewhere, with
    the old nodes' RAM and local directories gone, and restores step 1 from durable, bitwise.
    Without the agents nothing of it would be left anywhere."""
    durable = f"s3://{s3['bucket']}/{s3['prefix']}/durable"
    opts = s3["storage_options"]
    ram = {n: shm / f"node{n}" for n in (0, 1)}
    local = {n: tmp_path / f"local{n}" for n in (0, 1)}
    for d in ram.values():
        d.mkdir()
    run_trainers(tmp_path, {"job": job, "world": 4, "nodes": [0, 0, 1, 1], "durable": durable, "durable_every": 1,
                            "ram": {str(n): str(d) for n, d in ram.items()},
                            "local": {str(n): str(d) for n, d in local.items()}, "last": 1,
                            "point": "ram.committed", "storage_options": opts})
    # What the trainers left: step 1 in RAM only.
    assert all(committed_steps(str(d)) == set() for d in local.values())
    assert durable_steps(durable, opts) == []

    results = run_agents([agent_argv(job, ram[n], local[n], durable, opts) for n in (0, 1)])
    for r in results:
        assert r.returncode == 0, r.stderr
    assert durable_steps(durable, opts) == [1]
    for n, d in local.items():  # each node's local directory holds its own ranks' files, as the store writes them
        assert committed_steps(str(d)) == {1}
        assert sorted(os.listdir(d / step_dir(1) / "data")) == [f"rank-{r:05d}.bin" for r in (2 * n, 2 * n + 1)]

    # The job restarts on other nodes: nothing of the old nodes' RAM or disks is left.
    for d in (*ram.values(), *local.values()):
        shutil.rmtree(d)
    fresh_ram = shm / "new-node"
    fresh_ram.mkdir()
    target = state(0)
    with CheckpointStore(job, local=tmp_path / "new-local", durable=durable, storage_options=opts,
                         ram_dir=str(fresh_ram)) as store:
        assert store.restore(target) == 1
    assert_same(target, state(1))
    assert_loads(durable, 1, opts)


# ------------------------------------------------------------------------------ what it persists


def _one_node(tmp_path: Path, shm: Path) -> dict[str, Any]:
    ram, local = shm / "node0", tmp_path / "local0"
    ram.mkdir()
    return {"ram": ram, "local": local, "durable": str(tmp_path / "durable"),
            "cfg": {"world": 1, "nodes": [0], "ram": {"0": str(ram)}, "local": {"0": str(local)},
                    "durable": str(tmp_path / "durable")}}


def _set_owner(doc_path: Path, owner: dict[str, Any]) -> None:
    doc = json.loads(doc_path.read_text())
    doc["owner"] = owner
    doc_path.write_text(json.dumps(doc))


def test_a_step_outside_the_durable_cadence_goes_to_local_only(tmp_path, shm, job):
    """durable_every=2: step 2 was promoted by the trainer, step 3 (killed after its RAM commit)
    was not due in the durable tier, so the agent writes it to local only, and leaves step 2 (in
    both tiers already) untouched. Before that: a snapshot whose owner is alive is left to its
    store, and one whose pid now names another process (another start time) is not."""
    n = _one_node(tmp_path, shm)
    run_trainers(tmp_path, {**n["cfg"], "job": job, "durable_every": 2, "last": 3, "point": "ram.committed"})
    assert committed_steps(str(n["local"])) == {1, 2} and durable_steps(n["durable"]) == [2]
    before = {p: os.stat(p).st_mtime_ns for p in (n["local"] / step_dir(2) / "manifest.json",
                                                 Path(n["durable"]) / step_dir(2) / "manifest.json")}
    # While its owner lives, a snapshot is the store's to persist; a reused pid is not its owner.
    doc_path = next(p for p in n["ram"].glob("*.json") if json.loads(p.read_text())["step"] == 3)
    _set_owner(doc_path, owner_record())
    idle = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (idle.local, idle.durable, idle.failed) == ([], [], [])
    assert committed_steps(str(n["local"])) == {1, 2}
    _set_owner(doc_path, {**owner_record(), "start": owner_record()["start"] - 1})
    out = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (out.local, out.durable, out.failed) == ([3], [], [])
    assert committed_steps(str(n["local"])) == {1, 2, 3}
    assert durable_steps(n["durable"]) == [2]
    assert not (Path(n["durable"]) / step_dir(3)).exists()
    assert_loads(str(n["local"]), 3)
    assert {p: os.stat(p).st_mtime_ns for p in before} == before
    # Nothing is pending any more: a second pass does nothing.
    again = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (again.local, again.durable, again.failed) == ([], [], [])


@pytest.mark.slow
def test_a_snapshot_being_written_is_never_persisted(tmp_path, shm, job):
    """Killed while step 2 was staged but not committed in RAM: its slot has no manifest, and the
    agent persists nothing of it (step 1 is in both tiers already)."""
    n = _one_node(tmp_path, shm)
    run_trainers(tmp_path, {**n["cfg"], "job": job, "durable_every": 1, "last": 2, "point": "ram.before_commit"})
    out = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (out.local, out.durable, out.waiting, out.failed) == ([], [], [], [])
    assert committed_steps(str(n["local"])) == {1} and durable_steps(n["durable"]) == [1]
    assert not (n["local"] / step_dir(2)).exists() and not (Path(n["durable"]) / step_dir(2)).exists()


@pytest.mark.slow
def test_a_damaged_segment_is_logged_and_the_others_are_persisted(tmp_path, shm, job, caplog):
    """Two pending steps, the older one's segment damaged: the agent names it, persists the other,
    and reports the failure; a stray document of the job is passed over."""
    n = _one_node(tmp_path, shm)
    run_trainers(tmp_path, {**n["cfg"], "job": job, "durable_every": 1, "last": 2, "point": "ram.committed"})
    # Step 1 reached both tiers before the crash; take it away there, so both steps are pending.
    for root in (n["local"], Path(n["durable"])):
        shutil.rmtree(root / step_dir(1))
    docs = {json.loads(p.read_text())["step"]: p for p in n["ram"].glob("*.json")}
    segment = docs[1].with_suffix(".bin")
    with open(segment, "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    (n["ram"] / f"ckptstore-{job}-r00007-s0.json").write_text("{not json")
    agent = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"]))
    out = agent.run_once()
    assert (out.local, out.durable, out.failed) == ([2], [2], [1])
    assert "checksum mismatch" in caplog.text and str(segment) in caplog.text
    assert committed_steps(str(n["local"])) == {2} and durable_steps(n["durable"]) == [2]
    assert_loads(n["durable"], 2)
    # A watching agent keeps going past it (retrying, logging it once), and one that exits when
    # idle gives up on it after give_up_s.
    caplog.clear()
    agent.give_up_s = 0.5
    agent.watch(poll_s=0.1, exit_when_idle=True)
    assert "checksum mismatch" not in caplog.text
    assert committed_steps(str(n["local"])) == {2} and durable_steps(n["durable"]) == [2]


def test_one_agent_per_node(tmp_path, shm, job, capsys):
    """A second agent of the job on the node is refused, naming the lock and what to do."""
    from ckptstore.cli import main

    fd = hold_agent_lock(job, str(shm))
    try:
        assert main(["agent", job, "--local", str(tmp_path / "local"), "--ram-dir", str(shm), "--once"]) == 2
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert "already runs on this node" in err and agent_lock(job) in err


# ------------------------------------------------------------------------------ the agent killed


AGENT_POINTS = [
    ("tier.data_written", "local0"),
    ("tier.part_written", "local0"),
    ("tier.before_manifest", "local0"),
    ("manifest.linked", "local0"),
    ("file.fsynced", "local0"),
    ("tier.data_written", "durable"),
    ("tier.part_written", "durable"),
    ("tier.before_manifest", "durable"),
    ("manifest.linked", "durable"),
]
DEFAULT_POINTS: set[tuple[str, str]] = set()  # each trial starts three processes: all of them run with -m slow


@pytest.fixture(scope="module")
def left_behind(tmp_path_factory):
    """One killed trainer's RAM directory (step 1 committed in RAM only), copied by each trial."""
    tmp = tmp_path_factory.mktemp("agent-crash")
    job = f"test-{uuid.uuid4().hex[:12]}"
    ram = Path("/dev/shm") / f"ckptstore-agent-test-{uuid.uuid4().hex[:10]}"
    ram.mkdir(mode=0o700)
    try:
        # Its store had a durable tier (the snapshot was due there); what it wrote there is not used.
        run_trainers(tmp, {"job": job, "world": 1, "nodes": [0], "ram": {"0": str(ram)},
                           "durable": str(tmp / "unused-durable"),
                           "local": {"0": str(tmp / "unused")}, "durable_every": 1, "last": 1,
                           "point": "ram.committed"})
        yield job, ram
    finally:
        shutil.rmtree(ram, ignore_errors=True)


@pytest.mark.parametrize("point,where", [
    pytest.param(p, w, marks=() if (p, w) in DEFAULT_POINTS else pytest.mark.slow) for p, w in AGENT_POINTS])
def test_an_agent_killed_at_a_commit_point_loses_nothing_and_a_rerun_finishes(tmp_path, shm, left_behind, point,
                                                                                  where):
    job, template = left_behind
    ram = shm / "node0"
    shutil.copytree(template, ram)
    local, durable = tmp_path / "local0", str(tmp_path / "durable")
    code = (f"import sys; from ckptstore import _faults; _faults.arm({point!r}, {str(tmp_path / where)!r}); "
            "from ckptstore.cli import main; sys.exit(main(sys.argv[1:]))")
    argv = agent_argv(job, ram, local, durable)
    killed = run_agents([[sys.executable, "-c", code, *argv[3:]]])[0]
    assert killed.returncode == -signal.SIGKILL, f"the agent never reached {point} in {where}:\n{killed.stderr}"
    # Whatever it committed before dying is whole.
    for root in (str(local), durable):
        for step in committed_steps(root):
            assert_loads(root, step)
    rerun = run_agents([argv])[0]
    assert rerun.returncode == 0, rerun.stderr
    assert committed_steps(str(local)) == {1} and durable_steps(durable) == [1]
    assert_loads(str(local), 1)
    assert_loads(durable, 1)


# ------------------------------------------------------------------------------ agent=True


@pytest.mark.slow
def test_a_store_started_agent_persists_after_the_trainer_dies(tmp_path, shm, job):
    """CheckpointStore(agent=True) on two ranks of one node starts one agent; both ranks are
    SIGKILLed after step 2's RAM commit; the agent writes step 2 to local and durable and exits
    once no store of the job is open on the node."""
    n = _one_node(tmp_path, shm)
    cfg = {**n["cfg"], "world": 2, "nodes": [0, 0], "job": job, "durable_every": 1, "last": 2,
           "point": "ram.committed", "agent": True, "count_agents": True}
    run_trainers(tmp_path, cfg)
    assert [(tmp_path / f"agents-{r}").read_text() for r in (0, 1)] == ["1", "1"]
    lock = os.open(n["ram"] / agent_lock(job), os.O_RDWR)
    try:
        deadline = time.monotonic() + 60
        while True:  # the agent holds its lock until it exits
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the store's agent did not exit"
                time.sleep(0.2)
    finally:
        os.close(lock)
    assert committed_steps(str(n["local"])) == {1, 2}
    assert durable_steps(n["durable"]) == [1, 2]
    assert_loads(n["durable"], 2)
    target = state(0)
    elsewhere = shm / "elsewhere"
    elsewhere.mkdir()
    with CheckpointStore(job, durable=n["durable"], ram_dir=str(elsewhere)) as store:
        assert store.restore(target) == 2
    assert_same(target, state(2))
