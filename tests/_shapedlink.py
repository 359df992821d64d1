"""A shaped link for tests and benchmarks: a forwarding HTTP proxy on 127.0.0.1 that limits bandwidth
and adds latency to every request, and logs every request it carries.

    link = ShapedLink(upstream_port=9000, rate=1e9, latency=0.010).start()   # 1 GB/s, 10 ms a request
    opts = {**server.options(), "endpoint": link.endpoint}  # point the client at the link
    ...
    link.stats()        # requests, bytes each way, most requests in flight, busy seconds
    link.stop()

Or from a spec, as the benchmarks take it: ``ShapedLink.parse("1GB/s,10ms", upstream_port)``
(rates in B/s with the SI prefixes k, M, G or the binary Ki, Mi, Gi; latency in ms, us or s;
either may be left out: ``"10GB/s"``, ``"5ms"``).

What it models: a link of `rate` bytes per second in each direction, shared by every connection
(a token bucket per direction, paced in chunks of at most 256 KiB, so a burst is at most that),
and a fixed `latency` per request, spent after the request's headers arrive and before they go on
to the server (the round trip a request costs before its first byte comes back). Connections are
kept alive and forwarded one request at a time (HTTP/1.1 without pipelining, what obstore's client
sends), each client connection with a connection of its own to the server, so concurrency is the
client's.

It understands just enough HTTP/1.1 to find where each request and answer ends (Content-Length,
chunked transfer coding, answers without a body) and forwards the bytes unchanged. A body of known
length goes from socket to socket through a pipe with ``os.splice`` where there is one (Linux): the
kernel moves the bytes, the link's threads only pace them, so the proxy's own cost per byte is small
next to the client's and the emulator's on a machine with few cores. Each request is
logged as a `Request` (method, target, Range header, status, bytes each way, start and end times on
``time.monotonic()``), for request counts, sizes and concurrency over time.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_CHUNK = 256 << 10
_SPLICE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")  # Linux, Python >= 3.10
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}


@dataclass
class Request:
    method: str
    target: str
    range: str | None
    status: int = 0
    sent: int = 0  # request bytes (headers and body), client to server
    received: int = 0  # answer bytes (headers and body), server to client
    start: float = 0.0  # when its headers arrived at the link
    end: float = 0.0  # when the last byte of its answer left the link


class _Bucket:
    """A token bucket of `rate` bytes per second (None: unlimited), shared by the connections of one direction."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._next = 0.0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            at = max(now, self._next)
            self._next = at + n / self.rate
        # The bytes may go at `at`; waiting until they have "crossed" keeps the rate with a one-chunk burst.
        delay = at + n / self.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _Pipe:
    """A pipe for moving bytes from one socket to another with ``os.splice``, without copying them
    into Python."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        try:
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, _CHUNK)  # one chunk fits
        except OSError:  # above /proc/sys/fs/pipe-max-size: the default size, smaller moves
            pass

    def take(self, sock: socket.socket, n: int) -> int:
        """Up to `n` bytes from `sock` into the pipe (as many as have arrived, at least one): how many (0 at its end)."""
        return os.splice(sock.fileno(), self.w, n)

    def give(self, sock: socket.socket, n: int) -> None:
        """The `n` bytes in the pipe out to `sock`."""
        while n:
            n -= os.splice(self.r, sock.fileno(), n)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class _Stream:
    """Buffered reads from a socket, for finding the ends of HTTP messages."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, bytearray()

    def _more(self) -> bool:
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        return True

    def head(self) -> bytes | None:
        """One message's start line and headers (through the blank line); None at a clean end of stream."""
        while True:
            i = self.buf.find(b"\r\n\r\n")
            if i >= 0:
                out = bytes(self.buf[: i + 4])
                del self.buf[: i + 4]
                return out
            if not self._more():
                if self.buf:
                    raise ConnectionError("the stream ended inside a message's headers")
                return None

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[: i + 2])
                del self.buf[: i + 2]
                return out
            if not self._more():
                raise ConnectionError("the stream ended inside a chunked body")

    def some(self, limit: int) -> bytes:
        if not self.buf and not self._more():
            raise ConnectionError("the stream ended inside a body")
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    hdrs: dict[str, str] = {}
    for ln in lines[1:]:
        if ":" in ln:
            k, v = ln.split(":", 1)
            hdrs[k.strip().lower()] = v.strip()
    return lines[0], hdrs


@dataclass
class ShapedLink:
    """A proxy on 127.0.0.1 in front of ``127.0.0.1:upstream_port``: `rate` bytes/s each way (None: no
    limit), `latency` seconds added to each request (see the module docstring)."""

    upstream_port: int
    rate: float | None = None
    latency: float = 0.0
    port: int = 0
    # Name the upstream in each request's Host header instead of the link (fake-gcs-server routes
    # by it); off by default, since S3's signatures cover the Host header as the client sent it.
    rewrite_host: bool = False
    log: list[Request] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # why connections ended other than cleanly
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def parse(cls, spec: str, upstream_port: int) -> ShapedLink:
        """``"1GB/s,10ms"``, ``"10GB/s"``, ``"500MiB/s,2ms"``, ``"5ms"`` -> a link (not started)."""
        rate: float | None = None
        latency = 0.0
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"([\d.]+)\s*([kKmMgG]i?)?B/s", part)
            if m:
                rate = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
                continue
            m = re.fullmatch(r"([\d.]+)\s*(ms|us|s)", part)
            if m:
                latency = float(m.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0}[m.group(2)]
                continue
            raise ValueError(f"link spec {spec!r}: {part!r} is neither a rate (like 1GB/s) nor a latency (like 10ms)")
        return cls(upstream_port, rate, latency)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ShapedLink:
        self._up, self._down = _Bucket(self.rate), _Bucket(self.rate)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="shaped-link", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=10)

    def __enter__(self) -> ShapedLink:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until every request logged so far is answered (a client can have the last byte of an
        answer before the link has written it down); whether that happened within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if all(r.end for r in self.log):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def stats(self, since: float = 0.0) -> dict[str, Any]:
        """Requests (those that started at or after `since`, once answered, waiting up to 10 s for
        those in flight): count, bytes each way, the most in flight at once, and the seconds with at
        least one in flight."""
        self.idle()
        with self._lock:
            reqs = [r for r in self.log if r.start >= since and r.end]
        events = sorted([(r.start, 1) for r in reqs] + [(r.end, -1) for r in reqs])
        peak = cur = 0
        busy = 0.0
        last = 0.0
        for t, d in events:
            if cur:
                busy += t - last
            cur += d
            peak = max(peak, cur)
            last = t
        return {"requests": len(reqs), "sent": sum(r.sent for r in reqs), "received": sum(r.received for r in reqs),
                "peak_in_flight": peak, "busy_s": busy,
                "by_method": {m: sum(1 for r in reqs if r.method == m) for m in sorted({r.method for r in reqs})}}

    # ------------------------------------------------------------------ forwarding

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="shaped-link-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        server = None
        req: Request | None = None
        pipe: _Pipe | None = None
        with self._lock:
            self._conns.add(client)
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=300)
            server.settimeout(None)  # blocking, as os.splice needs; stop() shuts it down to end a wait
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(server)
            cin, sin = _Stream(client), _Stream(server)
            pipe = _Pipe() if _SPLICE else None
            while not self._stopped:
                if not cin.buf:
                    # Idle: a server that closes a kept-alive connection (Azurite does) closes the
                    # client's too, as a direct connection would show it, before any request is lost.
                    ready, _, _ = select.select([client, server], [], [])
                    if server in ready:
                        return
                head = cin.head()
                if head is None:
                    return
                t0 = time.monotonic()
                line, hdrs = _headers(head)
                method, target = [*line.split(" "), "", ""][:2]
                req = Request(method, target, hdrs.get("range"), start=t0)
                with self._lock:
                    self.log.append(req)  # in the log from its start (`end` set once it is answered)
                if self.latency:
                    time.sleep(self.latency)
                if self.rewrite_host:
                    head = re.sub(rb"(?im)^host:[^\r\n]*", b"Host: 127.0.0.1:%d" % self.upstream_port, head, count=1)
                req.sent = self._relay(head, hdrs, cin, server, self._up, has_body=True, pipe=pipe)
                rhead = sin.head()
                if rhead is None:
                    raise ConnectionError("the server closed the connection without answering")
                status_line, rhdrs = _headers(rhead)
                req.status = int(status_line.split(" ")[1])
                bodyless = method == "HEAD" or req.status in (204, 304) or 100 <= req.status < 200
                req.received = self._relay(rhead, rhdrs, sin, client, self._down, has_body=not bodyless, pipe=pipe)
                req.end = time.monotonic()
                if rhdrs.get("connection", "").lower() == "close" or hdrs.get("connection", "").lower() == "close":
                    return
        except (OSError, ConnectionError, ValueError, IndexError) as e:
            if not self._stopped:
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
            return
        finally:
            if pipe is not None:
                pipe.close()
            if req is not None and not req.end:  # cut off: logged as answered now, status 0
                req.end = time.monotonic()
            for s in (client, server):
                if s is not None:
                    with self._lock:
                        self._conns.discard(s)
                    s.close()

    @staticmethod
    def _relay(head: bytes, hdrs: dict[str, str], src: _Stream, dst: socket.socket, bucket: _Bucket,
               has_body: bool, pipe: _Pipe | None = None) -> int:
        """Forward one message (its head already read from `src`) to `dst` at the bucket's rate; its bytes."""
        bucket.take(len(head))
        dst.sendall(head)
        n = len(head)
        if not has_body:
            return n

        def send(data: bytes) -> None:
            bucket.take(len(data))
            dst.sendall(data)

        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            while True:
                size_line = src.line()
                send(size_line)
                n += len(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:  # trailers, then a blank line
                    while True:
                        t = src.line()
                        send(t)
                        n += len(t)
                        if t == b"\r\n":
                            return n
                left = size + 2  # the data and its CRLF
                while left:
                    data = src.some(min(left, _CHUNK))
                    send(data)
                    left -= len(data)
                    n += len(data)
        left = int(hdrs.get("content-length") or 0)
        while left and (src.buf or pipe is None):  # what was read with the head, then all where no splice
            data = src.some(min(left, _CHUNK))
            send(data)
            left -= len(data)
            n += len(data)
        while left:  # the rest from socket to socket in the kernel, paced chunk by chunk
            assert pipe is not None
            k = pipe.take(src.sock, min(left, _CHUNK))
            if not k:
                raise ConnectionError("the stream ended inside a body")
            bucket.take(k)
            pipe.give(dst, k)
            left -= k
            n += k
        return n
