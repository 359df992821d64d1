"""GCS on a real server (fake-gcs-server on 127.0.0.1): everything but writes.

fake-gcs-server serves the requests obstore sends to read (GET, ranged GET,
HEAD, the XML listing) and to delete, but none of its XML-API writes (see
`_servers.GCS_NO_WRITES`). So these tests save checkpoints to local disk,
copy the files to the server through its JSON API, and then load, reshard,
inspect, verify and manage them from ``gs://`` through cairn; a save to GCS is
checked to fail loudly, naming the object and the server's answer. Saves,
commit races and kill-anywhere runs skip on GCS, each saying why (see
tests/storage/test_storage_conformance.py, test_concurrency.py, test_faults.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from _trees import assert_same
from cairn._cli import main as _cli


def sharded(mesh, shape, spec, dtype=jnp.float32, seed=0):
    x = jax.random.normal(jax.random.key(seed), shape, dtype=jnp.float32).astype(dtype)
    return jax.device_put(x, NamedSharding(mesh, spec))


@pytest.fixture(scope="module")
def bucket(gcs):
    return gcs.new_bucket("loads")


def upload(gcs, bucket, local, prefix):
    """A checkpoint (or a manager's folder) saved locally, copied to ``gs://bucket/prefix``."""
    gcs.upload_tree(bucket, prefix, local)
    return gcs.url(bucket, prefix)


def test_load_reshard_partial_and_metadata(gcs, bucket, tmp_path, mesh8, mesh42):
    w = sharded(mesh8, (128, 64), P("x", None), seed=1)
    v = sharded(mesh8, (8, 256), P(None, "x"), dtype=jnp.bfloat16, seed=2)
    state = {"params": {"w": w, "v": v}, "opt": {"m": np.arange(9.0).reshape(3, 3)},
             "meta": {"step": 7, "name": "on gcs", "blob": b"\x00\x01"}}
    cairn.save(tmp_path / "ck", state)
    path = upload(gcs, bucket, tmp_path / "ck", "runs/ck")
    opts = gcs.options()

    want = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)
    assert_same(cairn.load(path, storage_options=opts), want, path)
    target = {"params": {
        "w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh42, P("y", "x"))),
        "v": NamedSharding(mesh42, P("x", "y")),
    }}
    out = cairn.load(path, target, storage_options=opts)  # reads only "params"
    assert set(out) == {"params"}
    assert out["params"]["w"].sharding == target["params"]["w"].sharding
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(out["params"]["v"]), np.asarray(v))
    info = cairn.metadata(path, storage_options=opts)
    assert info["params"]["w"].shape == (128, 64) and info["params"]["v"].dtype == jnp.bfloat16


def test_large_arrays_read_in_parts(gcs, bucket, tmp_path):
    big = np.random.default_rng(3).standard_normal(3 * (1 << 20) + 7, dtype=np.float32)  # 12 MiB
    cairn.save(tmp_path / "big", {"x": big})
    path = upload(gcs, bucket, tmp_path / "big", "big")
    opts = gcs.options(read_part_size=1 << 20, read_concurrency=3)
    np.testing.assert_array_equal(cairn.load(path, storage_options=opts)["x"], big)


def test_settings_from_the_environment_and_the_cli(gcs, bucket, tmp_path, monkeypatch, capsys):
    cairn.save(tmp_path / "ck", {"a": np.arange(1000), "b": {"c": np.ones((4, 4), np.float32)}})
    path = upload(gcs, bucket, tmp_path / "ck", "cli/ck")
    for k, val in gcs.env().items():
        monkeypatch.setenv(k, val)
    np.testing.assert_array_equal(cairn.load(path, storage_options={"allow_http": True})["a"], np.arange(1000))
    monkeypatch.setenv("GOOGLE_ALLOW_HTTP", "true")  # the command line takes its settings from the environment
    assert _cli.main(["--plain", "verify", path]) == 0, capsys.readouterr()


def test_damaged_or_uncommitted_is_reported(gcs, bucket, tmp_path):
    cairn.save(tmp_path / "ck", {"a": np.arange(1000, dtype=np.int64), "b": np.ones(10)})
    path = upload(gcs, bucket, tmp_path / "ck", "damaged")
    opts = gcs.options()
    keys = gcs.keys(bucket, "damaged/")
    a_bin = next(k for k in keys if k.startswith("damaged/a/") and k.endswith(".bin"))
    b_bin = next(k for k in keys if k.startswith("damaged/b/") and k.endswith(".bin"))
    gcs.put_object(bucket, a_bin, gcs.get_object(bucket, a_bin)[:100])
    gcs.delete_object(bucket, b_bin)
    with pytest.raises(cairn.CorruptCheckpointError, match="truncated"):
        cairn.load(path, {"a": None}, storage_options=opts)
    with pytest.raises(cairn.CorruptCheckpointError, match="missing"):
        cairn.load(path, {"b": None}, storage_options=opts)
    gcs.delete_object(bucket, "damaged/manifest.json")
    with pytest.raises(cairn.CheckpointNotFoundError, match="no committed checkpoint"):
        cairn.load(path, storage_options=opts)


def test_manager_lists_restores_and_cleans_up(gcs, bucket, tmp_path):
    """Steps saved elsewhere and copied to GCS; opening the manager deletes an uncommitted one."""
    states = {s: {"w": np.full((4, 4), s, dtype=np.float32), "step": s} for s in (1, 2, 3)}
    with cairn.CheckpointManager(tmp_path / "run", async_save=False, handle_sigterm=False) as mgr:
        for s, st in states.items():
            mgr.save(s, st)
    directory = upload(gcs, bucket, tmp_path / "run", "mgr")
    gcs.put_object(bucket, "mgr/step_00000009/%root/p00000-0.dead.bin", b"x")  # an interrupted save
    with cairn.CheckpointManager(directory, async_save=False, handle_sigterm=False,
                                 storage_options=gcs.options()) as mgr:
        assert mgr.steps() == [1, 2, 3]
        out = mgr.restore()
        assert mgr.restored_step == 3 and out["step"] == 3
        np.testing.assert_array_equal(mgr.restore(1)["w"], states[1]["w"])
    assert not [k for k in gcs.keys(bucket, "mgr/") if k.startswith("mgr/step_00000009")]


def test_save_fails_loudly_and_commits_nothing(gcs, bucket):
    """What does not work on this server fails with the object's URL and the server's answer."""
    path = gcs.url(bucket, "nosave")
    with pytest.raises(cairn.CheckpointError, match=r"400") as e:
        cairn.save(path, {"a": np.arange(10)}, storage_options=gcs.options(max_retries=0))
    assert path in str(e.value)
    assert not [k for k in gcs.keys(bucket, "nosave/") if k.endswith("manifest.json")]
    with pytest.raises(cairn.CheckpointNotFoundError):
        cairn.load(path, storage_options=gcs.options())
