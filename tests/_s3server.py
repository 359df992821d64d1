"""A real S3 server for tests: moto's threaded server on 127.0.0.1, plus a fault proxy.

`S3Server` runs ``moto.server.ThreadedMotoServer`` on a free loopback port.
Every moto server in one process shares moto's in-memory backend, so a
bucket created through one server is visible through any other: a test can
stop its own server mid-save and inspect what was left through another one.

`FaultProxy` sits between a client and the server and forwards HTTP requests
one by one; a test tells it to answer some of them with an error status
(5xx, throttling) or to stop accepting connections, to exercise retries and
outages without touching moto.
"""

from __future__ import annotations

import http.client
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ACCESS_KEY = "cairn-test-key"
SECRET_KEY = "cairn-test-secret"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def storage_options(endpoint: str, **extra: Any) -> dict[str, Any]:
    """The `storage_options` that point cairn at `endpoint` with the test credentials."""
    opts: dict[str, Any] = {
        "endpoint": endpoint,
        "region": REGION,
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        "allow_http": True,
    }
    opts.update(extra)
    return opts


class S3Server:
    """moto's S3 server on 127.0.0.1 (in this process, in its own threads).

    It has the surface every test server has (see `_servers`): `url`, `options`,
    `env`, `new_bucket`, and raw `keys` / `get_object` / `put_object` / `delete_object`.
    """

    name = "moto"
    scheme = "s3"

    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        self.port = port or free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        self._server.start()
        self.running = True
        return self

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def client(self) -> Any:
        """A boto3 client (moto depends on boto3) for setting up buckets and checking raw state."""
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
        )

    def new_bucket(self, prefix: str = "cairn") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key in `bucket` under `prefix`, straight from the server."""
        out: list[str] = []
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            out.extend(o["Key"] for o in page.get("Contents", []))
        return sorted(out)

    def parts(self, bucket: str, key: str) -> int:
        """How many parts the object was uploaded in (S3 marks a multipart object's ETag with it)."""
        etag = self.client().head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1

    def open_uploads(self, bucket: str) -> int:
        """How many multipart uploads are in progress in `bucket`."""
        return len(self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))

    def options(self, **extra: Any) -> dict[str, Any]:
        return storage_options(self.endpoint, **extra)

    def url(self, bucket: str, path: str = "") -> str:
        return f"s3://{bucket}/{path}".rstrip("/")

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION, "AWS_ALLOW_HTTP": "true"}

    def get_object(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def delete_object(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)


@dataclass
class Fault:
    """Answer the next `times` requests that match with `status` (and an S3 error body)."""

    status: int
    times: int
    method: str | None = None
    path_contains: str | None = None
    query_contains: str | None = None
    #: Forward the request first and lose the server's answer (the request took effect).
    after_forward: bool = False
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.hits >= self.times:
            return False
        base, _, query = path.partition("?")
        if self.method is not None and method != self.method:
            return False
        if self.path_contains is not None and self.path_contains not in base:
            return False
        return not (self.query_contains is not None and self.query_contains not in query)


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate"}


@dataclass
class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of `upstream` (``host:port``) that can inject faults."""

    upstream_port: int
    port: int = field(default_factory=free_port)
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)  # (method, path, status)
    #: While set, every request is dropped without an answer (the server looks gone).
    down: bool = False
    #: Called (in the proxy's thread) with (method, path) before each request is forwarded.
    on_request: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self, **extra: Any) -> dict[str, Any]:
        return storage_options(self.endpoint, **extra)

    def fail(self, status: int = 503, times: int = 1, *, method: str | None = None,
             path_contains: str | None = None, query_contains: str | None = None,
             after_forward: bool = False) -> Fault:
        f = Fault(status, times, method, path_contains, query_contains, after_forward)
        with self._lock:
            self.faults.append(f)
        return f

    def injected(self) -> int:
        with self._lock:
            return sum(f.hits for f in self.faults)

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if proxy.down:
                    self.close_connection = True
                    return
                if proxy.on_request is not None:
                    proxy.on_request(self.command, self.path)
                fault = None
                with proxy._lock:
                    for f in proxy.faults:
                        if f.matches(self.command, self.path):
                            f.hits += 1
                            fault = f
                            break
                if fault is not None and fault.after_forward:
                    self._forward(body)  # reaches the server; its answer is dropped below
                if fault is not None:
                    code = "SlowDown" if fault.status == 503 else "InternalError"
                    payload = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                               f"<Message>injected by the test proxy</Message></Error>").encode()
                    self._reply(fault.status, [("Content-Type", "application/xml")], payload)
                    return
                status, hdrs, data = self._forward(body)
                # A HEAD answer's Content-Length is the object's size, not the (empty) body's.
                keep_length = self.command == "HEAD"
                hdrs = [(k, v) for k, v in hdrs if keep_length or k.lower() != "content-length"]
                self._reply(status, hdrs, data, send_length=not keep_length)

            def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    hdrs = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
                    return resp.status, hdrs, data
                finally:
                    conn.close()

            def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes,
                       send_length: bool = True) -> None:
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, status))
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                if send_length:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.down = True  # handler threads on kept-alive connections outlive shutdown()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
