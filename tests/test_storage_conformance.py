"""One conformance suite for every storage backend.

`StorageConformance` states what the save and load engines rely on; each
backend's test class only says how to build a fresh, empty storage. The
object-store backend runs against a real S3 server (moto, on 127.0.0.1).
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from cairn._storage import LocalStorage, MemoryStorage, RandomReader, Storage

MiB = 1 << 20


class StorageConformance:
    """Behaviour every backend must have. Subclasses provide the `storage` fixture."""

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError

    # -------------------------------------------------------------- small objects

    def test_is_a_storage(self, storage):
        assert isinstance(storage, Storage)
        assert isinstance(storage.atomic_rename, bool)
        assert "ck/manifest.json" in storage.describe("ck/manifest.json")

    def test_put_then_read(self, storage):
        storage.put("ck/a.json", b'{"x": 1}')
        assert storage.read("ck/a.json") == b'{"x": 1}'
        assert storage.size("ck/a.json") == 8
        storage.put("ck/a.json", b"[]")  # a plain put replaces
        assert storage.read("ck/a.json") == b"[]"

    def test_put_create_fails_if_present_and_keeps_the_first(self, storage):
        storage.put("ck/manifest.json", b"first", create=True)
        with pytest.raises(FileExistsError):
            storage.put("ck/manifest.json", b"second", create=True)
        assert storage.read("ck/manifest.json") == b"first"

    def test_racing_creates_have_one_winner(self, storage):
        n = 8
        barrier = threading.Barrier(n, timeout=30)
        won: list[int] = []
        lost: list[int] = []

        def race(i: int) -> None:
            barrier.wait()
            try:
                storage.put("race/manifest.json", f"writer {i}".encode(), create=True)
                won.append(i)
            except FileExistsError:
                lost.append(i)

        threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert len(won) == 1 and len(lost) == n - 1
        assert storage.read("race/manifest.json") == f"writer {won[0]}".encode()

    def test_missing_objects(self, storage):
        with pytest.raises(FileNotFoundError):
            storage.read("nope/x")
        with pytest.raises(FileNotFoundError):  # at the open, or at the latest on the first read
            storage.open_read("nope/x").read_into(0, memoryview(bytearray(1)))
        with pytest.raises(FileNotFoundError):
            storage.size("nope/x")
        assert not storage.exists("nope/x")
        assert not storage.exists("nope")

    def test_keys_with_escapes_and_spaces(self, storage):
        # Checkpointable folders are percent-escaped ("%root", "a%2Eb"); keys must round-trip as is.
        keys = ["c/%root/p00000-0.ab12.bin", "c/a%2Eb%7E/index.ab12.json", "c/with space/x"]
        for i, k in enumerate(keys):
            storage.put(k, bytes([i]))
        assert storage.list("c") == sorted(keys)
        assert storage.list_dir("c") == sorted(["%root", "a%2Eb%7E", "with space"])
        for i, k in enumerate(keys):
            assert storage.read(k) == bytes([i])

    # -------------------------------------------------------------- streamed writes

    def test_write_parts_in_order(self, storage):
        parts = [b"ab", bytearray(b"cd"), memoryview(b"efg"), np.arange(4, dtype=np.uint8)]
        n = storage.write("ck/d/p0.bin", parts)
        assert n == 11
        assert storage.read("ck/d/p0.bin") == b"abcdefg" + bytes(range(4))
        assert storage.size("ck/d/p0.bin") == 11

    def test_write_accepts_a_generator_and_no_parts(self, storage):
        assert storage.write("ck/empty.bin", iter([])) == 0
        assert storage.read("ck/empty.bin") == b""
        assert storage.write("ck/gen.bin", (bytes([i]) * 3 for i in range(3))) == 9
        assert storage.read("ck/gen.bin") == b"\x00\x00\x00\x01\x01\x01\x02\x02\x02"

    def test_large_write_and_ranged_reads(self, storage):
        # Bigger than the object store's multipart part size in these tests (5 MiB).
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, 13 * MiB + 12345, dtype=np.uint8)
        parts = (memoryview(data[i : i + 3 * MiB]) for i in range(0, len(data), 3 * MiB))
        assert storage.write("big/p0.bin", parts) == len(data)
        assert storage.size("big/p0.bin") == len(data)
        r = storage.open_read("big/p0.bin")
        assert isinstance(r, RandomReader)
        try:
            for start, n in [(0, 10), (5 * MiB - 3, 7), (123, 6 * MiB + 17), (len(data) - 5, 5), (0, len(data))]:
                out = np.empty(n, np.uint8)
                r.read_into(start, memoryview(out))
                np.testing.assert_array_equal(out, data[start : start + n])
        finally:
            r.close()

    def test_read_into_typed_buffer_and_eof(self, storage):
        values = np.arange(1000, dtype=np.float32)
        storage.write("ck/f.bin", [memoryview(values.view(np.uint8))])
        r = storage.open_read("ck/f.bin")
        try:
            out = np.zeros(10, np.float32)
            r.read_into(40, memoryview(out.view(np.uint8)))
            np.testing.assert_array_equal(out, values[10:20])
            r.read_into(4000, memoryview(bytearray(0)))  # an empty read at the end is fine
            with pytest.raises(EOFError):
                r.read_into(3996, memoryview(bytearray(8)))
            with pytest.raises(EOFError):
                r.read_into(5000, memoryview(bytearray(1)))
        finally:
            r.close()

    def test_reader_declares_what_it_can_do(self, storage):
        """`size` (None or the true size) and `read_into_many` (vectored or not, it reads the same)."""
        data = bytes(range(256)) * 40
        storage.write("ck/many.bin", [data])
        r = storage.open_read("ck/many.bin")
        try:
            assert isinstance(r.vectored, bool)
            assert r.size is None or r.size == len(data)
            outs = [np.empty(n, np.uint8) for n in (3, 0, 4096, 17)]
            r.read_into_many(5, [memoryview(o) for o in outs])
            assert b"".join(o.tobytes() for o in outs) == data[5 : 5 + 3 + 4096 + 17]
            with pytest.raises(EOFError):
                r.read_into_many(len(data) - 4, [memoryview(bytearray(3)), memoryview(bytearray(3))])
        finally:
            r.close()

    # -------------------------------------------------------------- listing

    def test_exists_for_objects_and_folders(self, storage):
        storage.put("run/step_1/manifest.json", b"{}")
        assert storage.exists("run/step_1/manifest.json")
        assert storage.exists("run/step_1")
        assert storage.exists("run")
        assert not storage.exists("run/step_2")
        assert not storage.exists("run/step")  # a prefix of a name is not a folder

    def test_list_is_recursive_relative_and_sorted(self, storage):
        for k in ["s/b/2", "s/a", "s/b/1", "s/b/c/3", "sibling/x", "s2/y"]:
            storage.put(k, b"x")
        assert storage.list("s") == ["s/a", "s/b/1", "s/b/2", "s/b/c/3"]
        assert storage.list("s/b") == ["s/b/1", "s/b/2", "s/b/c/3"]
        assert storage.list("missing") == []
        assert set(storage.list("")) >= {"s/a", "sibling/x", "s2/y"}

    def test_list_dir_gives_immediate_children(self, storage):
        for k in ["d/f1", "d/sub/f2", "d/sub/deeper/f3", "d/f0", "dd/x"]:
            storage.put(k, b"x")
        assert storage.list_dir("d") == ["f0", "f1", "sub"]
        assert storage.list_dir("d/sub") == ["deeper", "f2"]
        assert storage.list_dir("nothing") == []
        assert {"d", "dd"} <= set(storage.list_dir(""))

    # -------------------------------------------------------------- deletes

    def test_delete_prefix(self, storage):
        for k in ["run/step_1/manifest.json", "run/step_1/%root/p0.bin", "run/step_10/manifest.json",
                  "run/step_1x"]:
            storage.put(k, b"x")
        storage.delete_prefix("run/step_1")
        assert storage.list("run") == ["run/step_10/manifest.json", "run/step_1x"]
        assert not storage.exists("run/step_1")
        storage.delete_prefix("run/step_1")  # deleting what is gone is not an error
        storage.delete_prefix("run/step_1x")  # nor is deleting a single object
        assert storage.list("run") == ["run/step_10/manifest.json"]


class TestLocalStorage(StorageConformance):
    @pytest.fixture
    def storage(self, tmp_path):
        return LocalStorage(str(tmp_path / "root"))


class TestMemoryStorage(StorageConformance):
    @pytest.fixture
    def storage(self):
        return MemoryStorage(f"memory://conf-{uuid.uuid4().hex}")



@pytest.fixture(scope="module")
def bucket(s3):
    return s3.new_bucket("conformance")


class TestObjectStorage(StorageConformance):
    @pytest.fixture
    def storage(self, s3, bucket):
        from cairn._storage._obstore import ObjectStorage

        # Small parts so the tests cross part boundaries on both paths.
        opts = s3.options(part_size=5 * MiB, read_part_size=1 * MiB, read_concurrency=3)
        return ObjectStorage(f"s3://{bucket}/{uuid.uuid4().hex}", opts)

    def test_options_from_environment(self, s3, bucket, monkeypatch):
        """Credentials and the endpoint can come from the usual AWS variables alone."""
        from cairn._storage import open_storage

        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
        storage = open_storage(f"s3://{bucket}/env")
        storage.put("k", b"from env")
        assert storage.read("k") == b"from env"
        assert s3.keys(bucket, "env/") == ["env/k"]

    def test_stored_under_the_prefix(self, s3, bucket, storage):
        storage.put("ck/manifest.json", b"{}")
        prefix = storage.url.split(f"s3://{bucket}/", 1)[1]
        assert s3.keys(bucket, prefix + "/") == [f"{prefix}/ck/manifest.json"]
