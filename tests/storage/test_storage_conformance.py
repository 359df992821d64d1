"""One conformance suite for every storage backend.

`StorageConformance` states what the save and load engines rely on; each
backend's test class only says how to build a fresh, empty storage. The
object-store backend runs against real servers on 127.0.0.1: S3 (moto),
Azure Blob (Azurite) and GCS (fake-gcs-server). fake-gcs-server takes none
of obstore's writes, so on GCS the objects a test only reads are put there
through the server's own JSON API (`seed`), and the tests of writes skip,
each saying why (`unsupported`).
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from _servers import GCS_NO_WRITES
from cairn._storage import LocalStorage, MemoryStorage, PartReader, RandomReader, Storage

MiB = 1 << 20


class StorageConformance:
    """Behaviour every backend must have. Subclasses provide the `storage` fixture."""

    #: Tests this backend's server cannot run: test name -> why (shown as the skip reason).
    unsupported: dict[str, str] = {}
    #: Which of the load's route defaults (`_plan.routes.STORAGE_DEFAULTS`) this backend gets.
    route_kind: str

    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError

    @pytest.fixture(autouse=True)
    def _supported(self, request):
        reason = self.unsupported.get(request.node.originalname)
        if reason:
            pytest.skip(reason)

    def seed(self, storage: Storage, key: str, data: bytes) -> None:
        """Put an object that the test then reads: through the storage, unless the server cannot take that."""
        storage.put(key, data)

    # -------------------------------------------------------------- small objects

    def test_is_a_storage(self, storage):
        assert isinstance(storage, Storage)
        assert isinstance(storage.atomic_rename, bool)

    def test_declares_its_capabilities(self, storage):
        """What the engines ask a storage instead of guessing from its class: its kind (and so its
        default bandwidth, which `compression="auto"` prices against) and whether it renames folders
        atomically, which only a POSIX filesystem does (the rename commit needs `LocalDirs`)."""
        from cairn._storage import LocalDirs
        from cairn._storage.base import DEFAULT_BANDWIDTH, KINDS, bandwidth_of

        assert storage.kind in KINDS
        assert storage.bandwidth is None and bandwidth_of(storage) == DEFAULT_BANDWIDTH[storage.kind] > 0
        assert storage.atomic_rename == (storage.kind != "object")
        assert not storage.atomic_rename or isinstance(storage, LocalDirs)
        # Folder operations are declared, not found by testing the class: `dirs` exactly where
        # folders rename, and they work.
        assert (storage.dirs is not None) == storage.atomic_rename
        if storage.dirs is not None:
            assert isinstance(storage.dirs, LocalDirs)
            storage.dirs.makedirs("ck/sub")
            assert storage.dirs.is_dir("ck/sub") and storage.dirs.mtime("ck/sub") is not None
        storage.bandwidth = 2e9  # a user's declared figure wins over the kind's default
        assert bandwidth_of(storage) == 2e9
        assert "ck/manifest.json" in storage.describe("ck/manifest.json")

    def test_declares_its_read_capabilities(self, storage):
        # The reader and the dry run ask these instead of testing the storage's class.
        from cairn._load.readonce import storage_kind

        assert isinstance(storage.in_process, bool) and (not storage.in_process or storage.kind == "object")
        assert storage_kind(storage) == self.route_kind  # the load's route defaults (`STORAGE_DEFAULTS`)
        assert storage.preferred_read is None or (isinstance(storage.preferred_read, int) and storage.preferred_read > 0)
        self.seed(storage, "ck/cap.bin", b"abcd")
        reader = storage.open_read("ck/cap.bin")
        try:
            assert storage.vectored_reads is type(reader).vectored
        finally:
            reader.close()

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
            self.seed(storage, k, bytes([i]))
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

    def test_large_write(self, storage):
        # Bigger than the object store's multipart part size in these tests (5 MiB).
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, 13 * MiB + 12345, dtype=np.uint8)
        parts = (memoryview(data[i : i + 3 * MiB]) for i in range(0, len(data), 3 * MiB))
        assert storage.write("big/p0.bin", parts) == len(data)
        assert storage.size("big/p0.bin") == len(data)
        assert storage.read("big/p0.bin") == data.tobytes()
        r = storage.open_read("big/p0.bin")  # ranges of an object written in parts
        try:
            for start, n in [(5 * MiB - 3, 7), (3 * MiB - 1, 5 * MiB + 2)]:
                out = np.empty(n, np.uint8)
                r.read_into(start, memoryview(out))
                np.testing.assert_array_equal(out, data[start : start + n])
        finally:
            r.close()

    def test_a_large_writes_parts_may_read_the_storage(self, storage):
        """Producing a part may read the storage (an incremental save reads its base's block to write
        a delta against it), also in the middle of a multipart upload: obstore iterates a stream on
        its own runtime's thread, where a call into obstore panicked ("Cannot start a runtime from
        within a runtime") until the parts were pulled on a thread of cairn's."""
        self.seed(storage, "base/p0.bin", b"base bytes")
        seen = []

        def parts():
            for i in range(13):
                if i in (1, 7, 12):  # before, inside and at the end of the multipart upload (5 MiB parts)
                    seen.append(storage.read("base/p0.bin"))
                yield bytes([i]) * MiB

        assert storage.write("ck/d/p0.bin", parts()) == 13 * MiB
        assert seen == [b"base bytes"] * 3
        got = storage.read("ck/d/p0.bin")
        assert got == b"".join(bytes([i]) * MiB for i in range(13))

    def test_ranged_reads(self, storage):
        # Reads larger than the object stores' read part in these tests (1 MiB) are split.
        rng = np.random.default_rng(1)
        data = rng.integers(0, 256, 7 * MiB + 12345, dtype=np.uint8)
        self.seed(storage, "big/p0.bin", data.tobytes())
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
        self.seed(storage, "ck/f.bin", values.tobytes())
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
        self.seed(storage, "ck/many.bin", data)
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
        self.seed(storage, "run/step_1/manifest.json", b"{}")
        assert storage.exists("run/step_1/manifest.json")
        assert storage.exists("run/step_1")
        assert storage.exists("run")
        assert not storage.exists("run/step_2")
        assert not storage.exists("run/step")  # a prefix of a name is not a folder

    def test_list_is_recursive_relative_and_sorted(self, storage):
        for k in ["s/b/2", "s/a", "s/b/1", "s/b/c/3", "sibling/x", "s2/y"]:
            self.seed(storage, k, b"x")
        assert storage.list("s") == ["s/a", "s/b/1", "s/b/2", "s/b/c/3"]
        assert storage.list("s/b") == ["s/b/1", "s/b/2", "s/b/c/3"]
        assert storage.list("missing") == []
        assert set(storage.list("")) >= {"s/a", "sibling/x", "s2/y"}

    def test_list_dir_gives_immediate_children(self, storage):
        for k in ["d/f1", "d/sub/f2", "d/sub/deeper/f3", "d/f0", "dd/x"]:
            self.seed(storage, k, b"x")
        assert storage.list_dir("d") == ["f0", "f1", "sub"]
        assert storage.list_dir("d/sub") == ["deeper", "f2"]
        assert storage.list_dir("nothing") == []
        assert {"d", "dd"} <= set(storage.list_dir(""))

    # -------------------------------------------------------------- deletes

    def test_delete_prefix(self, storage):
        for k in ["run/step_1/manifest.json", "run/step_1/%root/p0.bin", "run/step_10/manifest.json",
                  "run/step_1x"]:
            self.seed(storage, k, b"x")
        storage.delete_prefix("run/step_1")
        assert storage.list("run") == ["run/step_10/manifest.json", "run/step_1x"]
        assert not storage.exists("run/step_1")
        storage.delete_prefix("run/step_1")  # deleting what is gone is not an error
        storage.delete_prefix("run/step_1x")  # nor is deleting a single object
        assert storage.list("run") == ["run/step_10/manifest.json"]

    def test_delete_keys(self, storage):
        """Exact keys, in one call (batched requests where the storage declares `batch_deletes`): a
        missing key is no error, and a key is not a prefix (its neighbours stay)."""
        assert isinstance(storage.batch_deletes, bool) and storage.batch_deletes == (
            storage.kind == "object" and not storage.in_process)
        for k in ["ck/a.bin", "ck/b.bin", "ck/a.bin.2", "ck/sub/c.bin"]:
            self.seed(storage, k, b"x")
        storage.delete_keys(["ck/a.bin", "ck/sub/c.bin", "ck/missing.bin"])
        assert storage.list("ck") == ["ck/a.bin.2", "ck/b.bin"]
        storage.delete_keys([])
        assert storage.list("ck") == ["ck/a.bin.2", "ck/b.bin"]


class TestLocalStorage(StorageConformance):
    route_kind = "local"

    @pytest.fixture
    def storage(self, tmp_path):
        return LocalStorage(str(tmp_path / "root"))


class TestMemoryStorage(StorageConformance):
    route_kind = "memory"

    @pytest.fixture
    def storage(self):
        return MemoryStorage(f"memory://conf-{uuid.uuid4().hex}")



class ObjectStoreConformance(StorageConformance):
    """The object-store backend on one server; subclasses provide the `server` fixture."""

    route_kind = "object"

    @pytest.fixture
    def server(self):
        raise NotImplementedError

    @pytest.fixture
    def bucket(self, server):
        return server.new_bucket("conformance")

    @pytest.fixture
    def storage(self, server, bucket):
        from cairn._storage.obstore import ObjectStorage

        # Small parts so the tests cross part boundaries on both paths.
        opts = server.options(part_size=5 * MiB, read_part_size=1 * MiB, read_concurrency=3)
        return ObjectStorage(server.url(bucket, uuid.uuid4().hex), opts)

    #: Put the objects a test reads through the server's own API (it takes no write from obstore).
    seed_out_of_band = False

    def seed(self, storage, key, data):
        if self.seed_out_of_band:
            bucket, prefix = storage.url.split("://", 1)[1].split("/", 1)
            self._server.put_object(bucket, f"{prefix}/{key}", bytes(data))
        else:
            storage.put(key, data)

    @pytest.fixture(autouse=True)
    def _remember_server(self, server):
        self._server = server

    def test_options_from_environment(self, server, bucket, monkeypatch):
        """The endpoint and credentials can come from the usual environment variables alone."""
        from cairn._storage import open_storage

        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        storage = open_storage(server.url(bucket, "env"), {"allow_http": True})
        self.seed(storage, "k", b"from env")
        assert storage.read("k") == b"from env"
        assert storage.list("") == ["k"]
        assert server.keys(bucket, "env/") == ["env/k"]

    def test_deleting_keys_some_of_which_are_gone(self, server, bucket, storage):
        """A delete racing another (two cleanups) finds some keys gone: the rest still go.

        GCS and Azure report a missing key, and obstore stops at the first error.
        """
        import obstore

        from cairn._storage import obstore as _obstore

        keys = [f"gone/k{i:02d}" for i in range(12)]
        for k in keys:
            self.seed(storage, k, b"x")
        prefix = storage.url.split(f"://{bucket}/", 1)[1]
        server.delete_object(bucket, f"{prefix}/{keys[0]}")
        server.delete_object(bucket, f"{prefix}/{keys[5]}")
        _obstore._delete(obstore, storage.store, keys)
        assert storage.list("gone") == []

    def test_reader_reports_each_part_as_it_lands(self, storage):
        """`on_part`: once per ranged GET, the parts tiling the read, each after its bytes landed;
        an exception from it fails the read, unchanged."""
        data = np.random.default_rng(1).integers(0, 256, 5 * MiB + 123, dtype=np.uint8).tobytes()
        self.seed(storage, "ck/parts.bin", data)
        r = storage.open_read("ck/parts.bin")
        assert r.reports_parts and isinstance(r, PartReader)
        outs = [np.zeros(n, np.uint8) for n in (700_000, 3 * MiB, 5 * MiB + 100 - 700_000 - 3 * MiB)]
        flat = [memoryview(o) for o in outs]
        seen: list[tuple[int, int, str, bool]] = []

        def landed(a, b):  # the part's bytes are in `outs` when it is reported
            got = b"".join(o.tobytes() for o in outs)[a - 20 : b - 20]
            seen.append((a, b, threading.current_thread().name, got == data[a:b]))

        r.read_into_many(20, flat, on_part=landed)
        assert b"".join(o.tobytes() for o in outs) == data[20 : 5 * MiB + 120]
        parts = sorted((a, b) for a, b, _, _ in seen)
        assert parts == [(a, min(a + MiB, 5 * MiB + 120)) for a in range(20, 5 * MiB + 120, MiB)]
        assert all(ok for *_, ok in seen)
        assert all(name.startswith("cairn-get") for _, _, name, _ in seen)  # the storage's read pool

        class Bad(Exception):
            pass

        def fail(a, b):
            if a > 20:
                raise Bad(f"part {a}")

        with pytest.raises(Bad, match="part"):
            r.read_into_many(20, flat, on_part=fail)
        one: list[tuple[int, int]] = []  # a read of one part is one GET, in the calling thread
        r.read_into_many(0, [memoryview(np.zeros(1000, np.uint8))], on_part=lambda a, b: one.append((a, b)))
        assert one == [(0, 1000)]
        r.close()

    def test_an_error_of_the_parts_comes_through_and_leaves_no_object(self, storage):
        """A multipart upload whose parts raise is aborted: the error is the parts' own, no object is
        left, and the thread that pulled the parts has ended."""
        class PartFailed(Exception):
            pass

        def parts():
            for i in range(13):
                if i == 9:  # inside a multipart upload
                    raise PartFailed("part 9")
                yield bytes([i]) * MiB

        with pytest.raises(PartFailed, match="part 9"):
            storage.write("ck/d/p1.bin", parts())
        assert "ck/d/p1.bin" not in storage.list("ck")
        assert not any(t.name == "cairn-upload-parts" for t in threading.enumerate())

    def test_stored_under_the_prefix(self, server, bucket, storage):
        self.seed(storage, "ck/manifest.json", b"{}")
        prefix = storage.url.split(f"://{bucket}/", 1)[1]
        assert server.keys(bucket, prefix + "/") == [f"{prefix}/ck/manifest.json"]
        assert server.get_object(bucket, f"{prefix}/ck/manifest.json") == b"{}"


class TestS3Storage(ObjectStoreConformance):
    """moto's S3 server."""

    @pytest.fixture
    def server(self, s3):
        return s3

    def test_aws_variable_names(self, s3, bucket, monkeypatch):
        """AWS's own names for the settings, as boto3 users have them."""
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


class TestAzureStorage(ObjectStoreConformance):
    """Azurite's blob service: ``az://container/prefix``."""

    @pytest.fixture
    def server(self, azure):
        return azure

    @pytest.mark.parametrize("form", ["azure://{c}/{p}", "abfs://{c}@devstoreaccount1.dfs.core.windows.net/{p}",
                                      "https://devstoreaccount1.blob.core.windows.net/{c}/{p}"])
    def test_other_url_forms(self, azure, bucket, form):
        """obstore's other spellings of an Azure location name the same objects as ``az://``."""
        from cairn._storage import open_storage

        storage = open_storage(form.format(c=bucket, p="forms"), azure.options())
        storage.put("k", b"x", create=True)
        assert azure.keys(bucket, "forms/") == ["forms/k"]
        assert open_storage(f"az://{bucket}/forms", azure.options()).read("k") == b"x"
        storage.delete_prefix("")
        assert azure.keys(bucket) == []

    def test_emulator_settings(self, azure, bucket):
        """`use_emulator` with an `endpoint` (cairn's shortcut) or spelt out as account, key and endpoint."""
        from _servers import AZURITE_ACCOUNT, AZURITE_KEY
        from cairn._storage.obstore import ObjectStorage

        spelt = {"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY,
                 "endpoint": f"{azure.endpoint}/{AZURITE_ACCOUNT}", "allow_http": True}
        for i, opts in enumerate([azure.options(), {"use_emulator": "true", "endpoint": azure.endpoint + "/"}, spelt]):
            ObjectStorage(azure.url(bucket, "settings"), opts).put(f"k{i}", b"x")
        assert azure.keys(bucket) == ["settings/k0", "settings/k1", "settings/k2"]


class TestGCSStorage(ObjectStoreConformance):
    """fake-gcs-server: reads, listing and deletes through cairn; objects put by its JSON API."""

    seed_out_of_band = True
    unsupported = {name: f"GCS: {GCS_NO_WRITES}" for name in [
        "test_put_then_read", "test_put_create_fails_if_present_and_keeps_the_first",
        "test_racing_creates_have_one_winner", "test_write_parts_in_order",
        "test_write_accepts_a_generator_and_no_parts", "test_large_write",
        "test_a_large_writes_parts_may_read_the_storage", "test_an_error_of_the_parts_comes_through_and_leaves_no_object"]}

    @pytest.fixture
    def server(self, gcs):
        return gcs

    def test_writes_are_refused_with_the_servers_answer(self, storage):
        """What fails, and that it fails loudly: the error names the object and the server's answer."""
        with pytest.raises(OSError, match=r"put failed.*ck/x.*400|ck/x.*put failed.*400") as e:
            storage.put("ck/x", b"1", create=True)
        assert storage.url in str(e.value)
