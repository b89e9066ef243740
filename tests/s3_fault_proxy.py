"""A fault-injecting HTTP proxy in front of the local S3 server (moto), for the object-store fault tests.

A real TCP server on 127.0.0.1 (port chosen by the OS): s3fs talks to it exactly as it talks to S3
(``endpoint_url``), and each request is forwarded to moto unless a rule says otherwise. Rules pick
requests by their S3 operation (``UploadPart``, ``CompleteMultipartUpload``, ``PutObject``,
``GetObject``, ...) and apply one fault:

- ``slowdown``: answer 503 with S3's ``SlowDown`` XML error body, without forwarding;
- ``reset_request``: read the headers and part of the body, then reset the connection (RST);
- ``reset_response``: forward, then send half of the response and reset the connection;
- ``delay``: wait ``seconds`` before forwarding;
- ``hold``: keep the request unanswered until :meth:`FaultProxy.release` (or the client gives up);
- ``outage``: reset the connection as soon as the request line and headers are read.

A rule applies to the next ``count`` matching requests, or to a ``fraction`` of them (seeded), or
to all of them; ``where`` narrows it to paths containing a string. Every request is counted by
operation in :attr:`FaultProxy.counts`, whatever happened to it, so a test can prove how many
times a client tried.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>FAULTPROXY</RequestId></Error>"
)
ACTIONS = ("slowdown", "reset_request", "reset_response", "delay", "hold", "outage")


def operation(method: str, target: str, headers: dict[str, str]) -> str:
    """The S3 operation of a request, from its method, path and query."""
    parsed = urllib.parse.urlsplit(target)
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
    has_key = parsed.path.strip("/").count("/") >= 1  # /bucket/key... (path-style addressing)
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPart"
        if "x-amz-copy-source" in headers:
            return "CopyObject"
        return "PutObject" if has_key else "CreateBucket"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        if "delete" in query:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    if method == "GET":
        if "uploads" in query:
            return "ListMultipartUploads"
        if "uploadId" in query:
            return "ListParts"
        return "GetObject" if has_key else "ListObjects"
    return method


@dataclass
class Rule:
    action: str
    kinds: frozenset[str] | None = None  # None: every operation
    count: int | None = None  # apply to this many matching requests, then stop
    fraction: float = 1.0
    seconds: float = 0.0  # for delay
    where: str | None = None  # only requests whose path contains this
    hits: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def matches(self, kind: str, target: str) -> bool:
        if self.kinds is not None and kind not in self.kinds:
            return False
        if self.where is not None and self.where not in target:
            return False
        if self.count is not None and self.hits >= self.count:
            return False
        if self.fraction < 1.0 and self.rng.random() >= self.fraction:
            return False
        self.hits += 1
        return True


class FaultProxy:
    """See the module docstring. Use as a context manager, or call :meth:`close`."""

    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.faults: collections.Counter[str] = collections.Counter()  # (action) -> how many applied
        self.log: list[tuple[str, str, str]] = []  # (operation, path, what happened)
        self.held = threading.Event()  # set when a request is being held
        self._release = threading.Event()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._upstream: dict[socket.socket, http.client.HTTPConnection] = {}
        self.active = 0  # requests between their headers and their answer (held ones included)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)  # so that close() is noticed: closing does not wake accept()
        self.endpoint_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, name="s3-fault-proxy", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ control

    def add(self, action: str, kinds: str | tuple[str, ...] | None = None, *, count: int | None = None,
            fraction: float = 1.0, seconds: float = 0.0, seed: int = 0, where: str | None = None) -> Rule:
        if action not in ACTIONS:
            raise ValueError(f"unknown fault {action!r}; one of {ACTIONS}")
        if isinstance(kinds, str):
            kinds = (kinds,)
        rule = Rule(action, frozenset(kinds) if kinds else None, count, fraction, seconds, where,
                    rng=random.Random(seed))
        with self.lock:
            self.rules.append(rule)
        if action == "hold":
            self._release.clear()
        return rule

    def clear(self) -> None:
        """Remove every rule and let held requests go on."""
        with self.lock:
            self.rules.clear()
        self.release()

    def release(self) -> None:
        self._release.set()
        self.held.clear()

    def reset_counts(self) -> None:
        with self.lock:
            self.counts.clear()
            self.faults.clear()
            self.log.clear()

    def close(self) -> None:
        self._closing = True
        self.release()
        self.sock.close()
        with self.lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the thread serving it
            except OSError:
                pass
        self.thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ serving

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self.lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _rule(self, kind: str, target: str) -> Rule | None:
        with self.lock:
            self.counts[kind] += 1
            for rule in self.rules:
                if rule.matches(kind, target):
                    self.faults[rule.action] += 1
                    return rule
        return None

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                line = reader.readline(65537)
                if not line:
                    return
                method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
                headers: list[tuple[str, str]] = []
                while True:
                    h = reader.readline(65537)
                    if h in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = h.decode("latin-1").partition(":")
                    headers.append((name.strip(), value.strip()))
                lower = {k.lower(): v for k, v in headers}
                kind = operation(method, target, lower)
                rule = self._rule(kind, target)
                action = rule.action if rule else None
                self.log.append((kind, target, action or "forwarded"))
                with self.lock:
                    self.active += 1
                try:
                    if not self._handle(conn, reader, method, target, headers, lower, rule, action):
                        return
                finally:
                    with self.lock:
                        self.active -= 1
        except (OSError, ValueError, http.client.HTTPException):
            _reset(conn)
        finally:
            with self.lock:
                self._conns.discard(conn)
            if self._upstream.get(conn) is not None:
                self._upstream.pop(conn).close()
            reader.close()
            conn.close()

    def _handle(self, conn, reader, method, target, headers, lower, rule, action) -> bool:
        """Answer one request; False when the connection is finished."""
        if action == "outage":
            _reset(conn)
            return False
        if action == "hold":
            self.held.set()
            while not self._release.wait(0.05):
                if self._closing:
                    _reset(conn)
                    return False
            self.held.clear()
        expect = lower.get("expect", "").lower() == "100-continue"
        if action == "reset_request":
            if expect:
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            reader.read(min(int(lower.get("content-length", "0") or 0) // 2, 1 << 20))
            _reset(conn)
            return False
        if action == "slowdown":
            if not expect:
                _read_body(reader, lower)  # so the connection stays usable for the next request
            conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                         + f"Content-Length: {len(SLOWDOWN_BODY)}\r\n\r\n".encode() + SLOWDOWN_BODY)
            # With Expect: 100-continue the client never sent the body: the connection is out of
            # step, so it is closed, as S3 does.
            return not expect
        if expect:
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = _read_body(reader, lower)
        if action == "delay":
            time.sleep(rule.seconds)
        upstream = self._upstream.get(conn)
        if upstream is None:
            upstream = self._upstream[conn] = http.client.HTTPConnection(*self.upstream, timeout=60)
        fwd = {k: v for k, v in headers if k.lower() not in ("expect", "transfer-encoding", "connection",
                                                                "content-length")}
        fwd["Content-Length"] = str(len(body))
        upstream.request(method, target, body=body, headers=fwd)
        resp = upstream.getresponse()
        data = resp.read()
        out = [f"HTTP/1.1 {resp.status} {resp.reason}\r\n".encode()]
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                out.append(f"{k}: {v}\r\n".encode("latin-1"))
        length = int(resp.getheader("Content-Length") or len(data)) if method == "HEAD" else len(data)
        out.append(f"Content-Length: {length}\r\n\r\n".encode())
        payload = b"".join(out) + (b"" if method == "HEAD" else data)
        if action == "reset_response":
            conn.sendall(payload[: max(1, len(payload) // 2)])
            _reset(conn)
            return False
        conn.sendall(payload)
        return True


def _read_body(reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(reader.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while reader.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            parts.append(reader.read(size))
            reader.readline()
    return reader.read(int(headers.get("content-length", "0") or 0))


def _reset(conn: socket.socket) -> None:
    """Close with RST rather than FIN: the peer sees 'connection reset', as when a server dies."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass
