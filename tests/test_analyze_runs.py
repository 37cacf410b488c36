"""Geometry analysis, reports and PCA maps on tiny runs of every recipe (classify, lm, sft, dino).

Each run is trained once per module (a few steps of a tiny model) and shared by the tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _lm_helpers import tiny_lm_run

from lapheads.cli import main as cli
from lapheads.engine.config import load_config
from lapheads.engine.launch import launch
from lapheads.engine.trainer import TrainConfig
from lapheads.recipes.shipped import CONFIG_DIR
from lapheads.runs import LM_MIN_COUNT

pytestmark = pytest.mark.xdist_group("analyze_runs")  # the module's runs are trained once, on one worker

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(CONFIG_DIR / "classify" / "digits.yaml")
TINY_CLASSIFY = [
    "--set",
    "model.embed_dim=32",
    "--set",
    "model.depth=2",
    "--set",
    "model.num_heads=2",
    "--set",
    "train.progress=false",
    "--set",
    "data.batch_size=32",
    "--set",
    "data.max_eval_items=64",
    "--set",
    "train.max_steps=2",
    "--set",
    "model.laplacian_heads=1",
]


def _dino_run(out: Path) -> Path:
    from lapheads.recipes.dino import (
        CropsConfig,
        DinoConfig,
        DinoDataConfig,
        DinoHeadConfig,
        DinoModelConfig,
        DinoTask,
        KnnConfig,
    )

    cfg = DinoConfig(
        model=DinoModelConfig(
            name="vit_small_patch16_224",
            laplacian_heads=2,
            kwargs=dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=6),
        ),
        head=DinoHeadConfig(out_dim=32, hidden_dim=32, bottleneck_dim=16),
        crops=CropsConfig(global_size=16, local_size=8, local_crops=2, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
        data=DinoDataConfig(batch_size=32),
        knn=KnnConfig(max_train=100),
        epochs=1,
        train=TrainConfig(max_steps=2, progress=False, log_every=1),
    )
    launch("dino", cfg, DinoTask, str(out))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from lapheads.recipes import sft as S

    root = tmp_path_factory.mktemp("every_recipe")
    out = {"classify": root / "classify"}
    assert cli(["train", "classify", "--config", DIGITS, "--out", str(out["classify"]), *TINY_CLASSIFY]) == 0
    out["lm"] = tiny_lm_run(root / "lm_root", "2", 3)
    cfg = load_config(
        S.SFTConfig,
        None,
        [f"init_from={out['lm']}", "data.seq_len=96", "data.batch_size=4", "train.max_steps=2", "train.progress=false"],
    )
    launch("sft", cfg, S.SFTTask, str(root / "sft"))
    out["sft"] = root / "sft"
    out["dino"] = _dino_run(root / "dino")
    return out


RECIPES = ["classify", "lm", "sft", "dino"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_analyze_run_of_every_recipe_honours_every_setting(runs, recipe, tmp_path, capsys):
    run = runs[recipe]
    out = tmp_path / "geo"
    assert (
        cli(
            [
                "analyze",
                "--run",
                str(run),
                "--max-items",
                "16",
                "--batch-size",
                "8",
                "--min-count",
                "2",
                "--threshold",
                "0.9",
                "--no-spectra",
                "--no-nc4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    for path in (out / "geometry.json", run / "geometry" / "geometry.json"):
        res = json.loads(path.read_text())
        res = res["runs"][run.name] if "runs" in res else res
        meta = res["meta"]
        assert meta["recipe"] == recipe and meta["min_count"] == 2 and meta["threshold"] == 0.9
        assert meta["spectra"] is False and meta["nc4"] is False
        # --no-spectra: no per-sequence spectra (k99); the global spectrum is one eigen-decomposition
        assert res["layers"] and all("k_mean" not in r.get("spectra", {}) for r in res["layers"].values())
        assert all("nc4_agreement" not in (r.get("nc_tokens") or {}) for r in res["layers"].values())
    assert f"{recipe} run" in capsys.readouterr().out


def test_language_runs_default_to_a_min_count_for_next_token_classes(runs, tmp_path):
    assert (
        cli(
            [
                "analyze",
                "--run",
                str(runs["sft"]),
                "--max-items",
                "8",
                "--batch-size",
                "8",
                "--seq-len",
                "32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    meta = json.loads((tmp_path / "geometry.json").read_text())["runs"]["sft"]["meta"]
    assert meta["min_count"] == LM_MIN_COUNT and meta["seq_len"] == 32
    layers = json.loads((tmp_path / "geometry.json").read_text())["runs"]["sft"]["layers"]
    assert all("k_mean" in r["spectra"] for r in layers.values())


@pytest.mark.parametrize("recipe,data", [("sft", "pydoc"), ("dino", "digits")])
def test_analyze_run_on_other_data(runs, recipe, data, tmp_path):
    args = [
        "analyze",
        "--run",
        str(runs[recipe]),
        "--data",
        data,
        "--batch-size",
        "4",
        "--max-batches",
        "1",
        "--no-figures",
        "--out",
        str(tmp_path),
    ]
    assert cli(args + (["--seq-len", "32"] if data == "pydoc" else [])) == 0
    res = json.loads((tmp_path / "geometry.json").read_text())["runs"][recipe]
    assert res["meta"]["n_batches"] == 1


@pytest.mark.parametrize(
    "recipe,extra,message",
    [
        ("dino", ["--seq-len", "32"], "--seq-len is for language runs"),
        ("lm", ["--include-prefix"], "--include-prefix is for vision runs"),
        ("classify", ["--image-size", "32"], "--image-size is for --checkpoint"),
        ("classify", ["--model-args", "depth=2"], "--model-args is for --checkpoint"),
        ("lm", ["--data", "pydoc", "--max-items", "8"], "--max-items is for --run without --data"),
        ("lm", ["--min-count", "0"], "--min-count must be >= 1"),
    ],
)
def test_analyze_run_refuses_settings_it_cannot_use(runs, recipe, extra, message, tmp_path, capsys):
    assert cli(["analyze", "--run", str(runs[recipe]), *extra, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_report_analyzes_and_draws_runs_of_every_recipe(runs, tmp_path):
    for r in runs.values():  # make --analyze do the work
        shutil.rmtree(r / "geometry", ignore_errors=True)
    out = tmp_path / "rep"
    assert cli(["report", *(str(runs[k]) for k in RECIPES), "--out", str(out), "--analyze"]) == 0
    for r in runs.values():
        assert (r / "geometry" / "geometry.json").is_file()
    lm_meta = json.loads((runs["lm"] / "geometry" / "geometry.json").read_text())["meta"]
    assert lm_meta["min_count"] == LM_MIN_COUNT
    md = (out / "report.md").read_text()
    for recipe in RECIPES:
        assert f"## {recipe}" in md
        assert (out / "figures" / f"{recipe}_layers.png").is_file()
    assert (out / "figures" / "classify_pca.png").is_file() and (out / "figures" / "dino_pca.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_pca_maps_of_every_recipe(runs, recipe, tmp_path, capsys):
    out = tmp_path / "maps.png"
    rc = cli(["pca-maps", "--run", str(runs[recipe]), "--images", "digits", "--max-images", "3", "--out", str(out)])
    if recipe in ("classify", "dino"):
        assert rc == 0 and out.stat().st_size > 1000
    else:  # a language model has no patch tokens: refused, saying what to use instead
        assert rc == 2 and not out.exists()
        err = capsys.readouterr().err
        assert "language model" in err and "lapheads analyze --run" in err


def test_every_recipe_module_loads_its_run(runs):
    from lapheads.recipes import load_run

    for recipe, run in runs.items():
        got = load_run(run)
        assert got.recipe == recipe and got.kind == ("hf" if recipe in ("lm", "sft") else "vit")
