"""The shipped sweep presets: each expands to the grid its paper fork ran (numbers written here, not read from the
preset), each trains for real at tiny size through `lapheads sweep --preset`, and a bad name is one line."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from lapheads.cli import main as cli
from lapheads.engine.config import load_config
from lapheads.engine.run import RunDir
from lapheads.errors import ConfigError
from lapheads.recipes import get_recipe
from lapheads.recipes.classify import ClassifyConfig, scaled_lr
from lapheads.sweep import plan_grid
from lapheads.sweep_presets import PRESET_DIR, load_preset, presets

# name -> (recipe, head settings, seeds, {axis: values}) of the authors' forks (docs/reports.md)
EXPECTED = {
    "nanochat2026": ("lm", [0, 1, 2, 4], [0, 1, 2], {"model.depth": [12, 16, 20]}),
    "nanochat2026_lora": ("retrofit", [0, 3, 6, 9, 12, 15], [0], {}),
    "deit3_base": ("classify", [0, 1, 3, 6, 9, 11, 12], [0, 1, 2], {}),
    "deit3_large": ("classify", [0, 4, 8, 12, 16], [0, 1, 2], {}),
}


def _value(sets, key):
    return next(s.split("=", 1)[1] for s in reversed(sets) if s.split("=", 1)[0] == key)


def test_the_presets_are_the_four_shipped_files():
    assert sorted(p.name for p in presets()) == sorted(EXPECTED) == sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    assert all(p.description and not p.description.startswith("#") for p in presets())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_preset_expands_to_its_grid(name, tmp_path):
    recipe, heads, seeds, axes = EXPECTED[name]
    p = load_preset(name)
    rec = get_recipe(recipe)
    plan = plan_grid(recipe, p.config, p.heads, p.seeds, tmp_path, p.spec.overrides, p.design())
    assert len(plan) == math.prod(len(v) for v in axes.values()) * len(heads) * len(seeds) == p.n_runs()
    got = sorted(
        (int(_value(r.sets, rec.heads_key)), int(_value(r.sets, "train.seed")), *(int(_value(r.sets, a)) for a in axes))
        for r in plan
    )
    assert got == sorted(itertools.product(heads, seeds, *axes.values()))
    assert len({r.path for r in plan}) == len(plan)
    for r in plan[:: max(1, len(plan) // 4)]:  # what a run of the preset trains (placeholder paths: no run rules)
        cfg = load_config(rec.config_type, p.config, r.sets, recipe=recipe, run_rules=False)
        _check_settings(name, cfg, int(_value(r.sets, rec.heads_key)))


def _check_settings(name, cfg, k):
    if name == "nanochat2026":
        m, d = cfg.model, cfg.data
        assert (m.laplacian_heads, m.vocab_size, m.value_embeddings, m.window_pattern) == (k, 32768, True, "SSSL")
        assert (d.tokens_per_param, d.budget_params, d.seq_len) == (12, "scaling", 2048)
    elif name == "nanochat2026_lora":
        assert (cfg.laplacian_heads, cfg.method, cfg.select, cfg.baseline) == (k, "lora", "trailing", False)
        assert (cfg.lora.r, cfg.lora.alpha) == (16, 32.0)
        assert set(cfg.lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"}
    else:
        drop, heads = {"deit3_base": (0.2, 12), "deit3_large": (0.45, 16)}[name]
        m = cfg.model
        assert (m.laplacian_heads, m.drop_path, m.img_size, cfg.optim.min_lr) == (k, drop, 192, 1e-6)
        assert cfg.data.epochs == 400 and cfg.data.batch_size * 32 == 2048


def test_a_bad_preset_name_is_one_line_naming_the_known_ones(capsys):
    with pytest.raises(ConfigError) as e:
        load_preset("deit3_huge")
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in EXPECTED)
    assert cli(["sweep", "--preset", "deit3_huge", "--out", "x"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deit3_huge" in err[0] and "nanochat2026_lora" in err[0]
    assert cli(["sweep", "--preset", "deit3_base", "--config", "classify/digits", "--out", "x"]) != 0
    assert "drop --config" in capsys.readouterr().err


def test_list_presets(capsys):
    assert cli(["sweep", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for name, (_, heads, seeds, axes) in EXPECTED.items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert f"{len(heads) * len(seeds) * math.prod(len(v) for v in axes.values())} runs" in line


def test_min_lr_is_absolute_whatever_the_batch(monkeypatch):
    """optim.min_lr of the DeiT-3 configs: train.min_lr_ratio follows the global batch so the lr ends at 1e-6."""
    for world, batch, accum in ((1, 64, 1), (4, 256, 2), (32, 64, 1)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        cfg = load_config(
            ClassifyConfig,
            load_preset("deit3_base").config,
            [f"data.batch_size={batch}", f"train.grad_accum={accum}"],
            recipe="classify",
        )
        lr = scaled_lr(cfg.optim, batch * world * accum)
        assert lr == pytest.approx(1e-3 * batch * world * accum / 1024)
        assert cfg.train.min_lr_ratio * lr == pytest.approx(1e-6, rel=1e-12)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"optim\.min_lr=1e-06 and train\.min_lr_ratio=0\.001 are both given"):
        load_config(ClassifyConfig, None, ["optim.min_lr=1e-6", "train.min_lr_ratio=0.001"])
    with pytest.raises(ConfigError, match="above the learning rate"):
        load_config(ClassifyConfig, None, ["optim.min_lr=0.5"])


# ----------------------------------------------------------------------------- tiny runs of each preset
def _tiny_lm(cache):
    return [
        "model.width=48",
        "model.n_heads=4",
        "model.vocab_size=0",
        "model.short_window=4",  # the windows bite at seq_len 24
        "data.shards=null",
        "data.corpus=embedded",
        "data.tokenizer=train",
        "data.vocab_size=300",
        f"data.cache_dir={cache}",
        "data.seq_len=24",
        "data.batch_size=2",
        "data.total_batch_tokens=0",
        "data.eval_tokens=96",
        "samples.max_new_tokens=3",
        "samples.prompts=[The list]",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.eval_every=0",
        "train.ckpt_every=0",
        "train.progress=false",
        "train.trackers=[]",
    ]


def _sets(items):
    return [a for s in items for a in ("--set", s)]


@pytest.mark.slow
def test_nanochat2026_runs_at_tiny_size(tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", "--preset", "nanochat2026", "--out", str(out), "--laplacian-heads", "0,4", "--seeds", "0"]
    assert cli([*argv, *_sets(_tiny_lm(tmp_path / "cache"))]) == 0
    runs = sorted(d.name for d in out.iterdir() if (d / "final" / "model.json").is_file())
    assert runs == sorted(f"depth={d}__lap{k}_seed0" for d in (12, 16, 20) for k in (0, 4))
    spec = json.loads((out / "depth=20__lap4_seed0" / "final" / "hf" / "config.json").read_text())
    assert spec["model_type"] == "lapheads_nanochat" and spec["num_hidden_layers"] == 20
    assert spec["layer_types"].count("sliding_attention") == 15 and spec["sliding_window"] == 5
    assert spec["value_embedding_layers"] == list(range(1, 20, 2))
    samples = (out / "depth=20__lap4_seed0" / "samples.jsonl").read_text().splitlines()
    assert samples and json.loads(samples[-1])["prompt"] == "The list"  # KV-cached sampling with windows ran
    assert (out / "report" / "report.html").is_file()


@pytest.mark.slow
def test_nanochat2026_lora_runs_at_tiny_size(tmp_path):
    base = tmp_path / "base"
    tiny = _tiny_lm(tmp_path / "cache")
    tiny = [s for s in tiny if not s.startswith(("model.width", "model.n_heads"))] + [
        "model.width=60",
        "model.n_heads=15",
    ]
    argv = ["train", "lm", "--config", "nanochat2026", "--out", str(base), "--set", "model.depth=2"]
    assert cli([*argv, "--set", "model.laplacian_heads=0", *_sets(tiny)]) == 0
    out = tmp_path / "lora"
    retro = [s for s in tiny if s.startswith(("data.", "train.", "samples."))]
    retro = [s for s in retro if not s.startswith(("data.tokenizer", "data.vocab_size"))]
    argv = ["sweep", "--preset", "nanochat2026_lora", "--out", str(out), "--laplacian-heads", "0,15", "--no-report"]
    assert cli([*argv, "--set", f"init_from={base}", *_sets(retro)]) == 0
    for k in (0, 15):
        spec = json.loads((out / f"lap{k}_seed0" / "final" / "model.json").read_text())
        assert spec["method"] == "lora" and spec["n_trainable"] < spec["n_params"]
        assert spec["laplacian_heads"] == k  # 15 of the 15 heads of each layer
        assert not (out / f"lap{k}_seed0" / "baseline").exists()


@pytest.mark.parametrize("name,width,k", [("deit3_base", 48, 12), ("deit3_large", 64, 16)])
def test_deit3_presets_run_at_tiny_size(tmp_path, name, width, k):
    tiny = [
        "data.train=digits",
        "model.img_size=16",
        "model.patch_size=4",
        f"model.embed_dim={width}",  # 4 per head: the base's 12 heads, the large's 16
        "model.depth=2",
        "data.batch_size=16",
        "data.eval_batch_size=64",
        "data.max_eval_items=64",
        "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.5,0.5,0.5]",
        "data.three_augment=false",
        "train.num_workers=0",
        "train.max_steps=4",
        "train.log_every=1",
        "train.eval_every=0",
        "train.ckpt_every=0",
        "train.precision=fp32",
        "train.progress=false",
        "train.trackers=[]",
    ]
    out = tmp_path / "sweep"
    argv = ["sweep", "--preset", name, "--out", str(out), "--laplacian-heads", f"0,{k}", "--seeds", "0", "--no-report"]
    assert cli([*argv, *_sets(tiny)]) == 0
    for heads in (0, k):
        run = out / f"lap{heads}_seed0"
        cfg = RunDir(run).read_config()
        assert (cfg["model"]["laplacian_heads"], cfg["optim"]["min_lr"]) == (heads, 1e-6)
        # the logged lr is timm's cosine from the batch-scaled lr down to the ABSOLUTE min lr
        lr, lo = 1e-3 * 16 / 1024, 1e-6
        logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        lrs = [(r["step"], r["lr"]) for r in logged if "lr" in r]
        assert [s for s, _ in lrs] == [1, 2, 3, 4]
        for s, got in lrs:
            assert got == pytest.approx(lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 4)), rel=1e-9)
    assert Path(out / "sweep_command.json").is_file()
