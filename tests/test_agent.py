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
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_same, s3_keys

from ckptstore import CheckpointStore, load_sharded
from ckptstore.engine.agent import NodeAgent, hold_agent_lock
from ckptstore.names import agent_lock, step_dir, stores_lock
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


class Zygote:
    """tests/agent_worker.py --zygote: forks the trainers and agents a test asks for, each a real
    process, sharing only the imports (six torch imports cost a minute on a loaded 2-core machine)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--zygote"], env=_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True)

    def ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(timeout, self.kill)  # a hung child must not hang the test run
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        assert line, f"the zygote died or was killed after {timeout} s (a child hung?)"
        return json.loads(line)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and every child it forked
        except ProcessLookupError:
            pass

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def run_trainers(zygote: Zygote, tmp_path: Path, cfg: dict[str, Any], *, timeout: float = 240) -> None:
    """Start every rank of a job, wait for all of them, and check each died by SIGKILL at its point."""
    cfg = {"storage_options": None, "init": f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex[:8]}",
           "out": str(tmp_path), **cfg}
    path = tmp_path / f"trainer-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(cfg))
    answer = zygote.ask({"trainers": str(path), "ranks": cfg["world"]}, timeout)
    for rank, (code, err) in enumerate(zip(answer["status"], answer["stderr"])):
        assert code == -signal.SIGKILL, f"rank {rank} was not killed at {cfg['point']} (exit {code}):\n{err}"


def agent_args(job: str, ram: Path, local: Path | None, durable: str | None, storage_options: Any = None) -> list[str]:
    """The arguments of ``ckptstore`` that run one node's agent once."""
    argv = ["agent", job, "--ram-dir", str(ram), "--once"]
    argv += ["--local", str(local)] if local is not None else []
    argv += ["--durable", durable] if durable is not None else []
    argv += ["--storage-options", json.dumps(storage_options)] if storage_options else []
    return argv


def run_agents(zygote: Zygote, argvs: list[list[str]], *, arm: tuple[str, str] | None = None,
               timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run agents side by side (one per simulated node), as on a real job's nodes."""
    answer = zygote.ask({"agents": argvs, "arm": arm}, timeout)
    return [subprocess.CompletedProcess(a, code, out, err)
            for a, code, out, err in zip(argvs, answer["status"], answer["stdout"], answer["stderr"])]


def durable_steps(url: str, storage_options: Any = None) -> list[int]:
    return DirectoryTier("durable", url, storage_options=storage_options).steps_sync()


def assert_loads(url: str, step: int, storage_options: Any = None) -> None:
    """The committed step at ``url`` loads through the reference loader, bitwise."""
    loaded = state(0)
    load_sharded(loaded, f"{url}/{step_dir(step)}", storage_options=storage_options)
    assert_same(loaded, state(step), f"step {step} at {url}")


# ------------------------------------------------------------------------------ the main case


@pytest.mark.timeout(600)  # seven processes and a real S3 server on a loaded 2-core machine
@pytest.mark.parametrize("point", ["ram.committed", pytest.param("tier.data_written", marks=pytest.mark.slow)])
def test_agents_persist_what_killed_trainers_left_on_two_nodes(tmp_path, shm, s3, job, zygote, point):
    """2 nodes x 2 ranks on gloo, SIGKILLed once step 1 is committed in RAM (its local write held
    back; or, with ``tier.data_written``, once each rank's local data file is written and before its
    part file: the agent then writes beside that debris): one agent per node (--once) writes it to
    each node's local directory and to the durable tier (the last agent to find every part commits
    the manifest); the job restarts elsewhere, with the old nodes' RAM and local directories gone,
    and restores step 1 from durable, bitwise. Without the agents nothing of it would be left anywhere."""
    durable = f"s3://{s3['bucket']}/{s3['prefix']}/durable"
    opts = s3["storage_options"]
    ram = {n: shm / f"node{n}" for n in (0, 1)}
    local = {n: tmp_path / f"local{n}" for n in (0, 1)}
    for d in ram.values():
        d.mkdir()
    run_trainers(zygote, tmp_path, {"job": job, "world": 4, "nodes": [0, 0, 1, 1], "durable": durable, "durable_every": 1,
                            "ram": {str(n): str(d) for n, d in ram.items()},
                            "local": {str(n): str(d) for n, d in local.items()}, "last": 1,
                            "point": point, "storage_options": opts})
    # What the trainers left: step 1 in RAM only.
    assert all(committed_steps(str(d)) == set() for d in local.values())
    assert durable_steps(durable, opts) == []

    # Node 0's agent alone: its ranks' parts go to durable, the manifest waits for node 1's.
    first = run_agents(zygote, [agent_args(job, ram[0], local[0], durable, opts)])[0]
    assert first.returncode == 0, first.stderr
    assert "waiting in the durable tier" in first.stdout and "waits for ranks 2, 3" in first.stderr
    assert durable_steps(durable, opts) == []
    # Both nodes' agents at once (node 0's again, as after a restart of it): node 0's finds its
    # parts there and writes none, node 1's writes its own, and whichever finds all four commits.
    results = run_agents(zygote, [agent_args(job, ram[n], local[n], durable, opts) for n in (0, 1)])
    for r in results:
        assert r.returncode == 0, r.stderr
    assert durable_steps(durable, opts) == [1]
    parts = s3_keys(s3, f"{s3['prefix']}/durable/{step_dir(1)}/parts/")
    assert len(parts) == 4, parts  # one part per rank: the rerun on node 0 wrote none
    for n, d in local.items():  # each node's local directory holds its own ranks' files, as the store writes them
        assert committed_steps(str(d)) == {1}
        names = sorted(os.listdir(d / step_dir(1) / "data"))
        if point == "ram.committed":
            assert names == [f"rank-{r:05d}.bin" for r in (2 * n, 2 * n + 1)]
        else:  # the dead trainers' files are never replaced: the agent's are named for it
            assert len(names) == 4 and all(name.startswith((f"rank-{2 * n:05d}", f"rank-{2 * n + 1:05d}"))
                                           for name in names), names

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


def test_a_step_outside_the_durable_cadence_goes_to_local_only(tmp_path, shm, job, zygote):
    """durable_every=2: step 2 was promoted by the trainer, step 3 (killed after its RAM commit)
    was not due in the durable tier, so the agent writes it to local only, and leaves step 2 (in
    both tiers already) untouched. Before that: a snapshot whose owner is alive is left to its
    store, and one whose pid now names another process (another start time) is not."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 2, "last": 3, "point": "ram.committed"})
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
    again = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"]))
    out = again.run_once()
    assert (out.local, out.durable, out.failed) == ([], [], [])
    # Once persisted, the dead trainer's segments are given back to the node; one a live process
    # committed since (a trainer restarted here) is kept.
    _set_owner(doc_path, owner_record())
    kept = {doc_path, doc_path.with_suffix(".bin")}
    assert len(list(n["ram"].glob(f"ckptstore-{job}-*"))) > len(kept)
    assert again.release_persisted()[0] >= 1
    assert set(n["ram"].glob(f"ckptstore-{job}-*")) == kept


@pytest.mark.parametrize("last", [4, 5])
def test_an_agent_persists_to_local_the_steps_due_there_and_the_dead_trainers_newest(tmp_path, shm, job, zygote, last):
    """local_every=2: steps 2 and 4 are due in the local tier, 1, 3 and 5 are not. The trainer is
    killed after the RAM commit of step ``last``, its RAM holding ``last`` and the step before.
    The agent writes the newest step whether due or not (the RAM it gives back afterwards would
    take a step that lived in RAM alone with it), and leaves an older one that was not due (the
    store would not have written it either)."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 10, "local_every": 2, "last": last,
                                    "point": "ram.committed"})
    written = {2} if last == 4 else {2, 4}
    assert committed_steps(str(n["local"])) == written
    agent = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"]))
    out = agent.run_once()
    assert (out.local, out.durable, out.failed) == ([last], [], [])
    assert committed_steps(str(n["local"])) == written | {last}  # step 3 (last=4) is not written
    assert_loads(str(n["local"]), last)


@pytest.mark.slow
def test_a_snapshot_being_written_is_never_persisted(tmp_path, shm, job, zygote):
    """Killed while step 2 was staged but not committed in RAM: its slot has no manifest, and the
    agent persists nothing of it (step 1 is in both tiers already)."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 1, "last": 2, "point": "ram.before_commit"})
    out = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (out.local, out.durable, out.waiting, out.failed) == ([], [], [], [])
    assert committed_steps(str(n["local"])) == {1} and durable_steps(n["durable"]) == [1]
    assert not (n["local"] / step_dir(2)).exists() and not (Path(n["durable"]) / step_dir(2)).exists()


@pytest.mark.slow
def test_a_damaged_segment_is_logged_and_the_others_are_persisted(tmp_path, shm, job, zygote, caplog):
    """Two pending steps, the older one's segment damaged: the agent names it, persists the other,
    and reports the failure; a stray document of the job is passed over."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 1, "last": 2, "point": "ram.committed"})
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


def test_bad_agent_arguments_are_refused_before_anything_is_made(tmp_path, shm, job):
    from ckptstore import InvalidArgumentError

    for kwargs, words in (({"agent": True}, "pass local= or durable="),
                          ({"agent": "yes", "local": tmp_path}, "True or False"),
                          ({"agent": True, "local": tmp_path, "ram_fallback": "private"}, "one or the other")):
        with pytest.raises(InvalidArgumentError, match=words):
            CheckpointStore(job, ram_dir=str(shm), **kwargs)
    assert os.listdir(shm) == [] and not any(tmp_path.iterdir())
    for bad in ("soon", "-1", "nan"):
        os.environ["CKPTSTORE_AGENT_LINGER_S"] = bad
        try:
            with pytest.raises(InvalidArgumentError, match=f"CKPTSTORE_AGENT_LINGER_S='{bad}': the node agent's linger "
                                                           "must be a number of seconds"):
                CheckpointStore(job, ram_dir=str(shm), agent=True, local=tmp_path / "local")
        finally:
            del os.environ["CKPTSTORE_AGENT_LINGER_S"]
    assert os.listdir(shm) == [] and not any(tmp_path.iterdir())
    with pytest.raises(InvalidArgumentError, match="--local DIR, --durable URL"):
        NodeAgent(job, local=None, durable=None, ram_dir=str(shm))


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
DEFAULT_POINTS = {("tier.part_written", "durable"), ("tier.before_manifest", "local0")}


@pytest.fixture(scope="module")
def left_behind(tmp_path_factory, zygote):
    """One killed trainer's RAM directory (step 1 committed in RAM only), copied by each trial."""
    tmp = tmp_path_factory.mktemp("agent-crash")
    job = f"test-{uuid.uuid4().hex[:12]}"
    ram = Path("/dev/shm") / f"ckptstore-agent-test-{uuid.uuid4().hex[:10]}"
    ram.mkdir(mode=0o700)
    try:
        # Its store had a durable tier (the snapshot was due there); what it wrote there is not used.
        run_trainers(zygote, tmp, {"job": job, "world": 1, "nodes": [0], "ram": {"0": str(ram)},
                           "durable": str(tmp / "unused-durable"),
                           "local": {"0": str(tmp / "unused")}, "durable_every": 1, "last": 1,
                           "point": "ram.committed"})
        yield job, ram
    finally:
        shutil.rmtree(ram, ignore_errors=True)


@pytest.mark.parametrize("point,where", [
    pytest.param(p, w, marks=() if (p, w) in DEFAULT_POINTS else pytest.mark.slow) for p, w in AGENT_POINTS])
def test_an_agent_killed_at_a_commit_point_loses_nothing_and_a_rerun_finishes(tmp_path, shm, left_behind, zygote,
                                                                                  point, where):
    job, template = left_behind
    ram = shm / "node0"
    shutil.copytree(template, ram)
    local, durable = tmp_path / "local0", str(tmp_path / "durable")
    argv = agent_args(job, ram, local, durable)
    killed = run_agents(zygote, [argv], arm=(point, str(tmp_path / where)))[0]
    assert killed.returncode == -signal.SIGKILL, f"the agent never reached {point} in {where}:\n{killed.stderr}"
    # Whatever it committed before dying is whole.
    for root in (str(local), durable):
        for step in committed_steps(root):
            assert_loads(root, step)
    rerun = run_agents(zygote, [argv])[0]
    assert rerun.returncode == 0, rerun.stderr
    assert committed_steps(str(local)) == {1} and durable_steps(durable) == [1]
    assert_loads(str(local), 1)
    assert_loads(durable, 1)


# ------------------------------------------------------------------------------ agent=True


@pytest.mark.slow
def test_a_store_started_agent_persists_after_the_trainer_dies(tmp_path, shm, job, zygote):
    """CheckpointStore(agent=True) on two ranks of one node starts one agent; both ranks are
    SIGKILLed after step 2's RAM commit; the agent writes step 2 to local and durable and exits
    once no store of the job is open on the node (at once: CKPTSTORE_AGENT_LINGER_S=0)."""
    n = _one_node(tmp_path, shm)
    cfg = {**n["cfg"], "world": 2, "nodes": [0, 0], "job": job, "durable_every": 1, "last": 2,
           "point": "ram.committed", "agent": True, "count_agents": True, "agent_linger_s": 0}
    run_trainers(zygote, tmp_path, cfg)
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


def test_an_idle_agent_lingers_with_the_ram_a_restart_restores_from(tmp_path, shm, job, zygote):
    """The trainer dies after step 2's RAM commit. An agent that exits when idle persists step 2 at
    once, yet keeps its RAM segment for ``linger_s`` after the last store closed, and as long as a
    store is open (the restarted trainer's, here the stores lock held shared): a crashed job that
    restarts on the node restores from RAM. Then it exits and gives the segments back. An agent
    that gave them back in the gap between the crash and the restart sent every such restart to
    the local tier, and after a node loss left a survivor's part of a step in no layout that
    matched the lost node's replicas."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 1, "last": 2, "point": "ram.committed"})
    agent = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"]))
    linger = 1.5
    watcher = threading.Thread(target=agent.watch, kwargs={"poll_s": 0.1, "exit_when_idle": True, "linger_s": linger})
    stores = os.open(n["ram"] / stores_lock(job), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        watcher.start()
        deadline = time.monotonic() + 60
        while committed_steps(str(n["local"])) != {1, 2}:
            assert time.monotonic() < deadline, "the agent did not persist step 2"
            time.sleep(0.05)
        segments = sorted(p.name for p in n["ram"].glob("*.bin"))
        assert segments and watcher.is_alive()
        fcntl.flock(stores, fcntl.LOCK_SH)  # a restarted store opens on the node
        time.sleep(2 * linger)
        assert watcher.is_alive() and sorted(p.name for p in n["ram"].glob("*.bin")) == segments
        fcntl.flock(stores, fcntl.LOCK_UN)  # and closes again: the linger starts over
        closed = time.monotonic()
        watcher.join(timeout=60)
        assert not watcher.is_alive(), "the agent did not exit after its linger"
        assert time.monotonic() - closed >= linger
        assert list(n["ram"].glob("*.bin")) == []
    finally:
        os.close(stores)
        watcher.join(timeout=60)


def test_a_step_dropped_from_ram_while_being_persisted_is_not_committed(tmp_path, shm, job, zygote):
    """A restarted store that restored an older step drops a newer one it cannot restore from RAM
    and local, then saves that number again. An agent already persisting it when it was dropped
    must not commit it in local afterwards: that copy would stand in the new save's way."""
    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 2, "last": 3, "point": "ram.committed"})
    assert committed_steps(str(n["local"])) == {1, 2}
    agent = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"]))
    assert agent.local is not None
    put = agent.local.put

    async def put_then_dropped(snap: Any) -> Any:
        part = await put(snap)
        for doc_path in n["ram"].glob("*.json"):  # the store's drop of step 3 lands meanwhile
            if json.loads(doc_path.read_text())["step"] == 3:
                doc_path.with_suffix(".bin").unlink()
                doc_path.unlink()
        return part

    agent.local.put = put_then_dropped  # type: ignore[method-assign]
    out = agent.run_once()
    assert (out.local, out.durable, out.failed) == ([], [], [])
    assert committed_steps(str(n["local"])) == {1, 2}
    # Nothing of the agent's copy is left behind (empty directories wait for the next start's sweep,
    # and a new save of step 3 writes beside them).
    assert [p for p in (n["local"] / step_dir(3)).rglob("*") if p.is_file()] == []


def test_a_slot_reused_while_the_agent_reads_it_is_not_reported_as_damage(tmp_path, shm, job, zygote, caplog,
                                                                           monkeypatch):
    """The agent reads a dead trainer's committed slot of step 3 while a restarted store stages a
    new save into that slot (its document removed first, then its bytes overwritten): the bytes no
    longer match the checksums, and that is no damage. The agent persists nothing of it and says so
    quietly, instead of logging "checksum mismatch ... the file was damaged after it was written"
    (seen on a surviving node in the crash-loop test)."""
    import ckptstore.engine.agent as agent_module

    n = _one_node(tmp_path, shm)
    run_trainers(zygote, tmp_path, {**n["cfg"], "job": job, "durable_every": 2, "last": 3, "point": "ram.committed"})
    read = agent_module.read_verified

    def read_while_reused(path: str, doc: Any, manifest: Any, sid: str) -> Any:
        Path(path).with_suffix(".json").unlink()  # the restarted store's stage: the document goes first
        with open(path, "r+b") as fh:  # then the new save's bytes
            fh.write(b"\xff" * 64)
        return read(path, doc, manifest, sid)

    monkeypatch.setattr(agent_module, "read_verified", read_while_reused)
    caplog.set_level("INFO", logger="ckptstore")
    out = NodeAgent(job, local=str(n["local"]), durable=n["durable"], ram_dir=str(n["ram"])).run_once()
    assert (out.local, out.durable, out.failed) == ([], [], [])
    assert "left the RAM tier while it was being read" in caplog.text
    assert "checksum mismatch" not in caplog.text and "was not persisted" not in caplog.text
    assert committed_steps(str(n["local"])) == {1, 2}


def test_an_idle_agent_gives_back_slots_made_ahead_that_no_save_used(tmp_path, shm, job):
    """A store makes the next save's slot ahead of it; killed before that save, it leaves the slot
    empty (no document, nothing committed). The agent's exit, holding the stores lock (no store of
    the job open on the node), gives it back with the persisted ones; a pass that cannot know that
    (``--once``) keeps it, since a live store's slot between its document's removal and its commit
    looks the same (and its store maps it: the inventory says alive)."""
    ram = shm / "node0"
    ram.mkdir()
    empty = ram / f"ckptstore-{job}-r00000-s1.bin"
    empty.write_bytes(b"\0" * 8192)
    other = ram / f"ckptstore-{job}x-r00000-s1.bin"  # another job's: never this agent's
    other.write_bytes(b"\0" * 8192)
    agent = NodeAgent(job, local=str(tmp_path / "local"), durable=None, ram_dir=str(ram))
    assert agent.release_persisted() == (0, 0) and empty.exists()
    assert agent.release_persisted(empty=True) == (1, 8192)
    assert not empty.exists() and other.exists()


def test_a_store_starting_beside_an_agent_leaves_the_step_it_may_be_writing(tmp_path, shm, job):
    """A store's start sweeps what crashed saves left (step directories with no manifest); with a
    node agent of the job running (a lingering one, or `ckptstore agent` run by hand), an
    incomplete step newer than every committed one may be the agent's write in progress, and
    stays (removing it mid-write could leave the agent's manifest naming deleted files); an
    older one goes. With no agent about, both go, as before."""
    local = tmp_path / "local"
    with CheckpointStore(job, ram_dir=str(shm), local=str(local)) as store:
        store.save(2, state(2)).wait("local")

    def plant(step: int) -> Path:
        where = local / step_dir(step) / "data"
        where.mkdir(parents=True)
        (where / "rank-00000.w0badc0de.bin").write_bytes(b"\1" * 4096)
        return where.parent

    older, newer = plant(1), plant(5)
    agent = hold_agent_lock(job, str(shm))  # what the node agent holds while it runs
    try:
        with CheckpointStore(job, ram_dir=str(shm), local=str(local)) as store:
            assert not older.exists() and newer.exists()
            assert (newer / "data" / "rank-00000.w0badc0de.bin").read_bytes() == b"\1" * 4096
            assert store.local.steps_sync() == [2]
    finally:
        os.close(agent)
    with CheckpointStore(job, ram_dir=str(shm), local=str(local)) as store:
        assert not newer.exists()
        target = state(0)
        assert store.restore(target) == 2
        assert_same(target, state(2))
