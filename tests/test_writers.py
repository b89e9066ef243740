"""Two writers committing the same step: two real processes, each with a CheckpointStore of its
own on the same local directory (or the same S3 prefix), save the same step with different
states at the same instant, trial after trial.

What users rely on: in every trial exactly one writer wins (conditional create of the manifest:
link() locally, If-None-Match on S3); the other gets CheckpointExistsError naming the step and
the location and saying what to do; the committed step loads bitwise equal to the winner's state,
never a mix with the loser's bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch
import warm_python
from conftest import assert_same, s3_pending_uploads, wipe_ram

import ckptstore

FAST_TRIALS = 5  # per backend: 10 races in the default run (-m slow: 50 each)
SLOW_TRIALS = 50


def _state(writer: int, trial: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * trial + writer)
    return {"w": torch.randn(1 << 18, generator=g), "who": torch.tensor([writer, trial])}


def _worker(writer: int, job: str, backends: str, trials: int, sync_root: str) -> None:
    """One writer: for each backend (root, storage options) and each trial, wait for the other
    writer, then save step ``trial + 1``. One process for all backends: starting a process that
    imports torch costs more than all the trials."""
    for index, (root, options) in enumerate(json.loads(backends)):
        sync = os.path.join(sync_root, str(index))
        os.makedirs(sync, exist_ok=True)
        _trials(writer, f"{job}-{index}", root, trials, sync, options)


def _trials(writer: int, job: str, root: str, trials: int, sync: str, storage_options: dict | None) -> None:
    if storage_options:
        # A fresh process: s3fs's cached instance cannot hold another test's listings, and one
        # client for all trials spares building a botocore client per request.
        storage_options.pop("skip_instance_cache", None)
    other = 1 - writer
    for trial in range(trials):
        kind = "durable" if "://" in root else "local"
        tiers = {"durable": root, "durable_every": 1} if kind == "durable" else {"local": root, "keep_local": None}
        store = ckptstore.CheckpointStore(f"{job}-{writer}", storage_options=storage_options, **tiers)
        state = _state(writer, trial)
        open(os.path.join(sync, f"ready-{writer}-{trial}"), "w").close()
        while not os.path.exists(os.path.join(sync, f"ready-{other}-{trial}")):
            time.sleep(0.0005)
        out: dict = {"trial": trial, "writer": writer}
        t0 = time.perf_counter()
        try:
            store.save(trial + 1, state).wait(kind)
            out["won"] = True
        except ckptstore.CheckpointExistsError as exc:
            out.update(won=False, error="CheckpointExistsError", message=str(exc), location=exc.location)
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            out.update(won=False, error=type(exc).__name__, message=str(exc))
        try:
            store.close()
        except ckptstore.CheckpointError:
            pass  # the same failure, raised once more by close()
        out["seconds"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(out), flush=True)
        # Both finish the trial before either starts a store again: a starting store sweeps the
        # step directories that have no manifest yet, which includes one the other is writing.
        open(os.path.join(sync, f"done-{writer}-{trial}"), "w").close()
        while not os.path.exists(os.path.join(sync, f"done-{other}-{trial}")):
            time.sleep(0.0005)


def _race(backends: list[tuple[str, dict | None]], job: str, trials: int, sync_dir) -> list[list[list[dict]]]:
    """Per backend, per trial: both writers' outcomes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    # Processes of their own, forked from the warm forkserver (tests/warm_python.py): what races is
    # the two stores' commits, not two interpreters importing torch.
    files = [(sync_dir / f"writer-{w}.out", sync_dir / f"writer-{w}.err") for w in (0, 1)]
    for pair in files:
        for path in pair:
            path.touch()
    procs = [warm_python.start([__file__, str(w), job, json.dumps(backends), str(trials), str(sync_dir)],
                               env=env, stdout=files[w][0], stderr=files[w][1]) for w in (0, 1)]
    outs = []
    try:
        for p, (out, err) in zip(procs, files):
            assert p.wait(timeout=600) == 0, err.read_text()[-3000:]
            outs.append([json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")])
    finally:
        for p in procs:
            p.kill()
        for index in range(len(backends)):
            for w in (0, 1):
                wipe_ram(f"{job}-{index}-{w}")
    n = len(backends) * trials
    assert [len(o) for o in outs] == [n, n]
    return [[[outs[0][b * trials + t], outs[1][b * trials + t]] for t in range(trials)] for b in range(len(backends))]


def _check(results: list[list[dict]], root: str, storage_options=None) -> tuple[dict[int, int], dict[str, int]]:
    """Exactly one winner per trial, a clear error for the loser, the winner's state bitwise."""
    wins = {0: 0, 1: 0}
    where: dict[str, int] = {}
    for trial, pair in enumerate(results):
        winners = [r["writer"] for r in pair if r["won"]]
        assert len(winners) == 1, f"trial {trial}: {pair}"
        winner, loser = winners[0], pair[1 - winners[0]]
        wins[winner] += 1
        step = trial + 1
        assert loser["error"] == "CheckpointExistsError", f"trial {trial}: {loser}"
        assert f"step {step} in " in loser["message"] and f"step-{step:012d}" in loser["message"], loser["message"]
        assert "another writer" in loser["message"] and "new step" in loser["message"], loser["message"]
        stage = loser["location"].rsplit("/", 2)[-2:]
        stage_name = "manifest" if stage[-1] == "manifest.json" else stage[0]
        where[stage_name] = where.get(stage_name, 0) + 1
        got: dict = {"w": None, "who": None}
        ckptstore.load_sharded(got, f"{root}/step-{step:012d}", storage_options=storage_options)
        assert_same(got, _state(winner, trial), f"trial {trial}: the winner's checkpoint")
    return wins, where


@pytest.mark.parametrize("trials", [FAST_TRIALS, pytest.param(SLOW_TRIALS, marks=[pytest.mark.slow,
                                                                                  pytest.mark.timeout(900)])])
def test_two_processes_race_for_the_same_step(tmp_path, job, s3, trials):
    local = str(tmp_path / "shared")
    remote = f"s3://{s3['bucket']}/{s3['prefix']}/shared"
    results = _race([(local, None), (remote, s3["storage_options"])], job, trials, tmp_path)
    for name, root, options, pairs in (("local", local, None, results[0]),
                                       ("s3", remote, s3["storage_options"], results[1])):
        wins, where = _check(pairs, root, options)
        print(f"{name}: {trials} races, wins by writer {wins}, the loser stopped at {where}")
    assert s3_pending_uploads(s3, s3["prefix"]) == []


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
