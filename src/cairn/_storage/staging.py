"""A seekable local file that becomes an object of any storage only once complete.

Some writers need to seek (a zip archive records member offsets as it goes),
which a streamed `Storage.write` cannot offer. `staged_file` hands out a real
file: on local storage a hidden sibling of the destination, fsync'd and
renamed into place; elsewhere a temporary local file, uploaded in pieces
once it is complete. An error inside the block leaves nothing at `key`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

from .base import Storage
from .local import LocalStorage, fsync_dir

_UPLOAD_PIECE = 64 << 20


@contextlib.contextmanager
def staged_file(storage: Storage, key: str, piece_bytes: int = _UPLOAD_PIECE) -> Iterator[BinaryIO]:
    """Yield a writable, seekable file that is published as `key` when the block exits cleanly.

    An upload reads the finished file back `piece_bytes` at a time (the caller's memory budget).

    Example:

        with staged_file(storage, "model.pt") as f:
            write_zip(f)
    """
    local = isinstance(storage, LocalStorage)
    final = storage.describe(key) if local else ""
    folder = os.path.dirname(final) if local else tempfile.gettempdir()
    if local:
        os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(key)}.cairn-tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if local:
            os.replace(tmp, final)
            fsync_dir(folder)
        else:
            storage.write(key, _pieces(tmp, piece_bytes))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _pieces(path: str, piece_bytes: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while piece := f.read(piece_bytes):
            yield piece
