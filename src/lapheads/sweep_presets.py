"""Sweep presets: named grids that ship with the package, run by ``lapheads sweep --preset NAME --out DIR``.

A preset is ``lapheads/recipes/sweeps/<name>.yaml``: the flags of one ``lapheads sweep`` (``config``: a shipped
config or a path; ``laplacian_heads``; ``seeds``; ``grid`` and ``points`` as ``--grid`` / ``--point`` take them;
``overrides`` as ``--set`` takes them), its first comment line its description. ``lapheads sweep --list-presets``
lists them (docs/reports.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from .engine.config import ConfigModel, Int, Str, from_dict, read_yaml
from .errors import ConfigError
from .recipes.shipped import resolve_any
from .sweep import design_points, parse_grid, parse_heads_list, parse_point

__all__ = ["PRESET_DIR", "PresetSpec", "Preset", "presets", "load_preset"]

PRESET_DIR = Path(__file__).resolve().parent / "recipes" / "sweeps"


class PresetSpec(ConfigModel):
    """The keys of a preset file."""

    config: Str = Field(description="the recipe config: a shipped config's name (lm/nanochat2026) or a path")
    laplacian_heads: list[Any] = Field(description="the head settings, e.g. [0, 1, 2, 4] or [0, all]")
    seeds: list[Int] = Field([0], description="the seeds")
    grid: list[Str] = Field([], description="config axes, each as --grid takes it (model.depth=12,16,20)")
    points: list[Str] = Field([], description="explicit design points, each as --point takes it")
    overrides: list[Str] = Field([], description="settings of every run, each as --set takes it (key=value)")


@dataclass(frozen=True)
class Preset:
    """A shipped preset: its name, description, file and keys, and the sweep they stand for."""

    name: str
    description: str
    path: Path
    spec: PresetSpec

    @property
    def config(self) -> str:
        """The path of the recipe config."""
        return resolve_any(self.spec.config)

    @property
    def heads(self) -> list[str]:
        """The head settings as ``--laplacian-heads`` spells them."""
        return parse_heads_list(",".join(str(h) for h in self.spec.laplacian_heads))

    @property
    def seeds(self) -> list[int]:
        return list(self.spec.seeds)

    def design(self, overrides: tuple[str, ...] | list[str] = ()) -> list[dict[str, str]]:
        """The design points of its grid and points (``overrides``: all the ``--set`` of the sweep)."""
        sets = [*self.spec.overrides, *overrides]
        return design_points(parse_grid(self.spec.grid, sets), [parse_point(p, sets) for p in self.spec.points])

    def n_runs(self) -> int:
        """Runs of the whole preset: design points x head settings x seeds."""
        return len(self.design()) * len(self.heads) * len(self.seeds)


def _read(path: Path) -> Preset:
    first = next(
        (ln.lstrip("#").strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.startswith("#")), ""
    )
    spec = from_dict(PresetSpec, read_yaml(path), prefix=f"{path}: ")
    preset = Preset(path.stem, first, path, spec)
    if len(set(spec.seeds)) != len(spec.seeds):
        raise ConfigError(f"{path}: seeds {spec.seeds} gives a seed twice; give each seed once")
    preset.n_runs()  # a malformed head setting or axis fails when the preset is read
    return preset


def presets() -> list[Preset]:
    """Every shipped preset, sorted by name."""
    return [_read(p) for p in sorted(PRESET_DIR.glob("*.yaml"))]


def load_preset(name: str) -> Preset:
    """The shipped preset ``name``.

    Raises:
        ConfigError: no preset has that name (the message lists them).
    """
    path = PRESET_DIR / f"{name}.yaml"
    if not name or "/" in name or not path.is_file():
        known = ", ".join(p.stem for p in sorted(PRESET_DIR.glob("*.yaml"))) or "none"
        raise ConfigError(
            f"--preset {name!r} is not a shipped sweep preset (known: {known}; `lapheads sweep --list-presets` "
            "describes them)"
        )
    return _read(path)
