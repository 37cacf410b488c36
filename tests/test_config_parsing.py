"""Config parsing that never silently misreads, and the output-path checks every command shares.

Unit tests of :mod:`lapheads.engine.config` (repeated YAML keys, NaN/inf, 64-bit ints, declared
ranges of the pydantic config models) and :mod:`lapheads.outputs`; the command-line cases (one line, exit 2, nothing left
behind) are in ``test_bad_inputs.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest
from pydantic import Field

from lapheads.engine.config import (
    INT64_MAX,
    Beta,
    ConfigModel,
    Float,
    FloatOrInf,
    Int,
    from_dict,
    load_config,
    load_yaml,
    parse_overrides,
    read_yaml,
)
from lapheads.errors import CheckpointError, ConfigError
from lapheads.outputs import check_out_dir, check_out_file, read_json, removed_on_failure
from lapheads.recipes.shipped import CONFIG_DIR


# ----------------------------------------------------------------------------- repeated keys
def test_repeated_key_names_key_path_and_both_lines():
    text = "recipe: classify\nmodel:\n  laplacian_heads: 0\n  depth: 2\n  laplacian_heads: all\n"
    with pytest.raises(
        ConfigError,
        match=r"cfg\.yaml: key 'model\.laplacian_heads' is given twice "
        r"\(lines 3 and 5\)",
    ):
        load_yaml(text, "cfg.yaml")


def test_repeated_key_inside_a_list_and_on_one_line():
    with pytest.raises(ConfigError, match=r"'sources\[1\]\.path' is given twice \(line 1, columns 23 and 32\)"):
        load_yaml("sources: [{path: a}, {path: b, path: c}]", "x")


def test_the_same_key_in_different_mappings_and_merge_keys_are_fine():
    text = "base: &b {lr: 1, wd: 2}\nsmall:\n  <<: *b\n  lr: 3\nbig:\n  <<: *b\n  lr: 4\n"
    assert load_yaml(text, "x") == {"base": {"lr": 1, "wd": 2}, "small": {"lr": 3, "wd": 2}, "big": {"lr": 4, "wd": 2}}


def test_keys_equal_after_construction_count_as_repeated():
    with pytest.raises(ConfigError, match="given twice"):
        load_yaml("1: a\n1.0: b\n", "x")


def test_read_yaml_refuses_repeats_and_says_what_a_bad_path_is(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  seed: 1\ntrain:\n  seed: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: key 'train' is given twice \(lines 1 and 3\)"):
        read_yaml(f)
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        read_yaml(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml(tmp_path / "missing.yaml")
    f.write_bytes(b"a: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_yaml(f)


def test_set_value_with_a_repeated_key_names_the_full_path():
    with pytest.raises(ConfigError, match=r"--set 'optim=\{lr: 1, lr: 2\}': key 'optim\.lr' is given twice"):
        parse_overrides(["optim={lr: 1, lr: 2}"])


def test_a_run_config_yaml_with_a_repeated_key_is_refused(tmp_path):
    from lapheads.engine.run import RunDir

    (tmp_path / "config.yaml").write_text("recipe: classify\nmodel:\n  depth: 2\n  depth: 3\n")
    with pytest.raises(ConfigError, match=r"config\.yaml: key 'model\.depth' is given twice"):
        RunDir(tmp_path).read_config()


def test_no_yaml_read_in_the_package_bypasses_the_strict_loader():
    src = Path(__file__).resolve().parents[1] / "src" / "lapheads"
    offenders = [
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if any(s in p.read_text(encoding="utf-8") for s in ("safe_load(", "yaml.load(", "full_load("))
    ]
    assert offenders == [], f"use lapheads.engine.config.load_yaml instead in {offenders}"


# ----------------------------------------------------------------------------- numbers
class Inner(ConfigModel):
    rate: Float = Field(0.5, ge=0.0, le=1.0)
    smoothing: Float = Field(0.1, ge=0.0, lt=1.0)
    betas: tuple[Beta, Beta] = Field((0.9, 0.99), strict=False)
    width: Optional[Int] = Field(None, ge=1)
    temperature: FloatOrInf = Field(1.0, gt=0.0)  # an opt-in to +-inf (no real field has one)


class Outer(ConfigModel):
    seed: Int = 0
    clip: Float = 0.0
    scale: Optional[Float] = None
    inner: Inner = Inner()


@pytest.mark.parametrize("raw", ["nan", ".nan", ".inf", "-.inf", "inf", "-inf", "1e400"])
def test_every_float_field_refuses_nan_and_infinity(raw):
    for key in ("clip", "scale", "inner.rate"):
        with pytest.raises(ConfigError, match=rf"{key.replace('.', r'[.]')}=.* must be a finite number"):
            load_config(Outer, overrides=[f"{key}={raw}"])


def test_a_non_finite_item_of_a_tuple_is_refused_by_position():
    with pytest.raises(ConfigError, match=r"inner\.betas\[1\]=nan must be a finite number"):
        load_config(Outer, overrides=["inner.betas=[0.9, .nan]"])


def test_ints_beyond_64_bits_are_refused():
    assert load_config(Outer, overrides=[f"seed={INT64_MAX}"]).seed == INT64_MAX
    for raw in (str(INT64_MAX + 1), str(-(2**63) - 1), "1.0e+30", "9" * 5000):
        with pytest.raises(ConfigError, match="64 bits|cannot read"):
            load_config(Outer, overrides=[f"seed={raw}"])


def test_an_int_too_large_for_a_float_field_is_refused():
    with pytest.raises(ConfigError, match="too large for a float"):
        from_dict(Outer, {"clip": 10**400})


@pytest.mark.parametrize(
    "key,raw,message",
    [
        ("inner.rate", "1.5", r"inner\.rate=1\.5 must be in \[0, 1\]"),
        ("inner.rate", "-0.1", r"inner\.rate=-0\.1 must be in \[0, 1\]"),
        ("inner.smoothing", "1", r"inner\.smoothing=1\.0 must be in \[0, 1\)"),
        ("inner.betas", "[0.9, 1.0]", r"inner\.betas\[1\]=1\.0 must be in \[0, 1\)"),
        ("inner.width", "0", r"inner\.width=0 must be >= 1"),
        ("inner.temperature", "0", r"inner\.temperature=0\.0 must be > 0"),
    ],
)
def test_declared_ranges_are_checked_at_parse_time(key, raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Outer, overrides=[f"{key}={raw}"])


def test_values_inside_the_ranges_and_opt_in_infinity_pass():
    cfg = load_config(
        Outer,
        overrides=[
            "inner.rate=1",
            "inner.smoothing=0",
            "inner.width=null",
            "inner.temperature=.inf",
            "clip=0",
            "scale=2.5",
        ],
    )
    assert cfg.inner.rate == 1.0 and cfg.inner.width is None and cfg.inner.temperature == float("inf")
    with pytest.raises(ConfigError, match="finite"):
        load_config(Outer, overrides=["inner.temperature=.nan"])  # NaN never


def test_recipe_fields_from_the_issue_are_refused():
    from lapheads.recipes.classify import ClassifyConfig

    for override, message in [
        ("train.clip_grad=nan", "train.clip_grad=nan must be a finite number"),
        ("aug.label_smoothing=5", r"aug\.label_smoothing=5\.0 must be in \[0, 1\)"),
        (f"train.seed={2**64}", r"train\.seed=18446744073709551616 does not fit in 64 bits"),
        ("aug.mix_prob=2", r"aug\.mix_prob=2\.0 must be in \[0, 1\]"),
        ("optim.betas=[0.9, 1]", r"optim\.betas\[1\]=1\.0 must be in \[0, 1\)"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(ClassifyConfig, overrides=[override])


@pytest.mark.parametrize(
    "override, meant",
    [
        ("train.max_step=10", r"did you mean train\.max_steps\? allowed keys under train: \["),
        ("train.lr=0.1", r"did you mean optim\.lr \(under optim, not train\)\? allowed keys under train: \["),
        ("seed=1", r"did you mean train\.seed \(under train, not the top level\)\?"),
        ("modle.depth=2", r"did you mean model\? allowed keys under the top level"),
        ("train.epochs=3", r"did you mean data\.epochs \(under data, not train\)\?"),
    ],
)
def test_an_unknown_key_suggests_the_closest_allowed_keys(override, meant):
    """A misspelt key gets the near one of its section; a key of another section names that section."""
    from lapheads.recipes.classify import ClassifyConfig

    key = override.split("=")[0].split(".")[0] if override.startswith("modle") else override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown config key {re.escape(key)}; {meant}"):
        load_config(ClassifyConfig, overrides=[override])


def test_an_unknown_key_far_from_every_key_gets_no_guess():
    from lapheads.recipes.classify import ClassifyConfig

    with pytest.raises(ConfigError) as e:
        load_config(ClassifyConfig, overrides=["train.zzzz=1"])
    assert "did you mean" not in str(e.value) and "allowed keys under train: [" in str(e.value)


def test_language_model_fields_are_refused_at_parse_time():
    from lapheads.recipes.lm import LMConfig

    for override, message in [
        ("optim.matrix_lr=-1", r"optim\.matrix_lr=-1\.0 must be >= 0"),
        ("optim.adam_betas=[0.8, 1.5]", r"optim\.adam_betas\[1\]=1\.5 must be in \[0, 1\)"),
        ("optim.adam_eps=0", r"optim\.adam_eps=0\.0 must be > 0"),
        ("model.depth=0", r"model\.depth=0 must be >= 1"),
        ("model.softcap=-3", r"model\.softcap=-3\.0 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(LMConfig, overrides=[override])


def test_model_extra_that_timm_refuses_is_a_config_error():
    from lapheads.recipes.classify import ModelConfig, build_model

    m = ModelConfig(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, extra={"foo": {"bar": 1}})
    with pytest.raises(
        ConfigError,
        match=r"^model\.extra\.foo=\{'bar': 1\}: timm cannot build 'vit_tiny_patch16_224' with it \(.*"
        r"unexpected keyword argument 'foo'\)",
    ):
        build_model(m, 10)


def test_number_arg_applies_the_config_rules_to_flags():
    import argparse

    from lapheads.engine.config import number_arg

    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--temperature", type=number_arg(float, ge=0.0))
    p.add_argument("--seed", type=number_arg(int))
    assert vars(p.parse_args(["--temperature", "0.7", "--seed", "-3"])) == {"temperature": 0.7, "seed": -3}
    for argv, message in [
        (["--temperature", "nan"], "'nan' is not a finite number"),
        (["--temperature=-inf"], "'-inf' is not a finite number"),
        (["--temperature=-0.5"], "-0.5 must be >= 0"),
        (["--temperature", "warm"], "'warm' is not a number"),
        (["--seed", str(2**63)], "9223372036854775808 does not fit in 64 bits"),
        (["--seed", "1.5"], "'1.5' is not an integer"),
    ]:
        with pytest.raises(argparse.ArgumentError, match=message):
            p.parse_args(argv)


# ----------------------------------------------------------------------------- output paths
def test_check_out_dir(tmp_path):
    assert check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # the probe left nothing
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*/f is an existing file"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"--cache .*/f/a/b cannot be created: .*/f is a file"):
        check_out_dir(tmp_path / "f" / "a" / "b", flag="--cache")


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="no sysfs here")
def test_check_out_dir_refuses_a_place_even_root_cannot_write():
    # permission bits do not stop root (the tests run as root), sysfs refuses new entries to everyone
    with pytest.raises(ConfigError, match="/sys is not writable"):
        check_out_dir("/sys/lapheads_test_out")


def test_check_out_file(tmp_path):
    assert check_out_file(tmp_path / "sub" / "eval.json") == tmp_path / "sub" / "eval.json"
    with pytest.raises(ConfigError, match="is a directory; give the name of the file"):
        check_out_file(tmp_path)
    (tmp_path / "f").write_text("x")
    check_out_file(tmp_path / "f")  # an existing file is replaced
    with pytest.raises(ConfigError, match="cannot be created: .*/f is a file"):
        check_out_file(tmp_path / "f" / "eval.json")


def test_removed_on_failure_removes_a_created_tree(tmp_path):
    out = tmp_path / "a" / "b"
    with pytest.raises(ConfigError):
        with removed_on_failure(out):
            (out / "figures").mkdir(parents=True)
            (out / "figures" / "x.png").write_text("x")
            raise ConfigError("boom")
    assert list(tmp_path.iterdir()) == []  # "a", created on the way, is gone too


def test_removed_on_failure_keeps_what_existed(tmp_path):
    (tmp_path / "old.md").write_text("old")
    (tmp_path / "figs").mkdir()
    with pytest.raises(RuntimeError):
        with removed_on_failure(tmp_path):
            (tmp_path / "figs" / "new.png").write_text("x")
            (tmp_path / "new").mkdir()
            (tmp_path / "new" / "y").write_text("y")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["figs", "old.md"]


def test_removed_on_failure_keeps_everything_on_interrupt_and_success(tmp_path):
    out = tmp_path / "shards"
    with pytest.raises(KeyboardInterrupt):
        with removed_on_failure(out):
            out.mkdir()
            (out / "train_000000.bin").write_bytes(b"\0")
            raise KeyboardInterrupt  # resumable work survives Ctrl-C
    assert (out / "train_000000.bin").exists()
    with removed_on_failure(tmp_path / "ok") as p:
        p.mkdir()
    assert (tmp_path / "ok").is_dir()
    with pytest.raises(ValueError):
        with removed_on_failure(out, remove_new_entries=False):
            (out / "train_000001.bin").write_bytes(b"\0")
            raise ValueError
    assert (out / "train_000001.bin").exists()


def test_read_json(tmp_path):
    f = tmp_path / "model.json"
    f.write_text(json.dumps({"a": 1}))
    assert read_json(f) == {"a": 1}
    f.write_text('{"a": ')
    with pytest.raises(CheckpointError, match=r"model\.json is not valid JSON \(the spec\): .* line 1, column 7"):
        read_json(f, "the spec")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="not JSON text"):
        read_json(f)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_json(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "recipe,config", [("classify", "classify/digits.yaml"), ("dino", "dino/digits.yaml"), ("lm", "lm/tiny.yaml")]
)
def test_every_recipe_refuses_a_bad_head_selection_when_the_config_is_parsed(recipe, config, tmp_path, capsys):
    """One shared, typed config field (heads_field): a bad value is one line naming the key, before any work."""
    from lapheads.cli import main as cli

    root = CONFIG_DIR
    out = tmp_path / "run"
    rc = cli(
        ["train", recipe, "--config", str(root / config), "--out", str(out), "--set", "model.laplacian_heads=alll"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.laplacian_heads='alll'" in err[0], err
    assert not out.exists()
