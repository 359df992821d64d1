"""Storage writes held back until a test says so: a save stays in flight for as long as it must."""

import threading

from cairn._storage.local import LocalStorage


def hold_writes(monkeypatch):
    """Writes wait until the returned event is set: whatever the test does first surely runs before them."""
    go = threading.Event()
    orig = LocalStorage.write

    def write(self, key, parts):
        assert go.wait(60)
        return orig(self, key, parts)

    monkeypatch.setattr(LocalStorage, "write", write)
    return go
