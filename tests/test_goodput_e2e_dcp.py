"""The crash loop's ``dcp-s3`` configuration (benchmarks/bench_goodput_e2e.py): DCP's async_save to
the same S3 server the ckptstore configurations promote to, through the same seeded failures as the
default suite's short crash loop. Every restart must resume bitwise from the newest step DCP
committed (its ``.metadata`` object), and retention must leave the newest steps in the bucket. Slow:
DCP's uploads to the server dominate it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_goodput_e2e import BENCH, REPO, SCHEDULE, _bench

pytestmark = pytest.mark.slow


def test_dcp_to_s3_resumes_bitwise_from_its_newest_committed_step(tmp_path, s3_server):
    prefix = f"s3://{s3_server['bucket']}/test-goodput-e2e-dcp"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(BENCH), "--configs", "dcp-s3", *SCHEDULE, "--every", "5",
                           "--layers", "4", "--width", "128", "--batch", "4", "--verify", "--durable", prefix,
                           "--storage-options", json.dumps(s3_server["storage_options"]), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _bench().check(str(tmp_path / "dcp-s3")) == []
    resumed = [json.loads(line) for line in (tmp_path / "dcp-s3" / "resumed-1.jsonl").read_text().splitlines()]
    assert sum(r["step"] is not None for r in resumed) >= 2, resumed
