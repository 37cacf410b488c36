"""The recipe configs as pydantic models: ``lapheads config show`` / ``schema``, the docs table, and
bad inputs that pydantic itself sees (NaN, ranges, unknown nested keys, wrong types).

Assertions name key paths, values and structure, never prose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lapheads.cli import main as cli
from lapheads.engine.config import ConfigModel, config_table, from_dict, load_config, to_dict
from lapheads.errors import ConfigError
from lapheads.recipes import RECIPES, get_recipe
from lapheads.recipes.shipped import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(CONFIG_DIR / "classify" / "digits.yaml")
#: a section every recipe has, and one of its own
SECTIONS = {
    "classify": "aug",
    "lm": "samples",
    "sft": "data",
    "dino": "crops",
    "retrofit": "lora",
    "retrofit_vit": "lora",
}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli(argv)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- config show / schema
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_config_show_prints_defaults_that_load_back(recipe, capsys, tmp_path):
    rc, out, err = _run(["config", "show", recipe], capsys)
    assert rc == 0, err
    data = yaml.safe_load(out)
    cls = get_recipe(recipe).config_type
    assert data["recipe"] == recipe and list(data)[1:] == list(cls.model_fields)
    f = tmp_path / "defaults.yaml"
    f.write_text(out)
    # run_rules=False: sft / retrofit leave init_from open in their defaults
    assert load_config(cls, f, recipe=recipe, run_rules=False) == cls()
    assert to_dict(load_config(cls, f, recipe=recipe, run_rules=False)) == {
        k: v for k, v in data.items() if k != "recipe"
    }


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_config_schema_is_json_with_the_sections_and_descriptions(recipe, capsys):
    rc, out, err = _run(["config", "schema", recipe], capsys)
    assert rc == 0, err
    schema = json.loads(out)
    props = schema["properties"]
    assert {"recipe", "train", SECTIONS[recipe]} <= set(props)
    assert props["recipe"]["const"] == recipe and schema["additionalProperties"] is False
    train = schema["$defs"]["TrainConfig"]["properties"]
    assert train["seed"]["type"] == "integer" and train["seed"]["description"]
    assert train["ema_decay"]["minimum"] == 0.0 and train["ema_decay"]["exclusiveMaximum"] == 1.0
    assert train["schedule"]["enum"] == ["cosine", "linear", "constant", "wsd"]


def test_config_show_resolves_a_named_recipe_file_and_overrides(capsys):
    rc, out, err = _run(
        ["config", "show", "classify", "--config", "digits", "--set", "model.depth=3", "--set", "train.seed=7"], capsys
    )
    assert rc == 0, err
    data = yaml.safe_load(out)
    assert data["model"]["depth"] == 3 and data["train"]["seed"] == 7
    assert data["model"]["embed_dim"] == yaml.safe_load(Path(DIGITS).read_text())["model"]["embed_dim"]
    rc, path_out, _ = _run(
        ["config", "show", "classify", "--config", DIGITS, "--set", "model.depth=3", "--set", "train.seed=7"], capsys
    )
    assert rc == 0 and path_out == out


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["config", "show", "classify", "--set", "optim.betas=[0.9, .nan]"], ("optim.betas[1]=nan", "finite")),
        (["config", "show", "classify", "--set", "aug.mix_prob=1.5"], ("aug.mix_prob=1.5", "[0, 1]")),
        (
            ["config", "show", "lm", "--set", "train.until_plateau.patiense=2"],
            ("train.until_plateau.patiense", "patience"),
        ),
        (["config", "show", "dino", "--config", "no_such_recipe_file"], ("no_such_recipe_file", "digits")),
        (["config", "show", "sft", "--set", "data.packing=2"], ("data.packing=2",)),
    ],
)
def test_config_show_refuses_bad_values_in_one_line(argv, needles, capsys):
    rc, out, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert all(n in lines[0] for n in needles), (needles, lines[0])


# ----------------------------------------------------------------------------- the docs table
def test_config_table_lists_every_key_with_type_default_range_and_description():
    cls = get_recipe("classify").config_type
    table = config_table(cls)
    lines = table.strip().splitlines()
    assert lines[0].count("|") == 6 and set(lines[1].replace("|", "").split()) == {"---"}
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines[2:]]  # "\|" is in a cell
    rows = {c[0].strip("`"): c[1:] for c in cells}
    flat = {k for k in rows if rows[k][0] != "section"}
    assert {"model.laplacian_heads", "optim.betas", "train.until_plateau.patience", "aug.loss"} <= flat
    assert rows["train"][0] == "section" and rows["train.until_plateau"][0] == "section"
    ls = rows["aug.label_smoothing"]
    assert ls[:3] == ["float", "`0.1`", "in [0, 1)"] and ls[3]
    assert rows["optim.betas"][1:3] == ["`[0.9, 0.999]`", "items in [0, 1)"]
    assert rows["train.clip_grad"][1] == "`1.0`"  # the recipe's own default of the shared section
    assert rows["model.patch_size"][0] == "int \\| null"

    # every field of every section has a row, and a description
    def keys(c: type[ConfigModel], prefix: str = "") -> set[str]:
        out = set()
        for name, f in c.model_fields.items():
            sub = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, ConfigModel) else None
            out |= keys(sub, f"{prefix}{name}.") if sub else {prefix + name}
        return out

    assert keys(cls) == flat and all(rows[k][3] for k in flat)


def test_config_table_shows_the_fields_of_a_list_of_sections():
    rows = config_table(get_recipe("sft").config_type)
    assert "`data.sources[].path` | str | required" in rows and "`data.sources[].weight`" in rows


# ----------------------------------------------------------------------------- pydantic-side bad inputs
@pytest.mark.parametrize(
    "data, needles",
    [
        ({"optim": {"betas": [0.9, float("nan")]}}, ("optim.betas[1]=nan", "finite")),
        ({"train": {"until_plateau": {"min_rel_delta": float("inf")}}}, ("train.until_plateau.min_rel_delta=inf",)),
        ({"data": {"hflip": -0.5}}, ("data.hflip=-0.5", "[0, 1]")),
        ({"data": {"std": [0.5, 0.5, 0]}}, ("data.std[2]=0.0", "> 0")),
        ({"train": {"until_plateau": {"paitence": 1}}}, ("train.until_plateau.paitence", "min_rel_delta")),
        ({"model": {"qk_norm": 1}}, ("model.qk_norm=1",)),
        ({"model": {"img_size": "16"}}, ("model.img_size='16'",)),
        ({"train": {"seed": True}}, ("train.seed=True",)),
        ({"aug": {"mixup": False}}, ("aug.mixup=False",)),
        ({"optim": {"betas": 0.9}}, ("optim.betas=0.9",)),
        ({"model": {"laplacian_heads": "sometimes"}}, ("model.laplacian_heads='sometimes'",)),
        ({"data": []}, ("data", "DataConfig")),
    ],
)
def test_bad_values_name_the_full_key_path_and_the_value(data, needles):
    cls = get_recipe("classify").config_type
    with pytest.raises(ConfigError) as e:
        from_dict(cls, data)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), (needles, msg)


def test_lenient_spellings_of_yaml_numbers_are_read():
    cls = get_recipe("classify").config_type
    cfg = load_config(cls, overrides=["optim.lr=1e-3", "data.epochs=3.0", "data.train=2024", "optim.betas=[0.8, 9e-1]"])
    assert (cfg.optim.lr, cfg.data.epochs, cfg.data.train, cfg.optim.betas) == (1e-3, 3, "2024", (0.8, 0.9))
    assert type(cfg.data.epochs) is int


def test_the_file_prefix_and_duplicate_yaml_keys(tmp_path):
    cls = get_recipe("classify").config_type
    with pytest.raises(ConfigError, match=r"^run/config\.yaml: model\.depth=0 must be >= 1$"):
        from_dict(cls, {"model": {"depth": 0}}, prefix="run/config.yaml: ")
    f = tmp_path / "dup.yaml"
    f.write_text("recipe: classify\noptim:\n  betas: [0.9, 0.99]\n  lr: 0.1\n  betas: [0.8, 0.9]\n")
    with pytest.raises(ConfigError, match=r"dup\.yaml: key 'optim\.betas' is given twice \(lines 3 and 5\)"):
        load_config(cls, f, recipe="classify")


def test_direct_construction_raises_config_error_and_validate_runs_the_run_rules():
    from lapheads.engine import TrainConfig
    from lapheads.recipes.sft import SFTConfig

    with pytest.raises(ConfigError, match=r"^warmup_ratio=1\.0 must be in \[0, 1\)$"):
        TrainConfig(warmup_ratio=1)
    assert SFTConfig().init_from == ""  # the defaults leave init_from open ...
    with pytest.raises(ConfigError, match="^init_from"):
        SFTConfig().validate()  # ... a config to run must set it
    assert SFTConfig(init_from="runs/x").validate() == SFTConfig(init_from="runs/x")
