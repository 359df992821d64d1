"""Grain: checkpoint a data iterator's position with `get_state` / `set_state`.

    python examples/grain_iterator.py

A dataset iterator's state is a small dict and a `grain.DataLoader`'s is
bytes; either is one more entry of the checkpointed mapping. This is the
single-process pattern: with several processes, each has its own iterator
and declares its state with `cairn.PerProcess` (see grain_elastic.py).
"""

from __future__ import annotations

import tempfile

import grain

import cairn


def batches() -> grain.IterDataset:
    return grain.MapDataset.range(100).shuffle(seed=0).map(lambda i: i * 2).batch(8).to_iter_dataset()


def main() -> None:
    it = iter(batches())
    for _ in range(5):
        next(it)
    with tempfile.TemporaryDirectory() as tmp:
        cairn.save(f"{tmp}/step_5", {"data": it.get_state(), "step": 5})
        want = [next(it).tolist() for _ in range(3)]

        restored = cairn.load(f"{tmp}/step_5")
    resumed = iter(batches())
    resumed.set_state(restored["data"])
    got = [next(resumed).tolist() for _ in range(3)]

    print("saved state:", restored["data"])
    print("next batches:", got)
    assert got == want, "the restored iterator yields different batches"
    print("OK: the restored iterator continues where the saved one was")


if __name__ == "__main__":
    main()
