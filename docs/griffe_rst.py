"""A griffe extension for the API reference: the reStructuredText habits of lapheads' docstrings,
rendered as Markdown.

The docstrings are Google-style (``Args:``, ``Returns:``, ``Raises:``) with a few Sphinx
constructs that Markdown does not know. This extension rewrites them when griffe loads the
package (nothing in ``src/`` changes):

* roles such as ``:func:`lapheads.laplacian_attention``` or ``:class:`~lapheads.heads.LayerHeads```
  become a link to the object's entry when the reference shows that object, else a code span;
* simple tables (columns framed by lines of ``=``) become Markdown tables;
* hyperlinks ```text <url>`_`` become ``[text](url)``;
* a paragraph ending in ``::`` (a literal block follows, indented) ends in ``:``.

A link is made only to an object that the API pages render (a public object of a module named in a
``:::`` line under ``docs/api/``, or a public member of such a class), so ``mkdocs build --strict``
never meets an unresolved reference.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|mod|exc|obj|const|term|ref|doc):`([^`]+)`")
_LINK = re.compile(r"`([^`<]+?)\s*<(https?://[^>]+)>`__?")
_NAMES = re.compile(r"^\s+\w+(,\s*\w+)+,\s*$")
_BORDER = re.compile(r"^(\s*)(=+)(\s+=+)+\s*$")

_API_DIR = Path(__file__).resolve().parent / "api"


def rendered_modules(api_dir: Path = _API_DIR) -> tuple[set[str], set[str]]:
    """The modules named in ``::: module`` lines of the API pages, and those among them rendered with
    their submodules (``show_submodules: true`` in the block's options)."""
    mods: set[str] = set()
    trees: set[str] = set()
    for page in api_dir.glob("*.md"):
        current = None
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("::: "):
                current = line[4:].strip()
                mods.add(current)
            elif current and line.startswith(" ") and re.match(r"\s*show_submodules:\s*true\b", line):
                trees.add(current)
            elif line.strip() and not line.startswith(" "):
                current = None
    return mods, trees


def _public(path: str) -> bool:
    return not any(part.startswith("_") for part in path.split("."))


class RstToMarkdown(griffe.Extension):
    """Rewrite the docstrings of a package from its Sphinx habits into Markdown (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._pkg: Optional[griffe.Module] = None
        self._modules, self._trees = rendered_modules()

    # ------------------------------------------------------------------ references
    def _lookup(self, path: str) -> Optional[Any]:
        if self._pkg is None or not path.startswith(self._pkg.path):
            return None
        obj: Any = self._pkg
        for part in path.split(".")[1:]:
            try:
                obj = obj.members[part]
            except Exception:  # not there, or an alias of another package that griffe did not load
                return None
        return obj

    def _module_shown(self, path: str) -> bool:
        return path in self._modules or any(path.startswith(t + ".") for t in self._trees)

    def _shown(self, path: str) -> bool:
        """Whether an API page renders an entry with this identifier."""
        if not _public(path):
            return False
        if self._module_shown(path):
            obj = self._lookup(path)
            return obj is not None and not obj.is_alias and obj.is_module
        obj = self._lookup(path)
        if obj is None:
            return False
        try:
            target = obj.final_target if obj.is_alias else obj
        except Exception:  # an alias of another package
            return False
        if target.is_module:  # a module has an entry only when a page names it
            return False
        if not (target.docstring and target.docstring.value.strip()):  # show_if_no_docstring: false
            return False
        parent = path.rsplit(".", 1)[0]
        if self._module_shown(parent):  # a public member of a rendered module
            mod = self._lookup(parent)
            if obj.is_alias:  # an import: shown only when the module lists it in __all__
                exports = getattr(mod, "exports", None) or ()
                return path.rsplit(".", 1)[1] in {str(e) for e in exports}
            return True
        grand = parent.rsplit(".", 1)[0]  # a member of a class of a rendered module
        owner = self._lookup(parent)
        return (
            self._module_shown(grand)
            and owner is not None
            and not owner.is_alias
            and owner.is_class
            and _public(parent)
        )

    def _resolve(self, target: str, context: Any) -> Optional[str]:
        """The identifier ``target`` names, seen from ``context`` (module, class or function)."""
        candidates = [target]
        scope = context
        while scope is not None:
            candidates.append(f"{scope.path}.{target}")
            scope = scope.parent
        for cand in candidates:
            if self._shown(cand):
                return cand
        return None

    def _role(self, match: re.Match, context: Any) -> str:
        text = match.group(1).strip()
        label_override = None
        m = re.match(r"(.+?)\s*<(.+)>$", text)
        if m:
            label_override, text = m.group(1), m.group(2)
        short = text.startswith("~")
        target = text.lstrip("~.").removesuffix("()")
        label = label_override or (target.rsplit(".", 1)[-1] if short else target)
        ident = self._resolve(target, context)
        return f"[`{label}`][{ident}]" if ident else f"`{label}`"

    # ------------------------------------------------------------------ tables
    @staticmethod
    def _table(lines: list[str], start: int) -> tuple[Optional[list[str]], int]:
        """Convert the simple table whose top border is ``lines[start]``; returns (rows, end)."""
        border = lines[start]
        indent = len(border) - len(border.lstrip())
        cols = [(m.start(), m.end()) for m in re.finditer(r"=+", border)]
        borders = [start]
        i = start + 1
        while i < len(lines):
            if _BORDER.match(lines[i]):
                borders.append(i)
                if len(borders) >= 2 and (i + 1 == len(lines) or not lines[i + 1].strip()):
                    break  # the bottom border: a blank line (or the end) follows
            elif not lines[i].strip():
                return None, start
            i += 1
        if len(borders) not in (2, 3) or i == len(lines) and len(borders) < 2:
            return None, start

        def cells(line: str) -> list[str]:
            out = []
            for n, (a, _) in enumerate(cols):
                b = cols[n + 1][0] if n + 1 < len(cols) else None
                out.append(line[a:b].strip() if b is not None else line[a:].strip())
            return out

        def rows_between(a: int, b: int) -> list[list[str]]:
            rows: list[list[str]] = []
            for line in lines[a + 1 : b]:
                if not line.strip():
                    continue
                c = cells(line)
                if rows and not c[0]:  # a continuation line: more text for the row above
                    rows[-1] = [f"{x} {y}".strip() for x, y in zip(rows[-1], c)]
                else:
                    rows.append(c)
            return rows

        if len(borders) == 3:
            header, body = rows_between(borders[0], borders[1]), rows_between(borders[1], borders[2])
        else:  # no header row: Markdown needs one, left empty
            header, body = [], rows_between(borders[0], borders[1])
        pad = " " * indent
        head = [" ".join(col) for col in zip(*header)] if header else [""] * len(cols)

        def fmt(row: list[str]) -> str:
            return pad + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

        out = [fmt(head), pad + "|" + "|".join(" --- " for _ in cols) + "|"] + [fmt(r) for r in body]
        return ["", *out, ""], borders[-1] + 1

    def _tables(self, text: str) -> str:
        lines = text.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            if _BORDER.match(lines[i]):
                rows, end = self._table(lines, i)
                if rows is not None:
                    out.extend(rows)
                    i = end
                    continue
            out.append(lines[i])
            i += 1
        return "\n".join(out)

    # ------------------------------------------------------------------ docstrings
    @staticmethod
    def _join_name_lists(text: str) -> str:
        """``a, b,`` followed by a more indented ``c: text`` (several Google-style parameters that
        share one description, wrapped): one line, which griffe parses as one entry."""
        lines = text.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            if _NAMES.match(line) and i + 1 < len(lines) and lines[i + 1].strip():
                out.append(line.rstrip() + " " + lines[i + 1].strip())
                i += 2
                continue
            out.append(line)
            i += 1
        return "\n".join(out)

    def convert(self, text: str, context: Any) -> str:
        text = self._join_name_lists(text)
        text = self._tables(text)
        text = _LINK.sub(lambda m: f"[{m.group(1).strip()}]({m.group(2)})", text)
        text = _ROLE.sub(lambda m: self._role(m, context), text)
        lines = text.split("\n")
        for n, line in enumerate(lines):
            if line.rstrip().endswith("::") and not line.strip().startswith(("|", ">>>")):
                stripped = line.rstrip()[:-2].rstrip()
                lines[n] = stripped + ":" if stripped else ""
        return "\n".join(lines)

    def _visit(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or obj.is_alias:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            obj.docstring.value = self.convert(obj.docstring.value, obj)
        for member in list(obj.members.values()):
            if not member.is_alias:
                self._visit(member, seen)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._pkg = pkg
        self._visit(pkg, set())
