"""The ``ckptstore`` console script: inspect, verify and the demo (README's main job)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore.cli import main


def _saved(tmp_path):
    path = tmp_path / "m.ckpt"
    state = {"model": {"w": torch.arange(12.0).view(3, 4), "b": torch.ones(3)}, "step": 7}
    ckptstore.save(state, path)
    return path


def test_inspect_lists_keys_dtypes_shapes(tmp_path, capsys):
    path = _saved(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model/w" in out and "float32" in out and "[3, 4]" in out
    assert "top-level keys: model, step" in out


def test_inspect_json_is_machine_readable(tmp_path, capsys):
    path = _saved(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_tensors"] == 2
    assert {t["key"]: t["shape"] for t in info["tensors"]} == {"model/w": [3, 4], "model/b": [3]}
    assert info["tensor_bytes"] == 12 * 4 + 3 * 4
    assert info["format_version"] == "1.1"


def test_verify_sound_file_exits_0(tmp_path, capsys):
    path = _saved(tmp_path)
    assert main(["verify", str(path)]) == 0
    assert "sound (2 chunks" in capsys.readouterr().out


def test_verify_lists_the_damaged_chunk_and_exits_1(tmp_path, capsys):
    path = _saved(tmp_path)
    info = ckptstore.checkpoint.single_file.open_container(
        ckptstore.storage.targets.open_source(ckptstore.storage.targets.resolve(str(path)))
    )
    chunk = info.manifest.tensors["model/b"].chunks[0]
    info.source.close()
    data = bytearray(path.read_bytes())
    data[chunk.offset + 1] ^= 0x40
    path.write_bytes(bytes(data))
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 chunks are damaged" in out
    assert "'model/b'" in out and "checksum mismatch" in out
    assert "'model/w'" not in out


def test_missing_file_is_a_clear_error_with_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "nope.ckpt" in err


def test_every_command_has_help(capsys):
    # One interpreter start proves `python -m ckptstore.cli` runs; each command's help is then read
    # in-process (an interpreter start per command cost seconds each on a loaded 2-core machine).
    res = subprocess.run([sys.executable, "-m", "ckptstore.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "usage: ckptstore" in res.stdout
    commands = ("inspect", "verify", "reshard", "convert", "demo", "bench", "plan", "simulate", "goodput",
                "ram", "agent")
    for cmd in commands:
        assert cmd in res.stdout
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: ckptstore {cmd}")


def test_ram_and_ram_rm_have_help(capsys):
    for cmd, usage in ((["ram"], "usage: ckptstore ram [-h] [--ram-dir DIR] [--json] [rm JOB [--force]]"),
                       (["ram", "rm"], "usage: ckptstore ram rm [-h] [--ram-dir DIR] [--force] JOB")):
        with pytest.raises(SystemExit) as exit_:
            main([*cmd, "--help"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith(usage)


def test_demo_crashes_resumes_exactly_and_reports_the_tiers(tmp_path):
    # Its own process: the warnings of interpreter shutdown (a leaked semaphore) come at its exit.
    res = subprocess.run([sys.executable, "-m", "ckptstore.cli", "demo", "--dir", str(tmp_path), "--mib", "12",
                          "--steps", "24"], capture_output=True, text=True, timeout=280)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    # /dev/shm is left as the demo found it: its own job's segments are gone (close() released
    # them), and no multiprocessing semaphore of the killed run was left to the resource tracker.
    assert "leaked" not in res.stderr and "resource_tracker" not in res.stderr, res.stderr[-3000:]
    demo_job = re.search(r"s3://ckptstore/demo/(demo-[0-9a-f]+)", out)
    assert demo_job is not None, out
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptstore-{demo_job.group(1)}-")]
    assert "close() released the RAM segments" in out and "ram []" in out
    assert "killed with SIGKILL after step 14: yes" in out
    assert "bitwise equal to the uninterrupted run: yes; final weights equal: yes" in out
    assert "s3://ckptstore/demo/demo-" in out and "demo passed" in out
    # Snapshots at 5, 10, ..., the crash after 14, the resume from 10 (RAM) and saves up to 20.
    # The restored step 10 was not due in the durable tier (every 4th snapshot): it is not uploaded
    # at the restart, the cadence counts on from it, and the last step reaches the tier on close.
    assert "restored step 10 from the ram tier" in out
    # The crash comes 4 quick steps after the save of step 10, whose local commit may or may not
    # have landed by then (a loaded machine): either way the newest local steps are 15 and 20.
    assert "durable [20]" in out and re.search(r"local \[(5|10), 15, 20\]", out), out


def test_convert_round_trip_through_the_cli(tmp_path, capsys):
    state = {"model": {"w": torch.arange(12.0).view(3, 4)}, "step": 7}
    ckptstore.save(state, tmp_path / "a.ckpt")
    assert main(["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "b.safetensors"), "--to", "safetensors"]) == 0
    assert main(["convert", str(tmp_path / "b.safetensors"), str(tmp_path / "c.pt"), "--to", "torch"]) == 0
    back = torch.load(tmp_path / "c.pt", weights_only=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 7
    assert "safetensors (1 tensors" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "c.pt"), "--to", "torch"]) == 2
    assert "exists" in capsys.readouterr().err


def test_inspect_and_verify_a_sharded_directory(tmp_path, capsys):
    ckptstore.save_sharded({"w": torch.randn(2000, 1000), "step": 1}, tmp_path / "s")
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "sharded checkpoint" in out and "saved by 1 ranks" in out and "rank     0" in out
    assert main(["verify", str(tmp_path / "s")]) == 0
    data = tmp_path / "s" / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "s")]) == 1
    assert "data/rank-00000.bin" in capsys.readouterr().out
