"""The README and the docs site: their Python examples run, their links and named files exist.

* Every ```python block of README.md and docs/**/*.md runs, each with a fresh namespace, from an
  empty temporary directory. A block that needs a GPU is marked, and skipped with that reason, by
  an HTML comment ``<!-- gpu -->`` on the line before its fence or by ``title="gpu"`` on the
  fence (```python title="gpu"). Blocks run in this process (torch, timm and transformers are
  imported once for all of them), so the examples must stay tiny: random weights, no download.
* Every relative link (``[text](path)``, ``![alt](path)``) of README.md and the docs points at a
  file of the repository, and so does every repository path they name in text or code
  (``src/lapheads/ops.py``, ``src/lapheads/recipes/configs/lm/tiny.yaml``, ``benchmarks/attention.py``), and every
  such path named in a docstring or comment under ``src/lapheads``.
* Nothing in the repository refers to the team's working notes, which users do not have.
* README.md is at most 12 KB.

``mkdocs build --strict`` (broken links inside the site, missing API references, docstrings that
do not render) runs from the Makefile, not here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 12 * 1024


def doc_files() -> list[Path]:
    """README.md and every Markdown page of the docs site."""
    return [README] + sorted(DOCS.rglob("*.md"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --------------------------------------------------------------------------- (a) Python blocks
_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, source, skip_reason)`` of every Python code block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, indent = m.group("fence"), m.group("info").strip(), len(m.group("indent"))
        start = i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence) and not lines[i].strip()[len(fence) :].strip()
        ):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        lang = info.split()[0].lower() if info else ""
        if lang not in ("python", "py"):
            continue
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        gpu = prev == "<!-- gpu -->" or re.search(r"""title\s*=\s*["']gpu["']""", info) is not None
        blocks.append((start + 1, "\n".join(body) + "\n", "needs a GPU (marked in the page)" if gpu else None))
    return blocks


def _block_params() -> list:
    params = []
    for path in doc_files():
        for line, source, skip in python_blocks(path):
            marks = [pytest.mark.skip(reason=skip)] if skip else []
            params.append(pytest.param(path, line, source, id=f"{_rel(path)}:{line}", marks=marks))
    return params


def test_the_docs_have_python_examples():
    # the README's three examples at least; a parser that finds none would pass every check below
    assert len(python_blocks(README)) >= 3
    assert len(_block_params()) >= 3


@pytest.mark.parametrize(("path", "line", "source"), _block_params())
def test_python_block_runs(path, line, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an example must never need the network
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code = compile(source, f"{_rel(path)}:{line}", "exec")
    namespace = {"__name__": "__main__"}
    exec(code, namespace)  # noqa: S102 - the documented examples are the code under test


# --------------------------------------------------------------------------- (b) links and files
_MD_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")
# a repository path: starts with a top-level folder of the repository, or is a top-level file
_TOP_DIRS = ("src", "recipes", "benchmarks", "tests", "studies", "docs", "tools", ".ci")
_TOP_FILES = (
    "README.md",
    "CHANGELOG.md",
    "CITATION.cff",
    "LICENSE",
    "Makefile",
    "pyproject.toml",
    "constraints.txt",
    "mkdocs.yml",
)
_REPO_PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./-]*)" % "|".join(re.escape(d) for d in _TOP_DIRS))
# a pattern or a stand-in: recipes/*/x.yaml, <name>, {a,b}, $OUT, ..., a placeholder word (docs/recipe-NAME.md)
_PLACEHOLDER = re.compile(
    r"[*<>{}$]|\.\.\.|/\.\.?/|(?<![A-Za-z])(?:NAME|RECIPE|RUN|OUT|DIR|PATH|FILE|CKPT|SWEEP|TAG|URL)"
    r"(?![A-Za-z])"
)


def named_paths(text: str) -> set[str]:
    """Repository paths named in ``text`` (placeholders such as ``recipes/*/x.yaml`` left out)."""
    found = set()
    for m in _REPO_PATH.finditer(text):
        end = m.end()
        if end < len(text) and text[end] in "*<{$":  # recipes/<name>.yaml, studies/{a,b}: a pattern
            continue
        path = m.group(1).rstrip(".,:;")
        if _PLACEHOLDER.search(path):
            continue
        found.add(path.rstrip("/"))
    return found


def _exists(path: str) -> bool:
    return (ROOT / path).exists()


def relative_links(path: Path) -> list[tuple[str, Path]]:
    """``(link, resolved file)`` of every relative link of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"(?ms)^\s*(`{3,}|~{3,}).*?^\s*\1\s*$", "", text)  # links in code blocks are code
    out = []
    for link in _MD_LINK.findall(text) + _HTML_LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or link.startswith(("#", "/")):
            continue  # http:, mailto:, an anchor of this page, a site-absolute path
        target = link.split("#", 1)[0].split("?", 1)[0]
        if target:
            out.append((link, (path.parent / target).resolve()))
    return out


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_relative_links_exist(path):
    missing = [link for link, target in relative_links(path) if not target.exists()]
    assert not missing, f"{_rel(path)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_named_files_exist(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted(p for p in named_paths(text) if not _exists(p))
    tops = sorted(f for f in _TOP_FILES if re.search(rf"(?<![\w/.-]){re.escape(f)}(?![\w/-])", text) and not _exists(f))
    assert not missing + tops, f"{_rel(path)} names repository files that do not exist: {missing + tops}"


def _python_sources() -> list[Path]:
    return sorted((ROOT / "src" / "lapheads").rglob("*.py"))


def test_files_named_in_docstrings_exist():
    missing = []
    for f in _python_sources():
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for p in named_paths(line):
                if not _exists(p):
                    missing.append(f"{_rel(f)}:{n}: {p}")
    assert not missing, "docstrings and comments name files that are not in the repository:\n" + "\n".join(missing)


# --------------------------------------------------------------------------- the team's notes
# built from pieces so that this file does not name them itself
_NOTES = re.compile(r"\b(?:%s)\.md\b|\.\./%s\b" % ("PAPER|DESIGN", "shared"))


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split("\n")
        files = [ROOT / f for f in out if f]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked sdist)
        files = [p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts]
    keep = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".cff", ".j2", ".json", ".sh", ""}
    return [f for f in files if f.is_file() and f.suffix in keep and f != Path(__file__).resolve()]


def test_docs_do_not_refer_to_the_team_notes():
    bad = [
        f"{_rel(p)}:{n}"
        for p in doc_files()
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if _NOTES.search(line)
    ]
    assert not bad, f"README/docs refer to notes users do not have: {bad}"


def test_repository_does_not_refer_to_the_team_notes():
    bad = []
    for p in _tracked_text_files():
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        bad += [f"{_rel(p)}:{n}: {line.strip()[:100]}" for n, line in enumerate(lines, 1) if _NOTES.search(line)]
    assert not bad, "files refer to notes that are not in the repository:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- architecture and API pages
ARCHITECTURE = DOCS / "architecture.md"
PACKAGE = ROOT / "src" / "lapheads"


def _units() -> list[str]:
    """The top-level parts of the package: its modules and sub-packages (``heads``, ``engine``, ...)."""
    out = []
    for p in sorted(PACKAGE.iterdir()):
        if p.suffix == ".py" and p.stem not in ("__init__", "__main__"):
            out.append(p.stem)
        elif p.is_dir() and (p / "__init__.py").is_file():
            out.append(p.name)
    return out


def architecture_layers() -> dict[str, int]:
    """``unit -> layer`` from the table of docs/architecture.md (rows ``| N | `a`, `b` | ... |``)."""
    layers = {}
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            for name in re.findall(r"`([\w.]+)`", m.group(2)):
                layers[name] = int(m.group(1))
    return layers


def import_edges() -> set[tuple[str, str, str]]:
    """``(importing unit, imported unit, file)`` for every import of one part of lapheads by another
    (at the top of a file or inside a function alike)."""
    import ast

    edges = set()
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE.parent).with_suffix("").parts
        is_pkg = rel[-1] == "__init__"
        mod = list(rel[:-1] if is_pkg else rel)
        pkg = mod if is_pkg else mod[:-1]
        src = mod[1] if len(mod) > 1 else "lapheads"
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[: len(pkg) - (node.level - 1)]
                    if node.module:
                        targets = [base + node.module.split(".")]
                    else:
                        targets = [base + [a.name] for a in node.names]
                elif node.module and node.module.split(".")[0] == "lapheads":
                    targets = [node.module.split(".")]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "lapheads"]
            for t in targets:
                dst = t[1] if len(t) > 1 else "lapheads"
                if dst != src and dst != "__version__":
                    edges.add((src, dst, _rel(f)))
    return edges


def test_architecture_page_lists_every_part_of_the_package():
    layers = architecture_layers()
    missing = [u for u in _units() if u not in layers]
    stale = [u for u in layers if u not in _units()]
    assert not missing, f"docs/architecture.md: add these parts of src/lapheads to the layer table: {missing}"
    assert not stale, f"docs/architecture.md names parts that src/lapheads no longer has: {stale}"


def test_imports_follow_the_architecture_layers():
    layers = dict(architecture_layers(), lapheads=2)  # the package root re-exports layers 1-2
    bad = sorted(
        f"{f}: {a} (layer {layers[a]}) imports {b} (layer {layers[b]})"
        for a, b, f in import_edges()
        if a in layers and b in layers and layers[b] > layers[a]
    )
    assert not bad, (
        "imports against the layers of docs/architecture.md (a module may import its own "
        "layer and those above it):\n" + "\n".join(bad)
    )


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``module -> modules it imports`` over every module of ``package`` (dotted names; a package is its
    ``__init__``). Every import counts: at the top of a file, under ``TYPE_CHECKING`` or inside a function.
    ``from pkg import name`` is an import of the module ``pkg.name`` where there is one, of ``pkg`` otherwise."""
    import ast

    mods = {}
    for f in package.rglob("*.py"):
        parts = list(f.relative_to(package.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    root = package.name
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == root):
                base = pkg[: len(pkg) - (node.level - 1)] if node.level else []
                target = base + (node.module.split(".") if node.module else [])
                for a in node.names:
                    sub = ".".join(target + [a.name])
                    names.append(sub if sub in mods else ".".join(target))
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == root]
            for n in names:
                while n not in mods and "." in n:  # ``import pkg.mod.attr`` and the like: the module part
                    n = n.rsplit(".", 1)[0]
                if n != m and n in mods:
                    graph[m].add(n)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others (networkx, torch's own
    dependency: strongly connected components of more than one module)."""
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in graph.items() for b in bs])
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_no_import_cycle_anywhere_in_the_package():
    cycles = import_cycles(module_graph())
    assert not cycles, (
        "modules of src/lapheads that import each other (move the shared part down, or hand the object "
        "over as an argument):\n" + "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_sees_two_module_cycles_inside_a_package(tmp_path):
    """The check itself: a ``TYPE_CHECKING`` import back, a function-level one and ``from . import`` all count."""
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import A\n")
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "sub" / "b.py").write_text("from .a import A\n")
    (pkg / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "d.py").write_text("import demo.c\n")
    (pkg / "e.py").write_text("from .sub import a\n")  # one way only: no cycle
    assert import_cycles(module_graph(pkg)) == [["demo.c", "demo.d"], ["demo.sub.a", "demo.sub.b"]]


def api_modules() -> tuple[set[str], set[str]]:
    """Modules named by ``::: module`` in docs/api/*.md, and those rendered with their submodules: the
    docs build's own reading of the pages (docs/griffe_rst.py), so the test and the site agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_griffe_rst", DOCS / "griffe_rst.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rendered_modules(DOCS / "api")


def test_every_public_module_is_in_the_api_reference():
    mods, trees = api_modules()
    missing = []
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if any(p.startswith("_") for p in parts) or name.startswith("lapheads.commands"):
            continue  # private modules; the commands are documented by --help and the pages
        if name not in mods and not any(name.startswith(t + ".") for t in trees):
            missing.append(name)
    assert not missing, f"modules missing from the API reference (docs/api/*.md): {missing}"


# --------------------------------------------------------------------------- (c) size
def test_readme_is_at_most_12_kb():
    size = README.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; at most {README_LIMIT} (move details to docs/)"


# --------------------------------------------------------------------------- the checker itself
def test_block_parser_and_path_finder(tmp_path):
    page = (
        "text\n\n```python\nx = 1\n```\n\n<!-- gpu -->\n```python\ny = 2\n```\n\n"
        '```python title="gpu"\nz = 3\n```\n\n```bash\nls\n```\n'
    )
    tmp = tmp_path / "page.md"
    tmp.write_text(page, encoding="utf-8")
    blocks = python_blocks(tmp)
    assert [(b[1], b[2] is None) for b in blocks] == [("x = 1\n", True), ("y = 2\n", False), ("z = 3\n", False)]
    assert named_paths("see `src/lapheads/ops.py`, recipes/lm/tiny.yaml. and runs/x/src/y") == {
        "src/lapheads/ops.py",
        "recipes/lm/tiny.yaml",
    }
    assert (
        named_paths(
            "recipes/<name>.yaml, recipes/*/x.yaml, studies/{a,b}, docs/recipe-NAME.md, "
            "src/lapheads/recipes/configs/RECIPE/x.yaml"
        )
        == set()
    )
    assert named_paths("benchmarks/RESULTS.md") == {"benchmarks/RESULTS.md"}


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (what `make docs` runs): a broken link, a missing reference or a
    docstring that does not render fails it. Built into a temporary directory, so build/ is left alone."""
    import os
    import sys

    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
