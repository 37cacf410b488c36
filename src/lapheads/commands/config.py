"""``lapheads config show RECIPE`` and ``lapheads config schema RECIPE``: a recipe's config, without training.

``show`` prints the defaults (or what ``--config`` / ``--set`` resolve to) as a YAML that is itself a
``--config`` file; ``schema`` prints the JSON schema of the recipe's config model, for editors.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

import yaml

from ..engine.config import config_schema, load_config, to_dict
from ..recipes import RECIPES, get_recipe
from ..recipes.shipped import resolve_config
from . import repeated


def _recipe_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=sorted(RECIPES), help="the recipe whose config is printed")


def show_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads config show RECIPE [--config NAME_OR_PATH] [--set KEY=VALUE ...]``."""
    p = argparse.ArgumentParser(
        prog="lapheads config show",
        allow_abbrev=False,
        description="Print a recipe's config as YAML: the defaults, or what --config and --set resolve to.",
    )
    _recipe_arg(p)
    p.add_argument(
        "--config",
        metavar="NAME_OR_PATH",
        help="a YAML recipe file, or the name of a shipped one (e.g. digits; `lapheads recipes`)",
    )
    repeated(
        p,
        "--set",
        "override a config value, e.g. --set train.max_steps=100 (repeatable)",
        dest="overrides",
        metavar="KEY=VALUE",
    )
    args = p.parse_args(list(argv or []))
    recipe = get_recipe(args.recipe)
    path = resolve_config(recipe.name, args.config)
    cfg = load_config(recipe.config_type, path, args.overrides, recipe=recipe.name, run_rules=False)
    print(yaml.safe_dump({"recipe": recipe.name, **to_dict(cfg)}, sort_keys=False), end="")
    return 0


def schema_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads config schema RECIPE``: the JSON schema of the recipe's config."""
    p = argparse.ArgumentParser(
        prog="lapheads config schema",
        allow_abbrev=False,
        description="Print the JSON schema of a recipe's config (for editors).",
    )
    _recipe_arg(p)
    args = p.parse_args(list(argv or []))
    recipe = get_recipe(args.recipe)
    print(json.dumps(config_schema(recipe.config_type, recipe.name), indent=2))
    return 0
