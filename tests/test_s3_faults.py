"""Object-store faults: a real HTTP proxy (tests/s3_fault_proxy.py) between s3fs and the local S3
server injects 503 SlowDown, connection resets, slow and held responses and a full outage.

What users rely on: every S3 request is retried by one layer only, a bounded number of times; a
promotion to the durable tier either commits a step that loads bitwise equal or fails by its
deadline, leaving the RAM and local copies intact; the training loop's ``save`` returns while an
upload is stuck; later promotions succeed once the store answers again; no multipart upload is
left behind.
"""

from __future__ import annotations

import errno
import time

import pytest
import torch
from conftest import assert_same, s3_keys, s3_pending_uploads, s3_view, wipe_ram
from s3_fault_proxy import FaultProxy

import ckptstore
from ckptstore import CheckpointStore, StorageError
from ckptstore.storage import s3 as s3mod
from ckptstore.storage.targets import READ_ATTEMPTS

PART = 5 << 20  # the smallest part S3 takes: a 12 MiB rank file is a 3-part upload


@pytest.fixture
def s3(moto_s3_server, request):
    """moto, not the session's real server: these faults are timed against a server that answers
    at once (a 2 s deadline, say), and a real server sharing two loaded cores does not."""
    return s3_view(moto_s3_server, request)


@pytest.fixture
def proxy(s3):
    with FaultProxy(s3["endpoint_url"]) as p:
        yield p


def _through(s3, proxy, **config):
    """s3fs options that go through the proxy; ``config`` adds botocore settings (timeouts, retries)."""
    opts = dict(s3["storage_options"])
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url)
    if config:
        opts["config_kwargs"] = config
    return opts


# Short botocore timeouts and two attempts, for the tests where requests hang or the store is down.
QUICK = {"connect_timeout": 1, "read_timeout": 2, "retries": {"mode": "standard", "total_max_attempts": 2}}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=g), "b": torch.arange(step, step + 7, dtype=torch.int64)}


def _from_durable(s3, url: str, step: int) -> dict[str, torch.Tensor]:
    """Load a step straight from the S3 server (not through the proxy)."""
    out: dict = {"w": None, "b": None}
    ckptstore.load_sharded(out, f"{url}/step-{step:012d}", storage_options=s3["storage_options"])
    return out


def _durable(s3, job: str) -> str:
    return f"s3://{s3['bucket']}/{s3['prefix']}/{job}"


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch):
    monkeypatch.setenv("CKPTSTORE_S3_PART_SIZE", str(PART))


def test_one_retry_layer_with_a_bounded_number_of_attempts(s3, proxy, monkeypatch, tmp_path):
    """A steady 503 SlowDown on every part: the part is sent exactly RETRY_ATTEMPTS times (s3fs's
    own loop around botocore's made that 5 x 5 = 25), then the save fails with a StorageError,
    the upload is aborted and nothing appears at the key."""
    monkeypatch.setenv("CKPTSTORE_S3_UPLOAD_CONCURRENCY", "1")  # parts one at a time: an exact count
    proxy.add("slowdown", "UploadPart")
    url = f"s3://{s3['bucket']}/{s3['prefix']}/one.ckpt"
    with pytest.raises(StorageError, match=r"cannot write s3://.*one\.ckpt: .*reduce your request rate"):
        ckptstore.save(_state(1), url, storage_options=_through(s3, proxy))
    assert proxy.counts["UploadPart"] == s3mod.RETRY_ATTEMPTS == 5
    assert proxy.counts["AbortMultipartUpload"] >= 1
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    assert s3_keys(s3, s3["prefix"]) == []


def test_caller_retry_settings_are_kept(s3, proxy):
    """An explicit botocore retry configuration in storage_options wins over ours."""
    proxy.add("slowdown", "PutObject")
    opts = _through(s3, proxy, retries={"mode": "standard", "total_max_attempts": 2})
    with pytest.raises(StorageError):
        ckptstore.save({"x": torch.zeros(4)}, f"s3://{s3['bucket']}/{s3['prefix']}/x.ckpt", storage_options=opts)
    assert proxy.counts["PutObject"] == 2


FAULTS = {
    "slowdown-parts": dict(action="slowdown", kinds="UploadPart", count=2),
    "reset-mid-request": dict(action="reset_request", kinds=("UploadPart", "PutObject"), count=2),
    "reset-mid-response": dict(action="reset_response", kinds=("UploadPart", "HeadObject", "ListObjects"), count=2),
    "slow-responses": dict(action="delay", kinds=("UploadPart", "CompleteMultipartUpload"), seconds=0.2),
    "slowdown-complete": dict(action="slowdown", kinds="CompleteMultipartUpload", count=1),
    # The answers to the conditional PUTs (part file, manifest) are lost after the server stored
    # them: the retry is refused (412) because of its own first attempt, which must count as success.
    "lost-answer-part-file-put": dict(action="reset_response", kinds="PutObject", count=1, where="/parts/"),
    "lost-answer-manifest-put": dict(action="reset_response", kinds="PutObject", count=1, where="manifest.json"),
}
# Random mixes over every kind of request, behind -m slow: (seed, fraction of requests hit).
MIXES = [(seed, 0.15) for seed in range(8)]


@pytest.mark.slow
@pytest.mark.parametrize("seed, fraction", MIXES)
def test_promotion_through_random_fault_mixes(s3, proxy, job, tmp_path, seed, fraction):
    for i, action in enumerate(("slowdown", "reset_request", "reset_response")):
        proxy.add(action, fraction=fraction / 3, seed=seed * 10 + i)
    url = _durable(s3, job)
    with CheckpointStore(job, local=tmp_path / "local", durable=url, durable_every=1,
                         storage_options=_through(s3, proxy)) as store:
        for step in (1, 2, 3):
            store.save(step, _state(step)).wait("durable")
    for step in (1, 2, 3):
        assert_same(_from_durable(s3, url, step), _state(step), f"step {step}")
    assert s3_pending_uploads(s3, s3["prefix"]) == []


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_promotion_through_transient_faults_commits_bitwise(s3, proxy, job, tmp_path, fault):
    spec = dict(FAULTS[fault])
    proxy.add(spec.pop("action"), spec.pop("kinds", None), **spec)
    url = _durable(s3, job)
    with CheckpointStore(job, local=tmp_path / "local", durable=url, durable_every=1,
                         storage_options=_through(s3, proxy)) as store:
        store.save(1, _state(1)).wait("durable")
    assert sum(proxy.faults.values()) > 0, "the fault was never injected"
    assert_same(_from_durable(s3, url, 1), _state(1))
    assert s3_pending_uploads(s3, s3["prefix"]) == []


def test_restore_reads_through_cut_responses_and_slowdowns(s3, proxy, job, tmp_path):
    """Reads from a faulty store: responses cut mid-body (which botocore's retries cannot see, so
    the reader asks again) and SlowDown on GETs. A durable-only restore loads bitwise equal."""
    url = _durable(s3, job)
    with CheckpointStore(job, durable=url, durable_every=1, storage_options=s3["storage_options"]) as store:
        store.save(1, _state(1)).wait("durable")
    wipe_ram(job)
    proxy.add("reset_response", "GetObject", count=2)
    proxy.add("slowdown", "GetObject", count=2)
    target = {"w": torch.zeros(3 << 20), "b": torch.zeros(7, dtype=torch.int64)}
    with CheckpointStore(job, durable=url, storage_options=_through(s3, proxy)) as store:
        assert store.restore(target) == 1
    assert proxy.faults["reset_response"] == 2 and proxy.faults["slowdown"] == 2
    assert_same(target, _state(1))


def test_reads_cut_every_time_fail_clearly_and_boundedly(s3, proxy):
    """Every GET cut off: load raises a StorageError naming the object (not aiohttp's own
    exception), after a bounded number of requests."""
    url = f"s3://{s3['bucket']}/{s3['prefix']}/r.ckpt"
    ckptstore.save(_state(1), url, storage_options=s3["storage_options"])
    proxy.add("reset_response", "GetObject")
    with pytest.raises(StorageError, match=r"cannot read s3://.*r\.ckpt"):
        ckptstore.load(url, storage_options=_through(s3, proxy, **QUICK))
    assert 1 <= proxy.counts["GetObject"] <= READ_ATTEMPTS * s3mod.RETRY_ATTEMPTS


@pytest.mark.parametrize("policy", ["block", "skip"])
def test_save_returns_while_an_upload_is_stuck(s3, proxy, job, tmp_path, policy):
    """While step 1's parts hang in the proxy, the saves that follow return and commit locally
    under either policy, none skipped: a promotion reads the step's local files, not its RAM slot,
    so a stuck upload holds no slot. Once the store answers, step 1's promotion completes, step 2's,
    queued behind it and overtaken by step 3's, is dropped without a request, and step 3 is
    promoted next: step 2's wait("durable") returns only once step 3 is committed there (the
    durable tier holds step 2 or a newer one), steps 1 and 3 load bitwise equal, and step 2 stays
    in the local tier."""
    proxy.add("hold", "UploadPart")
    url = _durable(s3, job)
    store = CheckpointStore(job, local=tmp_path / "local", durable=url, durable_every=1, policy=policy,
                            durable_timeout_s=120, storage_options=_through(s3, proxy))
    try:
        h1 = store.save(1, _state(1))
        assert proxy.held.wait(60), "the upload never reached the proxy"
        h2 = store.save(2, _state(2))  # returns: step 1's slot is not needed
        h2.wait("local")
        assert not h1.done("durable") and proxy.held.is_set(), "the upload was meant to be stuck still"
        h3 = store.save(3, _state(3))  # into step 1's slot, whose promotion still hangs
        assert not h3.skipped and store.skipped == 0
        h3.wait("local")
        assert not h1.done("durable"), "save must not have waited for the stuck upload"
        proxy.clear()
        h1.wait("durable")
        h2.wait("durable")
        assert store.durable.steps_sync() == [1, 3], "step 2's wait returned before step 3 was committed"
        h3.wait("durable")
    finally:
        proxy.clear()
        store.close()
    for step in (1, 3):
        assert_same(_from_durable(s3, url, step), _state(step), f"step {step}")
    assert not [k for k in s3_keys(s3, s3["prefix"]) if "step-000000000002" in k]
    local2: dict = {"w": None, "b": None}
    ckptstore.load_sharded(local2, tmp_path / "local" / "step-000000000002")
    assert_same(local2, _state(2), "local copy of step 2")
    assert s3_pending_uploads(s3, s3["prefix"]) == []


def test_an_overtaken_promotion_fails_with_the_one_that_overtook_it(s3, proxy, job, tmp_path):
    """Step 2's promotion, overtaken by step 3's while step 1's upload hangs, is dropped; then
    every request for step 3 is reset, so its promotion fails. Step 2's wait("durable") raises that
    failure rather than returning, since the durable tier holds neither: step 1 is its only step,
    no multipart upload is left, and steps 2 and 3 load bitwise from the local tier."""
    hold = proxy.add("hold", "UploadPart", where="step-000000000001")
    proxy.add("outage", where="step-000000000003")
    url = _durable(s3, job)
    local = tmp_path / "local"
    store = CheckpointStore(job, local=local, durable=url, durable_every=1, durable_timeout_s=120,
                            storage_options=_through(s3, proxy))
    try:
        h1 = store.save(1, _state(1))
        assert proxy.held.wait(60), "the upload never reached the proxy"
        h2 = store.save(2, _state(2))
        h3 = store.save(3, _state(3))
        h3.wait("local")
        assert not h1.done("durable"), "the upload was meant to be stuck still"
        with proxy.lock:
            proxy.rules.remove(hold)
        proxy.release()
        h1.wait("durable")
        with pytest.raises(StorageError, match=r"promoting step 3 to .* failed"):
            h3.wait("durable")
        with pytest.raises(StorageError, match=r"promoting step 3 to .* failed"):
            h2.wait("durable")
        assert proxy.faults["outage"] > 0
        assert store.durable.steps_sync() == [1]
        with pytest.raises(ckptstore.CheckpointError, match=r"background save \(step 3\) failed"):
            store.save(4, _state(4))  # reported to the trainer once, as step 3's
    finally:
        proxy.clear()
        store.close()
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    for step in (2, 3):
        got: dict = {"w": None, "b": None}
        ckptstore.load_sharded(got, local / f"step-{step:012d}")
        assert_same(got, _state(step), f"local copy of step {step}")


def _wait_until(cond, what: str, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_stuck_upload_fails_by_its_deadline_and_later_promotions_succeed(s3, proxy, job, tmp_path):
    """A part that never gets an answer: the promotion fails with ETIMEDOUT at durable_timeout_s,
    the multipart upload is aborted (even though the held part reaches the server afterwards),
    the local copy of the step loads bitwise, and the next promotion succeeds."""
    proxy.add("hold", "UploadPart")
    url = _durable(s3, job)
    local = tmp_path / "local"
    with CheckpointStore(job, local=local, durable=url, durable_every=1, durable_timeout_s=6,
                         storage_options=_through(s3, proxy, **QUICK)) as store:
        h1 = store.save(1, _state(1))
        h1.wait("local")
        with pytest.raises(StorageError, match=r"durable_timeout_s=6 passed before the object store answered") as err:
            h1.wait("durable")
        assert err.value.errno == errno.ETIMEDOUT
        with pytest.raises(ckptstore.CheckpointError, match=r"background save \(step 1\) failed"):
            store.save(2, _state(2))  # the failure is reported once, to the trainer
        proxy.clear()  # the held parts now reach the server, after the abort
        _wait_until(lambda: proxy.active == 0, "the proxy still forwards requests")
        store.save(3, _state(3)).wait("durable")
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    durable = CheckpointStore(job, durable=url, storage_options=s3["storage_options"])
    try:
        assert durable.durable.steps_sync() == [3]
    finally:
        durable.close()
    assert_same(_from_durable(s3, url, 3), _state(3))
    step1: dict = {"w": None, "b": None}
    ckptstore.load_sharded(step1, local / "step-000000000001")
    assert_same(step1, _state(1), "local copy of step 1")


def test_outage_fails_promotion_keeps_local_and_recovers(s3, proxy, job, tmp_path):
    """Every connection reset: the promotion fails when its bounded attempts run out, the trainer
    gets the error once, the local tier has the step; after the outage the next promotion succeeds
    and a restore from durable alone finds it.

    The deadline is far (60 s) on purpose: the outage fails by its attempts in about a second, and
    a 3 s deadline failed the healthy promotions of steps 1 and 4 at a load of ~20 on two cores.
    The deadline has a test of its own (a stuck upload, above)."""
    url = _durable(s3, job)
    local = tmp_path / "local"
    with CheckpointStore(job, local=local, durable=url, durable_every=1, durable_timeout_s=60,
                         storage_options=_through(s3, proxy, **QUICK)) as store:
        store.save(1, _state(1)).wait("durable")
        proxy.add("outage")
        h2 = store.save(2, _state(2))
        h2.wait("local")
        with pytest.raises(StorageError, match=r"promoting step 2 to .*step-000000000002 failed") as err:
            h2.wait("durable")
        # Failed by the bounded attempts, not by outwaiting the store (that would take the 60 s).
        assert "durable_timeout_s" not in str(err.value), err.value
        assert proxy.faults["outage"] > 0
        with pytest.raises(ckptstore.CheckpointError, match=r"background save \(step 2\) failed"):
            store.save(3, _state(3))
        proxy.clear()
        store.save(4, _state(4)).wait("durable")
    assert s3_pending_uploads(s3, s3["prefix"]) == []
    step2: dict = {"w": None, "b": None}
    ckptstore.load_sharded(step2, local / "step-000000000002")
    assert_same(step2, _state(2), "local copy of step 2")

    wipe_ram(job)
    target = {"w": torch.zeros(3 << 20), "b": torch.zeros(7, dtype=torch.int64)}
    with CheckpointStore(job, durable=url, storage_options=s3["storage_options"]) as store:
        assert store.restore(target) == 4
    assert_same(target, _state(4))


def test_restore_during_an_outage_uses_the_local_copy(s3, proxy, job, tmp_path):
    """The durable tier down at restore time: listing it fails with a warning, not a raw HTTP
    error, and the step comes from the local tier, bitwise."""
    url = _durable(s3, job)
    local = tmp_path / "local"
    with CheckpointStore(job, local=local, durable=url, durable_every=1,
                         storage_options=s3["storage_options"]) as store:
        store.save(1, _state(1)).wait("durable")
    wipe_ram(job)
    proxy.add("outage")
    target = {"w": torch.zeros(3 << 20), "b": torch.zeros(7, dtype=torch.int64)}
    with CheckpointStore(job, local=local, durable=url, storage_options=_through(s3, proxy, **QUICK)) as store:
        assert store.restore(target) == 1
    assert proxy.faults["outage"] > 0
    assert_same(target, _state(1))
