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
* ``--config NAME`` (no ``/``, no ``.yaml``) is a recipe file of the source checkout's ``recipes/``
  folder that names this recipe (``recipe: NAME``), or names none and lies in ``recipes/RECIPE/``
  (``lapheads config show classify --config digits``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import yaml

from ..engine.config import config_schema, load_config, read_yaml, to_dict
from ..errors import ConfigError
from ..recipes import RECIPES, get_recipe


def _recipe_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=sorted(RECIPES), help="the recipe whose config is printed")


def resolve_config_file(recipe: str, name_or_path: str) -> Path:
    """The YAML file ``--config`` names: a path, or the name of a recipe file of ``recipe`` in the
    checkout's ``recipes/`` folder (``digits`` -> ``recipes/classify/digits.yaml``; module docstring).

    Raises:
        ConfigError: a name that no recipe file of ``recipe`` has (the message lists those there are).
    """
    path = Path(name_or_path)
    if path.exists() or "/" in name_or_path or path.suffix in (".yaml", ".yml"):
        return path  # load_config says what is wrong with a path
    from ..quickstart import recipes_dir  # the checkout's recipes/ (a ConfigError outside one)

    def of_recipe(f: Path) -> bool:  # names the recipe, or names none and lies in recipes/RECIPE/
        try:
            named = read_yaml(f).get("recipe")
        except ConfigError:
            return False
        return named == recipe or (named is None and f.parent.name == recipe)

    files = sorted(f for f in recipes_dir().glob("*/*.yaml") if of_recipe(f))
    hits = [f for f in files if f.stem == name_or_path]
    if not hits:
        raise ConfigError(f"--config {name_or_path!r} is neither a file nor a recipe file of {recipe!r}; its recipe "
                          f"files are {[f.stem for f in files]} (or give a path)")
    return hits[0]


def show_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads config show RECIPE [--config NAME_OR_PATH] [--set KEY=VALUE ...]``."""
    p = argparse.ArgumentParser(prog="lapheads config show", allow_abbrev=False,
                                description="Print a recipe's config as YAML: the defaults, or what --config "
                                            "and --set resolve to.")
    _recipe_arg(p)
    p.add_argument("--config", default=None, metavar="NAME_OR_PATH",
                   help="a YAML recipe file, or the name of one in recipes/ (e.g. digits)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=100 (repeatable)")
    args = p.parse_args(list(argv or []))
    recipe = get_recipe(args.recipe)
    path = resolve_config_file(recipe.name, args.config) if args.config else None
    if path is None and not args.overrides:
        cfg = recipe.config_type()
    else:
        cfg = load_config(recipe.config_type, path, args.overrides, recipe=recipe.name, run_rules=False)
    print(yaml.safe_dump({"recipe": recipe.name, **to_dict(cfg)}, sort_keys=False), end="")
    return 0


def schema_main(argv: Optional[Sequence[str]] = None) -> int:
    """``lapheads config schema RECIPE``: the JSON schema of the recipe's config."""
    p = argparse.ArgumentParser(prog="lapheads config schema", allow_abbrev=False,
                                description="Print the JSON schema of a recipe's config (for editors).")
    _recipe_arg(p)
    args = p.parse_args(list(argv or []))
    recipe = get_recipe(args.recipe)
    print(json.dumps(config_schema(recipe.config_type, recipe.name), indent=2))
    return 0
