"""The recipe configs shipped in the package: listed by `lapheads recipes`, found by name, and each
one a valid config of its recipe (so a shipped file can never rot unnoticed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lapheads.cli import main as cli
from lapheads.engine.config import load_config
from lapheads.errors import ConfigError
from lapheads.recipes import RECIPES, get_recipe
from lapheads.recipes.shipped import CONFIG_DIR, resolve_any, resolve_config, shipped_configs

SHIPPED = shipped_configs()


def test_every_yaml_under_the_config_dir_is_listed_once_with_a_recipe_and_a_description():
    assert sorted(c.path for c in SHIPPED) == sorted(CONFIG_DIR.glob("*/*.yaml"))
    assert len({c.name for c in SHIPPED}) == len(SHIPPED)
    for c in SHIPPED:
        assert c.recipe in RECIPES, c
        assert c.description and not c.description.startswith("#"), c


@pytest.mark.parametrize("shipped", SHIPPED, ids=[c.name for c in SHIPPED])
def test_each_shipped_config_is_a_valid_config_of_its_recipe(shipped):
    cfg = load_config(get_recipe(shipped.recipe).config_type, shipped.path, recipe=shipped.recipe, run_rules=False)
    assert cfg is not None


def test_the_recipes_command_lists_every_config(capsys):
    assert cli(["recipes"]) == 0
    out = capsys.readouterr().out
    for c in SHIPPED:
        line = next(line for line in out.splitlines() if line.startswith(c.name + " "))
        assert c.recipe in line.split() and c.description in line


def test_names_resolve_to_the_shipped_file_and_a_path_wins(tmp_path, monkeypatch):
    digits = str(CONFIG_DIR / "classify" / "digits.yaml")
    assert resolve_config("classify", "digits") == digits
    assert resolve_config("classify", "classify/digits") == digits
    assert resolve_config("retrofit_vit", "vit_tiny") == str(CONFIG_DIR / "retrofit" / "vit_tiny.yaml")
    assert resolve_config("classify", None) is None
    assert resolve_any("classify/digits") == digits
    with pytest.raises(ConfigError, match="classify/digits, dino/digits"):
        resolve_any("digits")  # two recipes ship a `digits`
    assert resolve_any("digits", "dino") == str(CONFIG_DIR / "dino" / "digits.yaml")
    with pytest.raises(ConfigError, match="'nope'.*cifar100_vits, deit3_base_imagenet, deit3_large_imagenet, digits"):
        resolve_config("classify", "nope")
    monkeypatch.chdir(tmp_path)
    Path("digits").write_text("recipe: classify\n")
    assert resolve_config("classify", "digits") == "digits"  # an existing path is never shadowed
