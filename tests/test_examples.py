"""Every script under examples/ runs on CPU and reports success (a subprocess per script, as a
user would run it; each script checks its own result bitwise and exits non-zero on a mismatch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NEEDS = {"lightning_resume.py": "lightning", "hf_trainer.py": "transformers"}


def test_every_adapter_has_an_example():
    assert {p.name for p in EXAMPLES} >= {"dcp_tiers.py", "lightning_resume.py", "hf_trainer.py"}


# The Lightning and Hugging Face examples spend most of their 13-16 s importing those frameworks in a
# fresh interpreter; their adapters' behaviour is tested by default in test_adapters_lightning.py and
# test_adapters_hf.py, so the scripts themselves run under -m slow (dcp_tiers.py stays by default).
SLOW = {"lightning_resume.py", "hf_trainer.py"}


@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in EXAMPLES],
                         ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path):
    if script.name in NEEDS:
        pytest.importorskip(NEEDS[script.name])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{out[-4000:]}"
    assert "bitwise equal" in proc.stdout and "MISMATCH" not in proc.stdout, out[-4000:]
