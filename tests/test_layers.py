"""The house rules of src/cairn, checked on the source with `ast` (only the __all__ check imports cairn).

Rules (docs/ARCHITECTURE.md, shared/DESIGN.md "Layers"):

1. No upward imports: every module has a rank in `LAYERS`; a module imports
   only modules of its own rank or below (every import counts, also those
   inside functions, since a lazy import is still a dependency).
2. `_format` and `_plan` are pure: no cairn module but `PURE_MAY_IMPORT`, no
   JAX, no file or network I/O.
3. Only `_coord` touches `jax.distributed` (or `jax._src.distributed`).
4. Only `_storage/` and `_commit` do file or network I/O.
5. The public API is `cairn.__all__` (pinned below), re-exported from
   `cairn/__init__.py` and from nowhere else; every other module is private.
6. No module is over `MAX_LINES` lines.

Each rule is a checker function over a module's source, and each checker has a
negative test on a synthetic source, so that no rule can pass by being unable
to fail. A new module must be added to `LAYERS`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PKG = SRC / "cairn"

# ----------------------------------------------------------------------------------- the rules

# The layers, top to bottom (shared/DESIGN.md: api > manager > items/engine > tree/plan/format
# > coord > storage). A module may import modules of its own rank or lower. To add a module,
# give it the rank of the layer it belongs to; to split one, give the parts ranks that keep
# every existing import downward.
LAYERS: dict[str, int] = {
    # the public surface: re-exports only
    "cairn": 100,
    # api and the command line
    "cairn._api": 90,
    "cairn._cli": 90,
    # manager: CheckpointManager on top of its parts; _steps is shared with the CLI
    "cairn._manager": 80,
    "cairn._localtier": 79,
    "cairn._localxfer": 78,
    "cairn._localplan": 78,
    "cairn._localblob": 78,
    "cairn._replicas": 78,
    "cairn._watch": 77,
    "cairn._agree": 76,
    "cairn._preemption": 75,
    "cairn._leases": 73,
    "cairn._steps": 72,
    "cairn._retention": 70,
    # restore transforms (rename, drop, fill) over the sources; the dry run of a load
    "cairn._plancmd": 71,
    "cairn._dryrun": 71,
    "cairn._transforms": 69,
    # between engine and cli: verification and conversion
    # readers of other formats (Orbax, DCP, safetensors) and the sharded safetensors export
    "cairn._sources._convert": 69,
    "cairn._sources": 68,
    "cairn._sources._hf": 67,
    "cairn._sources._dcp": 67,
    "cairn._sources._orbax": 67,
    "cairn._export": 67,
    "cairn._sources._base": 66,
    "cairn._sources._torchsave": 66,
    "cairn._copy": 66,
    "cairn._verify": 65,
    "cairn._safetensors": 65,
    "cairn._torchfile": 65,
    "cairn._torch": 62,
    # engine (save / load / reader / async) and items
    "cairn._async": 58,
    "cairn._save": 55,
    "cairn._load": 55,
    "cairn._reader": 53,
    "cairn._metadata": 52,
    "cairn._coalesce": 52,
    "cairn._streamwriter": 54,
    "cairn._waves": 54,
    "cairn._readonce": 54,
    "cairn._prefetch": 54,
    "cairn._indexparts": 54,
    "cairn._layout": 54,
    "cairn._snapshot": 54,
    "cairn._commit": 51,
    "cairn._perprocess": 51,
    "cairn._leaves": 50,
    "cairn._jaxutil": 48,
    # tree / plan / format (pure)
    "cairn._tree": 40,
    "cairn._estimate": 39,
    "cairn._planmemo": 39,  # plan_reads, memoised per layout
    "cairn._plan": 38,
    "cairn._merge": 38,
    "cairn._grid": 38,
    "cairn._format": 36,
    "cairn._binindex": 35,
    "cairn._structure": 35,
    "cairn._runs": 35,
    "cairn._values": 35,
    "cairn._chunks": 35,
    "cairn._names": 35,
    "cairn._partfile": 34,
    # coord
    "cairn._coord": 30,
    # storage: a path's storage, then bytes only
    "cairn._location": 25,
    "cairn._storage": 20,
    "cairn._storage._local": 18,
    "cairn._storage._memory": 18,
    "cairn._storage._obstore": 18,
    "cairn._storage._obsettings": 17,
    "cairn._storage._staging": 19,
    "cairn._storage._base": 16,
    # the bottom: anything may use these
    "cairn._stats": 7,  # stats, metrics events and listeners: stdlib only (JAX if imported)
    "cairn._buffers": 6,
    "cairn._memo": 4,
    "cairn._gcpause": 4,
    "cairn._version": 4,
    "cairn._checksum": 4,
    "cairn._errors": 0,
}

PURE = ("cairn._format", "cairn._values", "cairn._chunks", "cairn._plan", "cairn._planmemo", "cairn._grid",
        "cairn._estimate", "cairn._names")
# The cairn modules the pure ones may import (what they import today).
PURE_MAY_IMPORT = {"cairn._format", "cairn._values", "cairn._chunks", "cairn._plan", "cairn._grid", "cairn._checksum",
                   "cairn._binindex", "cairn._structure", "cairn._runs", "cairn._names", "cairn._partfile",
                   "cairn._errors"}

JAX_DISTRIBUTED = ("jax.distributed", "jax._src.distributed")
MAY_TOUCH_JAX_DISTRIBUTED = {"cairn._coord"}


def may_do_io(module: str) -> bool:
    return module == "cairn._commit" or module == "cairn._storage" or module.startswith("cairn._storage.")


# File and network I/O: any use of these names (dotted prefixes; `open` is the builtin).
IO_NAMES = (
    "builtins.open", "io.open", "io.FileIO", "os.fdopen",
    *(f"os.{f}" for f in (
        "open", "read", "write", "pread", "pwrite", "readv", "writev", "preadv", "pwritev", "sendfile",
        "copy_file_range", "replace", "rename", "renames", "unlink", "remove", "removedirs", "rmdir",
        "mkdir", "makedirs", "fsync", "fdatasync", "sync", "listdir", "scandir", "walk", "fwalk", "stat",
        "lstat", "truncate", "ftruncate", "posix_fallocate", "link", "symlink", "readlink", "utime",
        "chmod", "chown", "statvfs",
    )),
    *(f"os.path.{f}" for f in (
        "exists", "lexists", "isfile", "isdir", "islink", "ismount", "getsize", "getmtime", "getatime",
        "getctime", "samefile", "realpath",
    )),
    "shutil", "tempfile", "socket", "obstore", "urllib.request", "http.client", "requests", "httpx",
    "ftplib", "mmap",
)
# Importing one of these is I/O by itself (urllib.parse, say, is not).
IO_MODULES = ("shutil", "tempfile", "socket", "obstore", "urllib.request", "http.client", "requests",
              "httpx", "ftplib", "mmap")
ZIP_WRITERS = ("zipfile.ZipFile", "zipfile.PyZipFile")

MAX_LINES = 500

# The public API, exactly (cairn.__all__ at commit 8b322df, plus export_safetensors). Changing it is an
# API change: update this list in the same commit, and the docs.
PUBLIC_API = [
    "ArrayMetadata", "CheckpointError", "CheckpointExistsError", "CheckpointInfo", "CheckpointManager",
    "CheckpointNotFoundError", "CoordinationError", "CoordinationTimeoutError", "Coordinator",
    "CorruptCheckpointError", "KeepAll", "KeepAny", "KeepBest", "KeepEvery", "KeepIf", "KeepLatest",
    "KeepNewerThan", "KeepOnePer", "LoadPlan", "LoadStats", "LocalTier", "MismatchError",
    "PerProcess", "RestoreReport", "RetentionPolicy", "SaveFuture", "SaveStats", "StatsEvent", "UnsupportedTypeError", "__version__",
    "add_listener", "copy", "export_safetensors", "load", "metadata", "plan_load", "register_type", "release_snapshot_buffers", "remove_listener", "save", "save_async", "wait_all",
]


# ------------------------------------------------------------------------------- source model


@dataclass(frozen=True)
class Import:
    base: str  # the absolute module of `import base` / `from base import name`
    name: str | None  # the imported name of a `from` import
    line: int

    def targets(self) -> list[str]:
        """What this import may load: `base`, and `base.name` (a submodule or an attribute)."""
        return [self.base] if self.name is None else [self.base, f"{self.base}.{self.name}"]


@dataclass(frozen=True)
class Violation:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


class Source:
    """One module's AST, its imports (at any depth) and the dotted names it uses."""

    def __init__(self, module: str, text: str, is_package: bool = False, where: str | None = None):
        self.module, self.is_package = module, is_package
        self.where = where or module
        self.text = text
        self.tree = ast.parse(text)
        self.imports = list(self._imports())
        self.aliases = self._aliases()

    def _resolve(self, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        package = self.module if self.is_package else self.module.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - (level - 1)])
        return f"{base}.{module}" if module else base

    def _imports(self) -> Iterator[Import]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield Import(a.name, None, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = self._resolve(node.level, node.module)
                for a in node.names:
                    yield Import(base, a.name, node.lineno)
            elif (isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module", "__import__")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                yield Import(node.args[0].value, None, node.lineno)

    def _aliases(self) -> dict[str, str]:
        """Local name -> the dotted name it is bound to by an import (any scope)."""
        out: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        out[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        out[root] = root
            elif isinstance(node, ast.ImportFrom):
                base = self._resolve(node.level, node.module)
                for a in node.names:
                    out[a.asname or a.name] = f"{base}.{a.name}"
        return out

    @functools.cached_property
    def bound_names(self) -> set[str]:
        """Names the module binds itself (so a bare `open` there is not the builtin)."""
        out = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                out.add(node.id)
            elif isinstance(node, ast.arg):
                out.add(node.arg)
        return out

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted name that a name or attribute chain rooted in an import (or builtin `open`) means."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        root, _, rest = dotted.partition(".")
        if root in self.aliases:
            return self.aliases[root] + (f".{rest}" if rest else "")
        if root == "open" and not rest and "open" not in self.bound_names:
            return "builtins.open"
        return None  # a local name, not a module

    def uses(self) -> Iterator[tuple[str, int]]:
        """Every name and attribute chain the module reads, resolved (with its line)."""
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                dotted = self.resolve(node)
                if dotted is not None:
                    yield dotted, node.lineno


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def sources() -> dict[str, Source]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        out[name] = Source(name, path.read_text(), path.name == "__init__.py", str(path.relative_to(SRC.parent)))
    return out


MODULES = sorted(module_name(p) for p in PKG.rglob("*.py"))
FILES = sorted(p.relative_to(SRC.parent).as_posix() for p in PKG.rglob("*.py"))


# ----------------------------------------------------------------------------------- checkers


def cairn_target(imp: Import, known: set[str]) -> str | None:
    """The cairn module an import loads (`from . import _format` is `cairn._format`), or None."""
    if not _under(imp.base, "cairn"):
        return None
    if imp.name is not None and f"{imp.base}.{imp.name}" in known:
        return f"{imp.base}.{imp.name}"
    return imp.base


def layer_violations(src: Source, layers: dict[str, int], known: set[str] | None = None) -> list[Violation]:
    known = set(layers) | (known or set())
    if src.module not in layers:
        return [Violation(src.where, 1, f"{src.module} has no rank: add it to LAYERS in tests/test_layers.py")]
    mine = layers[src.module]
    out: dict[tuple[int, str], Violation] = {}
    for imp in src.imports:
        target = cairn_target(imp, known)
        if target is None or target == src.module or (imp.line, target) in out:
            continue
        if target not in layers:
            out[imp.line, target] = Violation(src.where, imp.line,
                                              f"imports {target}, which has no rank: add it to LAYERS")
        elif layers[target] > mine:
            what = f"{target}.{imp.name}" if target == imp.base and imp.name else target
            out[imp.line, target] = Violation(src.where, imp.line, f"upward import of {what} (rank "
                                                                   f"{layers[target]}) from {src.module} (rank {mine})")
    return [out[k] for k in sorted(out)]


def purity_violations(src: Source, may_import: set[str] = PURE_MAY_IMPORT) -> list[Violation]:
    out = []
    known = set(LAYERS) | set(sources())
    for imp in src.imports:
        if any(_under(t, "jax") or _under(t, "jaxlib") for t in imp.targets()):
            out.append(Violation(src.where, imp.line, f"pure module imports JAX ({imp.base})"))
        target = cairn_target(imp, known)
        if target is not None and target != src.module and target not in may_import:
            out.append(Violation(src.where, imp.line, f"pure module imports {target} "
                                                      f"(it may import only {sorted(may_import)})"))
    return out + io_violations(src, allowed=False)


def jax_distributed_violations(src: Source, allowed: bool | None = None) -> list[Violation]:
    if allowed is None:
        allowed = src.module in MAY_TOUCH_JAX_DISTRIBUTED
    if allowed:
        return []
    out = {}
    for imp in src.imports:
        for t in imp.targets():
            if any(_under(t, p) for p in JAX_DISTRIBUTED):
                out[imp.line] = Violation(src.where, imp.line, f"imports {t} (only _coord may touch jax.distributed)")
    for dotted, line in src.uses():
        if line not in out and any(_under(dotted, p) for p in JAX_DISTRIBUTED):
            out[line] = Violation(src.where, line, f"uses {dotted} (only _coord may touch jax.distributed)")
    return [out[k] for k in sorted(out)]


def io_violations(src: Source, allowed: bool | None = None) -> list[Violation]:
    if allowed is None:
        allowed = may_do_io(src.module)
    if allowed:
        return []
    found: dict[tuple[int, str], Violation] = {}

    def add(line: int, key: str, what: str) -> None:
        found.setdefault((line, key), Violation(src.where, line, what))

    for imp in src.imports:
        for t in imp.targets():
            hit = next((m for m in IO_MODULES if _under(t, m)), None)
            if hit:
                add(imp.line, hit, f"imports {t} (I/O belongs in _storage or _commit)")
    for dotted, line in src.uses():
        hit = next((n for n in IO_NAMES if _under(dotted, n)), None)
        if hit:
            add(line, hit, f"{dotted} (I/O belongs in _storage or _commit)")
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Call):
            name = src.resolve(node.func)
            if name in ZIP_WRITERS:
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "mode"), None)
                target = node.args[0] if node.args else next(
                    (k.value for k in node.keywords if k.arg == "file"), None)
                # Encoding a zip into a file object that storage handed out is not I/O of
                # this module's own; opening a zip by path is.
                by_path = isinstance(target, ast.JoinedStr) or (
                    isinstance(target, ast.Constant) and isinstance(target.value, str)) or (
                    isinstance(target, ast.Call) and (src.resolve(target.func) or "").startswith("os."))
                if mode is None or not by_path:
                    continue
                if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)) or set(mode.value) & set("wax"):
                    add(node.lineno, "zipfile", f"{name}(..., mode={ast.unparse(mode)}) writes a zip file "
                                                 "(I/O belongs in _storage or _commit)")
    return [found[k] for k in sorted(found)]


def top_level_definitions(src: Source) -> set[str]:
    out = set()
    for node in src.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def declared_all(src: Source) -> list[str] | None:
    for node in src.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def reexport_violations(src: Source, public: set[str], by_module: dict[str, Source]) -> list[Violation]:
    """Public names re-exported from anywhere but the package root, or not from where they are defined."""
    out = []
    exported = set(declared_all(src) or ())
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = src._resolve(node.level, node.module)
        for a in node.names:
            bound = a.asname or a.name
            if bound not in public:
                continue
            if src.module != "cairn":
                if a.asname == a.name or bound in exported:
                    out.append(Violation(src.where, node.lineno, f"re-exports public name {bound} (from {base}); "
                                                                 "public names are re-exported only by cairn/__init__.py"))
            elif base in by_module and a.name not in top_level_definitions(by_module[base]):
                out.append(Violation(src.where, node.lineno, f"imports {a.name} from {base}, which does not define "
                                                             "it; import it from the module that defines it"))
    if src.module != "cairn" and not all(p.startswith("_") for p in src.module.split(".")[1:]):
        out.append(Violation(src.where, 1, f"{src.module} is a public module; implementation modules are private (_name)"))
    return out


def size_violation(where: str, text: str, limit: int = MAX_LINES) -> list[Violation]:
    n = len(text.splitlines())
    return [Violation(where, n, f"{n} lines, over the limit of {limit}: split it")] if n > limit else []


def _fail(violations: list[Violation], rule: str) -> None:
    if violations:
        pytest.fail(f"{rule}:\n" + "\n".join(f"  {v}" for v in violations), pytrace=False)


# ----------------------------------------------------------------------------------- the tests


def test_every_module_has_a_rank():
    missing = [m for m in MODULES if m not in LAYERS]
    assert not missing, f"modules without a rank: {missing}; add them to LAYERS in tests/test_layers.py"


def test_no_rank_for_a_module_that_is_gone():
    stale = sorted(set(LAYERS) - set(MODULES))
    assert not stale, f"LAYERS names modules that do not exist: {stale}; remove them from tests/test_layers.py"


@pytest.mark.parametrize("module", MODULES)
def test_no_upward_imports(module):
    _fail(layer_violations(sources()[module], LAYERS, set(MODULES)), f"{module} imports upward")


@pytest.mark.parametrize("module", PURE)
def test_pure_modules(module):
    _fail(purity_violations(sources()[module]), f"{module} must be pure (no I/O, no JAX, few imports)")


def test_pure_modules_import_what_they_may():
    # The allowed set is what they import today, all at or below the pure layer; keep it from growing silently.
    for m in PURE_MAY_IMPORT:
        assert m in LAYERS and LAYERS[m] <= max(LAYERS[p] for p in PURE), m


@pytest.mark.parametrize("module", MODULES)
def test_only_coord_touches_jax_distributed(module):
    _fail(jax_distributed_violations(sources()[module]), f"{module} touches jax.distributed")


@pytest.mark.parametrize("module", MODULES)
def test_only_storage_and_commit_do_io(module):
    _fail(io_violations(sources()[module]), f"{module} does file or network I/O")


def test_all_is_pinned():
    assert declared_all(sources()["cairn"]) == PUBLIC_API


def test_public_names_are_exactly_all():
    import cairn

    assert cairn.__all__ == PUBLIC_API
    public = {n for n in vars(cairn) if not n.startswith("_")} | {"__version__"}
    assert public == set(PUBLIC_API), "public attributes of cairn that are not in __all__ (or missing ones)"


@pytest.mark.parametrize("module", MODULES)
def test_public_names_are_reexported_only_from_the_package(module):
    _fail(reexport_violations(sources()[module], set(PUBLIC_API), sources()),
          f"{module} breaks the public-API rule")


@pytest.mark.parametrize("path", FILES)
def test_module_size(path):
    _fail(size_violation(path, (SRC.parent / path).read_text()), f"{path} is too long")


# --------------------------------------------------------------- every checker can fail


def _src(module: str, text: str, is_package: bool = False) -> Source:
    return Source(module, text, is_package)


def test_checker_finds_upward_imports():
    layers = {"cairn": 9, "cairn._hi": 5, "cairn._lo": 1}
    assert layer_violations(_src("cairn._lo", "from ._hi import x\n"), layers)
    assert layer_violations(_src("cairn._lo", "def f():\n    from . import _hi\n"), layers)  # function-local
    assert layer_violations(_src("cairn._lo", "import cairn._hi\n"), layers)
    assert layer_violations(_src("cairn._lo", "from . import __version__\n"), layers)  # the package root
    assert layer_violations(_src("cairn._lo", "from cairn import _hi\n"), layers)
    v = layer_violations(_src("cairn._lo", "import os\nfrom ._lo import y\n\n\ndef g():\n    from ._hi import z\n"),
                         layers)
    assert [x.line for x in v] == [6] and "upward import of cairn._hi" in v[0].what
    assert not layer_violations(_src("cairn._hi", "from ._lo import x\nfrom . import _lo\n"), layers)
    assert not layer_violations(_src("cairn", "from ._hi import x\n", is_package=True), layers)


def test_checker_finds_modules_without_a_rank():
    layers = {"cairn._lo": 1}
    assert "add it to LAYERS" in layer_violations(_src("cairn._new", "x = 1\n"), layers)[0].what
    assert "add it to LAYERS" in layer_violations(_src("cairn._lo", "from ._new import x\n"), layers,
                                                  {"cairn._new"})[0].what


def test_checker_resolves_relative_imports_in_subpackages():
    layers = {"cairn._storage": 3, "cairn._storage._a": 2, "cairn._storage._b": 1, "cairn._x": 9}
    assert layer_violations(_src("cairn._storage._b", "from ._a import x\n"), layers)
    assert layer_violations(_src("cairn._storage._b", "from .. import _x\n"), layers)
    assert not layer_violations(_src("cairn._storage", "from ._a import x\n", is_package=True), layers)


def test_checker_finds_impure_code():
    for text in (
        "import jax\n",
        "def f():\n    import jax.numpy as jnp\n",
        "from jax.sharding import NamedSharding\n",
        "from . import _load\n",
        "from ._storage import open_storage\n",
        "def f(p):\n    with open(p) as f:\n        return f.read()\n",
        "import os\ndef f(p):\n    os.replace(p, p + '.x')\n",
    ):
        assert purity_violations(_src("cairn._format", text)), text
    assert not purity_violations(_src("cairn._plan", "import math\nfrom ._format import ArrayLeaf\n"
                                                     "from ._errors import E\nfrom urllib.parse import quote\n"))


def test_checker_finds_jax_distributed():
    for text in (
        "import jax.distributed\n",
        "from jax import distributed\n",
        "from jax._src import distributed\n",
        "def f():\n    from jax._src import distributed\n    return distributed.global_state\n",
        "from jax._src.distributed import global_state\n",
        "import jax\njax.distributed.initialize()\n",
        "import jax._src.distributed as d\n",
        "from jax import _src\nx = _src.distributed.global_state\n",
        "import importlib\nimportlib.import_module('jax._src.distributed')\n",
    ):
        assert jax_distributed_violations(_src("cairn._manager", text)), text
        assert not jax_distributed_violations(_src("cairn._coord", text)), text
    assert not jax_distributed_violations(_src("cairn._save", "import jax\njax.process_index()\n"))


def test_checker_finds_io():
    for text in (
        "def f(p):\n    return open(p, 'rb').read()\n",
        "import builtins\nbuiltins.open('x')\n",
        "import os\nos.replace('a', 'b')\n",
        "from os import replace\nreplace('a', 'b')\n",
        "import os\nos.path.getmtime('a')\n",
        "import os.path\nos.path.exists('a')\n",
        "import os\ndef f(fd):\n    os.fsync(fd)\n",
        "import shutil\nshutil.rmtree('a')\n",
        "def f():\n    import tempfile\n    return tempfile.gettempdir()\n",
        "import socket\n",
        "import obstore\n",
        "import urllib.request\n",
        "import zipfile\nzipfile.ZipFile('out.zip', 'w')\n",
        "import zipfile\nzipfile.ZipFile(f'{d}/out.zip', mode='a')\n",
        "import os, zipfile\nzipfile.ZipFile(os.path.join(d, 'out.zip'), 'x')\n",
    ):
        assert io_violations(_src("cairn._cli", text)), text
        assert not io_violations(_src("cairn._storage._local", text)), text
        assert not io_violations(_src("cairn._commit", text)), text
    for text in (
        "import os\nos.path.join('a', 'b')\nos.fspath('a')\nos.path.abspath('a')\n",
        "def f(storage):\n    return storage.open_read('k')\n",
        "import io, zipfile\nzipfile.ZipFile(io.BytesIO(b''))\n",
        "import zipfile\ndef f(staged):\n    zipfile.ZipFile(staged, 'w')\n",
        "from urllib.parse import quote\n",
        "def open(x):\n    return x\nopen(1)\n",
        "def f(requests, socket):\n    return requests.pop(), socket\n",
    ):
        assert not io_violations(_src("cairn._cli", text)), text


def test_checker_finds_reexports():
    defining = _src("cairn._a", "class Thing:\n    pass\n")
    middle = _src("cairn._b", "from ._a import Thing as Thing\n")
    by_module = {"cairn._a": defining, "cairn._b": middle}
    assert reexport_violations(middle, {"Thing"}, by_module)
    assert reexport_violations(_src("cairn._c", "from ._a import Thing\n__all__ = ['Thing']\n"), {"Thing"}, by_module)
    assert not reexport_violations(_src("cairn._c", "from ._a import Thing\n"), {"Thing"}, by_module)
    assert not reexport_violations(defining, {"Thing"}, by_module)
    root = _src("cairn", "from ._b import Thing as Thing\n", is_package=True)
    assert "does not define" in reexport_violations(root, {"Thing"}, by_module)[0].what
    assert not reexport_violations(_src("cairn", "from ._a import Thing as Thing\n", True), {"Thing"}, by_module)
    assert reexport_violations(_src("cairn.public", "x = 1\n"), {"Thing"}, by_module)


def test_checker_finds_a_changed_all():
    assert declared_all(_src("cairn", "__all__ = ['load', 'save']\n", True)) != PUBLIC_API


def test_checker_finds_long_modules():
    assert size_violation("x.py", "pass\n" * (MAX_LINES + 1))
    assert not size_violation("x.py", "pass\n" * MAX_LINES)
