"""The recipe configs that ship inside the package (``lapheads recipes``, ``--config NAME``).

``lapheads/recipes/configs/<group>/<name>.yaml``: its ``recipe:`` key (else the group) names the recipe, its
first comment line describes it. ``--config`` takes a path or a shipped name (``digits``, ``classify/digits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

__all__ = ["CONFIG_DIR", "ShippedConfig", "shipped_configs", "resolve_config", "resolve_any"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped recipe config.

    Attributes:
        name: ``group/stem`` (``classify/digits``), what ``lapheads recipes`` lists.
        recipe: the recipe it configures (``classify``, ``retrofit_vit``, ...).
        path: the YAML file.
        description: its first comment line.
    """

    name: str
    recipe: str
    path: Path
    description: str


def _describe(path: Path) -> ShippedConfig:
    """The config in ``path``: its ``recipe:`` key and first comment line read from the text, without a YAML parser."""
    recipe, first = "", ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not first and line.startswith("#"):
            first = line.lstrip("#").strip()
        if line.startswith("recipe:"):
            recipe = line.split(":", 1)[1].split("#", 1)[0].strip().strip("'\"")
    return ShippedConfig(f"{path.parent.name}/{path.stem}", recipe or path.parent.name, path, first)


def shipped_configs() -> list[ShippedConfig]:
    """Every shipped config, sorted by name."""
    return [_describe(path) for path in sorted(CONFIG_DIR.glob("*/*.yaml"))]


def _is_path(spec: str) -> bool:
    return Path(spec).exists() or spec.endswith((".yaml", ".yml"))


def _shipped(spec: str, recipe: Optional[str]) -> str:
    """The shipped config (of ``recipe``, when given) that ``spec`` names; a ConfigError listing them otherwise."""
    mine = [c for c in shipped_configs() if recipe is None or c.recipe == recipe]
    found = [c for c in mine if spec in (c.name, c.path.stem)]
    if len(found) == 1:
        return str(found[0].path)
    of = f" of {recipe}" if recipe else ""
    if found:
        raise ConfigError(
            f"--config {spec!r} names several shipped configs{of}: {', '.join(c.name for c in found)}; "
            f"give one of those names{'' if recipe else ' (or --recipe)'}"
        )
    names = ", ".join(c.path.stem for c in mine) or "none"
    where = f"(shipped: {names}; `lapheads recipes` lists them all)" if recipe else "(`lapheads recipes` lists them)"
    raise ConfigError(f"--config {spec!r} is neither a file nor a shipped config{of} {where}")


def resolve_any(spec: str, recipe: Optional[str] = None) -> str:
    """``spec`` as given when it is an existing path, else the shipped config it names, of ``recipe``
    when given, else of any recipe (``digits`` is then ambiguous: ``classify/digits``).

    Raises:
        ConfigError: no shipped config has that name, or several do (the message lists them).
    """
    return spec if _is_path(spec) else _shipped(spec, recipe)


def resolve_config(recipe: str, spec: Optional[str]) -> Optional[str]:
    """``spec`` as given when it is None or an existing path, else the shipped config of ``recipe``
    it names (``digits`` / ``classify/digits``).

    Raises:
        ConfigError: ``spec`` is neither a file nor a shipped config of ``recipe`` (the message
            lists that recipe's shipped configs).
    """
    # a path as given: a missing one is reported by the YAML reader, naming the file
    return spec if spec is None or _is_path(spec) else _shipped(spec, recipe)
