"""Conversions: cairn <-> safetensors and cairn -> torch, bitwise, and within a memory budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._exports.safetensors import from_safetensors, to_safetensors
from cairn._exports.statedict import to_torch_file
from cairn._sources import verify as _verify


def assert_bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert a.tobytes() == b.tobytes()


def assert_trees_bitwise(x, y):
    if isinstance(x, dict):
        assert isinstance(y, dict) and set(x) == set(y), (x.keys(), y.keys())
        for k in x:
            assert_trees_bitwise(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y)
        for a, b in zip(x, y):
            assert_trees_bitwise(a, b)
    elif isinstance(x, np.ndarray) or type(x).__module__.startswith("jax"):
        assert_bitwise(x, y)
    else:
        assert type(x) is type(y) and (x == y or (x != x and y != y)), (x, y)


def rich_state(mesh):
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((32, 24)).astype(np.float32)
    f32[0, 0] = np.nan
    return {
        "params": {
            "w": jax.device_put(f32, NamedSharding(mesh, P("x", None))),
            "w2": jax.device_put(f32.astype(ml_dtypes.bfloat16), NamedSharding(mesh, P(None, "x"))),
            "f8": rng.standard_normal(10).astype(ml_dtypes.float8_e4m3fn),
            "u16": np.arange(7, dtype=np.uint16),
            "i64": np.array([-(2**62), 3], dtype=np.int64),
            "c": (rng.standard_normal(3) + 1j).astype(np.complex64),
            "mask": np.array([[True, False]]),
            "empty": np.zeros((0, 5), np.float16),
            "scalar0d": np.array(2.5, np.float64),
        },
        "opt": [np.ones(4, np.float32), (np.int32(3), None)],
        "step": 12,
        "meta": {"name": "x/y", "blob": b"\x00\xff", "lr": 0.1, "big": 2**70},
    }


@pytest.mark.parametrize("per_item", [False, True])
def test_safetensors_round_trip_is_bitwise(tmp_path, mesh8, per_item):
    state = rich_state(mesh8)
    cairn.save(tmp_path / "ck", state, user_metadata={"run": "r1"})
    dst = tmp_path / ("dir" if per_item else "m.safetensors")
    written = to_safetensors(tmp_path / "ck", dst, per_item=per_item, all_items=True, budget_bytes=1 << 20)
    assert len(written) == (4 if per_item else 1)
    from_safetensors(dst, tmp_path / "back")
    assert_trees_bitwise(cairn.load(tmp_path / "ck"), cairn.load(tmp_path / "back"))
    assert cairn._load.engine.read_manifest(cairn._storage.location.resolve(tmp_path / "back")).metadata == {"run": "r1"}
    assert _verify.verify(tmp_path / "back").ok


def test_safetensors_output_reads_with_the_safetensors_library(tmp_path, mesh8):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    state = rich_state(mesh8)
    del state["params"]["w2"], state["params"]["f8"]  # numpy has no bfloat16 / float8
    cairn.save(tmp_path / "ck", state)
    to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors", all_items=True)
    got = load_file(str(tmp_path / "m.safetensors"))
    assert_bitwise(got["params.w"], state["params"]["w"])  # HF's dotted names, checkpointable first
    assert_bitwise(got["params.i64"], state["params"]["i64"])
    assert_bitwise(got["opt.0"], state["opt"][0])
    assert_bitwise(got["meta.blob"], np.frombuffer(b"\x00\xff", np.uint8))
    to_safetensors(tmp_path / "ck", tmp_path / "raw.safetensors", names="raw")  # cairn's key paths
    assert "params/w" in load_file(str(tmp_path / "raw.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), "np") as f:
        meta = json.loads(f.metadata()["cairn"])
    assert meta["format"] == "cairn-safetensors" and set(meta["items"]) == {"params", "opt", "step", "meta"}


def test_bfloat16_safetensors_reads_in_torch(tmp_path, mesh8):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    state = rich_state(mesh8)
    cairn.save(tmp_path / "ck", state)
    to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors", all_items=True)
    got = load_file(str(tmp_path / "m.safetensors"))
    assert got["params.w2"].dtype == torch.bfloat16
    assert got["params.w2"].view(torch.int16).numpy().tobytes() == np.asarray(state["params"]["w2"]).tobytes()
    assert got["params.f8"].dtype == torch.float8_e4m3fn


def test_plain_safetensors_file_becomes_a_flat_checkpoint(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"model.layers.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
               "model/odd%name": np.array([1, 2], np.int8), "scalar": np.array(3.0)}
    save_file(tensors, str(tmp_path / "hf.safetensors"), metadata={"format": "pt"})
    from_safetensors(tmp_path / "hf.safetensors", tmp_path / "ck")
    got = cairn.load(tmp_path / "ck")
    assert list(got) == list(tensors) or set(got) == set(tensors)
    for k, v in tensors.items():
        assert_bitwise(got[k], v)
    # and back: the flat dict maps to the same tensor names
    to_safetensors(tmp_path / "ck", tmp_path / "again.safetensors")
    from safetensors.numpy import load_file

    again = load_file(str(tmp_path / "again.safetensors"))
    assert set(again) == set(tensors)


def test_unsupported_dtype_and_bad_header_errors(tmp_path):
    cairn.save(tmp_path / "ck", {"x": np.ones(2, ml_dtypes.int4)})
    with pytest.raises(cairn.UnsupportedTypeError, match=r"\[x\]: leaf '<root>' has dtype int4, which safetensors cannot hold"):
        to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(cairn.CorruptCheckpointError, match="too large or truncated"):
        from_safetensors(bad, tmp_path / "x")
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(cairn.CorruptCheckpointError, match="'t'.*data_offsets"):
        from_safetensors(bad, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_memory_url_round_trip(mesh8):
    import uuid

    base = f"memory://conv-{uuid.uuid4().hex}"
    state = rich_state(mesh8)
    cairn.save(f"{base}/ck", state)
    to_safetensors(f"{base}/ck", f"{base}/m.safetensors", all_items=True)
    from_safetensors(f"{base}/m.safetensors", f"{base}/back")
    assert_trees_bitwise(cairn.load(f"{base}/ck"), cairn.load(f"{base}/back"))


# ---------------------------------------------------------------------- torch


def test_torch_state_dict_round_trip_is_bitwise(tmp_path, mesh8):
    torch = pytest.importorskip("torch")
    state = rich_state(mesh8)
    cairn.save(tmp_path / "ck", state)
    to_torch_file(tmp_path / "ck", tmp_path / "m.pt", budget_bytes=1 << 20)
    for mmap in (False, True):
        sd = torch.load(tmp_path / "m.pt", weights_only=True, mmap=mmap)
        assert sd["params.w2"].dtype == torch.bfloat16 and sd["params.f8"].dtype == torch.float8_e4m3fn
        assert sd["params.u16"].dtype == torch.uint16
        for key in ("w", "w2", "f8", "u16", "i64", "c", "mask", "empty", "scalar0d"):
            t, ref = sd[f"params.{key}"], np.asarray(state["params"][key])
            assert tuple(t.shape) == ref.shape
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert raw == ref.tobytes(), key
        assert sd["step"] == 12 and sd["meta.name"] == "x/y" and sd["meta.blob"] == b"\x00\xff"
        assert sd["meta.big"] == 2**70 and sd["opt.1.1"] is None and sd["opt.1.0"] == 3
    # torch -> back into cairn goes through safetensors: the reverse path is covered there.


def test_load_framework_torch(tmp_path, mesh8):
    torch = pytest.importorskip("torch")
    state = rich_state(mesh8)
    cairn.save(tmp_path / "ck", state)
    got = cairn.load(tmp_path / "ck", framework="torch")
    w2 = got["params"]["w2"]
    assert isinstance(w2, torch.Tensor) and w2.dtype == torch.bfloat16
    assert w2.view(torch.int16).numpy().tobytes() == np.asarray(state["params"]["w2"]).tobytes()
    assert got["params"]["f8"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["params"]["i64"], torch.tensor([-(2**62), 3]))
    assert got["step"] == 12 and got["meta"]["blob"] == b"\x00\xff"
    with pytest.raises(ValueError, match="framework"):
        cairn.load(tmp_path / "ck", framework="tf")


# ---------------------------------------------------------------------- memory


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    kind, src, dst, budget, warm = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    from cairn._exports.safetensors import from_safetensors, to_safetensors
    from cairn._exports.statedict import to_torch_file

    def convert(src, dst):
        if kind == "safetensors":
            to_safetensors(src, dst, all_items=True, budget_bytes=budget)
        elif kind == "cairn":
            from_safetensors(src, dst, budget_bytes=budget)
        else:
            to_torch_file(src, dst, budget_bytes=budget)

    # A tiny conversion first, so that lazy imports and thread start-up are not counted.
    convert(warm, dst + ".warm")

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    convert(src, dst)
    print(json.dumps({"before": before, "peak": status("VmHWM")}))
    """
)


def _peak_growth(kind, src, dst, budget, tmp_path, warm):
    script = tmp_path / "rss.py"
    script.write_text(_RSS_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, str(script), kind, str(src), str(dst), str(budget), str(warm)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["peak"] - r["before"]


def test_convert_memory_stays_within_budget(tmp_path, mesh8):
    """Peak RSS growth while converting a 112 MiB state with a 16 MiB budget, in fresh processes."""
    rng = np.random.default_rng(0)
    state = {
        "a": rng.standard_normal((4096, 2048), dtype=np.float32),  # 32 MiB, one chunk
        "b": jax.device_put(rng.standard_normal((2048, 4096), dtype=np.float32),
                            NamedSharding(mesh8, P(None, "x"))),  # 32 MiB, 8 column chunks
        "c": {"d": rng.standard_normal((6 << 20,)).astype(np.float64)},  # 48 MiB, 1-D
    }
    total = 112 << 20
    budget = 16 << 20
    cairn.save(tmp_path / "ck", state)
    del state
    cairn.save(tmp_path / "tiny", {"a": np.ones(3), "b": {"c": np.zeros(2)}})
    to_safetensors(tmp_path / "tiny", tmp_path / "tiny.safetensors", all_items=True)
    growth = {
        "safetensors": _peak_growth("safetensors", tmp_path / "ck", tmp_path / "m.safetensors", budget,
                                    tmp_path, tmp_path / "tiny"),
        "cairn": _peak_growth("cairn", tmp_path / "m.safetensors", tmp_path / "back", budget, tmp_path,
                              tmp_path / "tiny.safetensors"),
    }
    try:
        import torch  # noqa: F401

        growth["torch"] = _peak_growth("torch", tmp_path / "ck", tmp_path / "m.pt", budget, tmp_path,
                                       tmp_path / "tiny")
    except ImportError:
        pass
    print({k: f"{v / 2**20:.1f} MiB" for k, v in growth.items()})
    for kind, g in growth.items():
        # Within the budget; the state is seven times larger.
        assert g < budget, f"{kind}: peak RSS grew by {g / 2**20:.1f} MiB (budget 16 MiB)"
    assert os.path.getsize(tmp_path / "m.safetensors") > total
    assert _verify.verify(tmp_path / "back").ok
