"""One way into a load: every caller opens a checkpoint through `_sources.registry.open_source`.

`cairn.load`, `cairn.metadata`, `CheckpointManager.restore`, `plan_load`,
`verify` and `copy` open a path in the same function, so a format is detected
once, a path that holds nothing gives every caller the same error, and the
engine reads a cairn checkpoint and another format's through the same `Source`
protocol (`_load/source.py`).
"""

from __future__ import annotations

import numpy as np
import pytest

import cairn
from cairn._format import manifest as fmt
from cairn._load import engine as _load
from cairn._load.reader import LoadStats
from cairn._load.source import CairnSource, checkpointables
from cairn._sources import registry as _registry
from cairn._sources.base import FormatSource
from cairn._sources.verify import verify
from cairn._storage import local as _local
from cairn._storage.location import resolve

STATE = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32), "step": 3}


@pytest.fixture
def opened(monkeypatch):
    """Records the location and format of every `open_source` call."""
    calls: list[tuple[str, str | None]] = []
    real = _registry.open_source

    def spy(loc, target=None, **kw):
        calls.append((loc.path, kw.get("format")))
        return real(loc, target, **kw)

    monkeypatch.setattr(_registry, "open_source", spy)
    return calls


def test_every_caller_opens_through_open_source(tmp_path, opened):
    path = str(tmp_path / "ck")
    cairn.save(path, STATE)
    callers = {
        "load": lambda: cairn.load(path),
        "metadata": lambda: cairn.metadata(path),
        "plan_load": lambda: cairn.plan_load(path, processes=2),
        "verify": lambda: verify(path),
        "copy": lambda: cairn.copy(path, tmp_path / "copy"),
    }
    for name, call in callers.items():
        opened.clear()
        call()
        assert opened == [(path, None)], name
    with cairn.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, STATE)
        mgr.wait()
        opened.clear()
        got = mgr.restore()
    assert [p for p, _ in opened] == [mgr.path(1)]
    np.testing.assert_array_equal(got["w"], STATE["w"])


@pytest.mark.parametrize("what", ["nothing", "a stray file"])
def test_a_path_without_a_checkpoint_is_the_same_error_for_every_caller(tmp_path, what):
    path = tmp_path / "ck"
    if what == "a stray file":
        path.mkdir()
        (path / "notes.txt").write_text("hi")
    errors = []
    for call in (lambda: cairn.load(path), lambda: cairn.metadata(path), lambda: cairn.plan_load(path),
                 lambda: verify(path), lambda: cairn.copy(path, tmp_path / "dst"),
                 lambda: cairn.load(path, rename=[("a", "b")])):
        with pytest.raises(cairn.CheckpointNotFoundError) as e:
            call()
        errors.append(str(e.value))
    assert len(set(errors)) == 1, errors
    said = errors[0]
    assert str(path) in said
    if what == "nothing":
        assert said == f"no checkpoint at {path}"
    else:
        assert "holds no committed checkpoint" in said and "nor is it an Orbax, DCP or safetensors" in said
    assert not (tmp_path / "dst").exists()


class ManifestLooks:
    """Every look at a file named manifest.json (reads and existence probes), on local storage."""

    def __init__(self, monkeypatch):
        self.reads = self.probes = 0
        real_read, real_exists = _local.LocalStorage.read, _local.LocalStorage.exists
        looks = self

        def read(self, key):
            looks.reads += key.endswith(fmt.MANIFEST)
            return real_read(self, key)

        def exists(self, key):
            looks.probes += key.endswith(fmt.MANIFEST)
            return real_exists(self, key)

        monkeypatch.setattr(_local.LocalStorage, "read", read)
        monkeypatch.setattr(_local.LocalStorage, "exists", exists)


def test_a_cairn_checkpoint_is_recognised_by_one_manifest_read(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    cairn.save(path, STATE)
    looks = ManifestLooks(monkeypatch)
    for call in (lambda: cairn.load(path), lambda: cairn.metadata(path), lambda: cairn.plan_load(path),
                 lambda: verify(path), lambda: cairn.load(path, rename=[("^w$", "weight")])):
        looks.reads = looks.probes = 0
        call()
        assert (looks.reads, looks.probes) == (1, 0)


def test_another_format_is_detected_once(tmp_path, monkeypatch):
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"w": STATE["w"]}, str(tmp_path / "model.safetensors"))
    probes: list[str] = []
    for name, probe in list(_registry._PROBES.items()):
        monkeypatch.setitem(_registry._PROBES, name, lambda loc, name=name, probe=probe: probes.append(name) or probe(loc))
    looks = ManifestLooks(monkeypatch)
    for call in (lambda: cairn.load(tmp_path), lambda: cairn.metadata(tmp_path), lambda: cairn.plan_load(tmp_path),
                 lambda: verify(tmp_path)):
        probes.clear()
        looks.reads = looks.probes = 0
        call()
        assert (looks.reads, looks.probes) == (1, 0)  # the cairn manifest tried once, then the other formats
        assert probes == ["dcp", "orbax", "safetensors"]
    probes.clear()
    cairn.load(tmp_path, format="safetensors")  # format= skips detection: only its own probe checks the path
    assert probes == ["safetensors"]


class Counted:
    """A `Source` that hands on another's answers and counts what the engine asks of it."""

    def __init__(self, inner):
        self.inner, self.asked, self.readers, self.checks = inner, [], [], []
        self.loc, self.manifest, self.verify = inner.loc, inner.manifest, inner.verify
        self.moved, self.filled, self.added, self.unmatched = inner.moved, inner.filled, inner.added, inner.unmatched

    @property
    def format_name(self):
        return self.inner.format_name

    def indexes_of(self, names, pool):
        self.asked.append(list(names))
        return self.inner.indexes_of(names, pool)

    def reader(self, name, index, verify, pool, stats):
        self.readers.append((name, verify))
        reader = self.inner.reader(name, index, verify, pool, stats)
        self.checks.append(reader.verify)
        return reader


def test_a_cairn_and_a_foreign_source_drive_the_same_engine(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"w": STATE["w"], "b": STATE["b"]}
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    cairn.save(tmp_path / "ck", tensors, compression=False)
    sources = {"cairn": _registry.open_source(resolve(tmp_path / "ck")),
               "safetensors": _registry.open_source(resolve(tmp_path / "model.safetensors"))}
    assert isinstance(sources["cairn"], CairnSource) and isinstance(sources["safetensors"], FormatSource)
    target = {"w": np.zeros((8, 8), np.float32)}
    # cairn stores a mapping's keys as named checkpointables; a safetensors file is one plain tree.
    for (kind, src), asked in zip(sources.items(), ("w", "")):
        counted, stats = Counted(src), LoadStats()
        got = _load.load(counted, target, stats=stats, partial=True)
        np.testing.assert_array_equal(got["w"], tensors["w"])
        assert counted.format_name == kind
        # Through the protocol alone: the indexes it asks for, then one reader each (verifying where it can).
        assert counted.asked == [[asked]] and counted.readers == [(asked, True)]
        assert stats.bytes_read == tensors["w"].nbytes, kind  # only the asked leaf's bytes, from either
        assert counted.checks == [kind == "cairn"]  # checksums checked where the source has them


def test_checkpointables_are_formed_once_with_the_same_errors(tmp_path):
    named = {"params": {"w": STATE["w"]}, "opt": {"m": STATE["b"]}}
    cairn.save(tmp_path / "ck", named)
    assert checkpointables("p", ["params", "opt"], False, None) == [("params", None), ("opt", None)]
    assert checkpointables("p", ["params", "opt"], False, {"opt": 1}) == [("opt", 1)]
    assert checkpointables("p", [""], True, [1, 2]) == [("", [1, 2])]
    for bad, said in (({"params": None, "extra": None}, r"asks for checkpointables \['extra'\] that the checkpoint "
                                                        r"does not hold \(it holds \['opt', 'params'\]\)"),
                      ([1, 2], "holds named checkpointables \\['opt', 'params'\\]; pass a mapping")):
        with pytest.raises(cairn.MismatchError, match=said):
            checkpointables(str(tmp_path / "ck"), ["params", "opt"], False, bad)
        errors = []
        for call, kw in ((cairn.load, {}),  # the engine
                         (cairn.load, {"rename": [("^params/w$", "params/v")]}),  # a description (open_format)
                         (cairn.plan_load, {})):  # the dry run
            with pytest.raises(cairn.MismatchError) as e:
                call(tmp_path / "ck", bad, **kw)
            errors.append(str(e.value))
        assert len(set(errors)) == 1, errors
        assert str(tmp_path / "ck") in errors[0]


def test_retries_while_opening_count_in_the_loads_stats(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    cairn.save(path, STATE)
    real_read = _local.LocalStorage.read

    def read(self, key):  # as an object store's client counts a GET of the manifest it had to retry
        if key.endswith(fmt.MANIFEST):
            self.retries = self.retries + 1
        return real_read(self, key)

    monkeypatch.setattr(_local.LocalStorage, "read", read)
    stats = cairn.LoadStats()
    cairn.load(path, stats=stats)
    assert stats.retries == 1
