"""``lapheads config show RECIPE`` and ``lapheads config schema RECIPE``: a recipe's config, without training.

* ``show`` prints the defaults as YAML, or with ``--config NAME_OR_PATH`` / ``--set KEY=VALUE`` the
  config those resolve to (defaults <- YAML <- ``--set``, checked as ``lapheads train`` checks it).
  The output starts with ``recipe: NAME`` and has the keys and layout of a run's ``config.yaml``, so
  it is itself a ``--config`` file. The run rules (``init_from`` set and existing, values derived
  from the world size; :func:`lapheads.engine.config.run_rule`) are left to ``train``: a config
  whose ``init_from`` is still open can be shown.
* ``schema`` prints the JSON schema of the recipe's config model
  (:func:`lapheads.engine.config.config_schema`): types, ranges, defaults and a description per
  key, for editors that complete and check YAML (e.g. ``# yaml-language-server: $schema=...``).
* ``--config NAME`` is a shipped config of the recipe (:mod:`lapheads.recipes.shipped`;
  ``lapheads config show classify --config digits``), as for ``lapheads train``.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

import yaml

from ..engine.config import config_schema, load_config, to_dict
from ..recipes import RECIPES, get_recipe
from ..recipes.shipped import resolve_config


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
        default=None,
        metavar="NAME_OR_PATH",
        help="a YAML recipe file, or the name of a shipped one (e.g. digits; `lapheads recipes`)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=100 (repeatable)",
    )
    args = p.parse_args(list(argv or []))
    recipe = get_recipe(args.recipe)
    path = resolve_config(recipe.name, args.config)
    if path is None and not args.overrides:
        cfg = recipe.config_type()
    else:
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
