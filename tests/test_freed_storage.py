"""A tensor whose storage was freed (``untyped_storage().resize_(0)``, as FSDP frees parameters
outside forward) keeps its shape, and its data pointer becomes 0. Saving it must fail with an error
that names it: the store's copy by address read address 0 (the process died of SIGSEGV), and
``ckptstore.save`` and ``save_sharded`` wrote zeros in its place without a word.

Each case runs in a process of its own (tests/warm_python.py), so a crash is this test failing and
not the suite dying."""

from __future__ import annotations

import json
import textwrap

import pytest
import warm_python

_CASE = textwrap.dedent("""
    import json, os, sys, torch, ckptstore
    case, root, job = sys.argv[1:4]
    state = {f"small{i}": torch.randn(16) for i in range(40)}
    state["large"] = torch.randn(1 << 16)  # 256 KiB: copied by torch, not by address
    freed = "large" if case.endswith("large") else "small7"
    out = {}
    if case.startswith("store"):
        store = ckptstore.CheckpointStore(job, local=os.path.join(root, "local"))
        store.save(1, state).wait("local")
        if case.startswith("store-steady"):
            store.save(2, state).wait("local")  # the same sources twice: the steady path
        want = {k: v.clone() for k, v in state.items()}
        state[freed].untyped_storage().resize_(0)
        try:
            store.save(3, state).wait("local")
        except ckptstore.CheckpointError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        newest = 2 if case.startswith("store-steady") else 1
        out["restored"] = store.restore(got)
        out["intact"] = all(torch.equal(got[k], want[k]) for k in want) and out["restored"] == newest
        store.close()
    else:
        state[freed].untyped_storage().resize_(0)
        try:
            if case.startswith("save-"):
                ckptstore.save(state, os.path.join(root, "a.ckpt"))
            else:
                ckptstore.save_sharded(state, os.path.join(root, "sharded"))
        except ckptstore.CheckpointError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("case", ["store-first-small", "store-steady-small", "store-steady-large",
                                  "save-small", "sharded-large"])
def test_a_tensor_whose_storage_was_freed_is_refused_by_name(tmp_path, job, case):
    proc = warm_python.run(["-c", _CASE, case, str(tmp_path), job], timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    freed = "large" if case.endswith("large") else "small7"
    assert "error" in out, out
    assert "InvalidArgumentError: " in out["error"] and f"'{freed}'" in out["error"], out
    assert "storage" in out["error"] and "freed" in out["error"], out
    if case.startswith("store"):
        assert out["intact"], out  # the refused save left the committed steps as they were
