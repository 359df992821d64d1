"""The `cairn` command line on real checkpoints: local folders and memory:// object stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cairn
from cairn._cli.main import main
from cairn._format import manifest as fmt
from cairn._save import commit as _commit
from cairn._save import engine as _save


def run(capsys, *argv):
    rc = main(["--plain", *map(str, argv)])
    got = capsys.readouterr()
    return rc, got.out, got.err


def make_state(mesh, seed=0):
    rng = np.random.default_rng(seed)
    w = jax.device_put(rng.standard_normal((64, 16)).astype(np.float32), NamedSharding(mesh, P("x")))
    return {
        "params": {"w": w, "b": rng.standard_normal(8).astype(ml_dtypes.bfloat16)},
        "step": 7,
        "meta": {"name": "run", "blob": b"\x00\x01"},
    }


@pytest.fixture
def ckpt(tmp_path, mesh8, unmerged):  # w in 8 chunks, one per shard (the verify tests name them)
    path = tmp_path / "ck"
    cairn.save(path, make_state(mesh8), user_metadata={"note": "hello"})
    return path


def data_file(path, item="params"):
    (name,) = [n for n in os.listdir(path / item) if n.endswith(".bin")]
    return path / item / name


# ---------------------------------------------------------------------- inspect


def test_inspect_table_and_json_read_no_array_data(ckpt, capsys, monkeypatch):
    from cairn._storage import local as _local

    def no_data(self, key):
        raise AssertionError(f"inspect opened data file {key}")

    monkeypatch.setattr(_local.LocalStorage, "open_read", no_data)
    rc, out, err = run(capsys, "inspect", ckpt)
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("params/w"))
    assert "float32" in line and "(64, 16)" in line and "4.0 KiB" in line and "8x1" in line and "P(x)" in line
    assert "mesh(x=8)" in line
    assert any(ln.startswith("step") and "int" in ln and "7" in ln for ln in out.splitlines())
    assert "5 leaves (3 arrays" in out and '"note": "hello"' in out

    rc, out, _ = run(capsys, "inspect", ckpt, "--json")
    assert rc == 0
    data = json.loads(out)
    leaves = {leaf["path"]: leaf for leaf in data["items"]["params"]["leaves"]}
    assert leaves["w"]["shape"] == [64, 16] and leaves["w"]["dtype"] == "float32"
    assert leaves["w"]["chunks"] == 8 and leaves["w"]["sharding"]["spec"] == ["x"]
    assert leaves["b"]["dtype"] == "bfloat16" and leaves["b"]["nbytes"] == 16
    assert data["items"]["step"]["leaves"] == [{"path": "", "kind": "int", "value": 7}]
    assert data["totals"]["arrays"] == 3 and data["totals"]["array_bytes"] == 64 * 16 * 4 + 16 + 2
    assert data["metadata"] == {"note": "hello"}


# ---------------------------------------------------------------------- verify


def test_verify_intact(ckpt, capsys):
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 0 and err == ""
    assert out.startswith("OK:") and "8 chunks" not in out  # 8 chunks of w + b + blob = 10
    assert "10 chunks" in out
    rc, out, _ = run(capsys, "verify", ckpt, "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["bytes_checked"] == 64 * 16 * 4 + 16 + 2


def test_verify_names_every_corrupt_chunk(ckpt, capsys):
    index = cairn._load.source.open_checkpoint(ckpt).indexes["params"]
    w = next(leaf for leaf in index.leaves if leaf.path == "w")
    path = data_file(ckpt)
    raw = bytearray(path.read_bytes())
    for cell in (2, 5):  # flip one byte inside two of w's eight chunks
        _, offset = w.chunks[cell]
        raw[offset + 17] ^= 0x40
    path.write_bytes(bytes(raw))
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1 and out.startswith("FAILED:")
    lines = err.strip().splitlines()
    assert len(lines) == 2
    assert "leaf 'w' chunk 2 [16:24, 0:16]" in lines[0] and path.name in lines[0] and "[params]" in lines[0]
    assert "leaf 'w' chunk 5 [40:48, 0:16]" in lines[1] and "CRC-32C" in lines[1]
    rc, out, _ = run(capsys, "verify", ckpt, "--json")
    problems = json.loads(out)["problems"]
    assert rc == 1 and [(p["leaf"], p["chunk"], p["file"]) for p in problems] == [
        ("w", 2, path.name), ("w", 5, path.name)
    ]


def test_verify_truncated_and_missing_files(ckpt, capsys):
    path = data_file(ckpt)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    blob = data_file(ckpt, "meta")
    blob.unlink()
    rc, _, err = run(capsys, "verify", ckpt)
    assert rc == 1
    assert f"{path.name!r} is truncated: {size - 100} bytes, the index records {size}" in err
    assert f"data file {blob.name!r} is missing" in err
    assert "past the end of the file" in err  # the chunk that lost its tail is named too


def test_verify_not_a_checkpoint_is_one_line(tmp_path, capsys):
    rc, out, err = run(capsys, "verify", tmp_path / "nothing")
    assert rc == 1 and out == ""
    assert err.strip() == f"cairn: error: no checkpoint at {tmp_path / 'nothing'}"


def test_corrupt_manifest_error_is_one_line_and_debug_shows_traceback(ckpt, capsys):
    from cairn._format import manifest as fmt

    (ckpt / "manifest.json").write_bytes(fmt.dump_checked_json({"format": "cairn", "version": 99}))
    rc, _, err = run(capsys, "inspect", ckpt)
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "format version 99 is not supported" in err and "Traceback" not in err
    with pytest.raises(cairn.CorruptCheckpointError):
        main(["--debug", "inspect", str(ckpt)])


# ---------------------------------------------------------------------- diff


def test_diff_reports_each_kind_of_change(tmp_path, mesh8, capsys):
    a = make_state(mesh8)
    b = make_state(mesh8)
    w = np.asarray(a["params"]["w"]).copy()
    w[3, 4] += 0.5
    w[60, 1] -= 2.0
    b["params"]["w"] = jax.device_put(w, NamedSharding(mesh8, P(None, "x")))  # another sharding, same values elsewhere
    b["params"]["b"] = np.asarray(a["params"]["b"]).astype(np.float32)
    b["params"]["new"] = np.zeros(3)
    del b["meta"]["blob"]
    b["step"] = 8
    cairn.save(tmp_path / "a", a)
    cairn.save(tmp_path / "b", b)
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b", "--json")
    assert rc == 1
    got = {(e["item"], e["path"]): e for e in json.loads(out)["entries"]}
    assert got[("params", "w")]["status"] == "values changed"
    assert got[("params", "w")]["max_abs_diff"] == pytest.approx(2.0, rel=1e-6)
    assert "2 of 1024 elements differ" in got[("params", "w")]["detail"]
    assert got[("params", "b")]["status"] == "changed type"
    assert got[("params", "b")]["detail"] == "bfloat16[8] -> float32[8]"
    assert got[("params", "new")]["status"] == "only in B"
    assert got[("meta", "blob")]["status"] == "only in A"
    assert got[("meta", "name")]["status"] == "equal"
    assert got[("step", "")] == {"item": "step", "path": "", "status": "values changed", "detail": "int 7 -> int 8"}
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert rc == 1 and "values changed" in out and "name" not in out  # equal leaves hidden without --all
    rc, out, _ = run(capsys, "diff", tmp_path / "a", tmp_path / "a", "--all")
    assert rc == 0 and out.strip().endswith("5 equal")


# ---------------------------------------------------------------------- ls / gc


def _interrupted_save(monkeypatch, path, state):
    """Run a save that dies just before its commit, leaving what a killed process leaves."""
    with monkeypatch.context() as m:
        # A killed process cleans nothing up.
        m.setattr(_commit.RenameCommit, "abort", lambda self, loc, token: None)
        m.setattr(_commit.MarkerCommit, "abort", lambda self, loc, token: None)

        def die(self, *a, **k):
            raise OSError("simulated crash before the commit")

        m.setattr(_save.SaveJob, "_commit", die)
        with pytest.raises(cairn.CheckpointError, match="simulated crash"):
            cairn.save(path, state, compression=False)


def _manager_meta(step, loss):
    return {"cairn.manager": {"step": step, "metrics": {"loss": loss}}}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_ls_and_gc_with_an_interrupted_save(tmp_path, monkeypatch, capsys, where):
    base = str(tmp_path / "run") if where == "local" else f"memory://cli-{uuid.uuid4().hex}/run"
    state = {"x": np.arange(1000, dtype=np.float32), "n": 1}
    cairn.save(f"{base}/step_00000001", state, user_metadata=_manager_meta(1, 0.5))
    cairn.save(f"{base}/step_00000002", state, user_metadata=_manager_meta(2, 0.25))
    _interrupted_save(monkeypatch, f"{base}/step_00000003", state)  # raw: its data file has 4000 bytes
    if where == "local":
        os.makedirs(tmp_path / "run" / "notes")  # not cairn's: never listed, never removed
        (tmp_path / "run" / "notes" / "readme.txt").write_text("mine")
    rc, out, _ = run(capsys, "ls", base, "--json")
    assert rc == 0
    entries = json.loads(out)["entries"]
    assert [(e["step"], e["status"]) for e in entries] == [
        (1, "committed"), (2, "committed"), (3, "temporary" if where == "local" else "uncommitted")
    ]
    assert entries[0]["metrics"] == {"loss": 0.5} and entries[0]["age_s"] < 600
    assert entries[2]["bytes"] >= 4000  # the data file of the interrupted attempt
    rc, out, _ = run(capsys, "ls", base)
    assert rc == 0 and "loss=0.25" in out and "1 leftover" in out

    rc, out, _ = run(capsys, "gc", base)  # default --min-age 3600: a fresh leftover may be a save in progress
    assert rc == 0 and out.startswith("kept ") and "may be a save in progress" in out
    rc, out, _ = run(capsys, "gc", base, "--dry-run", "--min-age", "0")
    assert rc == 0 and "would remove" in out
    assert len(json.loads(run(capsys, "ls", base, "--json")[1])["entries"]) == 3
    rc, out, _ = run(capsys, "gc", base, "--min-age", "0")
    assert rc == 0 and out.startswith("removed ")
    entries = json.loads(run(capsys, "ls", base, "--json")[1])["entries"]
    assert [e["status"] for e in entries] == ["committed", "committed"]
    np.testing.assert_array_equal(cairn.load(f"{base}/step_00000002")["x"], state["x"])
    if where == "local":
        assert (tmp_path / "run" / "notes" / "readme.txt").read_text() == "mine"
        assert sorted(os.listdir(tmp_path / "run")) == ["notes", "step_00000001", "step_00000002"]
    rc, out, _ = run(capsys, "gc", base, "--min-age", "0")
    assert rc == 0 and "nothing to remove" in out


@pytest.mark.parametrize("where", ["local", "memory"])
def test_gc_never_removes_a_folder_that_holds_checkpoints(tmp_path, monkeypatch, capsys, where):
    """A folder of checkpoints inside the directory (another run's, a local tier's `process_0`)
    has cairn files below it but no manifest of its own: it is not an uncommitted save."""
    base = str(tmp_path / "runs") if where == "local" else f"memory://cli-{uuid.uuid4().hex}/runs"
    state = {"x": np.arange(100, dtype=np.float32)}
    cairn.save(f"{base}/a/step_00000001", state, user_metadata=_manager_meta(1, 0.5))
    cairn.save(f"{base}/process_0/step_00000004/", state)
    _interrupted_save(monkeypatch, f"{base}/step_00000003", state)  # the one leftover
    entries = json.loads(run(capsys, "ls", base, "--json")[1])["entries"]
    assert [(e["step"], e["status"]) for e in entries] == [(3, "temporary" if where == "local" else "uncommitted")]
    rc, out, _ = run(capsys, "gc", base, "--min-age", "0")
    assert rc == 0 and "removed 1 entries" in out and "process_0" not in out
    np.testing.assert_array_equal(cairn.load(f"{base}/a/step_00000001")["x"], state["x"])
    np.testing.assert_array_equal(cairn.load(f"{base}/process_0/step_00000004")["x"], state["x"])


def test_commands_on_memory_urls(mesh8, capsys):
    base = f"memory://cli-{uuid.uuid4().hex}/ck"
    cairn.save(base, make_state(mesh8))
    rc, out, _ = run(capsys, "inspect", base, "--json")
    assert rc == 0 and json.loads(out)["totals"]["leaves"] == 5
    assert run(capsys, "verify", base)[0] == 0
    storage = cairn._storage.location.resolve(base).storage
    (key,) = [k for k in storage.list("ck/params") if k.endswith(".bin")]
    raw = bytearray(storage.read(key))
    raw[100] ^= 1
    storage.put(key, bytes(raw))
    rc, _, err = run(capsys, "verify", base)
    assert rc == 1 and "leaf 'w' chunk 0" in err


# ---------------------------------------------------------------------- output and errors


def test_plain_text_without_rich(ckpt, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich -> ImportError
    rc = main(["inspect", str(ckpt)])  # no --plain: falls back by itself
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[1].startswith("key path") and "params/w" in out


def test_rich_table_output(ckpt, capsys):
    pytest.importorskip("rich")
    rc = main(["inspect", str(ckpt)])
    out = capsys.readouterr().out
    assert rc == 0 and "params/w" in out and "━" in out


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert", "a", "b", "--to", "onnx"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["convert", "a", "b", "--to", "cairn", "--budget", "lots"])
    assert e.value.code == 2


def test_console_script(ckpt):
    script = os.path.join(os.path.dirname(sys.executable), "cairn")
    if not os.path.exists(script):
        pytest.skip("console script not installed in this environment")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([script, "verify", str(ckpt)], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and "OK:" in p.stdout, p.stderr
    p = subprocess.run([script, "inspect", str(ckpt / "nope")], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1 and p.stderr.startswith("cairn: error: no checkpoint") and "Traceback" not in p.stderr


def test_convert_commands(ckpt, tmp_path, capsys):
    st = tmp_path / "m.safetensors"
    rc, out, _ = run(capsys, "convert", ckpt, st, "--to", "safetensors", "--budget", "4M", "--all-items")
    assert rc == 0 and f"wrote {st}" in out
    rc, _, _ = run(capsys, "convert", st, tmp_path / "back", "--to", "cairn")
    assert rc == 0
    assert run(capsys, "diff", ckpt, tmp_path / "back")[0] == 0
    rc, _, err = run(capsys, "convert", st, tmp_path / "back", "--to", "cairn")
    assert rc == 1 and "already holds a checkpoint" in err
    rc, out, _ = run(capsys, "convert", ckpt, tmp_path / "per", "--to", "safetensors", "--per-item")
    assert rc == 0 and out.count("wrote") == 3
    if jnp is not None:  # torch is optional
        pytest.importorskip("torch")
        rc, out, _ = run(capsys, "convert", ckpt, tmp_path / "m.pt", "--to", "torch")
        assert rc == 0 and (tmp_path / "m.pt").exists()
    assert fmt.MANIFEST in os.listdir(tmp_path / "back")


def test_inspect_shows_the_format_version(ckpt, capsys):
    from pathlib import Path

    golden_v1 = Path(__file__).resolve().parents[1] / "golden" / "v1" / "step_5"
    for path, version in ((ckpt, 2), (golden_v1, 1)):
        rc, out, _ = run(capsys, "inspect", path)
        assert rc == 0 and f"format version {version}," in out
        rc, out, _ = run(capsys, "inspect", path, "--json")
        assert rc == 0 and json.loads(out)["format_version"] == version


def test_verify_reports_a_broken_index_part(ckpt, capsys):
    (part,) = (ckpt / "params").glob("index.p*.idx")
    raw = bytearray(part.read_bytes())
    raw[64 + 30] ^= 0x01  # inside the first record
    part.write_bytes(bytes(raw))
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1 and out.startswith("FAILED:") and "checksum mismatch" in err and part.name in err


def test_inspect_says_what_compression_decided(tmp_path, capsys):
    """`cairn inspect` sums up each array's codec: what the save's `compression=` decided."""
    import numpy as np

    state = {"w": np.linspace(0, 1, 1 << 16, dtype=np.float32), "z": np.zeros(4096, np.float32),
             "r": np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)}
    cairn.save(tmp_path / "c", state, compression=True)
    cairn.save(tmp_path / "raw", state, compression=False)
    rc, out, _ = run(capsys, "inspect", tmp_path / "c")
    line = next(x for x in out.splitlines() if x.startswith("compression:"))
    assert rc == 0 and "1 none" in line and "x raw)" in line and ("planes" in line or "zstd" in line or "blosc2" in line)
    rc, out, _ = run(capsys, "inspect", tmp_path / "raw")
    assert rc == 0 and "compression: none (every array stored raw)" in out


def test_ls_marks_steps_whose_base_was_deleted_as_broken(tmp_path, capsys):
    """An incremental run whose base step was deleted by hand: `cairn ls` shows the steps that refer to it
    as broken, naming the missing base, not as committed."""
    import shutil

    run = tmp_path / "run"
    frozen = np.random.default_rng(5).standard_normal((512, 1024)).astype(np.float32)  # two 1 MiB blocks
    with cairn.CheckpointManager(run, incremental=True, async_save=False, handle_sigterm=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"frozen": frozen, "head": np.full((8,), step, np.float32)})
    assert main(["--plain", "ls", str(run)]) == 0
    assert "2 committed" in capsys.readouterr().out
    shutil.rmtree(run / "step_00000001")
    assert main(["--plain", "ls", str(run)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("2 "))
    assert "broken" in row and "committed" not in row, out
    assert "step_00000002 is broken: its base step_00000001" in out and "0 committed, 1 broken" in out
    assert main(["--plain", "ls", str(run), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["entries"]
    assert entry["status"] == "broken" and "step_00000001" in entry["error"]


def test_verify_without_a_codec_library_exits_3_and_ls_of_nothing_exits_1(tmp_path, capsys, monkeypatch):
    """`cairn verify` of a checkpoint whose blocks need python-blosc2, where it is not installed: exit status 3
    (it could not check), not 1 (damage). `cairn ls` of a path that does not exist: exit status 1."""
    from cairn._codecs import blosc2lib
    from cairn._codecs import codecs as _codecs

    if not _codecs.blosc2_available():
        pytest.skip("writing a blosc2 checkpoint needs python-blosc2")
    run = tmp_path / "run"
    with cairn.CheckpointManager(run, incremental=True, compression="blosc2", async_save=False,
                                 handle_sigterm=False) as mgr:  # hashed blocks: verify decodes each
        mgr.save(1, {"w": np.linspace(0, 1, 1 << 16, dtype=np.float32)})
    ckpt = run / "step_00000001"
    assert main(["--plain", "verify", str(ckpt)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(_codecs, "_blosc2_module", None)
    monkeypatch.setattr(blosc2lib, "_loaded", [])  # (a fresh process's: nothing found yet)
    monkeypatch.setattr(blosc2lib, "_decoding", [])
    monkeypatch.setattr(blosc2lib, "_encoding", [])
    monkeypatch.setitem(sys.modules, "blosc2", None)  # import blosc2 -> ImportError
    assert main(["--plain", "verify", str(ckpt)]) == 3
    err = capsys.readouterr().err
    assert "cannot verify" in err and "python-blosc2" in err and "cairn-ckpt[fast]" in err and "CORRUPT" not in err
    assert main(["--plain", "verify", str(ckpt), "--json"]) == 3
    assert "codec_missing" in json.loads(capsys.readouterr().out)
    with pytest.raises(ImportError):  # the error a caller catches without knowing cairn
        cairn.load(ckpt)

    assert main(["--plain", "ls", str(tmp_path / "no-such-run")]) == 1
    assert "no-such-run: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--plain", "ls", str(tmp_path / "empty")]) == 0
    assert "no checkpoints in" in capsys.readouterr().out


def test_ls_names_a_step_committed_in_two_folders(tmp_path, capsys):
    """Two committed folders of one step (two namings): `cairn ls` says the manager cannot pick one."""
    state = {"x": np.arange(10, dtype=np.float32)}
    cairn.save(tmp_path / "run" / "step_00000004", state, user_metadata=_manager_meta(4, 0.5))
    cairn.save(tmp_path / "run" / "step_00000005", state, user_metadata=_manager_meta(5, 0.5))
    rc, out, _ = run(capsys, "ls", str(tmp_path / "run"))
    assert rc == 0 and "committed in" not in out
    cairn.save(tmp_path / "run" / "step_4", state, user_metadata=_manager_meta(4, 0.5))
    rc, out, _ = run(capsys, "ls", str(tmp_path / "run"))
    assert rc == 0 and "step 4 is committed in 2 folders (step_00000004, step_4)" in out, out
    assert "step 5 is" not in out
    assert cairn.CheckpointManager(tmp_path / "run", read_only=True).path(4).endswith("step_00000004")


# ---------------------------------------------------------------------- plan --save


def test_plan_save_is_a_dry_run_of_a_save_of_the_arrays(tmp_path, capsys):
    """`cairn plan PATH --save DEST`: what a save of PATH's arrays to DEST would write (files, chunks, bytes
    per checkpointable; each leaf's codec decision), as cairn.save plans it; DEST is not written."""
    import json

    state = {"params": {"w": np.arange(1 << 18, dtype=np.float32), "b": np.ones(10, np.int16), "step": 3},
             "opt": {"m": np.zeros((64, 64), np.float32)}}
    cairn.save(tmp_path / "src", state)
    rc, out, _ = run(capsys, "plan", tmp_path / "src", "--save", tmp_path / "dst", "--save-compression", "zstd",
                     "--json")
    assert rc == 0
    got = json.loads(out)
    assert got["compression"] == "zstd" and got["process"] == 0
    assert got["items"]["params"]["bytes"] == (1 << 18) * 4 + 20 and got["items"]["params"]["leaves"] == {"zstd": 2}
    assert got["items"]["opt"]["bytes"] == 64 * 64 * 4 and got["items"]["opt"]["chunks"] == 1
    assert not (tmp_path / "dst").exists()  # a dry run: nothing written
    rc, out, _ = run(capsys, "plan", tmp_path / "src", "--save", "memory://plan-save/x", "--save-compression", "true")
    assert rc == 0 and "leaves: 2 measure on its first chunk" in out, out
    # the destination is checked as a save checks it
    cairn.save(tmp_path / "dst", state)
    rc, _, err = run(capsys, "plan", tmp_path / "src", "--save", tmp_path / "dst")
    assert rc != 0 and "already holds a checkpoint" in err, err


# ---------------------------------------------------------------------- plan --compression


def test_plan_compression_shows_what_was_decided_and_what_auto_would_decide(tmp_path, capsys):
    """`cairn plan --compression URL`: the checkpoint's codecs, then what "auto" would decide saving to
    URL and why (bandwidth and where it came from, cores, codec speeds, each leaf's sample ratio)."""
    # what True and "auto" pick for bf16 weights on any host: only codecs every install reads
    floats = floats4 = "planes"
    rng = np.random.default_rng(0)
    state = {"w": rng.standard_normal(1 << 16).astype(ml_dtypes.bfloat16), "z": np.zeros(1 << 15, np.float32),
             "r": rng.integers(0, 256, 1 << 16, dtype=np.uint8), "step": 3}
    cairn.save(tmp_path / "c", state, compression=True)
    # a slow object store, declared: the weights and the zeros pay, random bytes never shrink
    rc, out, _ = run(capsys, "plan", tmp_path / "c", "--compression", "memory://plan/x", "--gbps", "0.05",
                     "--cores", "4")
    assert rc == 0
    lines = out.splitlines()
    version = 5 if floats == "blosc2" else 3  # a blosc2 leaf makes it version 5 (FORMAT.md §6.6)
    assert lines[0].startswith(f"{tmp_path / 'c'}: format version {version}; arrays ")
    assert "1 none" in lines[0] and floats in lines[0]
    assert ('"auto" saving to memory://plan/x: object storage at 0.05 GiB/s write, 0.05 read, coded transfers '
            "0.05 / 0.05 (declared: --gbps); 4 cores, codecs at 1.00x") in out
    row = {x.split()[0]: x.split() for x in lines if x.split() and x.split()[0] in ("w", "z", "r")}
    # zeros code to almost nothing: "zstd" ("auto" never takes a C-Blosc2 codec)
    zeros = "zstd"
    assert row["w"][-3] == floats4 and row["z"][-3] == zeros and row["r"][-3] == "none"
    assert f'"auto" would store {", ".join(sorted(["1 none", f"1 {floats4}", f"1 {zeros}"]))} (auto)' in out
    # a local disk: no leaf could pay, nothing sampled
    rc, out, _ = run(capsys, "plan", tmp_path / "c", "--compression", tmp_path / "elsewhere", "--cores", "4")
    assert rc == 0 and '"auto" would store 3 none (raw (format version 2): no leaf could pay)' in out
    rc, out, _ = run(capsys, "plan", tmp_path / "c", "--compression", "memory://plan/x", "--gbps", "0.05", "--json")
    data = json.loads(out)
    assert data["saved"]["codecs"]["none"] == 1 and data["auto"]["bandwidth"] == 0.05e9
    assert data["auto"]["bandwidth_source"] == "declared: --gbps" and data["auto"]["any_leaf_can_pay"]
    w = next(x for x in data["leaves"] if x["path"] == "w")
    assert w["auto"]["codec"] == floats and 0 < w["auto"]["sample_ratio"] < 1
    assert w["auto"]["coded_s"] < w["auto"]["raw_s"]


def test_plan_wants_a_mesh_or_compression(ckpt, capsys):
    rc, _, err = run(capsys, "plan", ckpt)
    assert rc != 0 and "--mesh" in err and "--compression" in err
