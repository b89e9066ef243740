"""`ckptstore bench` and `CheckpointStore(tuning=...)`: the JSON users and the planner read, and
that tuned settings really reach the writes (observed on a real moto S3 server and real files)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import uuid

import pytest
import torch
from conftest import assert_same, s3_keys

from ckptstore import CheckpointStore, InvalidArgumentError
from ckptstore._units import parse_size
from ckptstore.cli import main
from ckptstore.names import parse_segment
from ckptstore.storage.targets import WriteTuning
from ckptstore.storage.tuning import load_tuning


def test_bench_cli_measures_ram_local_and_durable_and_writes_json_and_png(tmp_path, s3, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    url = f"s3://{s3['bucket']}/{s3['prefix']}"
    rc = main(["--storage-options", json.dumps(s3["storage_options"]), "bench", "--size", "10MiB", "--ram",
               "--local", str(tmp_path / "disk"), "--durable", url, "--repeats", "1", "--sweep-size", "10MiB",
               "--state-size", "70GiB", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["schema"] == "ckptstore-bench/1" and doc["bytes"] == 10 << 20 and doc["repeats"] == 1
    assert set(doc["targets"]) == {"ram", "local", "durable"}
    assert set(doc["targets"]["ram"]["ops"]) == {"stage"}
    for target in ("local", "durable"):
        assert set(doc["targets"][target]["ops"]) == {"write", "read"}
    for body in doc["targets"].values():
        for row in body["ops"].values():
            raw, ours = row["raw"], row["ckptstore"]
            for entry in (raw, ours):
                assert len(entry["seconds"]) == 1 and entry["median_s"] > 0
                assert entry["GB_per_s"] == pytest.approx((10 << 20) / entry["median_s"] / 1e9, rel=1e-3)
            # The ratio is ckptstore's throughput over the raw ceiling's.
            assert row["ratio"] == pytest.approx(raw["median_s"] / ours["median_s"], rel=1e-3)
    assert doc["cache_drop"] in ("drop_caches", "fadvise_dontneed")
    # The sweeps cover the grid and recommend one of its points; S3 parts must cut the sweep's object
    # in at least two, so at 10 MiB only 5 MiB parts are tried.
    local, durable = doc["sweep"]["local"], doc["sweep"]["durable"]
    assert local["bytes"] == durable["bytes"] == 10 << 20
    assert len(local["results"]) == 15 and {(r["part_bytes"], r["concurrency"]) for r in durable["results"]} == {
        (5 << 20, k) for k in (1, 2, 4, 8)}
    assert {(r["chunk_bytes"], r["concurrency"]) for r in local["results"]} >= {
        (doc["recommended"]["local"]["chunk_bytes"], doc["recommended"]["local"]["concurrency"])}
    assert {(r["part_bytes"], r["concurrency"]) for r in durable["results"]} >= {
        (doc["recommended"]["durable"]["part_bytes"], doc["recommended"]["durable"]["concurrency"])}
    cost = doc["checkpoint_cost"]
    assert cost["state_bytes"] == 70 << 30
    assert 0 < cost["blocking_s"] < cost["to_local_s"] and cost["blocking_s"] < cost["to_durable_s"]
    assert doc["plan_hint"] == f"ckptstore plan --ckpt-cost {cost['blocking_s']:.3g}s"
    assert doc["plan_hint"] in text and "ratio" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The file is what `tuning=` takes.
    tuned = load_tuning(str(out))
    assert tuned.local_chunk_bytes == doc["recommended"]["local"]["chunk_bytes"]
    assert tuned.s3_part_bytes == doc["recommended"]["durable"]["part_bytes"]
    # The interval planner takes the measured cost straight from the file.
    assert main(["plan", "--bench", str(out), "--mtbf", "3h", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_s"] == cost["blocking_s"]
    # Nothing is left behind at the targets.
    assert os.listdir(tmp_path / "disk") == []
    assert s3_keys(s3, s3["prefix"]) == []


def test_bench_peer_compares_replication_with_raw_gloo(tmp_path):
    out = tmp_path / "peer.json"
    assert main(["bench", "--peer", "--size", "1MiB", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    peer = doc["targets"]["peer"]
    row = peer["ops"]["replicate"]
    assert peer["bytes_per_rank"] >= 1 << 20
    assert row["ratio"] == pytest.approx(row["raw"]["median_s"] / row["ckptstore"]["median_s"], rel=1e-6)
    assert doc["checkpoint_cost"]["to_peer_s"] is not None
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("ckptstore-benchrepl-")]


def test_bench_help_and_bad_size(capsys):
    # In-process: tests/test_cli.py's help test starts the one interpreter that proves `python -m ckptstore.cli` runs.
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0 and "--state-size" in capsys.readouterr().out
    assert main(["bench", "--size", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_parse_size():
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("64 MiB") == 64 << 20
    assert parse_size("2.5GB") == 2_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("", "0", "1 parsec", "-1GiB"):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad)


@pytest.mark.parametrize(
    "tuning, message",
    [
        ({"lcoal": {}}, "unknown section(s) ['lcoal']"),
        ({"local": {"chunk": 1 << 20}}, "unknown key(s) ['chunk'] in 'local'"),
        ({"local": {"chunk_bytes": 1000}}, "local.chunk_bytes must be an integer between 64 KiB and 32 MiB"),
        ({"local": {"chunk_bytes": 64 << 20}}, "local.chunk_bytes must be an integer between 64 KiB and 32 MiB"),
        ({"local": {"concurrency": 0}}, "local.concurrency must be an integer between 1 and 64"),
        ({"durable": {"part_bytes": 1 << 20}}, "durable.part_bytes must be an integer between 5 MiB and 5 GiB"),
        ({"durable": {"concurrency": True}}, "durable.concurrency must be an integer"),
        ({"durable": [8 << 20]}, "'durable' must be an object"),
        ([1, 2], "must be a bench JSON file path or a dict"),
    ],
)
def test_bad_tuning_is_a_clear_error_and_creates_nothing(tmp_path, job, tuning, message):
    with pytest.raises(InvalidArgumentError) as info:
        CheckpointStore(job, local=tmp_path / "local", tuning=tuning)
    assert message in str(info.value)
    assert not (tmp_path / "local").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptstore-{job}-")]


def test_bad_tuning_files_are_named(tmp_path, job):
    missing = tmp_path / "nope.json"
    with pytest.raises(InvalidArgumentError, match=r"tuning file '.*nope.json' does not exist; write one with"):
        CheckpointStore(job, tuning=str(missing))
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match=r"garbled.json' is not valid JSON"):
        CheckpointStore(job, tuning=str(garbled))
    # The bench document's own shape (with "recommended") is accepted; partial settings keep defaults.
    assert load_tuning({"recommended": {"local": {"concurrency": 2}}}) == WriteTuning(local_concurrency=2)


def _write_sizes(monkeypatch) -> list[int]:
    """Record the size of every bulk write call that reaches the kernel."""
    sizes: list[int] = []
    real = os.pwrite

    def spy(fd, data, offset):
        sizes.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    return sizes


def test_store_writes_local_files_in_the_tuned_chunk_size(tmp_path, job, monkeypatch):
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: one 12 MiB piece by default
    sizes = _write_sizes(monkeypatch)
    with CheckpointStore(job + "-d", local=tmp_path / "default") as store:
        store.save(1, state).wait("local")
    assert max(sizes) >= 8 << 20
    sizes.clear()
    with CheckpointStore(job, local=tmp_path / "tuned", tuning={"local": {"chunk_bytes": 1 << 20}}) as store:
        store.save(1, state).wait("local")
    bulk = [s for s in sizes if s >= 64 << 10]
    assert max(sizes) == 1 << 20 and sum(bulk) >= 12 << 20
    out = {"w": torch.zeros_like(state["w"])}
    from ckptstore import load_sharded

    load_sharded(out, str(tmp_path / "tuned" / "step-000000000001"))
    assert_same(out, state)
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-d-"):
            os.unlink(os.path.join("/dev/shm", name))


def test_store_uploads_durable_parts_of_the_tuned_size_and_concurrency(tmp_path, job, s3, monkeypatch):
    import s3fs

    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB of tensor data
    in_flight, peak = [0], [0]
    lock = threading.Lock()
    real = s3fs.S3FileSystem._call_s3

    async def spy(self, method, *args, **kwargs):
        if method != "upload_part":
            return await real(self, method, *args, **kwargs)
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        try:
            return await real(self, method, *args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", spy)
    parts = {}
    for name, tuning in (("default", None), ("tuned", {"durable": {"part_bytes": 5 << 20, "concurrency": 1}})):
        url = f"s3://{s3['bucket']}/{s3['prefix']}/{name}"
        peak[0] = 0
        with CheckpointStore(f"{job}-{name}", durable=url, durable_every=1, storage_options=s3["storage_options"],
                             tuning=tuning) as store:
            store.save(1, state).wait("durable")
        key = next(k for k in s3_keys(s3, f"{s3['prefix']}/{name}/") if "/data/" in k)
        etag = s3["client"].head_object(Bucket=s3["bucket"], Key=key)["ETag"].strip('"')
        parts[name] = (int(etag.rsplit("-", 1)[1]), peak[0])  # a multipart ETag ends in -<number of parts>
        out = {"w": torch.zeros_like(state["w"])}
        from ckptstore import load_sharded

        load_sharded(out, f"{url}/step-000000000001", storage_options=s3["storage_options"])
        assert_same(out, state)
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptstore-{job}-"):
            os.unlink(os.path.join("/dev/shm", name))
    assert parts["default"][0] == 2  # 8 MiB parts: 8 + 4 MiB (+ the container's own bytes)
    assert parts["tuned"] == (3, 1)  # 5 MiB parts, one at a time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_segments() -> set[str]:
    """The benchmarks' RAM segments in /dev/shm (their jobs are named bench*; other tests' are not)."""
    return {n for n in os.listdir("/dev/shm") if (seg := parse_segment(n)) is not None and seg.job.startswith("bench")}


def _suite(tmp_path, *only: str, prefix: str | None = None) -> dict:
    """Run benchmarks/run.py --quick. With ``prefix`` (honoured by the parts that name their jobs
    from benchmarks/common.py's JOB_PREFIX), only segments of this run's jobs count as left behind:
    another benchmark running beside this test makes and removes segments of its own meanwhile."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--out", str(tmp_path / "out"),
           "--dir", str(tmp_path)]
    env = dict(os.environ, CKPTSTORE_BENCH_JOB_PREFIX=prefix) if prefix else None
    before = _bench_segments()
    res = subprocess.run([*cmd, *(["--only", *only] if only else [])], capture_output=True, text=True, cwd=ROOT,
                         env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    left = _bench_segments() - before
    if prefix:
        left = {n for n in left if n.startswith(f"ckptstore-{prefix}-")}
    assert left == set(), f"the benchmarks left RAM segments in /dev/shm: {sorted(left)}"
    assert "leaked" not in res.stderr, res.stderr[-3000:]
    with open(tmp_path / "out" / "suite.json") as fh:
        return json.load(fh)


# 9-19 s at load 4-5 on two cores (11 s CPU): the benchmark runner and bench_scale are harness, not
# engine; -m slow runs them.
@pytest.mark.slow
def test_benchmark_suite_quick_smoke(tmp_path):
    prefix = f"bench-t{uuid.uuid4().hex[:8]}"  # this run's jobs: a bench run beside it leaves its own segments alone
    suite = _suite(tmp_path, "scale", prefix=prefix)
    assert suite["mode"] == "quick" and suite["parts"]["scale"]["status"] == "ok"
    rows = suite["parts"]["scale"]["ratios_by_state"]
    assert len(rows) == 4  # 2 sizes + 2 tensor counts
    for ratios in rows.values():
        assert set(ratios) == {"save_speedup_vs_torch", "load_speedup_vs_torch", "store_blocking_vs_memcpy_floor"}
        assert all(v > 0 for v in ratios.values())
    with open(tmp_path / "out" / "scale.json") as fh:
        scale = json.load(fh)
    for row in scale["by_size"] + scale["by_count"]:
        assert all(len(s) == row["repeats"] == 1 for s in row["seconds"].values())
    assert (tmp_path / "out" / "scale.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_benchmark_suite_quick_runs_every_part(tmp_path):
    # Every part that makes a store (async, scale, loop) names its jobs from the prefix.
    suite = _suite(tmp_path, prefix=f"bench-t{uuid.uuid4().hex[:8]}")
    assert {p: b["status"] for p, b in suite["parts"].items()} == {
        p: "ok" for p in ("dropin", "sharded", "async", "scale", "loop")}
    assert "safetensors" in json.dumps(suite["parts"]["dropin"]["ratios"])
    assert "store_save_vs_dcp_process" in suite["parts"]["async"]["ratios"]
    assert set(suite["parts"]["loop"]["loop_overhead"]) == {"every 2 steps", "every 4 steps"}


def _restore_bench_segments() -> set[str]:
    """The RAM segments of the jobs these restore benchmarks name (other benchmarks may run beside)."""
    return {n for n in _bench_segments() if re.match(r"ckptstore-bench-(restore-|smoke-|cuda-peer-|[0-9a-f]{8}-)", n)}


@pytest.mark.slow
def test_restore_benchmarks_run_on_the_cpu(tmp_path, monkeypatch):
    """bench_restore.py end to end at a tiny size, and bench_cuda.py's restore pieces that run
    without a GPU (its local-tier rows and its plot), in this process."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_cuda
    import bench_restore

    before = _restore_bench_segments()
    monkeypatch.setattr(sys, "argv", ["bench_restore.py", "--layers", "1", "--repeats", "1", "--out", str(tmp_path),
                                      "--dir", str(tmp_path)])
    bench_restore.main()
    with open(tmp_path / "restore.json") as fh:
        doc = json.load(fh)
    assert set(doc["median_seconds"]) == {"memcpy_floor", "memcpy_floor_threads", "restore_ram",
                                          "restore_ram_restarted", "restore_ram_restarted_first",
                                          "restarted_floor_pread", "restarted_floor_map",
                                          "restore_ram_restarted_fresh", "restarted_floor_pread_fresh",
                                          "raw_read_cold", "restore_local_cold"}
    assert set(doc["median_cpu_seconds"]) == set(doc["median_seconds"])
    assert all(v > 0 for v in doc["ratios"].values()) and doc["cache_drop"] == "fadvise_dontneed"
    assert (tmp_path / "restore.png").read_bytes()[:4] == b"\x89PNG"

    g = torch.Generator().manual_seed(0)
    flat = {"a": torch.randn(300, 700, generator=g), "b": torch.randint(0, 9, (5000,), generator=g)}
    want = {k: v.clone() for k, v in flat.items()}
    local = bench_cuda.restore_from_local(flat, list(flat.items()), str(tmp_path / "disk"),
                                          f"bench-smoke-{os.getpid()}", "/dev/shm", 1, False)
    assert set(local["median_seconds"]) == {"raw_read_into_pinned_cold", "ckptstore_store_restore_from_local_cold"}
    assert all(torch.equal(flat[k], want[k]) for k in flat)
    fake = {"seconds": {"x": [1.0]}, "median_seconds": {"x": 1.0}}
    bench_cuda.plot({"bytes": 1, "staging": fake, "restore": fake, "restore_local": local}, str(tmp_path))
    assert (tmp_path / "cuda.png").read_bytes()[:4] == b"\x89PNG"
    assert _restore_bench_segments() - before == set(), "the benchmarks left RAM segments in /dev/shm"


@pytest.mark.slow
def test_cuda_benchmark_runs_on_the_cpu(tmp_path):
    """The whole GPU benchmark at a tiny size on the CPU: every section, the peer restore's two
    processes included, runs to the end without an error recorded."""
    before = _restore_bench_segments()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_cuda.py"), "--hidden", "128",
                          "--blocks", "1", "--repeats", "1", "--loop-steps", "2", "--every", "1", "--tokens", "32",
                          "--peer-mib", "2", "--dir", str(tmp_path / "work"), "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "cuda.json") as fh:
        doc = json.load(fh)
    assert not [k for k in doc if k.endswith("_error")], {k: v for k, v in doc.items() if k.endswith("_error")}
    assert {"restore", "restore_local", "restore_peer"} <= set(doc)
    assert "ckptstore_load_map_location_cuda" in doc["restore"]["median_seconds"]
    assert _restore_bench_segments() - before == set(), "the benchmarks left RAM segments in /dev/shm"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch, capsys):
    from ckptstore.bench import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert plot({"targets": {}, "sweep": {}, "bytes": 1, "repeats": 1}, str(tmp_path / "x.png")) is False
    assert "matplotlib is not installed, so no plot was written" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


# A store cell at 2 thread-ranks, in the default run (4-8 s): it hung for good when one rank raised
# inside its `with CheckpointStore` (the harness read the local tier's format 2.0 manifest with
# parse_manifest): the failing rank's close waited in the promotion flag's all-reduce, the other in
# the cell's barrier. The second run makes a rank fail there on purpose: the cell reports it.
_RANKS_DRIVER = """
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("bench_ranks", sys.argv[1])
br = importlib.util.module_from_spec(spec)
spec.loader.exec_module(br)
if sys.argv[2] == "fail":
    real = br._sharded.chunks_needed
    def failing(*args, **kwargs):
        if threading.current_thread().name == "rank-1":
            raise ValueError("injected failure")
        return real(*args, **kwargs)
    br._sharded.chunks_needed = failing
sys.exit(br.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_bench_ranks_store_cell_finishes_at_two_ranks(tmp_path, mode):
    script = os.path.join(ROOT, "benchmarks", "bench_ranks.py")
    proc = subprocess.Popen([sys.executable, "-c", _RANKS_DRIVER, script, mode, "--kinds", "store", "--worlds", "2",
                             "--tensors", "2", "--out", str(tmp_path / "out"), "--no-plot", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail("bench_ranks --kinds store hung at 2 ranks:\n" + stdout[-2000:] + stderr[-2000:])
    finally:
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptstore-benchranks-{proc.pid}-")]
        for name in left:
            os.remove(os.path.join("/dev/shm", name))
    cells = json.loads((tmp_path / "out" / "ranks.json").read_text())["cells"]
    assert [(c["kind"], c["world"]) for c in cells] == [("store", 2)]
    if mode == "ok":
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "error" not in cells[0] and cells[0]["manifest_bytes"] > 0
    else:
        assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
        assert cells[0]["error"] == "RuntimeError: rank 1 of 2 failed: ValueError: injected failure"
    assert left == [], "bench_ranks left RAM segments in /dev/shm"


def test_bench_ranks_store_cell_spreads_ranks_over_nodes_and_cleans_up(tmp_path):
    """--ranks-per-node 1 at 2 ranks: two simulated nodes, each with RAM and local directories of
    its own; the cell saves and restores bitwise (checked inside) and leaves nothing in /dev/shm."""
    script = os.path.join(ROOT, "benchmarks", "bench_ranks.py")
    proc = subprocess.Popen([sys.executable, script, "--kinds", "store", "--worlds", "2", "--tensors", "2",
                             "--ranks-per-node", "1", "--out", str(tmp_path / "out"), "--no-plot", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    (cell,) = json.loads((tmp_path / "out" / "ranks.json").read_text())["cells"]
    assert "error" not in cell and cell["ranks_per_node"] == 1
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"benchranks-{proc.pid}-")
            or n.startswith(f"ckptstore-benchranks-{proc.pid}-")]
    assert left == [], left


def test_bench_ranks_counts_each_ranks_calls_on_its_own_threads(tmp_path):
    """--count-calls: every rank's steady save, restore, save_sharded and loads are counted in calls
    on that rank's threads, the save's blocking part within its control plane, the fit covers the
    counts, and the Markdown tables show them (they are left out of a run without counting)."""
    script = os.path.join(ROOT, "benchmarks", "bench_ranks.py")
    proc = subprocess.run([sys.executable, script, "--kinds", "store", "sharded", "--worlds", "2", "4", "--tensors", "2",
                           "--count-calls", "--out", str(tmp_path / "out"), "--no-plot", "--dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "ranks.json").read_text())
    assert doc["count_calls"] is True
    cells = {(c["kind"], c["world"]): c for c in doc["cells"]}
    for world in (2, 4):
        store, sharded = cells[("store", world)]["per_rank"], cells[("sharded", world)]["per_rank"]
        assert 0 < store["save_calls"]["median"] < store["control_plane_calls"]["median"]
        assert store["restore_calls"]["median"] > 0
        for name in ("save_calls", "shard1_calls", "shard0_uneven_calls", "replicate_calls"):
            assert sharded[name]["median"] > 0, name
    assert doc["growth"]["store.control_plane_calls"]["world_exponent"] is not None
    spec = importlib.util.spec_from_file_location("bench_ranks", script)
    assert spec is not None and spec.loader is not None
    bench_ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ranks)
    table = bench_ranks.markdown(doc)
    assert "calls per rank, steady save's control plane" in table and " calls |" in table
    for cell in doc["cells"]:
        for figure in list(cell["per_rank"]):
            if figure.endswith("calls"):
                del cell["per_rank"][figure]
    assert "calls per rank" not in bench_ranks.markdown(doc)


# Slow, like the other benchmarks' smoke runs: the default run keeps the quick suite smoke above.
@pytest.mark.slow
def test_bench_ranks_smoke_measures_real_ranks_and_compares(tmp_path):
    """benchmarks/bench_ranks.py at 2 and 4 thread-ranks: every kind of cell runs (its loads and
    restores are checked bitwise inside), the metadata and read counters see traffic, the JSON
    names the commit, and --compare plots two runs against each other."""
    out = tmp_path / "out"
    script = os.path.join(ROOT, "benchmarks", "bench_ranks.py")
    proc = subprocess.Popen([sys.executable, script, "--worlds", "2", "4", "--tensors", "3", "--plan-ranks", "8", "16",
                             "--plan-tensors", "2", "--out", str(out), "--name", "smoke", "--no-plot"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"ckptstore-benchranks-{proc.pid}-")]
    assert left == [], "bench_ranks left RAM segments in /dev/shm"
    doc = json.loads((out / "smoke.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert doc["schema"] == "ckptstore-bench-ranks/1" and doc["commit"] == head
    cells = {(c["kind"], c["world"]): c for c in doc["cells"]}
    assert set(cells) == {("store", 2), ("store", 4), ("sharded", 2), ("sharded", 4), ("plan", 8), ("plan", 16)}
    assert not [c for c in doc["cells"] if "error" in c or c.get("skipped")]
    store, sharded = cells[("store", 4)], cells[("sharded", 4)]
    ranks = store["per_rank"]
    # Counted at ckptstore's Group: the first save of 4 ranks receives metadata from the other ranks
    # (its structure agreement); a steady save agrees through all-reduced flags, tensors, no objects.
    assert ranks["first_meta_recv_bytes"]["median"] > 0 and ranks["first_meta_sent_bytes"]["median"] > 0
    assert ranks["meta_tensor_bytes"]["median"] > 0 and ranks["collectives"]["median"] > 0
    assert ranks["control_plane_cpu_s"]["median"] > 0 and ranks["load_plan_cpu_s"]["max"] > 0
    # Counted at the opener: a restore reads at least each rank's own bytes, a reshard at least the checkpoint.
    assert ranks["restore_read_bytes"]["median"] >= ranks["own_bytes"]["median"] > 0
    assert store["manifest_bytes"] > 0 and ranks["ram_manifest_bytes"]["median"] > 0
    for name in ("shard1", "shard0_uneven"):
        assert sharded[f"{name}_read_bytes_all_ranks"] >= sharded["checkpoint_bytes"] > 0
        assert sharded[f"{name}_read_ratio"] >= 1.0
    assert cells[("plan", 16)]["manifest_bytes"] > cells[("plan", 8)]["manifest_bytes"]
    growth = doc["growth"]
    # A steady save receives no objects (above), so meta_recv_bytes has nothing to fit: zeros on a log scale.
    assert growth["store.manifest_bytes"]["world_exponent"] is not None
    assert growth["store.control_plane_cpu_s"]["world_exponent"] is not None
    assert set(growth["store.control_plane_cpu_s"]["extrapolated"]) == {"4096x10000", "16384x10000"}
    # --compare only reads JSON and plots, so it runs here, without a second interpreter start.
    spec = importlib.util.spec_from_file_location("bench_ranks", script)
    assert spec is not None and spec.loader is not None
    bench_ranks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ranks)
    png = tmp_path / "cmp.png"
    assert bench_ranks.main(["--compare", str(out / "smoke.json"), str(out / "smoke.json"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
