"""``ckptstore demo``: the main job on embedded defaults (a local directory and a local S3 server).

It saves a model and its Adam state with ckptstore and with torch.save, to a local directory and to
a local S3 endpoint (moto on 127.0.0.1), loads everything back, checks that every tensor is
bitwise equal, and prints what it measured. No cloud account, no GPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch

from . import load, save


def _model_state(mib: int) -> dict[str, Any]:
    torch.manual_seed(0)
    width = 1024
    layers = max(1, mib * 2**20 // (3 * 4 * width * width))  # weights + Adam's two moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).pow(2).mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": 1}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run_demo(directory: str | None = None, mib: int = 96, use_s3: bool = True) -> dict[str, Any]:
    state = _model_state(mib)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values())
    nbytes += sum(v.numel() * v.element_size() for s in state["optim"]["state"].values() for v in s.values())
    work = directory or tempfile.mkdtemp(prefix="ckptstore-demo-")
    os.makedirs(work, exist_ok=True)
    rows: list[tuple[str, float, float, bool]] = []

    cpath, tpath = os.path.join(work, "demo.ckpt"), os.path.join(work, "demo.pt")
    ts, _ = _timed(lambda: save(state, cpath))
    tl, loaded = _timed(lambda: load(cpath))
    rows.append((f"ckptstore  -> {cpath}", ts, tl, _equal(state, loaded)))

    def torch_save() -> None:
        torch.save(state, tpath)
        fd = os.open(tpath, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    ts, _ = _timed(torch_save)
    tl, loaded = _timed(lambda: torch.load(tpath, weights_only=True))
    rows.append((f"torch.save -> {tpath}", ts, tl, _equal(state, loaded)))

    if use_s3:
        from ._local_s3 import start_local_s3

        s3 = start_local_s3()
        try:
            url, opts = s3.url("demo/demo.ckpt"), s3.storage_options
            ts, _ = _timed(lambda: save(state, url, storage_options=opts))
            tl, loaded = _timed(lambda: load(url, storage_options=opts))
            rows.append((f"ckptstore  -> {url} (local S3 at {s3.endpoint_url})", ts, tl, _equal(state, loaded)))
        finally:
            s3.stop()

    print(f"ckptstore demo: model + Adam state, {nbytes / 2**20:.1f} MiB of tensors, files in {work}")
    print(f"  {'where':84s} {'save s':>8s} {'load s':>8s}  bitwise equal")
    for name, s_, l_, ok in rows:
        print(f"  {name:84s} {s_:8.3f} {l_:8.3f}  {'yes' if ok else 'NO'}")
    ok = all(r[3] for r in rows)
    print("  all round trips bitwise equal" if ok else "  MISMATCH: a round trip was not bitwise equal")
    return {"bytes": nbytes, "rows": rows, "ok": ok, "dir": work}
