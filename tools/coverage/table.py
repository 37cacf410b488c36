"""What both coverage tables share: the row, the status words, the comparison of outputs, the Markdown.

A library's harness (:mod:`tools.coverage.timm_table`, :mod:`tools.coverage.transformers_table`)
builds one tiny representative per architecture family, checks it against a reference computed
apart from lapheads' forward code, and returns one :class:`Row` per representative; this module
turns rows into the committed Markdown (:func:`markdown`) and compares it with the file
(:func:`write_or_check`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
from typing import Any, Optional, Sequence

import torch

#: The status words, best first. ``supported``: every check passed. ``refused``: lapheads raised a
#: ``ConfigError`` (the detail quotes it). ``not built``: no tiny representative could be built and
#: checked (the detail says why). ``failed``: a crash, a silently standard model, or a mismatch.
STATUSES = ("supported", "refused", "not built", "failed")


@dataclasses.dataclass
class Row:
    """One representative's result.

    Attributes:
        family: the architecture family (timm's registering module; transformers' attention features).
        label: the variant within the family (timm's ``EVA-02``), or ``""``.
        model: the model that was built and checked (``""`` when none was).
        built_with: how it was built (tiny keyword arguments, the auto class).
        members: every model name of the family, sorted.
        status: one of :data:`STATUSES`.
        detail: what was converted and checked, or the reason.
        seconds: wall time (printed while running, never written to the table).
    """

    family: str
    label: str
    model: str
    built_with: str
    members: list[str]
    status: str
    detail: str
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is none of {STATUSES}")


def one_line(text: Any, limit: int = 220) -> str:
    """A message made deterministic and table-safe: no addresses, no temporary paths, one line, cut."""
    text = re.sub(r"0x[0-9a-fA-F]+", "0x…", str(text))
    text = re.sub(r"/tmp/[^\s'\"]+", "<tmp>", text)
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------- comparing outputs
def tensors(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a model output (a tensor, a tuple, a dict, a ``ModelOutput``), in order."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    elif isinstance(out, dict):
        out = [out[k] for k in sorted(out)]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in tensors(o)]
    return []


def max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two outputs; inf when their structures differ."""
    ta, tb = tensors(a), tensors(b)
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb)):
        return float("inf")
    return max([float((x - y).abs().max()) for x, y in zip(ta, tb) if x.numel()] or [0.0])


def equal(a: Any, b: Any) -> bool:
    """Bit-identical outputs (``torch.equal`` tensor by tensor)."""
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) > 0 and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def scale(out: Any) -> float:
    """Largest absolute value of an output (tolerances relative to it)."""
    return max([float(t.abs().max()) for t in tensors(out) if t.numel()] or [0.0])


# ---------------------------------------------------------------------- the table
def family_status(rows: Sequence[Row]) -> dict[str, str]:
    """Family -> its status: a family with several rows takes the worst (failed > not built > refused > supported)."""
    worst: dict[str, str] = {}
    for r in rows:
        if r.family not in worst or STATUSES.index(r.status) > STATUSES.index(worst[r.family]):
            worst[r.family] = r.status
    return worst


def counts(rows: Sequence[Row]) -> tuple[dict[str, int], dict[str, int]]:
    """(families per status, models of those families per status)."""
    worst = family_status(rows)
    members = {r.family: r.members for r in rows}
    families = {s: sum(v == s for v in worst.values()) for s in STATUSES}
    models = {s: sum(len(members[f]) for f, v in worst.items() if v == s) for s in STATUSES}
    return families, models


def markdown(title: str, intro: str, rows: Sequence[Row], extra: str = "") -> str:
    """The Markdown of a coverage table: counts, one line per representative, every family's members.

    Deterministic: no timing and nothing machine-dependent, so the same code gives the same file.
    """
    families, models = counts(rows)

    def tally(c: dict[str, int]) -> str:
        return f"{sum(c.values())} — " + ", ".join(f"{s} {c[s]}" for s in STATUSES)

    out = [
        f"# {title}",
        "",
        intro.strip(),
        "",
        f"Families: {tally(families)}.",
        f"Models in them: {tally(models)}.",
        "",
        "| # | family | representative | built with | models | status | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        fam = f"{r.family} ({r.label})" if r.label else r.family
        rep = f"`{r.model}`" if r.model else "—"
        cells = [str(i), fam, rep, r.built_with or "—", str(len(r.members)), r.status, r.detail or "—"]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", "## Members of each family", ""]
    seen: set[str] = set()
    for r in rows:
        if r.family not in seen:
            seen.add(r.family)
            out.append(f"- **{r.family}** ({len(r.members)}): {', '.join(r.members)}")
    if extra:
        out += ["", extra.strip()]
    return "\n".join(out) + "\n"


def write_or_check(text: str, write: Optional[str] = None, check: Optional[str] = None) -> int:
    """Print ``text``, write it to ``write``, or compare it with ``check`` (the diff printed, 1 when it differs)."""
    if check:
        with open(check, encoding="utf-8") as f:
            old = f.read()
        if old != text:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), check, "now"))
            return 1
        return 0
    if write:
        os.makedirs(os.path.dirname(os.path.abspath(write)), exist_ok=True)
        with open(write, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
