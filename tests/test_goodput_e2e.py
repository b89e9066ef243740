"""Goodput measured end to end, short: benchmarks/bench_goodput_e2e.py runs a 2-rank gloo training
job under its supervisor for two configurations (torch.save, and ckptstore with RAM, local, peers,
the durable tier on the tests' S3 server and the node agent) through the same seeded schedule of
real failures (SIGKILL of one rank, or of a whole "node" with its RAM and local directories wiped),
with a digest of each rank's state at every save and after every restore. Every restart must have
resumed bitwise from the newest committed step, no failure may lose a committed step, and the
accounting of each run's event log must add up to its wall time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore.cli import main

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "bench_goodput_e2e.py"
CONFIGS = ("torch.save", "ckptstore-full")
# Weibull inter-arrivals of shape 1.5, mean 3.5 s, over a 16 s window: a node lost at 4.8 s, a
# crash at 8.1 s, a node at 10.8 s and a crash at 13.9 s, so runs in between save, restore and die
# again; both configurations run side by side through the same instants. On a busy machine a run may
# not get as far as a save between two failures, so each failure waits for a step committed where it leaves one (--defer).
SCHEDULE = ["--window", "16", "--mtbf", "3.5", "--weibull", "1.5", "--seed", "169", "--mix", "crash=0.5,node=0.5",
            "--parallel", "--defer"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_goodput_e2e", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def crash_loop(tmp_path_factory, s3_server):
    out = tmp_path_factory.mktemp("e2e")
    prefix = f"s3://{s3_server['bucket']}/test-goodput-e2e"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(BENCH), "--configs", ",".join(CONFIGS), *SCHEDULE, "--every", "5",
                           "--layers", "4", "--width", "128", "--batch", "4", "--verify", "--cpu-log", "0.5", "--durable", prefix,
                           "--storage-options", json.dumps(s3_server["storage_options"]), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_every_restart_resumed_bitwise_from_the_newest_committed_step(crash_loop):
    bench = _bench()
    failures = json.loads((crash_loop / f"schedule-{'+'.join(CONFIGS)}.json").read_text())["failures"]
    assert len(failures) == 4 and {f["class"] for f in failures} == {"crash", "node"}
    for name in CONFIGS:
        assert bench.check(str(crash_loop / name)) == [], name
        resumed = [json.loads(line) for line in (crash_loop / name / "resumed-1.jsonl").read_text().splitlines()]
        assert sum(r["step"] is not None for r in resumed) >= 2, (name, resumed)  # the check had restores to check


def test_the_goodput_report_adds_up_to_wall_time(crash_loop, capsys):
    logs = [str(crash_loop / name / "events.jsonl") for name in CONFIGS]
    assert main(["goodput", *logs, "--simulate", "--json"]) == 0
    docs = json.loads(capsys.readouterr().out)
    assert [d["config"] for d in docs] == list(CONFIGS)
    for d in docs:
        parts = d["productive_s"] + d["checkpoint_s"] + d["lost_s"] + d["restart_s"] + d["reload_s"]
        # The 4 scheduled failures, and a start-over for each restart the store could not go on from.
        assert parts == pytest.approx(d["wall_s"], abs=1e-6) and d["failures"] >= 4
        assert d["useful_s"] + d["slowdown_s"] == pytest.approx(d["productive_s"])
        sim = d["simulated"]["split_s"]
        assert sum(sim.values()) == pytest.approx(d["wall_s"], rel=1e-9) and d["simulated"]["failures"] == d["failures"]
    assert main(["goodput", *logs]) == 0
    out = capsys.readouterr().out
    assert "useful" in out and "reload" in out and "ckptstore-full" in out.splitlines()[-1]


def test_the_cpu_log_covers_every_rank_and_the_agents(crash_loop):
    split = _bench().cpu_breakdown(str(crash_loop / "ckptstore-full"))
    assert {"rank0", "rank1", "others"} <= set(split)
    for rank in ("rank0", "rank1"):  # the trainer's own thread did the training
        main_thread = split[rank]["MainThread"]
        assert main_thread["idle"] + main_thread["in_flight"] > 0, split[rank]
    assert any(label.startswith("agent-node") for label in split["others"]), split["others"]


def test_cpu_breakdown_splits_intervals_by_saves_in_flight(tmp_path):
    # One save in flight from t=10 to t=20 (called at 10, blocking 0, committed at 20); CPU samples
    # at 0, 5, 12, 18 and 30: the intervals 0-5 (idle), 5-12, 12-18 and 18-30 (each overlaps the save).
    events = [{"t": 0.0, "event": "tick", "pid": 1, "step": 1, "step_s": 0.1},
              {"t": 10.0, "event": "save", "pid": 1, "step": 5, "blocking_s": 0.0},
              {"t": 20.0, "event": "commit", "pid": 1, "step": 5, "tier": "ram"},
              {"t": 30.0, "event": "tick", "pid": 1, "step": 6, "step_s": 0.1}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    samples = [(0.0, 0.0, 0.0), (5.0, 2.0, 0.0), (12.0, 3.0, 3.5), (18.0, 4.0, 6.5), (30.0, 10.0, 6.5)]
    (tmp_path / "cpu-0.jsonl").write_text("".join(
        json.dumps({"t": t, "pid": 7, "rank": 0, "attempt": 1, "total": main + bg,
                    "threads": {"7": ["MainThread", main], "8": ["ckptstore-loop", bg]}}) + "\n"
        for t, main, bg in samples))
    (tmp_path / "cpu-others.jsonl").write_text("".join(
        json.dumps({"t": t, "procs": {"99": ["s3-server", cpu]}}) + "\n" for t, cpu in ((0.0, 1.0), (5.0, 1.5), (30.0, 9.0))))
    split = _bench().cpu_breakdown(str(tmp_path))
    assert split["rank0"]["(seconds)"] == {"idle": 5.0, "in_flight": 25.0}
    assert split["rank0"]["MainThread"] == {"idle": 2.0, "in_flight": 8.0}
    assert split["rank0"]["ckptstore-loop"] == {"idle": 0.0, "in_flight": 6.5}
    assert split["others"]["s3-server"] == {"idle": 0.5, "in_flight": 7.5}


def test_steps_reached_follows_a_rollback_and_counts_the_training_done_by_each_instant(tmp_path, capsys):
    # Steps 1-3, a failure rolls the job back to step 1 (step 2 and 3 are trained again): the step
    # reached at each instant is the last tick's at or before it, not the highest seen before.
    events = [{"t": 100.0, "event": "setup", "pid": 1},
              {"t": 101.0, "event": "tick", "pid": 2, "step": 1, "step_s": 1.0},
              {"t": 102.0, "event": "tick", "pid": 2, "step": 2, "step_s": 1.0},
              {"t": 103.0, "event": "tick", "pid": 2, "step": 3, "step_s": 1.0},
              {"t": 103.5, "event": "kill", "pid": 1},
              {"t": 105.0, "event": "tick", "pid": 3, "step": 2, "step_s": 1.0},
              {"t": 106.0, "event": "tick", "pid": 3, "step": 3, "step_s": 1.0},
              {"t": 107.0, "event": "tick", "pid": 3, "step": 4, "step_s": 1.0}]
    assert _bench().steps_reached(events, [0.5, 1.0, 3.2, 4.0, 5.0, 60.0]) == {
        0.5: 0, 1.0: 1, 3.2: 3, 4.0: 3, 5.0: 2, 60.0: 4}
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert _bench().print_steps_reached(["2,6", str(tmp_path / "events.jsonl")]) == 0
    assert capsys.readouterr().out.strip().endswith("step reached at 2 s 2, 6 s 3")


def test_planned_interval_counts_the_steps_a_save_slowed_and_reads_a_log_or_a_report(tmp_path, capsys):
    # Nine steps of 1 s, but the two after the save (blocking 0.2 s) took 1.5 s: per save 0.2 s
    # blocking and 1.0 s of slowdown against the median step.
    ts = [1.0, 2.0, 3.0, 4.7, 6.2, 7.2, 8.2, 9.2, 10.2]
    steps = [1.0, 1.0, 1.0, 1.5, 1.5, 1.0, 1.0, 1.0, 1.0]
    events = ([{"t": 0.0, "event": "start", "pid": 2}]
              + [{"t": t, "event": "tick", "pid": 2, "step": i + 1, "step_s": s} for i, (t, s) in enumerate(zip(ts, steps))]
              + [{"t": 3.2, "event": "save", "pid": 2, "step": 3, "blocking_s": 0.2},
                 {"t": 10.2, "event": "close", "pid": 2}])
    (tmp_path / "run" / "dcp").mkdir(parents=True)
    (tmp_path / "run" / "dcp" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    bench = _bench()
    from ckptstore.goodput.planner import daly

    cost = bench.save_cost("dcp", [str(tmp_path / "run")])
    assert cost["blocking"] == pytest.approx(0.2) and cost["slowdown"] == pytest.approx(1.0) and cost["step"] == 1.0

    args = bench.argparse.Namespace(cost_from=[str(tmp_path / "run")], mtbf=80.0, plan_cost="total")
    assert bench.planned_every("dcp", args) == round(daly(1.2, 80.0)) == 13
    args.plan_cost = "blocking"
    assert bench.planned_every("dcp", args) == round(daly(0.2, 80.0)) == 6
    assert "0.200 s blocking + 1.000 s slowdown" in capsys.readouterr().out
    assert main(["goodput", str(tmp_path / "run" / "dcp" / "events.jsonl")]) == 0
    assert "per save: 0.2 s blocking + 1 s slowdown = 1.2 s; the interval for it: ckptstore plan --ckpt-cost 1.2s" \
        in capsys.readouterr().out

    # A report JSON (as docs/benchmarks/goodput_e2e_s16.json holds them): the last report of the
    # configuration, among the sources named, counts; mean blocking = checkpoint_s / saves.
    report = {"windows": [{"reports": [{"config": "dcp", "checkpoint_s": 9.0, "slowdown_s": 90.0, "saves": 300,
                                        "step_s": 0.5}]},
                          {"reports": [{"config": "dcp", "checkpoint_s": 18.0, "slowdown_s": 120.0, "saves": 300,
                                        "step_s": 0.6}],
                           # at the pair's common step time: not this configuration's own cost
                           "at_common_step": [{"config": "dcp", "checkpoint_s": 18.0, "slowdown_s": 200.0,
                                               "saves": 300, "step_s": 0.5, "step": "the common step"}]}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    cost = bench.save_cost("dcp", [str(tmp_path / "run"), str(tmp_path / "report.json")])
    assert (cost["blocking"], cost["slowdown"], cost["step"]) == (pytest.approx(0.06), pytest.approx(0.4), 0.6)
    with pytest.raises(SystemExit, match="no measurement of 'torch.save'"):
        bench.save_cost("torch.save", [str(tmp_path / "run"), str(tmp_path / "report.json")])
