"""One options object for a load: the same checks for `cairn.load`, `plan_load` and the engine."""

import dataclasses

import numpy as np
import pytest

import cairn
from cairn._load.options import LoadOptions, options_of


@pytest.mark.parametrize("bad", [dict(threads=0), dict(threads=True), dict(budget_bytes=0), dict(budget_bytes=1.5),
                                 dict(read_once="yes"), dict(timeout=0), dict(timeout=-1.0)])
def test_bad_options_are_refused_by_load_and_by_its_plan_before_any_read(tmp_path, bad):
    cairn.save(tmp_path / "c", {"x": np.arange(4)})
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        cairn.load(tmp_path / "c", **bad)
    if name != "timeout":  # plan_load waits for nobody
        with pytest.raises(ValueError, match=name):
            cairn.plan_load(tmp_path / "c", processes=1, **bad)
    with pytest.raises(ValueError, match=name):  # before the path is even looked at
        cairn.load(tmp_path / "missing", **bad)


def test_changes_apply_to_given_options_and_unknown_names_are_a_type_error():
    base = LoadOptions(threads=2, partial=True)
    assert options_of(base, {"threads": 4}) == LoadOptions(threads=4, partial=True)
    assert options_of(None, {}) == LoadOptions()
    assert options_of(base, {}) is base
    with pytest.raises(TypeError):
        options_of(base, {"thread": 4})
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.threads = 3  # type: ignore[misc]


def test_every_public_load_keyword_is_an_option_or_says_why_not():
    """A new load option is added to LoadOptions (one place), not threaded through by hand."""
    import inspect

    options = {f.name for f in dataclasses.fields(LoadOptions)}
    # Not options of how to read: where the checkpoint is, what comes back, and what is reported.
    outside = {"path", "target", "storage_options", "framework", "report", "stats"}
    load_keywords = set(inspect.signature(cairn.load).parameters)
    assert load_keywords - outside == options
    plan_keywords = set(inspect.signature(cairn.plan_load).parameters)
    # The dry run has no coordinator and waits for nobody; it adds what it simulates.
    assert plan_keywords - outside - {"processes", "bandwidth", "platform"} == options - {"coordinator", "timeout"}
