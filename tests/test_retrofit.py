"""`lapheads train retrofit`: a tiny k=0 LM switched to k=2 Laplacian heads, full and LoRA, with its baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _lm_helpers import tiny_lm_run

from lapheads.cli import main as cli
from lapheads.errors import ConfigError
from lapheads.recipes import retrofit as RF
from lapheads.recipes.lm import load_model
from lapheads.recipes.shipped import CONFIG_DIR

pytestmark = pytest.mark.xdist_group("test_retrofit")  # module-scoped runs, on one worker

STEPS = 3
RECIPE = CONFIG_DIR / "retrofit" / "tiny.yaml"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_lm_run(tmp_path_factory.mktemp("retro_base"), "0", 4)


def _argv(base: Path, out: Path, *sets: str) -> list[str]:
    cache = base.parent / "cache"
    sets = (
        f"init_from={base}",
        f"data.cache_dir={cache}",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.eval_tokens=512",
        f"train.max_steps={STEPS}",
        "train.progress=false",
        "train.log_every=1",
        *sets,
    )
    return ["train", "retrofit", "--config", str(RECIPE), "--out", str(out), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def full(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retro_full") / "run"
    assert cli(_argv(base, out, "select=score")) == 0
    return out


@pytest.fixture(scope="module")
def lora(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retro_lora") / "run"
    assert cli(_argv(base, out, "method=lora", "lora.r=4")) == 0
    return out


@pytest.mark.parametrize("which", ["full", "lora"])
def test_comparison_is_recorded_and_finite(which, request):
    out = request.getfixturevalue(which)
    res = json.loads((out / "retrofit.json").read_text())
    assert res["steps"] == STEPS and res["method"] == which and res["original_laplacian_heads"] == 0
    m = res["metrics"]
    assert set(m) == {"before_conversion", "after_conversion", "after_steps", "baseline_after_steps"}
    for row in m.values():
        assert math.isfinite(row["val_loss"]) and math.isfinite(row["val_bpb"])
    # the heads really switched: the converted model scores the same windows differently
    assert m["after_conversion"]["val_loss"] != m["before_conversion"]["val_loss"]
    # the baseline is the unconverted model, trained the same number of steps
    spec = json.loads((out / "baseline" / "final" / "model.json").read_text())
    assert spec["step"] == STEPS and spec["laplacian_heads"] == 0 and spec["before"] == spec["converted"]


def test_score_selects_the_cheapest_heads_per_layer(full):
    spec = json.loads((full / "final" / "model.json").read_text())
    costs, heads = spec["switch_costs"], spec["laplacian_heads"]
    assert len(costs) == 2 and all(len(r) == 4 for r in costs)
    for row, chosen in zip(costs, heads):
        assert len(chosen) == 2
        assert max(row[h] for h in chosen) <= min(row[h] for h in range(4) if h not in chosen)


def test_conversion_changes_the_model_and_the_export_reloads_laplacian(base, full):
    from lapheads import transformers as lap_tf

    orig, tok = load_model(base)
    x = torch.tensor([tok.encode("The list type is a mutable sequence")])
    converted = lap_tf.enable(load_model(base)[0], [[0, 1], [2, 3]])
    with torch.no_grad():
        assert not torch.allclose(orig(x).logits, converted(x).logits, atol=1e-4)
    model, _ = RF.load_model(full)
    spec = json.loads((full / "final" / "model.json").read_text())
    assert model.config.laplacian_heads == spec["laplacian_heads"]
    assert model.config._attn_implementation == lap_tf.ATTN_IMPLEMENTATION
    assert (
        json.loads((full / "final" / "hf" / "config.json").read_text())["attn_implementation"]
        == lap_tf.SAVED_ATTN_IMPLEMENTATION
    )
    from lapheads.recipes import load_run

    got = load_run(full)  # what `lapheads analyze --run` / `report` read
    assert got.recipe == "retrofit" and got.kind == "hf"
    assert got.model.config.laplacian_heads == spec["laplacian_heads"]


def test_lora_merged_export_reloads_with_identical_logits(lora):
    from peft import PeftModel

    from lapheads.engine.checkpoint import load_tensors

    model, tok = RF.load_model(lora)
    assert model.config.laplacian_heads == 2
    x = torch.tensor([tok.encode("The list type is a mutable sequence")])
    # the trained adapter (from the final checkpoint) on the original weights, merged in memory
    orig, _ = load_model(json.loads((lora / "final" / "model.json").read_text())["init_from"])
    from lapheads import transformers as lap_tf

    lap_tf.enable(orig, 2)
    peft_model = PeftModel.from_pretrained(orig, str(lora / "final" / "adapter")).eval()
    state = load_tensors(lora / "final" / "model.safetensors")
    assert any("lora_A" in k for k in state)
    with torch.no_grad():
        unmerged = peft_model(x).logits
        merged = peft_model.merge_and_unload()(x).logits
        reloaded = model(x).logits
    assert torch.equal(merged, reloaded)  # save + reload of the merged model is exact
    assert torch.allclose(unmerged, reloaded, atol=1e-5)  # merging only rounds
    assert not torch.equal(
        state[next(k for k in state if "lora_B" in k)], torch.zeros_like(state[next(k for k in state if "lora_B" in k)])
    )  # trained


def test_bad_settings_fail_before_training(base, tmp_path, capsys):
    assert cli(_argv(base, tmp_path / "a", "select=score", "laplacian_heads=[[0],[1]]")) == 2
    assert "select: score" in capsys.readouterr().err
    assert cli(_argv(base, tmp_path / "b", "laplacian_heads=5")) == 2
    assert "5" in capsys.readouterr().err
    assert cli(_argv(base, tmp_path / "c", "method=lora", "lora.target_modules=[nope]")) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "b" / "config.yaml").exists()
    with pytest.raises(ConfigError, match="init_from"):
        RF.RetrofitConfig().validate()
