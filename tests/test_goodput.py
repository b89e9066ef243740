"""Goodput: the interval planner's formulas, the failure simulator against them, the event log and its
accounting across a real crash, and the store's replica checks and agreed intervals over real gloo ranks."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap

import dist_workers
import pytest
import torch
import warm_python
from conftest import wipe_ram

import ckptstore
from ckptstore.cli import main
from ckptstore.goodput import events as ev
from ckptstore.goodput import planner, simulate, timings

# ---------------------------------------------------------------------------- planner


def test_young_daly_and_the_seed_example():
    cost, mtbf = 60.0, 180 * 60.0
    assert planner.young(cost, mtbf) / 60 == pytest.approx(math.sqrt(360))  # ~19 min
    # The seed's "5% + 5% ~ 10%" at Young's interval, first order and exactly.
    assert planner.first_order_waste(planner.young(cost, mtbf), cost, mtbf) == pytest.approx(0.1054, abs=1e-3)
    assert planner.waste(planner.young(cost, mtbf), cost, mtbf).total == pytest.approx(0.102, abs=2e-3)
    # Daly's correction is the optimum of the exact model to a fraction of a percent.
    d, o = planner.daly(cost, mtbf), planner.optimum(cost, mtbf)
    assert d < planner.young(cost, mtbf) and d == pytest.approx(o, rel=5e-3)
    w = planner.waste(d, cost, mtbf, restart=600)
    assert w.useful + w.checkpoint + w.lost + w.restart == pytest.approx(1.0)
    assert w.restart > 0 and planner.waste(d, cost, mtbf).restart == 0
    assert planner.daly(10 * mtbf, mtbf) == mtbf  # a checkpoint dearer than 2 MTBF: Daly's cut-off


def test_mtbf_from_the_llama3_failure_rate_and_durations():
    day = 86400.0
    assert planner.mtbf_from_rate(419, 54 * day, 16384, 16384) / 3600 == pytest.approx(3.09, abs=0.01)
    assert planner.mtbf_from_rate(419, 54 * day, 16384, 4096) / 3600 == pytest.approx(12.37, abs=0.01)
    assert [planner.parse_duration(v) for v in (90, "90s", "1.5m", "3h", "2d")] == [90, 90, 90, 10800, 172800]
    for bad in ("3 parsecs", "-1", "", True):
        with pytest.raises(ckptstore.InvalidArgumentError, match="duration"):
            planner.parse_duration(bad)
    # More failures than the prior's weight pull the estimate to the observed MTBF.
    assert planner.mtbf_posterior(3600, 0, 0) == 3600
    assert planner.mtbf_posterior(3600, 100, 100 * 600) == pytest.approx(600, rel=0.1)


def test_plan_cli_prints_both_intervals_and_the_waste_split(capsys):
    assert main(["plan", "--ckpt-cost", "60s", "--mtbf", "3h"]) == 0
    out = capsys.readouterr().out
    assert "every 19 min of training" in out and "every 18.3 min" in out
    assert "expected waste at Daly's interval: 10.2% = checkpoint overhead 4.9% + lost work 5.3% + restart 0.0%" in out
    assert main(["plan", "--ckpt-cost", "1m", "--observed", "419", "54d", "16384", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mtbf_s"] / 3600 == pytest.approx(3.09, abs=0.01) and len(doc["table"]) == 7
    assert main(["plan", "--ckpt-cost", "1m"]) == 2
    assert "give the MTBF" in capsys.readouterr().err


def test_plan_cli_takes_the_cost_from_bench_json_or_says_what_is_wrong(tmp_path, capsys):
    good, bad = tmp_path / "bench.json", tmp_path / "other.json"
    good.write_text(json.dumps({"checkpoint_cost": {"blocking_s": 60.0}}))
    bad.write_text(json.dumps({"targets": {}}))
    assert main(["plan", "--bench", str(good), "--mtbf", "3h"]) == 0
    assert "every 19 min of training" in capsys.readouterr().out  # the same as --ckpt-cost 60s
    assert main(["plan", "--bench", str(bad), "--mtbf", "3h"]) == 2
    assert "not the JSON of `ckptstore bench --json`" in capsys.readouterr().err
    assert main(["plan", "--mtbf", "3h"]) == 2
    assert "give the checkpoint cost" in capsys.readouterr().err


# ---------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("interval, cost, restart, mtbf", [
    (20 * 60, 60, 0, 3 * 3600),  # the seed's example
    (60 * 60, 360, 1500, 4 * 3600),  # synchronous hourly checkpoints, manual restarts
    (10 * 60, 20, 300, 2 * 3600),
])
def test_simulation_agrees_with_dalys_exact_model(interval, cost, restart, mtbf):
    cfg = simulate.Config("x", interval, cost, restart)
    r = simulate.simulate(cfg, mtbf=mtbf, work=21 * 86400, trials=2000, seed=7)
    exact = planner.waste(interval - cost, cost, mtbf, restart).useful
    # Seeded, so deterministic; the tolerance is the simulation's own 99.99% interval.
    assert abs(r.goodput - exact) < 3.9 * r.stderr, (r.goodput, exact, r.stderr)
    assert sum(r.fractions.values()) == pytest.approx(1.0)
    assert r.fractions["restart"] == pytest.approx(planner.waste(interval - cost, cost, mtbf, restart).restart, rel=0.05)
    # Weibull of shape 1 is the exponential law.
    w = simulate.simulate(cfg, mtbf=mtbf, work=21 * 86400, trials=2000, seed=8, weibull=1.0)
    assert abs(w.goodput - exact) < 3.9 * w.stderr


def test_tiers_only_help_against_the_failures_they_survive():
    ram = simulate.TierSpec("ram", frozenset({"crash"}), 1, 5.0, 10.0)
    durable = simulate.TierSpec("durable", frozenset("*"), 3, 300.0, 300.0)
    both = simulate.Config("ram+durable", 1200, 20, 300, (ram, durable))
    alone = simulate.Config("durable", 1200, 20, 300, (durable,))
    kw = dict(mtbf=3 * 3600, work=14 * 86400, trials=500, seed=3)
    # Node losses wipe the RAM copy: exactly the same runs as without it (same draws).
    assert simulate.simulate(both, mix={"node": 1}, **kw).goodput == simulate.simulate(alone, mix={"node": 1}, **kw).goodput
    crash = simulate.simulate(both, mix={"crash": 1}, **kw)
    assert crash.ci95[0] > simulate.simulate(alone, mix={"crash": 1}, **kw).ci95[1]
    # Weibull with shape < 1 (failures cluster) at the same MTBF keeps more than the exponential law here.
    assert simulate.simulate(alone, weibull=0.7, **kw).goodput != simulate.simulate(alone, **kw).goodput
    with pytest.raises(ckptstore.InvalidArgumentError, match="must exceed the checkpoint cost"):
        simulate.Config("bad", 60, 60, 0)


def test_simulate_cli_compares_the_seed_example(tmp_path, capsys):
    png = tmp_path / "seed.png"
    assert main(["simulate", "--example", "seed", "--mtbf", "4.5h", "--trials", "300", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if "%" in ln and "[" in ln]
    assert len(lines) == 3
    sync, asynchronous, tiers = (float(ln.split("%")[0].split()[-1]) for ln in lines)
    assert 65 < sync < 80 and 85 < asynchronous < 95 and tiers > asynchronous  # the seed: ~70% -> ~92%
    assert png.read_bytes()[:4] == b"\x89PNG"
    cfg = json.dumps({"name": "mine", "interval": "30m", "cost": "30s", "restart": "5m",
                      "tiers": ["ram:survives=crash", "durable:every=2,latency=3m"]})
    assert main(["simulate", "--config", cfg, "--mtbf", "3h", "--trials", "200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["results"][0]["name"] == "mine" and [t["name"] for t in doc["results"][0]["tiers"]] == ["ram", "durable"]
    for bad, message in ((["--mix", "crash"], "is not CLASS=WEIGHT"), (["--tier", "ram:every=0"], "positive integer"),
                         (["--cost", "30m"], "must exceed the checkpoint cost")):
        assert main(["simulate", "--interval", "20m", "--cost", "20s", "--mtbf", "3h", *bad]) == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------- event log and accounting


def test_accounting_splits_a_known_timeline():
    events = [
        {"t": 0.0, "event": "start"}, {"t": 10.0, "event": "restore", "step": None},
        {"t": 100.0, "event": "save", "step": 1, "blocking_s": 2.0},
        {"t": 200.0, "event": "save", "step": 2, "blocking_s": 2.0},
        {"t": 250.0, "event": "tick", "step": 3},  # the run dies after this
        {"t": 300.0, "event": "start"}, {"t": 320.0, "event": "failure", "last_seen": 250.0},
        {"t": 330.0, "event": "restore", "step": 2, "tier": "local"},
        {"t": 400.0, "event": "save", "step": 3, "blocking_s": 2.0},
        {"t": 500.0, "event": "close"},
        {"t": 1000.0, "event": "start"}, {"t": 1005.0, "event": "restore", "step": 3}, {"t": 1100.0, "event": "close"},
    ]
    acc = ev.account(events)
    assert (acc.failures, acc.saves, len(acc.runs), acc.open_run) == (1, 3, 3, False)
    assert acc.idle == 500.0 and acc.wall == 600.0
    assert acc.checkpoint == 6.0
    assert acc.lost == 50.0  # from the save of step 2 (t=200) to the last record (t=250)
    assert acc.restart == 10.0 + 80.0 + 5.0  # first start; 250 -> 330 across the failure; the clean restart
    assert acc.productive == pytest.approx(600.0 - 6.0 - 50.0 - 95.0)
    assert ev.history(events) == (1, 250.0 + 200.0 + 100.0)


def _ticking_log(path, step_s: float, steps: int) -> None:
    """One clean run of ``steps`` steps of ``step_s`` each, with a tick per step."""
    records = [{"t": 0.0, "event": "start"}, {"t": 1.0, "event": "restore", "step": None}]
    records += [{"t": 1.0 + step_s * i, "event": "tick", "step": i, "step_s": step_s} for i in range(1, steps + 1)]
    records.append({"t": 1.0 + step_s * steps + 1.0, "event": "close"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_goodput_at_a_common_step_ranks_logs_by_useful_steps(tmp_path, capsys):
    # Two jobs with the same wall time: one ran 100 steps of 0.5 s, the other 80 slower steps of
    # 0.625 s. By each log's own median step both look alike; at one step time for both, the one
    # that trained more steps is ahead, by exactly the ratio of its steps.
    fast, slow = tmp_path / "fast.jsonl", tmp_path / "slow.jsonl"
    _ticking_log(fast, 0.5, 100)
    _ticking_log(slow, 0.625, 80)
    assert main(["goodput", str(fast), str(slow), "--json"]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own[0]["goodput"] == pytest.approx(own[1]["goodput"])
    assert main(["goodput", str(fast), str(slow), "--json", "--step-s", "min"]) == 0
    common = json.loads(capsys.readouterr().out)
    assert [d["step_s"] for d in common] == [0.5, 0.5]
    assert [d["useful_steps"] for d in common] == [100, 80]
    assert common[1]["goodput"] == pytest.approx(common[0]["goodput"] * 0.8)
    assert main(["goodput", str(fast), str(slow), "--step-s", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "100 steps x 0.25 s, the common step" in out and "80 steps x 0.25 s, the common step" in out
    for bad in ("0", "-1", "fast", "inf"):
        assert main(["goodput", str(fast), "--step-s", bad]) == 2
        assert f"--step-s must be a positive number of seconds or 'min', not '{bad}'" in capsys.readouterr().err


def test_accounting_of_a_supervised_crash_loop_knows_failure_instants_and_rollbacks():
    """A harness's log (benchmarks/bench_goodput_e2e.py): kill records give the failure instants,
    restores carry their own seconds (reload), and a node loss that rolls the job back past an earlier
    run's start makes that run's work lost too. Every step takes 1 s; saves block 0.5 s."""
    def ticks(first, last, t0):
        return [{"t": t0 + i + 1, "event": "tick", "step": s, "step_s": 1.0} for i, s in enumerate(range(first, last + 1))]

    events = [
        {"t": 0.0, "event": "setup", "tiers": ["local:survives=crash", "durable"]},
        {"t": 0.0, "event": "start"}, {"t": 2.0, "event": "restore", "step": None, "seconds": 0.0},
        *ticks(1, 4, 2.0), {"t": 6.5, "event": "save", "step": 4, "blocking_s": 0.5},
        {"t": 6.6, "event": "commit", "step": 4, "tier": "durable"},
        *ticks(5, 8, 6.5), {"t": 11.0, "event": "save", "step": 8, "blocking_s": 0.5},
        {"t": 11.1, "event": "commit", "step": 8, "tier": "local"},
        {"t": 12.0, "event": "kill", "class": "crash"},
        {"t": 12.5, "event": "tick", "step": 9, "step_s": 1.0},  # a dying rank's straggler: ignored
        {"t": 13.0, "event": "start"}, {"t": 16.0, "event": "restore", "step": 8, "seconds": 1.0},
        *ticks(9, 11, 16.0),
        {"t": 20.0, "event": "kill", "class": "node"},  # step 8 was only local: back to step 4
        {"t": 20.0, "event": "start"}, {"t": 24.0, "event": "restore", "step": 4, "seconds": 2.0},
        *ticks(5, 6, 24.0), {"t": 26.5, "event": "end"},
    ]
    acc = ev.account(events)
    assert (acc.failures, len(acc.runs), acc.wall) == (2, 3, 26.5)
    assert acc.reload == 3.0 and acc.restart == 2.0 + 3.0 + 2.0  # start-up; 12 -> 15; 20 -> 22
    # Run 1 kept up to step 4's save (6.5 s): 6.5 -> 12 minus the save of step 8; run 2 entirely.
    assert acc.lost == pytest.approx((12.0 - 6.5 - 0.5) + (20.0 - 16.0))
    assert acc.checkpoint == 1.0
    assert acc.useful_steps == 6 and acc.step_s == 1.0 and acc.useful == 6.0
    assert acc.productive + acc.checkpoint + acc.lost + acc.restart + acc.reload == pytest.approx(acc.wall)
    sim = ev.predicted(events, acc)
    assert sum(sim["split_s"].values()) == pytest.approx(acc.wall) and sim["failures"] == 2
    assert sim["interval_s"] == pytest.approx(4.5) and sim["cost_s"] == 0.5
    assert sim["first_s"] == pytest.approx(4.5)  # run 1: training from its restore (2.0) to its first save (6.5)


def test_replay_puts_a_runs_first_checkpoint_after_its_first_interval():
    """interval 10 s, cost 1 s, a run's first checkpoint 15 s into its training (a restarted process
    warming up), no restart time; a crash at 30 s, the job ends at 50 s. Checkpoints end at 15 and
    25 s: the crash loses 5 s (25 -> 30); the second run trains 20 s, its first checkpoint at 15 s.
    Without the first interval the replay would put one at 30 s and lose nothing."""
    durable = (simulate.TierSpec("durable", frozenset("*")),)
    late = simulate.Config("late", 10.0, 1.0, 0.0, durable, first=15.0)
    split = simulate.replay(late, [(30.0, "crash")], 50.0)
    assert split == pytest.approx({"useful": 23.0 + 19.0, "checkpoint": 3.0, "lost": 5.0, "restart": 0.0,
                                   "reload": 0.0})
    plain = simulate.Config("plain", 10.0, 1.0, 0.0, durable)
    assert simulate.replay(plain, [(30.0, "crash")], 50.0) == simulate.replay(
        simulate.Config("same", 10.0, 1.0, 0.0, durable, first=10.0), [(30.0, "crash")], 50.0)
    assert simulate.replay(plain, [(30.0, "crash")], 50.0)["lost"] == 0.0
    with pytest.raises(ckptstore.InvalidArgumentError, match="first interval"):
        simulate.Config("bad", 10.0, 1.0, 0.0, durable, first=1.0)


def test_event_log_that_cannot_be_written_warns_and_never_raises(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    log = ev.EventLog(str(blocker / "events.jsonl"))  # its directory is a file
    log.write("save", step=1)
    log.write("save", step=2)
    log.close()
    assert [r.getMessage() for r in caplog.records if "cannot write the event log" in r.getMessage()]
    assert len([r for r in caplog.records if "cannot write the event log" in r.getMessage()]) == 1


_CRASHING_RUN = textwrap.dedent("""
    import os, sys, time, torch, ckptstore
    local, job = sys.argv[1], sys.argv[2]
    store = ckptstore.CheckpointStore(job, local=local, events=True, interval="10m")
    state = {"w": torch.arange(1000.0)}
    for step in range(4):
        if store.should_save(step):
            store.save(step, state).wait("local")
    time.sleep(0.5)   # the event log's writer catches up, then the process dies without close()
    os._exit(9)
""")


def test_a_crash_is_recorded_and_accounted(tmp_path, job, capsys):
    local = tmp_path / "local"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = warm_python.run(["-c", _CRASHING_RUN, str(local), job], env=env, timeout=120, text=False)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    with ckptstore.CheckpointStore(job, local=local, events=True) as store:
        state = {"w": torch.zeros(1000)}
        assert store.restore(state) == 1  # step 0 and the calibration save at step 1
        assert torch.equal(state["w"], torch.arange(1000.0))
        store.save(2, state).wait("local")
    records = ev.read_events(str(local / "events.jsonl"))
    kinds = [r["event"] for r in records]
    assert kinds.count("start") == 2 and kinds.count("close") == 1 and kinds.count("failure") == 1
    assert [r["step"] for r in records if r["event"] == "save"] == [0, 1, 2]
    restore = next(r for r in records if r["event"] == "restore")
    assert restore["step"] == 1 and restore["tier"] == "ram" and restore["seconds"] > 0
    png = tmp_path / "goodput.png"
    assert main(["goodput", str(local), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2 run(s), 1 failure(s), 3 save(s)" in out and "goodput" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["goodput", str(local), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["failures"] == 1 and doc["restart_s"] > 0 and doc["checkpoint_s"] > 0
    assert main(["goodput", str(tmp_path)]) == 2
    assert "events=True" in capsys.readouterr().err


def test_store_options_are_checked(tmp_path, job):
    with pytest.raises(ckptstore.InvalidArgumentError, match="pass mtbf="):
        ckptstore.CheckpointStore(job, interval="auto")
    with pytest.raises(ckptstore.InvalidArgumentError, match="sdc must be"):
        ckptstore.CheckpointStore(job, sdc="maybe")
    with pytest.raises(ckptstore.InvalidArgumentError, match="pass local= too"):
        ckptstore.CheckpointStore(job, events=True)
    with ckptstore.CheckpointStore(job, local=tmp_path / "l") as store:
        with pytest.raises(ckptstore.InvalidArgumentError, match="should_save needs"):
            store.should_save(1)
        store.save(1, {"w": torch.ones(3)}).wait("local")
    assert sorted(os.listdir(tmp_path / "l")) == ["step-000000000001"]  # no event log unless asked


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_auto_interval_counts_the_steps_a_save_in_flight_slowed(monkeypatch):
    # Steps of 1 s; a save blocks 0.2 s and then slows the two steps it overlaps to 1.5 s each: it
    # costs training 0.2 + 2 x 0.5 = 1.2 s, and Daly's interval is planned on that, not on 0.2 s.
    from ckptstore.goodput import tracker as tr

    clock = _Clock()
    monkeypatch.setattr(tr, "time", clock)
    t = tr.GoodputTracker(interval="auto", mtbf_s=80.0, events=False, rank=0, world=1, job="j", local=None)
    left = 0
    t.in_flight = lambda: left > 0
    for step in range(25):
        t.should_save(step)
        if step and step % 5 == 0:
            clock.now += 0.2
            left = 2  # the save hands its work to the background before it returns
            t.saved(step, 0.2, 0.0, 0.2, 0, 0)
        clock.now += 1.5 if left else 1.0
        left = max(0, left - 1)
    t.should_save(25)
    inputs = t.inputs()
    assert inputs["cost_s"] == pytest.approx(1.2)
    assert t._idle_s == pytest.approx(1.0)  # the in-flight steps are kept out of the idle step time
    t.planned(25, inputs)
    assert t.plan["interval_s"] == pytest.approx(planner.daly(1.2, inputs["mtbf_s"]))

    # Step noise while a save is in flight does not add up to a cost (the excess is signed: one step
    # 0.1 s slower and one 0.1 s faster cost nothing), and a synchronous save, after which nothing
    # is in flight, costs what it blocked.
    for sync in (False, True):
        s = tr.GoodputTracker(interval="auto", mtbf_s=80.0, events=False, rank=0, world=1, job="j", local=None)
        s.in_flight = lambda: flight["left"] > 0  # noqa: B023 - the loop's own flight
        flight = {"left": 0}
        for step in range(40):
            s.should_save(step)
            if step and step % 5 == 0:
                clock.now += 0.3
                flight["left"] = 0 if sync else 2
                s.saved(step, 0.3, 0.0, 0.3, 0, 0)
            if sync:  # the steps after a save are slow, but no save is in flight to blame
                clock.now += 1.05 if step % 5 < 2 else 1.0
            else:
                clock.now += {2: 1.1, 1: 0.9, 0: 1.0}[flight["left"]]
            flight["left"] = max(0, flight["left"] - 1)
        s.should_save(40)
        assert s.inputs()["cost_s"] == pytest.approx(0.3), sync


def test_the_store_tells_its_tracker_while_a_save_is_in_flight(tmp_path, job):
    with ckptstore.CheckpointStore(job, local=tmp_path / "l", interval="auto", mtbf="1h") as store:
        tracker = store._tracker
        assert not tracker.in_flight()
        # 64 MiB written and fsynced to the local tier takes tens of milliseconds after save returns.
        handle = store.save(1, {"w": torch.ones(16 << 20)})
        assert tracker.in_flight()
        handle.wait("local")
        store._pipeline.drain()
        assert not tracker.in_flight()


# ---------------------------------------------------------------------------- stragglers


def test_stragglers_are_flagged_per_stage_by_host():
    ranks = [{"rank": r, "host": f"h{r // 2}", "timings": {"stage_s": 0.1, "local_s": 1.0, "hash_s": 0.001}}
             for r in range(6)]
    ranks[3]["timings"]["local_s"] = 3.5
    ranks[4]["timings"]["hash_s"] = 0.009  # 9x the median but under the 10 ms noise floor
    slow = timings.stragglers(ranks)
    assert [(s["host"], s["rank"], s["stage"]) for s in slow] == [("h1", 3, "local_s")]
    assert slow[0]["ratio"] == pytest.approx(3.5)
    stages, rows = timings.stage_table(ranks)
    assert stages == ["stage_s", "hash_s", "local_s"] and len(rows) == 6


def test_a_ring_of_neighbours_finds_any_replica_that_differs_and_swaps_one_message_per_pair():
    """Round one of the replica check, its messages delivered by hand: every rank of a group sends
    its digest to the next and compares the previous one's with its own."""
    from ckptstore.goodput import sdc

    groups = {"plain": (0, 1, 2, 3), "pair": (1, 3)}

    def run(digest_of) -> set[int]:
        plans = {r: sdc.ring({g: digest_of(r, g) for g in groups.values() if r in g}, r) for r in range(4)}
        flagged = set()
        for r, (_send, expect) in plans.items():
            for peer, want in expect.items():
                if plans[peer][0][r] != want:  # what the previous rank sent this one
                    flagged.add(r)
        return flagged

    assert run(lambda r, g: 7) == set()
    assert run(lambda r, g: 7 + (r == 2 and g == groups["plain"])) == {2, 3}  # its receiver and itself
    assert run(lambda r, g: 7 + (r == 3 and g == groups["pair"])) == {1, 3}
    send, expect = sdc.ring({groups["plain"]: 1, groups["pair"]: 2}, 3)
    assert send == {0: [send[0][0], 1], 1: [send[1][0], 2]} and sorted(expect) == [1, 2]
    # Rank 2 follows rank 1 in both of their groups: one message carries both digests.
    send, expect = sdc.ring({(0, 1, 2, 3): 1, (1, 2): 2}, 1)
    assert sorted(send) == [2] and len(send[2]) == 4 and sorted(expect) == [0, 2]
    held = [["a", [0], [2], "all", "x"], ["b", [0], [2], "replicas", "y"]]
    by = sdc.group_digests(held, {"a": (0, 1), "b": (5,)})
    assert list(by) == [(0, 1)]  # a box no other rank holds compares with nobody


# ---------------------------------------------------------------------------- multi-rank: agreement and SDC


def _spawn(world: int, job: str, tmp_path, **args) -> None:
    dist_workers.spawn(world, f"goodput_workers:{job}", tmp_path, **args)


def test_replicas_are_compared_and_every_rank_plans_alike(tmp_path, capsys):
    job = f"gp-{os.urandom(5).hex()}"
    try:
        _spawn(3, "goodput_job", tmp_path, root=str(tmp_path), ram_dir="/dev/shm", name=job)
    finally:
        wipe_ram(job)
        wipe_ram(job + "r")
    outs = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(3)]
    # The same decisions on every rank, though each measured other step times; planned, not every step.
    assert outs[0]["decisions"] == outs[1]["decisions"] == outs[2]["decisions"]
    decisions = outs[0]["decisions"]
    assert decisions[:3] == [0, 1, 2] and len(decisions) < 40, decisions  # cold, then two warm measurements
    assert outs[0]["plan"] == outs[1]["plan"] == outs[2]["plan"] and outs[0]["plan"]["cost_s"] > 0

    warn = tmp_path / "warn"
    clean = json.loads((warn / "step-000000000100" / "manifest.json").read_text())["meta"]
    assert clean["sdc"] == {"policy": "warn", "mismatches": []}
    corrupt_step = outs[0]["corrupt_step"]
    meta = json.loads((warn / f"step-{corrupt_step:012d}" / "manifest.json").read_text())["meta"]
    assert sorted(m["key"] for m in meta["sdc"]["mismatches"]) == ["d", "v", "w"]
    for step in decisions:  # the other steps' replicas agreed
        if step != corrupt_step:
            meta = json.loads((warn / f"step-{step:012d}" / "manifest.json").read_text())["meta"]
            assert meta["sdc"]["mismatches"] == [], step
    sdc_events = [r for r in ev.read_events(str(warn / "events.jsonl")) if r["event"] == "sdc"]
    assert [r["step"] for r in sdc_events] == [corrupt_step]
    found = {m["key"]: m for m in sdc_events[0]["mismatches"]}
    assert sorted(found) == ["d", "v", "w"]
    assert found["w"]["suspects"] == [2] and found["d"]["suspects"] == [1] and found["v"]["suspects"] == [1]
    assert found["w"]["copies"][0]["ranks"] == [0, 1] and found["w"]["suspect_hosts"] == [os.uname().nodename]
    assert found["w"]["offsets"] == [0, 0] and found["w"]["sizes"] == [64, 32]

    # sdc="raise": the run stops at the next save on every rank, and a restore skips the step.
    for out in outs:
        assert "silent data corruption suspected at step 2" in out["raised"]
        assert "tensor 'w'" in out["raised"] and "suspect rank(s) 2" in out["raised"]
        assert out["restored"] == 1 and out["restored_step_value"] == 1
    # The restore went past step 2: it left the local tier, and its copy was set aside for inspection.
    assert not (tmp_path / "raise" / "step-000000000002").exists()
    (refused,) = (tmp_path / "raise" / "damaged").glob("step-000000000002.*")
    raised = json.loads((refused / "manifest.json").read_text())["meta"]
    assert raised["sdc"]["policy"] == "raise" and len(raised["sdc"]["mismatches"]) == 3
    assert all(out["peer_restored"] == 100 and out["peer_equal"] for out in outs)

    # Per-rank stage timings in every manifest, and inspect --timings on the tier's root (newest step).
    ranks = clean["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert all({"stage_s", "hash_s", "local_s"} <= set(r["timings"]) for r in ranks)
    durable = json.loads((tmp_path / "durable" / "step-000000000100" / "manifest.json").read_text())["meta"]
    assert all({"stage_s", "hash_s", "local_s", "replicate_s", "promote_s"} <= set(r["timings"]) for r in durable["ranks"])
    assert main(["inspect", "--timings", str(warn)]) == 0
    out = capsys.readouterr().out
    assert "step 100, 3 ranks" in out and "local" in out and "hash" in out
    assert main(["inspect", "--timings", str(refused)]) == 0
    assert "silent data corruption suspected" in capsys.readouterr().out
