"""Every ```python block of the documentation (docs/**/*.md) runs.

Each page is one test: its blocks run in order, in one fresh namespace, in a
subprocess with 8 virtual CPU devices and a temporary working directory, so a
page reads as one script a user could paste. A failure names the page, the
block's number and its first line in the file.

A block that cannot run here (several hosts, a cloud account) is marked by an
HTML comment on the line right before its fence, invisible on the site:

    <!-- skip: needs several hosts -->
    ```python
    ...

Each skipped block is reported as a skipped test with its page, line and
reason (pytest -ra lists them), and `test_skips_are_few` keeps them rare.
The API pages may name public objects only (``::: cairn.<name>``), never a
private module: those move. `test_site_builds` runs ``mkdocs build --strict``
where the `docs` extra is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SKIP = re.compile(r"^<!--\s*skip:\s*(?P<why>.+?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>```+)\s*(?P<lang>[\w+-]*)")
PAGE_TIMEOUT_S = 240
MAX_SKIPPED_SHARE = 0.15


@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    number: int  # 1-based among the page's python blocks
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None  # the reason, if the block is marked to skip


def blocks_of(path: Path) -> list[Block]:
    return parse(path.read_text(encoding="utf-8"), str(path.relative_to(DOCS)))


def parse(text: str, page: str) -> list[Block]:
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = len(m["indent"]), m["ticks"], m["lang"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(ticks):
            end += 1
        if lang == "python":
            prev = i - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            why = SKIP.match(lines[prev].strip()) if prev >= 0 else None
            body = "\n".join(line[indent:] for line in lines[i + 1 : end])
            out.append(Block(page, len(out) + 1, i + 1, textwrap.dedent(body),
                             why["why"] if why else None))
        i = end + 1
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md") if blocks_of(p))
ALL = [b for p in PAGES for b in blocks_of(p)]

# The driver runs the page's blocks in one namespace and names the block that failed.
DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    try:
        exec(compile(b["code"], f"{b['page']}:block{b['number']}(line {b['line']})", "exec"), ns)
    except BaseException:
        print(f"\nDOCS FAILURE: {b['page']} block {b['number']} (line {b['line']}):\n{b['code']}\n", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
print(f"ran {len(blocks)} blocks")
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CAIRN_PEER_TIMEOUT", None)
    return env


@pytest.mark.parametrize("page", [str(p.relative_to(DOCS)) for p in PAGES])
def test_page_runs(page: str, tmp_path: Path) -> None:
    import json

    runnable = [b.__dict__ for b in blocks_of(DOCS / page) if b.skip is None]
    if not runnable:
        pytest.skip(f"{page}: every python block is marked to skip")
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "driver.py").write_text(DRIVER)
    work = tmp_path / "work"
    work.mkdir()
    try:
        proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "blocks.json")],
                              cwd=work, env=_env(), capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"docs/{page}: its blocks did not finish within {PAGE_TIMEOUT_S} s\n{e.stderr or ''}")
    if proc.returncode != 0:
        tail = proc.stderr[-6000:]
        pytest.fail(f"docs/{page}: a python block failed (rc {proc.returncode})\n{tail}", pytrace=False)


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: f"{b.page}:{b.number}")
def test_skipped_block(block: Block) -> None:
    pytest.skip(f"docs/{block.page} block {block.number} (line {block.line}) not run: {block.skip}")


def test_skips_are_few() -> None:
    skipped = [b for b in ALL if b.skip]
    listing = "\n".join(f"  docs/{b.page}:{b.line}: {b.skip}" for b in skipped)
    print(f"{len(ALL)} python blocks in {len(PAGES)} pages, {len(skipped)} marked to skip:\n{listing}")
    assert len(ALL) >= 40, "the docs lost most of their examples?"
    assert len(skipped) <= MAX_SKIPPED_SHARE * len(ALL), f"too many skipped blocks:\n{listing}"


def test_skip_marker_found() -> None:
    text = "a\n\n<!-- skip: needs several hosts -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n"
    got = parse(text, "probe.md")
    assert [(b.number, b.skip) for b in got] == [(1, "needs several hosts"), (2, None)]


def test_api_pages_name_public_objects_only() -> None:
    import cairn

    seen = set()
    for page in sorted((DOCS / "api").glob("*.md")):
        for ident in re.findall(r"^:::\s*(\S+)", page.read_text(), flags=re.M):
            assert ident.startswith("cairn.") and ident.count(".") == 1, f"{page.name}: {ident} is not cairn.<name>"
            name = ident.split(".", 1)[1]
            assert name in cairn.__all__, f"{page.name}: {ident} is not public"
            seen.add(name)
    missing = {n for n in cairn.__all__ if not n.startswith("_")} - seen
    assert not missing, f"public names without an API page: {sorted(missing)}"


def test_public_docstrings_are_markdown_not_rst() -> None:
    """The API pages render docstrings as Markdown: an RST literal-block marker (``Example::``) would
    show as "Example::" there (the indented block after a single colon is already code)."""
    import inspect

    import cairn

    found = []
    for name in cairn.__all__:
        obj = getattr(cairn, name)
        members = [obj] + ([m for k, m in vars(obj).items() if not k.startswith("_")] if inspect.isclass(obj) else [])
        for m in members:
            doc = inspect.getdoc(m) if callable(m) or isinstance(m, property) else None
            found += [f"{name}: {line.strip()}" for line in (doc or "").splitlines() if line.rstrip().endswith("::")]
    assert not found, found


def install_mistakes(text: str, where: str, dist: str, extras: set[str]) -> list[str]:
    """The install commands and hints in `text` that would not install cairn as asked: the bare name
    `cairn` (the package index's `cairn` is an unrelated project), or an extra pyproject.toml lacks."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        bare = re.search(r"pip install\s+(?:-\S+\s+)*['\"]?cairn(?![\w.\[-])", line)
        if bare or re.search(r"(?<![\w.-])cairn\[", line):
            found.append(f"{where}:{n}: names the distribution `cairn`, not `{dist}`: {line.strip()}")
        for m in re.finditer(rf"(?:(?<![\w.-]){re.escape(dist)}|['\"]\.)\[([\w,-]+)\]", line):
            unknown = sorted(set(m[1].split(",")) - extras)
            if unknown:
                found.append(f"{where}:{n}: extra(s) {unknown} are not in pyproject.toml: {line.strip()}")
    return found


def test_install_mistakes_found() -> None:
    extras = {"jax", "cloud"}
    text = ("pip install 'cairn[cloud]'\npip install cairn\nInstall `cairn[cli]`\n"
            "pip install 'cairn-ckpt[jax,clouds]'\npip install -e '.[jax,cloud]'\nx = self._cairn[item]\n"
            "pip install 'cairn-ckpt[jax]' cairn-other\nimport cairn\n")
    got = install_mistakes(text, "t.md", "cairn-ckpt", extras)
    assert [g.split(":")[1] for g in got] == ["1", "2", "3", "4"], got


def test_install_lines_name_the_distribution() -> None:
    """Every install command and hint (README, docs, error messages in src) names the distribution that
    installs cairn, with extras that exist: `pip install 'cairn[cloud]'` installs another project."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dist, extras = project["name"], set(project["optional-dependencies"])
    assert dist != "cairn", "the package index's `cairn` is an unrelated project"
    files = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]
    found = [m for f in files
             for m in install_mistakes(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)), dist, extras)]
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_site_builds(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]', or make docs)")
    env = _env() | {"NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The API pages show public names only: no private module paths in text, signatures or link titles.
    for page in sorted((tmp_path / "site" / "api").glob("*/index.html")):
        html = page.read_text()
        private = sorted(set(re.findall(r"cairn\._\w+|\b_(?:save|async|load|api|run|core)\.\w+", html)))
        assert not private, f"{page.parent.name}: {private}"
        assert "::</p>" not in html, page.parent.name


def test_install_commands_work_before_the_package_is_published() -> None:
    """`cairn-ckpt` is not on the package index yet: the README's and the FAQ's install commands install
    from a checkout or from the wheel `make wheel` builds, and the index line stays, marked as what it will
    be (a comment). The FAQ names every extra a user installs; pyproject names the project's pages."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project.get("urls"), "pyproject.toml has no [project.urls]"
    for page in (ROOT / "README.md", DOCS / "faq.md"):
        text = page.read_text(encoding="utf-8")
        commands = [line.strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines()
                    if "pip install" in line and not line.strip().startswith("#")]
        assert commands, page
        by_name = [c for c in commands if re.search(r"pip install ['\"]?cairn-ckpt", c)]
        assert not by_name, f"{page.name}: installs by name from the index, where cairn-ckpt is not yet: {by_name}"
        assert any("-e '.[jax]'" in c for c in commands) and any("dist/cairn_ckpt-" in c for c in commands), page
        assert re.search(r"#.*(once )?published.*pip install 'cairn-ckpt\[jax\]'", text, re.S), page
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^wheel:", makefile, re.M), "the README's `make wheel` has no target"
    faq = (DOCS / "faq.md").read_text(encoding="utf-8")
    section = faq[faq.index("## Which package do I install?"):]
    section = section[: section.index("\n## ", 3)]
    for extra in set(project["optional-dependencies"]) - {"dev", "bench", "docs"}:
        assert f"`{extra}`" in section, f"docs/faq.md's list of extras leaves out {extra!r}"
