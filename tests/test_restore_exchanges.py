"""A restore's agreements at scale (issue 19), and what a rank gets when another dies mid-restore.

Real processes over gloo on loopback, each rank its own node (RAM directory under /dev/shm, local
directory), peer replicas and a durable ``file://`` tier; what each rank receives through the
store's groups is counted by ``collective.counting``, never timed.
"""

from __future__ import annotations

import json
import os
import signal

import dist_workers

# What a rank other than rank 0 may receive more at four ranks than at two: the size vectors of
# the sparse exchanges (8 bytes per rank each) and the padding of a few varying integers. A gather
# of every rank's files, steps or flags adds hundreds of bytes per rank.
SLACK = 256


def _saved(tmp_path, world: int, job: str, ram_root: str) -> dict[str, str]:
    args = dict(name=job, root=str(tmp_path / f"root{world}"), ram_root=os.path.join(ram_root, f"w{world}"))
    dist_workers.spawn(world, "restore_exchange_workers:save_job", tmp_path, **args)
    return args


def test_what_a_rank_receives_in_a_restore_does_not_grow_with_the_world(tmp_path, job, ram_root):
    """The newest step restored bitwise at two and at four ranks (at four, a plain tensor one rank
    wrote is fetched from another node), and the newest step held asked for: every rank but rank 0
    (which lists the durable tier for all) receives no more at four ranks than at two, within a
    few bytes per rank."""
    out = tmp_path / "out"
    out.mkdir()
    received: dict[int, list[int]] = {}
    for world in (2, 4):
        args = _saved(tmp_path, world, f"{job}-{world}", ram_root)
        dist_workers.spawn(world, "restore_exchange_workers:restore_job", tmp_path, out=str(out), **args)
        received[world] = [json.loads((out / f"w{world}-r{r}.json").read_text())["received"] for r in range(world)]
    two, four = max(received[2][1:]), max(received[4][1:])
    assert four <= two + SLACK, received


def test_a_rank_killed_mid_restore_gives_the_others_a_ckptstore_error_naming_the_step(tmp_path, job, ram_root):
    """Rank 1 is SIGKILLed when its restore of step 3 reaches the exchange of files: rank 0 gets a
    CollectiveError (still a RuntimeError) that names the step, the phase and what to do, chained
    from gloo's error; a restart then restores step 3 bitwise, nothing lost."""
    out = tmp_path / "out"
    out.mkdir()
    args = _saved(tmp_path, 2, job, ram_root)
    store = tmp_path / f"store-dies-{os.urandom(4).hex()}"
    results = tmp_path / "results-dies"
    results.mkdir()
    ctx = dist_workers.context()
    env = dict(os.environ)
    procs = [ctx.Process(target=dist_workers.enter,
                         args=(env, dist_workers.run, r, 2, str(store), "restore_exchange_workers:dies_mid_restore_job",
                               dict(out=str(out), **args), str(results))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, hung
    errors = {f.name: f.read_text() for f in results.iterdir() if f.name.startswith("error-")}
    assert [p.exitcode for p in procs] == [0, -signal.SIGKILL], errors
    got = json.loads((out / "dies-r0.json").read_text())
    assert got["type"] == "CollectiveError" and "RuntimeError" in got["mro"], got
    message = got["message"]
    assert "restore of step 3 of job" in message, message
    assert "rank 0 of 2" in message and "arranging which ranks send each other the step's files" in message, message
    assert "Restart the job" in message and "checkpoints are intact" in message, message
    assert got["cause"] in ("RuntimeError", "DistBackendError", "DistNetworkError"), got
    dist_workers.spawn(2, "restore_exchange_workers:restore_job", tmp_path, out=str(out), **args)


def test_a_restore_agreed_by_hash_answers_without_a_pass_over_the_world():
    """When every rank said the same of its node's copies (agreed by one all-reduced hash), the
    agreement is read from this rank's own word: the same answer as from every rank's, at any
    world size, without a list of the world's words (thousands of ranks on a large job)."""
    from ckptstore.engine import restore

    for said in ([(0, "a"), (1, "b"), (2, "a")], True, True), ([(1, "b")], True, False), ([], False, False):
        for world in (1, 2, 7):
            assert restore._agreed(None, said, world) == restore._agreed([said] * world, None, world)
    bare, ownless, preference = restore._agreed(None, ([(3, "x"), (1, "x")], True, True), 4096)
    assert (bare, ownless, preference) == (frozenset(), frozenset(), {"x": 1})
