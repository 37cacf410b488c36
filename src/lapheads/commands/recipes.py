"""``lapheads recipes``: the recipe configs and sweep presets that ship with the package, one line each."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ..recipes.shipped import shipped_configs
from ..sweep_presets import presets


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="lapheads recipes",
        allow_abbrev=False,
        description="List the shipped recipe configs: use one with `lapheads train RECIPE --config NAME`.",
    )
    p.add_argument("--paths", action="store_true", help="also print each config's file")
    args = p.parse_args(list(argv or []))
    configs = shipped_configs()
    width = max(len(c.name) for c in configs)
    rwidth = max(len(c.recipe) for c in configs)
    for c in configs:
        print(f"{c.name:<{width}}  {c.recipe:<{rwidth}}  {c.description}")
        if args.paths:
            print(f"{'':<{width}}  {'':<{rwidth}}  {c.path}")
    print("\nuse one with: lapheads train RECIPE --config NAME (e.g. lapheads train classify --config digits)")
    grids = presets()
    if grids:
        print("\nsweep presets (lapheads sweep --preset NAME --out DIR):")
        pwidth = max(len(x.name) for x in grids)
        for x in grids:
            print(f"{x.name:<{pwidth}}  {x.n_runs():>3} runs of {x.spec.config}: {x.description}")
    return 0
