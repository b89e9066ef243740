"""A local S3 endpoint (moto's server on 127.0.0.1, port 0) for the demo and the tests: no cloud account needed."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass
class LocalS3:
    endpoint_url: str
    bucket: str
    _server: Any
    client: Any  # a boto3 S3 client for the endpoint

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
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


def start_local_s3(bucket: str = "ckptstore", *, own_process: bool = False) -> LocalS3:
    """Start moto's S3 server on a free loopback port and create ``bucket`` in it (in a thread of
    this process, or with ``own_process=True`` in a process of its own)."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the local S3 server needs moto: pip install 'moto[server]' boto3") from exc
    # werkzeug logs every request of the server to stderr.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server: Any
    if own_process:
        server = _ServerProcess()
    else:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    client.create_bucket(Bucket=bucket)
    return LocalS3(endpoint_url=endpoint, bucket=bucket, _server=server, client=client)
