"""The house rules of src/cairn, checked on the source with `ast` (only the __all__ check imports cairn).

The package is a set of rooms, one folder each, in the order data flows (docs/ARCHITECTURE.md).
The rules follow the folders:

1. No upward imports: every room has a rank in `ROOMS`; a module imports only modules of its own
   room or of lower rooms (every import counts, also those inside functions, since a lazy import is
   still a dependency). Inside a room, modules import each other freely.
2. `_format/` and `_plan/` are pure: they import only each other, `_core.checksum` and `_errors`;
   no JAX, no file or network I/O, no native library loaded by hand (ctypes, cffi: `_codecs/` does that).
3. Only `_dist/` touches `jax.distributed` (or `jax._src.distributed`).
4. Only `_storage/` and the commit strategies (`_save.commit`) do file or network I/O.
5. The public API is `cairn.__all__` (pinned below), re-exported from `cairn/__init__.py` and from
   nowhere else; every room is private (`_name`), so nothing under it is public.
6. The package root holds only the public surface (`__init__`, the API, errors, version) and the
   rooms; every module lives in a room.
7. No import cycles: no two modules import each other, directly or round a loop (lazy imports count),
   inside a room as across rooms.
8. Storages declare what they can do (`Storage.kind`, `atomic_rename`, `dirs`, `vectored_reads`,
   ...: checked by tests/storage/test_storage_conformance.py); no module outside `_storage/` probes a storage's
   class (`isinstance`/`issubclass` against a `_storage` name) or its capabilities (`getattr`/`hasattr`).
9. One sequence counter: the numbers that name an operation's coordination keys come from
   `_dist.agree.sequence(kind)`; no other module keeps a module-level `itertools.count()`.
10. The tests mirror the rooms: every test file lives in the folder of tests/ named for its room
   (`TEST_FOLDERS`), every room has one, and `package/` holds the tests of the whole package.

There is no line cap: a module holds one concept, whatever its length (a review habit, not a test).
Each rule is a checker function over a module's source, and each checker has a negative test on a
synthetic source, so that no rule can pass by being unable to fail. A new room must be added to `ROOMS`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "cairn"

# ----------------------------------------------------------------------------------- the rules

# The rooms, bottom to top (shared/DESIGN.md "Layers"). A module may import modules of its own room
# or of a lower one. The two bottom entries and `_api` are single modules at the package root.
ROOMS: dict[str, int] = {
    "cairn._errors": 0,  # the error hierarchy
    "cairn._version": 0,
    "cairn._core": 1,  # checksums, buffers, memo, stats, gc pause
    "cairn._storage": 2,  # bytes only: backends and a path's location
    "cairn._dist": 3,  # coordination between processes
    "cairn._format": 4,  # pure: the on-disk format
    "cairn._codecs": 5,  # the per-block codecs as code, and the native C-Blosc2 library loaded by ctypes
    "cairn._plan": 6,  # pure: chunks, grids, reads
    "cairn._read": 7,  # a committed checkpoint's manifest and indexes, and its siblings: below save and load
    "cairn._tree": 8,  # the user's state: pytrees, leaves, per-process values, shardings
    "cairn._save": 9,
    "cairn._load": 10,
    "cairn._sources": 11,  # checkpoints opened for reading: detection, other formats, transforms, verify, dry run
    "cairn._exports": 12,  # one checkpoint written from another: cp, mv, convert, exports to other formats
    "cairn._run": 13,  # a run's directory: steps, retention, leases
    "cairn._local": 14,  # the local tier
    "cairn._manager": 15,
    "cairn._cli": 16,
    "cairn._api": 17,  # the public functions on paths
    "cairn": 18,  # the public surface: re-exports only
}
ROOT_MODULES = {"cairn", "cairn._api", "cairn._errors", "cairn._version"}

PURE_ROOMS = ("cairn._format", "cairn._plan")
# What the pure rooms may import besides themselves.
PURE_MAY_IMPORT = {"cairn._core.boxes", "cairn._core.checksum", "cairn._core.memo", "cairn._errors"}

# Loading a native library by hand: what a pure room may not import (an extension module is an import).
NATIVE_LOADERS = ("ctypes", "_ctypes", "cffi", "numpy.ctypeslib")

JAX_DISTRIBUTED = ("jax.distributed", "jax._src.distributed")
MAY_TOUCH_JAX_DISTRIBUTED = ("cairn._dist",)
MAY_DO_IO = ("cairn._storage", "cairn._save.commit")
MAY_PROBE_STORAGE = ("cairn._storage",)
# The capabilities a storage declares (attributes of `_storage.base.Storage`): read them, never probe them.
STORAGE_CAPABILITIES = ("kind", "bandwidth", "atomic_rename", "dirs", "preferred_read", "vectored_reads",
                        "in_process", "retries", "batch_deletes", "delete_keys")


def room_of(module: str, rooms: dict[str, int] = ROOMS) -> str | None:
    """The room a module lives in: the longest entry of `rooms` it is under (`cairn` only for itself)."""
    if module == "cairn":
        return "cairn" if "cairn" in rooms else None
    best = None
    for room in rooms:
        if room != "cairn" and _under(module, room) and (best is None or len(room) > len(best)):
            best = room
    return best


def is_pure(module: str) -> bool:
    return any(_under(module, r) for r in PURE_ROOMS)


def may_do_io(module: str) -> bool:
    return any(_under(module, m) for m in MAY_DO_IO)


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


# The public API, exactly (cairn.__all__ at commit 8b322df, plus export_safetensors, user_metadata). Changing it is an
# API change: update this list in the same commit, and the docs.
PUBLIC_API = [
    "ArrayMetadata", "CheckpointError", "CheckpointExistsError", "CheckpointInfo", "CheckpointManager",
    "CheckpointNotFoundError", "CoordinationError", "CoordinationTimeoutError", "Coordinator",
    "CorruptCheckpointError", "KeepAll", "KeepAny", "KeepBest", "KeepEvery", "KeepIf", "KeepLatest",
    "KeepNewerThan", "KeepOnePer", "LoadPlan", "LoadStats", "LocalTier", "ManagerStats", "MismatchError",
    "PerProcess", "ProgressStats", "RestoreReport", "RetentionPolicy", "SaveFuture", "SaveStats", "StatsEvent", "UnsupportedTypeError", "__version__",
    "add_listener", "copy", "export_orbax", "export_orbax_run", "export_safetensors", "load", "metadata", "plan_load", "register_type", "release_snapshot_buffers", "remove_listener", "save", "save_async", "shutdown",
    "user_metadata", "wait_all",
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
    """The cairn module an import loads (`from . import _format` is `cairn._format.manifest`), or None."""
    if not _under(imp.base, "cairn"):
        return None
    if imp.name is not None and f"{imp.base}.{imp.name}" in known:
        return f"{imp.base}.{imp.name}"
    return imp.base


def layer_violations(src: Source, rooms: dict[str, int] = ROOMS, known: set[str] | None = None) -> list[Violation]:
    """Imports of a module of a higher room (or of a module that lives in no room)."""
    mine_room = room_of(src.module, rooms)
    if mine_room is None:
        return [Violation(src.where, 1, f"{src.module} lives in no room: add its folder to ROOMS in "
                                        "tests/package/test_layers.py, or move it into a room")]
    mine = rooms[mine_room]
    out: dict[tuple[int, str], Violation] = {}
    for imp in src.imports:
        target = cairn_target(imp, known or set())
        if target is None or target == src.module or (imp.line, target) in out:
            continue
        room = room_of(target, rooms)
        if room is None:
            out[imp.line, target] = Violation(src.where, imp.line,
                                              f"imports {target}, which lives in no room: add it to ROOMS")
        elif rooms[room] > mine:
            what = f"{target}.{imp.name}" if target == imp.base and imp.name else target
            out[imp.line, target] = Violation(src.where, imp.line, f"upward import of {what} (room {room}, "
                                                                   f"rank {rooms[room]}) from {src.module} "
                                                                   f"(room {mine_room}, rank {mine})")
    return [out[k] for k in sorted(out)]


def import_graph(by_module: dict[str, Source]) -> dict[str, set[str]]:
    """Module -> the modules of `by_module` it imports (at any depth: a lazy import is still an edge)."""
    known = set(by_module)
    graph: dict[str, set[str]] = {}
    for name, src in by_module.items():
        edges = graph.setdefault(name, set())
        for imp in src.imports:
            target = cairn_target(imp, known)
            while target is not None and target not in known and "." in target:
                target = target.rpartition(".")[0]  # `from .m import name`: the module m
            if target in known and target != name:
                edges.add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import one another, round a loop (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]  # iterative: no recursion limit on a deep chain
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def purity_violations(src: Source, may_import: set[str] = PURE_MAY_IMPORT) -> list[Violation]:
    out = []
    for imp in src.imports:
        if any(_under(t, "jax") or _under(t, "jaxlib") for t in imp.targets()):
            out.append(Violation(src.where, imp.line, f"pure module imports JAX ({imp.base})"))
        if any(_under(t, n) for t in imp.targets() for n in NATIVE_LOADERS):
            out.append(Violation(src.where, imp.line, f"pure module loads a native library ({imp.base}): "
                                                      "that belongs in _codecs/ or _core/"))
        target = cairn_target(imp, set(sources()))
        if (target is not None and target != src.module and not is_pure(target)
                and not any(_under(target, m) for m in may_import)):
            out.append(Violation(src.where, imp.line, f"pure module imports {target} (it may import only "
                                                      f"{', '.join(PURE_ROOMS)} and {sorted(may_import)})"))
    return out + io_violations(src, allowed=False)


def root_violations(files: list[str], root_modules: set[str] = ROOT_MODULES) -> list[Violation]:
    """Modules at the package root that are not the public surface (they belong in a room)."""
    out = []
    for f in files:
        parts = Path(f).parts
        if len(parts) == 3:  # src/cairn/x.py
            name = "cairn" if parts[2] == "__init__.py" else f"cairn.{Path(parts[2]).stem}"
            if name not in root_modules:
                out.append(Violation(f, 1, f"{name} sits at the package root; the root holds only "
                                           f"{sorted(root_modules)} and the rooms' folders"))
    return out


def jax_distributed_violations(src: Source, allowed: bool | None = None) -> list[Violation]:
    if allowed is None:
        allowed = any(_under(src.module, m) for m in MAY_TOUCH_JAX_DISTRIBUTED)
    if allowed:
        return []
    out = {}
    for imp in src.imports:
        for t in imp.targets():
            if any(_under(t, p) for p in JAX_DISTRIBUTED):
                out[imp.line] = Violation(src.where, imp.line, f"imports {t} (only _dist/ may touch jax.distributed)")
    for dotted, line in src.uses():
        if line not in out and any(_under(dotted, p) for p in JAX_DISTRIBUTED):
            out[line] = Violation(src.where, line, f"uses {dotted} (only _dist/ may touch jax.distributed)")
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
                add(imp.line, hit, f"imports {t} (I/O belongs in _storage/ or _save/commit)")
    for dotted, line in src.uses():
        hit = next((n for n in IO_NAMES if _under(dotted, n)), None)
        if hit:
            add(line, hit, f"{dotted} (I/O belongs in _storage/ or _save/commit)")
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
                                                 "(I/O belongs in _storage/ or _save/commit)")
    return [found[k] for k in sorted(found)]


def storage_probe_violations(src: Source, allowed: bool | None = None) -> list[Violation]:
    """Tests of a storage's class, or probes of an attribute it declares, outside `_storage/`."""
    if allowed is None:
        allowed = any(_under(src.module, m) for m in MAY_PROBE_STORAGE)
    if allowed:
        return []
    out = []
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        fn = src.resolve(node.func) or _dotted(node.func)
        if fn in ("isinstance", "issubclass", "builtins.isinstance", "builtins.issubclass"):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for c in classes:
                name = src.resolve(c)
                if name is not None and _under(name, "cairn._storage"):
                    out.append(Violation(src.where, node.lineno, f"{fn.rpartition('.')[2]}(..., {ast.unparse(c)}) "
                                                                 "tests a storage's class; read what it declares "
                                                                 "(Storage.kind, .dirs, .atomic_rename, ...)"))
        elif fn in ("getattr", "hasattr", "builtins.getattr", "builtins.hasattr"):
            attr = node.args[1]
            if isinstance(attr, ast.Constant) and attr.value in STORAGE_CAPABILITIES:
                out.append(Violation(src.where, node.lineno, f"{ast.unparse(node)} probes a capability every "
                                                             f"storage declares; read .{attr.value}"))
    return out


SEQUENCE_HOME = "cairn._dist.agree"


def counter_violations(src: Source) -> list[Violation]:
    """Module-level `itertools.count()` counters outside `_dist.agree` (use `sequence(kind)`)."""
    if src.module == SEQUENCE_HOME:
        return []
    out = []
    for node in src.tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and src.resolve(value.func) == "itertools.count":
            out.append(Violation(src.where, node.lineno, f"a module-level {ast.unparse(value)}: number operations "
                                                         f"with {SEQUENCE_HOME}.sequence(kind)"))
    return out


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
    if src.module != "cairn" and not src.module.split(".")[1].startswith("_"):
        out.append(Violation(src.where, 1, f"{src.module} is a public module; implementation modules live in "
                                           "private rooms (cairn._room) or are private themselves (_name)"))
    return out


def _fail(violations: list[Violation], rule: str) -> None:
    if violations:
        pytest.fail(f"{rule}:\n" + "\n".join(f"  {v}" for v in violations), pytrace=False)


# ----------------------------------------------------------------------------------- the tests


# tests/ folder -> the room its tests are about (docs/ARCHITECTURE.md "Rooms"; tests/README.md).
TEST_FOLDERS: dict[str, str] = {
    "core": "cairn._core",
    "storage": "cairn._storage",
    "distributed": "cairn._dist",  # not "dist": pytest and .gitignore skip folders of that name
    "format": "cairn._format",
    "codecs": "cairn._codecs",
    "plan": "cairn._plan",
    "read": "cairn._read",
    "tree": "cairn._tree",
    "save": "cairn._save",
    "load": "cairn._load",
    "sources": "cairn._sources",
    "exports": "cairn._exports",
    "run": "cairn._run",
    "local": "cairn._local",
    "manager": "cairn._manager",
    "cli": "cairn._cli",
    "package": "cairn",  # the whole package: its rules, docs, examples, smoke and soak runs
}
TESTS = Path(__file__).resolve().parents[1]


def layout_problems(tests: Path) -> list[str]:
    """What is wrong with the layout of a tests/ folder (empty: it mirrors the rooms)."""
    wrong = [f"{p.relative_to(tests)}: a test file outside its room's folder" for p in sorted(tests.glob("test_*.py"))]
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")) and p.name != "golden"}
    wrong += [f"{f}/: names no room (add it to TEST_FOLDERS)" for f in sorted(folders - set(TEST_FOLDERS))]
    wrong += [f"{f}/: missing, so {TEST_FOLDERS[f]} has no tests" for f in sorted(set(TEST_FOLDERS) - folders)]
    wrong += [f"{p.relative_to(tests)}: nested too deep" for f in sorted(folders & set(TEST_FOLDERS))
              for p in sorted((tests / f).glob("*/test_*.py"))]
    return wrong




def test_tests_mirror_the_rooms():
    assert not layout_problems(TESTS), layout_problems(TESTS)
    rooms = {r for r in ROOMS if r not in ROOT_MODULES and r != "cairn"}
    assert rooms <= set(TEST_FOLDERS.values()), f"rooms with no tests/ folder: {sorted(rooms - set(TEST_FOLDERS.values()))}"


def test_checker_finds_tests_outside_the_rooms(tmp_path):
    for f in TEST_FOLDERS:
        (tmp_path / f).mkdir()
    assert not layout_problems(tmp_path)
    (tmp_path / "test_stray.py").write_text("")
    (tmp_path / "misc").mkdir()
    (tmp_path / "load" / "deep").mkdir()
    (tmp_path / "load" / "deep" / "test_x.py").write_text("")
    (tmp_path / "cli").rmdir()
    wrong = "\n".join(layout_problems(tmp_path))
    for needle in ("test_stray.py", "misc/", "cli/: missing", "load/deep/test_x.py"):
        assert needle in wrong, (needle, wrong)


def test_every_module_lives_in_a_room():
    homeless = [m for m in MODULES if room_of(m) is None]
    assert not homeless, f"modules in no room: {homeless}; add their folder to ROOMS in tests/package/test_layers.py"


def test_no_room_that_is_gone():
    stale = sorted(r for r in ROOMS if not any(_under(m, r) for m in MODULES))
    assert not stale, f"ROOMS names rooms that do not exist: {stale}; remove them from tests/package/test_layers.py"


def test_the_root_holds_only_the_public_surface():
    _fail(root_violations(FILES), "the package root")


@pytest.mark.parametrize("module", MODULES)
def test_no_upward_imports(module):
    _fail(layer_violations(sources()[module], ROOMS, set(MODULES)), f"{module} imports upward")


def test_no_import_cycles():
    cycles = import_cycles(import_graph(sources()))
    assert not cycles, ("modules that import one another (move what both need into a module of its own, "
                        f"or invert the dependency): {cycles}")


@pytest.mark.parametrize("module", [m for m in MODULES if is_pure(m)])
def test_pure_rooms(module):
    _fail(purity_violations(sources()[module]), f"{module} must be pure (no I/O, no JAX, few imports)")


def test_pure_rooms_import_what_they_may():
    # What they may import lies below them; keep it from growing silently.
    for m in PURE_MAY_IMPORT:
        assert ROOMS[room_of(m)] < min(ROOMS[r] for r in PURE_ROOMS), m


@pytest.mark.parametrize("module", MODULES)
def test_only_dist_touches_jax_distributed(module):
    _fail(jax_distributed_violations(sources()[module]), f"{module} touches jax.distributed")


@pytest.mark.parametrize("module", MODULES)
def test_only_storage_and_commit_do_io(module):
    _fail(io_violations(sources()[module]), f"{module} does file or network I/O")


@pytest.mark.parametrize("module", MODULES)
def test_only_storage_tests_storage_classes(module):
    _fail(storage_probe_violations(sources()[module]), f"{module} probes a storage's class or capabilities")


def test_storage_capabilities_are_declared_by_the_protocol():
    base = sources()["cairn._storage.base"]
    protocol = next(n for n in base.tree.body if isinstance(n, ast.ClassDef) and n.name == "Storage")
    declared = {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    declared |= {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}  # properties, methods
    assert set(STORAGE_CAPABILITIES) <= declared, set(STORAGE_CAPABILITIES) - declared


@pytest.mark.parametrize("module", MODULES)
def test_one_sequence_counter(module):
    _fail(counter_violations(sources()[module]), f"{module} keeps a counter of its own")


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


# --------------------------------------------------------------- every checker can fail


def _src(module: str, text: str, is_package: bool = False) -> Source:
    return Source(module, text, is_package)


def test_checker_finds_upward_imports():
    rooms = {"cairn": 9, "cairn._hi": 5, "cairn._lo": 1}
    assert layer_violations(_src("cairn._lo.a", "from .._hi.b import x\n"), rooms)
    assert layer_violations(_src("cairn._lo.a", "def f():\n    from .._hi import b\n"), rooms)  # function-local
    assert layer_violations(_src("cairn._lo.a", "import cairn._hi.b\n"), rooms)
    assert layer_violations(_src("cairn._lo.a", "from .. import __version__\n"), rooms)  # the package root
    assert layer_violations(_src("cairn._lo.a", "from cairn import _hi\n"), rooms)
    v = layer_violations(_src("cairn._lo.a", "import os\nfrom .c import y\n\n\ndef g():\n    from .._hi.b import z\n"),
                         rooms, {"cairn._hi.b", "cairn._lo.c"})
    assert [x.line for x in v] == [6] and "upward import of cairn._hi.b" in v[0].what
    assert not layer_violations(_src("cairn._hi.b", "from .._lo.a import x\nfrom .._lo import a\nfrom . import c\n"),
                                rooms)
    assert not layer_violations(_src("cairn", "from ._hi.b import x\n", is_package=True), rooms)


def test_checker_finds_import_cycles():
    def graph(**texts: str) -> dict[str, set[str]]:
        return import_graph({f"cairn._r.{m}": _src(f"cairn._r.{m}", t) for m, t in texts.items()})

    # a lazy import closes the loop as surely as a top-level one
    assert import_cycles(graph(a="from .b import x\n", b="def f():\n    from .a import y\n")) == [
        ["cairn._r.a", "cairn._r.b"]]
    assert import_cycles(graph(a="from . import b\n", b="import cairn._r.c\n", c="from .a import z\n",
                               d="from .a import z\n")) == [["cairn._r.a", "cairn._r.b", "cairn._r.c"]]
    assert import_cycles(graph(a="from .b import x\nfrom .c import y\n", b="from .c import y\n", c="import os\n",
                               d="from .d import itself\n")) == []
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_checker_finds_modules_in_no_room():
    rooms = {"cairn._lo": 1}
    assert "no room" in layer_violations(_src("cairn._new.a", "x = 1\n"), rooms)[0].what
    assert "no room" in layer_violations(_src("cairn._lo.a", "from .._new import b\n"), rooms,
                                         {"cairn._new.b"})[0].what


def test_checker_ranks_a_module_by_its_innermost_room():
    rooms = {"cairn._storage": 3, "cairn._storage._deep": 1, "cairn._x": 9}
    assert room_of("cairn._storage._deep.a", rooms) == "cairn._storage._deep"
    assert layer_violations(_src("cairn._storage._deep.a", "from .. import b\n"), rooms, {"cairn._storage.b"})
    assert layer_violations(_src("cairn._storage.b", "from .. import _x\n"), rooms)
    assert not layer_violations(_src("cairn._storage", "from ._deep import a\n", is_package=True), rooms)


def test_checker_finds_modules_at_the_root():
    assert root_violations(["src/cairn/_helper.py"])
    assert not root_violations(["src/cairn/__init__.py", "src/cairn/_api.py", "src/cairn/_load/engine.py"])


def test_checker_finds_impure_code():
    for text in (
        "import jax\n",
        "def f():\n    import jax.numpy as jnp\n",
        "from jax.sharding import NamedSharding\n",
        "from .._load import engine\n",
        "from .._storage import open_storage\n",
        "from .._core import stats\n",
        "import ctypes\nctypes.CDLL('libblosc2.so')\n",
        "def f():\n    from ctypes import CDLL\n    return CDLL\n",
        "from numpy import ctypeslib\n",
        "import cffi\n",
        "def f(p):\n    with open(p) as f:\n        return f.read()\n",
        "import os\ndef f(p):\n    os.replace(p, p + '.x')\n",
    ):
        assert purity_violations(_src("cairn._format.manifest", text)), text
    assert not purity_violations(_src("cairn._plan.chunking", "import math\nfrom .._format.manifest import ArrayLeaf\n"
                                  "from .._errors import E\nfrom urllib.parse import quote\n"
                                  "from . import grid\nfrom .._core.checksum import crc\n"))


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
        assert jax_distributed_violations(_src("cairn._manager.manager", text)), text
        assert not jax_distributed_violations(_src("cairn._dist.coord", text)), text
    assert not jax_distributed_violations(_src("cairn._save.engine", "import jax\njax.process_index()\n"))


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
        assert io_violations(_src("cairn._cli.main", text)), text
        assert not io_violations(_src("cairn._storage.local", text)), text
        assert not io_violations(_src("cairn._save.commit", text)), text
    for text in (
        "import os\nos.path.join('a', 'b')\nos.fspath('a')\nos.path.abspath('a')\n",
        "def f(storage):\n    return storage.open_read('k')\n",
        "import io, zipfile\nzipfile.ZipFile(io.BytesIO(b''))\n",
        "import zipfile\ndef f(staged):\n    zipfile.ZipFile(staged, 'w')\n",
        "from urllib.parse import quote\n",
        "def open(x):\n    return x\nopen(1)\n",
        "def f(requests, socket):\n    return requests.pop(), socket\n",
    ):
        assert not io_violations(_src("cairn._cli.main", text)), text


def test_checker_finds_storage_probes():
    for text in (
        "from .._storage import LocalDirs\ndef f(s):\n    return isinstance(s, LocalDirs)\n",
        "def f(s):\n    from .._storage import LocalStorage, MemoryStorage\n    return isinstance(s, (int, MemoryStorage))\n",
        "from .. import _storage\ndef f(s):\n    return isinstance(s, _storage.ObjectStorage)\n",
        "from .._storage.base import Storage\ndef f(c):\n    return issubclass(c, Storage)\n",
        "def f(storage):\n    return getattr(storage, 'atomic_rename', False)\n",
        "def f(loc):\n    return hasattr(loc.storage, 'preferred_read')\n",
    ):
        assert storage_probe_violations(_src("cairn._load.readonce", text)), text
        assert not storage_probe_violations(_src("cairn._storage.staging", text)), text
    for text in (
        "def f(storage):\n    return storage.kind == 'object' and storage.dirs is None\n",
        "from .._storage.location import Location\ndef f(x):\n    return isinstance(x, (str, dict))\n",
        "def f(node):\n    return getattr(node, 'shape', None)\n",
    ):
        assert not storage_probe_violations(_src("cairn._load.readonce", text)), text


def test_checker_finds_counters():
    for text in ("import itertools\n_seq = itertools.count()\n",
                 "from itertools import count\n_n: object = count(1)\n"):
        assert counter_violations(_src("cairn._save.engine", text)), text
        assert not counter_violations(_src(SEQUENCE_HOME, text)), text
    assert not counter_violations(_src("cairn._save.engine", "import itertools\ndef f():\n    c = itertools.count()\n"))


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
    assert reexport_violations(_src("cairn.public.inner", "x = 1\n"), {"Thing"}, by_module)
    assert not reexport_violations(_src("cairn._room.inner", "x = 1\n"), {"Thing"}, by_module)


def test_checker_finds_a_changed_all():
    assert declared_all(_src("cairn", "__all__ = ['load', 'save']\n", True)) != PUBLIC_API
