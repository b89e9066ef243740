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
                           "--layers", "4", "--width", "128", "--batch", "4", "--verify", "--durable", prefix,
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
