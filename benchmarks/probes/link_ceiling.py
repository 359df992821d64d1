"""What the shaped link (tests/_shapedlink.py) carries by itself: GETs and PUTs of 64 MiB bodies
through it, unshaped, against the same transfers straight to the upstream, in one run.

    python -m benchmarks.probe link_ceiling                 # 4 transfers of 64 MiB at once, 5 repetitions
    python -m benchmarks.probe link_ceiling --spec 1GB/s,10ms

The upstream is a minimal HTTP/1.1 server on 127.0.0.1 that answers a GET with a body from memory
and drains a PUT's body (``socket.sendall`` / ``recv_into``: the kernel's cost, little of
Python's), and the client reads answers into one preallocated buffer with ``readinto``, so what
the link adds shows next to as little else as possible. An emulator (moto, Azurite) serves far
less than this on the same machine (see docs/performance-objstore.md).
"""

from __future__ import annotations

import argparse
import http.client
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 1 << 20


class _Upstream:
    """GET: `size` bytes of zeros; PUT: the body read and dropped; both 200, kept alive."""

    def __init__(self, size: int) -> None:
        self.body = bytes(size)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        pending = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                left = int(hdrs.get("content-length", 0)) - len(pending)
                pending = b"" if left >= 0 else pending[left:]
                view = memoryview(buf)
                while left > 0:
                    n = conn.recv_into(view, min(left, len(buf)))
                    if not n:
                        return
                    left -= n
                if lines[0].startswith("GET"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body))
                    conn.sendall(self.body)
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def stop(self) -> None:
        self.sock.close()


def _transfers(port: int, method: str, n: int, size: int, into: list[bytearray], body: bytes) -> float:
    """Seconds for `n` transfers at once, each on a kept-alive connection of its own."""
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=120) for _ in range(n)]

    def one(i: int) -> None:
        c = conns[i]
        c.request(method, f"/o{i}", body=body if method == "PUT" else None)
        r = c.getresponse()
        view, got = memoryview(into[i]), 0
        while True:
            k = r.readinto(view[got:])
            if not k:
                break
            got += k
        assert r.status == 200 and got == (size if method == "GET" else 0), (r.status, got)

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))  # warm: connections open
        t0 = time.perf_counter()
        list(pool.map(one, range(n)))
        took = time.perf_counter() - t0
    for c in conns:
        c.close()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="", help="the link's shape (default: none, its own ceiling)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from _shapedlink import ShapedLink

    size = a.size_mib * MiB
    up = _Upstream(size)
    link = ShapedLink.parse(a.spec, up.port).start()
    into = [bytearray(size) for _ in range(a.streams)]
    body = bytes(size)
    total = a.streams * size
    try:
        times: dict[str, list[float]] = {}
        for _rep in range(a.reps):
            for name, port, method in (("direct GET", up.port, "GET"), ("link GET", link.port, "GET"),
                                       ("direct PUT", up.port, "PUT"), ("link PUT", link.port, "PUT")):
                times.setdefault(name, []).append(_transfers(port, method, a.streams, size, into, body))
        print(f"{a.streams} x {a.size_mib} MiB at once, link {a.spec or 'unshaped'}, median of {a.reps}:")
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in med.items():
            print(f"  {k:12s} {v:7.3f} s  {total / v / 1e9:6.2f} GB/s")
        print(f"  link / direct: GET {med['direct GET'] / med['link GET']:.2f}, "
              f"PUT {med['direct PUT'] / med['link PUT']:.2f} of the direct rate")
    finally:
        link.stop()
        up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
