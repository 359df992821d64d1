"""cairn's object-store settings: `storage_options` -> (cairn's tuning, obstore's client and store settings).

Kept apart from `_obstore` (which uses them) so that each stays one room.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_MiB = 1 << 20

# obstore's HTTP client settings; everything else that is not cairn's goes to the store's config.
_CLIENT_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "default_headers", "pool_idle_timeout", "pool_max_idle_per_host", "proxy_url",
    "proxy_ca_certificate", "proxy_excludes", "root_certificate", "randomize_addresses",
    "read_timeout", "timeout", "user_agent",
})
_ALIASES = {"endpoint_url": "endpoint"}  # boto3's name, which users reach for


@dataclass(frozen=True)
class Tuning:
    """cairn's own object-store settings (see the module docstring)."""

    max_retries: int = 5
    retry_backoff: float = 0.1
    max_backoff: float = 10.0
    part_size: int = 16 * _MiB
    upload_concurrency: int = 4
    # The read size this store prefers, which the storage states (`Storage.preferred_read`): a load
    # plans its reads up to it (adjacent chunks of a file merged, across boxes and leaves) and each
    # goes out as one GET. Stores charge per request, and some servers (moto) pass over the whole
    # object for each ranged GET, where reads as large as the data files win (docs/performance-objstore.md).
    read_size: int = 64 * _MiB
    # The two halves of `read_size`, apart (0 or None: `read_size`): the largest ranged GET, and the
    # largest read a load plans.
    read_part_size: int = 0
    read_concurrency: int = 4
    plan_read_size: int = 0

    def __post_init__(self) -> None:
        for name in ("read_part_size", "plan_read_size"):
            if not getattr(self, name):
                object.__setattr__(self, name, self.read_size)
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.part_size < 5 * _MiB:
            # S3 rejects multipart parts under 5 MiB (except the last).
            raise ValueError(f"part_size must be at least 5 MiB, got {self.part_size}")
        sizes = {"read_size": self.read_size, "read_part_size": self.read_part_size,
                 "upload_concurrency": self.upload_concurrency, "read_concurrency": self.read_concurrency,
                 "plan_read_size": self.plan_read_size}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be a positive number of bytes or requests, got {value!r}")


_TUNING_KEYS = frozenset(f.name for f in fields(Tuning))


def split_options(options: dict[str, Any] | None) -> tuple[Tuning, dict[str, Any], dict[str, Any]]:
    """`options` -> (cairn tuning, obstore client options, obstore store config)."""
    tuning: dict[str, Any] = {}
    client: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for k, v in (options or {}).items():
        k = _ALIASES.get(k, k)
        if k in _TUNING_KEYS:
            tuning[k] = v
        elif k in _CLIENT_KEYS:
            client[k] = v
        elif k == "client_options":
            client.update(v)
        else:
            config[k] = v
    _azure_emulator_at_endpoint(config, client)
    return Tuning(**tuning), client, config


# Azurite's account and its documented development key, the same in every Azurite (and in
# obstore, which uses them for `use_emulator`): public, not a secret.
_AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _truthy(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"))


def _azure_emulator_at_endpoint(config: dict[str, Any], client: dict[str, Any]) -> None:
    """``use_emulator`` with an ``endpoint``: the emulator at that address.

    obstore's ``use_emulator`` ignores ``endpoint`` and reads the emulator's
    address only from the process-wide ``AZURITE_BLOB_STORAGE_URL`` (default
    ``http://127.0.0.1:10000``). With an ``endpoint`` the same store is spelt
    out instead: the emulator's account and key (unless given), the account
    appended to the endpoint (Azurite's path-style URLs) and plain HTTP.
    """
    if not _truthy(config.get("use_emulator")) or not config.get("endpoint"):
        return
    del config["use_emulator"]
    account = config.setdefault("account_name", _AZURITE_ACCOUNT)
    config.setdefault("account_key", _AZURITE_KEY)
    endpoint = str(config["endpoint"]).rstrip("/")
    if not endpoint.endswith("/" + account):
        endpoint += "/" + account
    config["endpoint"] = endpoint
    client.setdefault("allow_http", endpoint.startswith("http://"))
