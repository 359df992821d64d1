"""Unit tests of `_run` (a run's directory), fast and in one process, on memory:// storage.

Step folder names and the survey of a directory (`steps`), the retention helpers (`retention`; the
policies' model-based tests are test_retention.py), reader leases (`leases`) and the references
between incremental steps (`refs`). The manager's use of them is tested in test_manager.py,
test_watch.py and test_incremental.py.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

import cairn
from cairn._run import leases as _leases
from cairn._run import refs as _refs
from cairn._run import steps as _steps
from cairn._run.retention import (
    CheckpointInfo,
    KeepAny,
    KeepBest,
    KeepLatest,
    policy_from,
    retained,
)
from cairn._storage.memory import MemoryStorage


def _store() -> MemoryStorage:
    return MemoryStorage()


def _committed(st: MemoryStorage, folder: str) -> None:
    """A folder that reads as a committed cairn checkpoint to a listing (the manifest's presence)."""
    st.put(f"{folder}/manifest.json", b"{}")


def _orbax(st: MemoryStorage, folder: str) -> None:
    """An Orbax step folder as an object store holds it once committed."""
    st.put(f"{folder}/_CHECKPOINT_METADATA", b"{}")
    st.put(f"{folder}/commit_success.txt", b"")


# ---------------------------------------------------------------------- steps: naming


def test_canonical_step_names_round_trip_and_nothing_else_parses():
    assert _steps.step_dirname(7) == "step_00000007"
    assert _steps.parse_step("step_00000007") == 7
    assert _steps.parse_step("step_123456789") == 123456789  # more than 8 digits
    for other in ("step_7", "step_000000007", "7", "step_0000007x", ".step_00000007"):
        assert _steps.parse_step(other) is None, other


def test_step_names_of_a_format_parse_only_their_own_spelling():
    names = _steps.StepNames("ckpt_{step:04d}")
    assert names.name(12) == "ckpt_0012" and names.parse("ckpt_0012") == 12
    assert names.parse("ckpt_12") is None and names.parse("ckpt_00012") is None
    assert _steps.StepNames("{step}").parse("100") == 100
    for bad in ("step", "a/{step}", "{step}_{step}", ".{step}", "{stp}"):
        with pytest.raises(ValueError, match="step_format"):
            _steps.StepNames(bad)


def test_lenient_and_orbax_names():
    assert [_steps.guess_step(n) for n in ("step_12", "step12", "step-12", "12", "eval_12")] == [12, 12, 12, 12, None]
    assert _steps.orbax_name("100") == ("", 100)
    assert _steps.orbax_name("ckpt_0010") == ("ckpt", 10)
    assert _steps.orbax_name("10.orbax-checkpoint-tmp-123") is None


def test_step_metadata_keeps_numbers_and_the_users_json():
    meta = _steps.step_metadata(3, {"loss": 0.5, "nan": float("nan")}, "run step 3", {"epoch": 1})
    assert meta == {_steps.META_KEY: {"step": 3, "metrics": {"loss": 0.5, "nan": None}, "user": {"epoch": 1}}}
    with pytest.raises(TypeError, match="run step 3: metric 'loss' is a str; metrics must be numbers"):
        _steps.step_metadata(3, {"loss": "low"}, "run step 3")
    with pytest.raises(TypeError, match="run step 3: metadata must be JSON-able"):
        _steps.step_metadata(3, None, "run step 3", {"x": object()})


def test_show_steps_names_the_newest_few():
    assert _steps.show_steps([]) == "none"
    assert _steps.show_steps(list(range(8))) == "3, 4, 5, 6, 7 (and 3 older)"


# ---------------------------------------------------------------------- steps: the survey


def test_survey_counts_committed_steps_and_names_the_strays():
    st = _store()
    _committed(st, "step_00000001")
    _committed(st, "step_00000002")
    st.put("step_00000003/p00000-0.abc.bin", b"x")  # no manifest: an interrupted save, not a step
    _committed(st, "step_4")  # a cairn checkpoint in another spelling
    st.put("checkpoint_5/.metadata", b"x")  # a DCP checkpoint
    st.put("eval_6/result.json", b"{}")  # not step-like: ignored
    st.put(".cairn-leases/step_00000001.r.lease", b"{}")  # hidden: ignored
    survey = _steps.survey(st)
    assert survey.steps == {1: "step_00000001", 2: "step_00000002"} and survey.orbax == set()
    assert [(s.name, s.step, s.kind) for s in survey.strays] == [("checkpoint_5", 5, "dcp"), ("step_4", 4, "cairn")]
    assert _steps.committed_steps(st) == [1, 2]
    assert _steps.newest_committed(st) == 2 and _steps.newest_committed(st, after=2) is None


def test_survey_takes_orbax_steps_and_refuses_a_step_saved_twice():
    st = _store()
    _orbax(st, "100")
    _orbax(st, "200")
    st.put("300/_CHECKPOINT_METADATA", b"{}")  # an Orbax save not yet committed on an object store
    _committed(st, "step_00000200")  # step 200 in cairn's naming too
    survey = _steps.survey(st)
    assert survey.steps == {100: "100"} and survey.orbax == {100}
    assert sorted((s.name, s.kind) for s in survey.strays) == [("200", "orbax"), ("step_00000200", "cairn")]
    assert all("saved in 2 folders" in s.why for s in survey.strays)
    assert _steps.folders_of_step(st, 200) == ["200", "step_00000200"]
    with pytest.raises(cairn.CheckpointError, match="step 200 has 2 folders"):
        _steps.folder_of(st, 200)
    assert _steps.folder_of(st, 100) == "100"


def test_leftovers_are_uncommitted_step_folders_only():
    st = _store()
    _committed(st, "step_00000001")
    st.put("step_00000002/p00000-0.abc.bin", b"x")
    st.put("step_00000003/p00000-0.abc.bin", b"x")
    assert sorted(_steps.leftovers(st, busy={3})) == ["step_00000002"]  # a save in progress is busy


# ---------------------------------------------------------------------- retention


def _infos(*steps: int, loss: dict[int, float] | None = None) -> list[CheckpointInfo]:
    return [CheckpointInfo(s, {"loss": (loss or {}).get(s, 1.0)}) for s in steps]


def test_retained_always_keeps_the_newest_and_everything_without_a_policy():
    infos = _infos(1, 2, 3)
    assert retained(None, infos) == {1, 2, 3}
    assert retained(KeepBest(1, "loss"), _infos(1, 2, 3, loss={1: 0.1})) == {1, 3}
    assert retained(KeepLatest(1), []) == set()


def test_policy_from_the_managers_arguments():
    assert policy_from(None, None, None, None, "min", None) is None
    p = policy_from(2, 10, 1, "loss", "min", None)
    assert isinstance(p, KeepAny)
    assert retained(p, _infos(5, 10, 15, 20, 25, loss={5: 0.01})) == {5, 10, 20, 25}
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        policy_from(None, None, 1, None, "min", None)
    with pytest.raises(ValueError, match="best_metric is set but keep_best is not"):
        policy_from(None, None, None, "loss", "min", None)
    with pytest.raises(TypeError, match="retention entries must be RetentionPolicy objects, got int"):
        policy_from(None, None, None, None, "min", [KeepLatest(1), 3])


# ---------------------------------------------------------------------- leases


def test_a_lease_is_seen_by_the_trainer_and_spares_its_step():
    st = _store()
    _committed(st, "step_00000001")
    _committed(st, "step_00000002")
    lease = _leases.take(st, 1, "run", ttl_s=60, reader="eval")
    assert lease is not None and not lease.lost
    try:
        (rec,) = _leases.leases(st)
        assert (rec.step, rec.reader) == (1, "eval") and rec.live(time.time())
        with _leases.spare_leased(st, [1, 2], "run") as deletable:
            assert deletable == [2]
            assert st.exists(".cairn-deleting.step_00000001")  # the trainer's flags, during the pass
        assert not st.exists(".cairn-deleting.step_00000001")  # and removed after it
    finally:
        lease.release()
    assert _leases.leases(st) == []
    with _leases.spare_leased(st, [1], "run") as deletable:
        assert deletable == [1]


def test_a_reader_backs_off_a_step_being_deleted_or_gone():
    st = _store()
    _committed(st, "step_00000001")
    with _leases.spare_leased(st, [1], "run"):
        assert _leases.take(st, 1, "run", reader="late") is None  # it sees the marker
    assert _leases.take(st, 9, "run", reader="late") is None  # no such step
    assert _leases.leases(st) == []  # nothing left behind either time
    with pytest.raises(ValueError, match="run: lease ttl_s must be > 0"):
        _leases.take(st, 1, "run", ttl_s=0)


def test_an_expired_lease_pins_nothing_and_is_removed():
    st = _store()
    _committed(st, "step_00000001")
    key = ".cairn-leases/step_00000001.crashed.lease"
    st.put(key, json.dumps({"step": 1, "reader": "crashed", "expires_unix": time.time() - 1}).encode())
    st.put(".cairn-leases/step_00000001.broken.lease", b"not json")  # unreadable: expired
    st.put(".cairn-leases/notalease.txt", b"")  # not a lease file: ignored
    assert sorted(r.reader for r in _leases.leases(st)) == ["broken", "crashed"]
    with _leases.spare_leased(st, [1], "run") as deletable:
        assert deletable == [1]
    assert _leases.leases(st) == []


def test_stale_deletion_markers_are_removed():
    st = _store()
    st.put(".cairn-deleting.step_00000004", b"{}")
    _leases.remove_stale_markers(st)
    assert not st.exists(".cairn-deleting.step_00000004")


# ---------------------------------------------------------------------- refs


def test_steps_that_kept_steps_refer_to_are_protected():
    run = f"memory://run-units-{uuid.uuid4().hex}/run"
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    cairn.save(f"{run}/step_00000001", state)
    # Step 1 has no hashes, so step 2 writes every block (with hashes); 3 and 4 refer to 2's blocks,
    # where the bytes are (a reference names the file that holds them, not the step in between).
    for step in (2, 3, 4):
        cairn.save(f"{run}/step_{step:08d}", state, base=f"{run}/step_{step - 1:08d}")
    cairn.save(f"{run}/step_00000005", state)  # self-contained
    _, st = _steps.open_directory(run)
    folders = _steps.step_folders(st)
    assert [_refs.bases_of(st, folders[s]) for s in range(1, 6)] == [(), (), ("step_00000002",),
                                                                      ("step_00000002",), ()]
    assert _refs.bases_of(st, "nothing") == ()
    assert _refs.protected(st, folders, keep=[4]) == {2, 4}
    assert _refs.protected(st, folders, keep=[5, 1]) == {1, 5}
    assert _refs.protected(st, folders, keep=[], extra=["step_00000003"]) == {2, 3}  # a save in progress
    assert _refs.referrers(st, folders, 2) == [3, 4] and _refs.referrers(st, folders, 1) == []


def test_protection_follows_references_through_each_other(monkeypatch):
    """`protected` walks bases of bases (the manifests' ``bases`` stand in for a chain of saves)."""
    st = _store()
    for step in (1, 2, 3, 4):
        _committed(st, f"step_{step:08d}")
    refers = {"step_00000002": ("step_00000001",), "step_00000003": ("step_00000002",)}
    monkeypatch.setattr(_refs, "bases_of", lambda _st, folder: refers.get(folder, ()))
    folders = _steps.step_folders(st)
    assert _refs.protected(st, folders, keep=[3]) == {1, 2, 3}
    assert _refs.protected(st, folders, keep=[4]) == {4}
    assert _refs.referrers(st, folders, 1) == [2]
