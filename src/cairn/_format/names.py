"""Pure: the names of a checkpoint's folders and files (docs/FORMAT.md), re-exported by `_format`."""

from __future__ import annotations

from urllib.parse import quote


def item_dirname(name: str) -> str:
    """The folder of checkpointable `name`: percent-escaped, never '.'-led or nested."""
    s = quote(name, safe="").replace(".", "%2E").replace("~", "%7E")
    if not s:
        s = "%"
    if len(s) > 200:
        import hashlib

        s = s[:150] + "%%" + hashlib.sha256(name.encode()).hexdigest()[:32]
    return s


def data_file_name(process: int, k: int, token: str) -> str:
    return f"p{process:05d}-{k}.{token}.bin"


def index_name(token: str) -> str:
    return f"index.{token}.json"


def partial_index_name(process: int, token: str) -> str:
    return f"_index.p{process:05d}.{token}.json"


def tmp_dirname(name: str, token: str) -> str:
    """The temporary sibling folder a local save writes before its rename."""
    return f".{name}.cairn-tmp-{token}"


TMP_MARK = ".cairn-tmp-"


def num_blocks(size: int, block_size: int) -> int:
    return -(-size // block_size)
