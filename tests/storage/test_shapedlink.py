"""The shaped link (tests/_shapedlink.py) between cairn and real servers (moto, Azurite,
fake-gcs-server): it carries every request unchanged (but for the Host header, with
rewrite_host), and its limits hold: no transfer beats the rate, no request the latency.

Only lower bounds are asserted (the link guarantees them whatever the machine's load); how close
cairn gets to the link's rate is a benchmark's question (benchmarks/probes/objstore.py --link).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import cairn
from _shapedlink import ShapedLink

MiB = 1 << 20

pytest.importorskip("obstore")


@pytest.fixture(params=["s3", "azure"])
def server(request):
    return request.getfixturevalue(request.param)


def _through(server, link: ShapedLink) -> dict:
    return {**server.options(), "endpoint": link.endpoint}


def test_parse_reads_rates_and_latencies():
    link = ShapedLink.parse("1GB/s,10ms", 1)
    assert (link.rate, link.latency) == (1e9, 0.010)
    assert ShapedLink.parse("10GB/s", 1).rate == 10e9
    assert ShapedLink.parse("500MiB/s, 250us", 1).rate == 500 * MiB
    assert ShapedLink.parse("500MiB/s, 250us", 1).latency == pytest.approx(250e-6)
    assert ShapedLink.parse("5ms", 1).rate is None
    with pytest.raises(ValueError, match="neither a rate"):
        ShapedLink.parse("fast", 1)


def test_cairn_round_trip_through_the_link_and_its_log(server, tmp_path):
    """A save and a load through the link: same bytes back, every request logged with its sizes."""
    with ShapedLink(server.port) as link:
        bucket = server.new_bucket()
        path = server.url(bucket, "ck")
        x = np.random.default_rng(0).standard_normal((6 * MiB) // 4, dtype=np.float32)
        cairn.save(path, {"x": x, "y": np.arange(10)}, storage_options=_through(server, link), compression=False)
        saved = link.stats()
        got = cairn.load(path, storage_options=_through(server, link))
        np.testing.assert_array_equal(got["x"], x)
        np.testing.assert_array_equal(got["y"], np.arange(10))
        everything = link.stats()
    assert saved["sent"] >= x.nbytes  # the array's bytes went up through the link
    assert everything["received"] - saved["received"] >= x.nbytes  # and came back through it
    assert everything["by_method"].get("GET", 0) >= 1 and saved["by_method"].get("PUT", 0) >= 1
    assert all(r.status < 500 for r in link.log), [(r.method, r.target, r.status) for r in link.log]
    assert not link.errors


def test_rate_limit_holds_for_a_read_and_a_write(server):
    """8 MiB up and 8 MiB down at 16 MiB/s: each takes at least half a second."""
    import obstore

    from cairn._storage.obstore import ObjectStorage

    rate = 16 * MiB
    with ShapedLink(server.port, rate=rate) as link:
        bucket = server.new_bucket()
        storage = ObjectStorage(server.url(bucket, ""), _through(server, link))
        data = os.urandom(8 * MiB)
        t0 = time.monotonic()
        storage.put("blob", data)
        up = time.monotonic() - t0
        t0 = time.monotonic()
        back = bytes(obstore.get(storage.store, "blob").bytes())
        down = time.monotonic() - t0
    assert back == data
    assert up >= len(data) / rate * 0.99, up
    assert down >= len(data) / rate * 0.99, down
    # The link is shared: two reads at once take as long as their bytes together.
    with ShapedLink(server.port, rate=rate) as link:
        storage = ObjectStorage(server.url(bucket, ""), _through(server, link))
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            sizes = list(pool.map(lambda _: len(obstore.get(storage.store, "blob").bytes()), range(2)))
        both = time.monotonic() - t0
    assert sizes == [len(data)] * 2
    assert both >= 2 * len(data) / rate * 0.99, both


def test_latency_holds_per_request(server):
    """Every request waits `latency` before it reaches the server: 10 small reads one after another
    take at least 10 latencies, and the log shows each of them."""
    from cairn._storage.obstore import ObjectStorage

    latency = 0.05
    with ShapedLink(server.port, latency=latency) as link:
        bucket = server.new_bucket()
        storage = ObjectStorage(server.url(bucket, ""), _through(server, link))
        storage.put("small", b"x" * 100)
        t0 = time.monotonic()
        for _ in range(10):
            assert storage.read("small") == b"x" * 100
        took = time.monotonic() - t0
        stats = link.stats(since=t0)
        reads = [r for r in link.log if r.start >= t0]
    assert took >= 10 * latency * 0.99, took
    assert stats["requests"] == 10 and stats["by_method"] == {"GET": 10}
    assert all(r.end - r.start >= latency * 0.99 for r in reads)


def test_gcs_load_through_the_link_with_the_host_rewritten(gcs, tmp_path):
    """fake-gcs-server routes its XML API by the Host header: with `rewrite_host` the link names the
    server there, and a load of a checkpoint in GCS goes through it whole."""
    import json

    x = np.random.default_rng(2).standard_normal((3 * MiB) // 4, dtype=np.float32)
    cairn.save(str(tmp_path / "ck"), {"x": x}, compression=False)
    bucket = gcs.new_bucket("link")
    gcs.upload_tree(bucket, "ck", str(tmp_path / "ck"))
    with ShapedLink(gcs.port, rewrite_host=True) as link:
        key = json.loads(gcs.options()["service_account_key"])
        opts = {**gcs.options(), "service_account_key": json.dumps({**key, "gcs_base_url": link.endpoint})}
        got = cairn.load(gcs.url(bucket, "ck"), storage_options=opts)
        np.testing.assert_array_equal(got["x"], x)
        stats = link.stats()
    assert stats["received"] >= x.nbytes and stats["by_method"].get("GET", 0) >= 1  # the data came through it
    assert all(r.status == 200 or r.status == 206 for r in link.log), [(r.method, r.target, r.status) for r in link.log]
    assert not link.errors
