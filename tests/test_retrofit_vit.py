"""`lapheads train retrofit_vit`: a tiny k=0 digits ViT switched to k=2 Laplacian heads, full and LoRA.

One tiny classify run (k=0) is trained per module; the full retrofit starts from it (with its
baseline), the LoRA retrofit from a timm checkpoint file written from its weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lapheads import timm as lap_timm
from lapheads.cli import main as cli
from lapheads.engine.checkpoint import load_tensors
from lapheads.engine.config import load_config
from lapheads.errors import CheckpointError, ConfigError
from lapheads.recipes import classify as C
from lapheads.recipes import load_run
from lapheads.recipes import retrofit_vit as RV
from lapheads.recipes.shipped import CONFIG_DIR

pytestmark = pytest.mark.xdist_group("test_retrofit_vit")  # module-scoped runs, on one worker

STEPS = 3
ROOT = Path(__file__).resolve().parents[1]
RECIPE = CONFIG_DIR / "retrofit" / "vit_tiny.yaml"
# the architecture of the base run, as model.* of a checkpoint file (the run gives it by itself)
ARCH = [
    "model.img_size=16",
    "model.patch_size=4",
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=4",
    "model.qk_norm=true",
    "model.extra.mlp_ratio=2",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retro_vit_base") / "digits_k0"
    sets = [
        "model.laplacian_heads=0",
        "model.embed_dim=32",
        "model.depth=2",
        "model.num_heads=4",
        "data.batch_size=32",
        "train.max_steps=20",
        "train.progress=false",
    ]
    assert (
        cli(
            [
                "train",
                "classify",
                "--config",
                str(CONFIG_DIR / "classify" / "digits.yaml"),
                "--out",
                str(out),
                *[a for s in sets for a in ("--set", s)],
            ]
        )
        == 0
    )
    return out


def _argv(init_from: Path, out: Path, *sets: str) -> list[str]:
    sets = (
        f"init_from={init_from}",
        "data.batch_size=32",
        f"train.max_steps={STEPS}",
        "train.progress=false",
        "train.log_every=1",
        *sets,
    )
    return [
        "train",
        "retrofit_vit",
        "--config",
        str(RECIPE),
        "--out",
        str(out),
        *[a for s in sets for a in ("--set", s)],
    ]


@pytest.fixture(scope="module")
def full(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retro_vit_full") / "run"
    assert cli(_argv(base, out, "select=score")) == 0
    return out


@pytest.fixture(scope="module")
def ckpt_file(base) -> Path:
    """The base run's weights as a plain timm checkpoint (timm's {"model": state_dict} layout)."""
    path = base.parent / "vit_tiny_digits.pth"
    torch.save({"model": C.load_model(base).state_dict()}, path)
    return path


@pytest.fixture(scope="module")
def lora(ckpt_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retro_vit_lora") / "run"
    assert cli(_argv(ckpt_file, out, *ARCH, "method=lora", "lora.r=4", "baseline=false")) == 0
    return out


def _final(run: Path) -> dict:
    return json.loads((run / "final" / "metrics.json").read_text())


def _batch(run: Path) -> torch.Tensor:
    loaded = load_run(run)
    ds = C.eval_dataset(loaded.config)
    return torch.stack([loaded.transform(ds[i][0]) for i in range(16)])


def test_comparison_is_recorded_and_starts_from_the_pretrained_model(base, full):
    res = json.loads((full / "retrofit.json").read_text())
    assert res["steps"] == STEPS and res["method"] == "full" and res["original_laplacian_heads"] == 0
    m = res["metrics"]
    assert set(m) == {"before_conversion", "after_conversion", "after_steps", "baseline_after_steps"}
    for row in m.values():
        assert set(row) == {"top1", "loss"} and 0.0 <= row["top1"] <= 1.0 and math.isfinite(row["loss"])
    pre = _final(base)  # the pretrained run's own final evaluation: the weights were loaded exactly
    assert m["before_conversion"]["top1"] == pre["top1"]
    assert m["before_conversion"]["loss"] == pytest.approx(pre["loss"], rel=1e-6)
    assert m["after_conversion"]["loss"] != m["before_conversion"]["loss"]  # the heads really switched
    spec = json.loads((full / "baseline" / "final" / "model.json").read_text())
    assert spec["step"] == STEPS and spec["laplacian_heads"] == 0 and spec["before"] == spec["converted"]
    assert m["baseline_after_steps"] == {k: _final(full / "baseline")[k] for k in ("top1", "loss")}


def test_score_selects_the_cheapest_heads_per_layer(full):
    spec = json.loads((full / "final" / "model.json").read_text())
    costs, heads = spec["switch_costs"], spec["laplacian_heads"]
    assert len(costs) == 2 and all(len(r) == 4 for r in costs) and spec["model"]["laplacian_heads"] == heads
    for row, chosen in zip(costs, heads):
        assert len(chosen) == 2
        assert max(row[h] for h in chosen) <= min(row[h] for h in range(4) if h not in chosen)


def test_final_reloads_laplacian_through_the_classify_loader(full, capsys):
    spec = json.loads((full / "final" / "model.json").read_text())
    got = load_run(full)  # what `analyze --run`, `report` and probes read
    assert got.recipe == "retrofit_vit" and got.kind == "vit"
    layers = [m for _, m in lap_timm.laplacian_attention_layers(got.model)]
    assert [list(m.laplacian_selection.indices) for m in layers] == spec["laplacian_heads"]
    assert RV.RECIPE.heads(full) == spec["laplacian_heads"]
    # the reloaded model scores the validation set exactly as the trained model did at the end of the run
    assert cli(["eval", "classify", "--checkpoint", str(full)]) == 0
    ev, final = json.loads((full / "final" / "eval.json").read_text()), _final(full)
    assert ev["top1"] == final["top1"] and ev["loss"] == pytest.approx(final["loss"], rel=1e-6)
    # ... and differently from the same weights with every head standard
    x = _batch(full)
    plain = lap_timm.convert(C.load_model(full), 0)
    with torch.no_grad():
        assert not torch.allclose(got.model(x), plain(x), atol=1e-4)
    assert (
        cli(
            [
                "analyze",
                "--run",
                str(full),
                "--max-items",
                "32",
                "--no-figures",
                "--no-spectra",
                "--out",
                str(full.parent / "geo"),
            ]
        )
        == 0
    )
    assert (
        json.loads((full / "geometry" / "geometry.json").read_text())["meta"]["laplacian_heads"]
        == spec["laplacian_heads"]
    )


def test_lora_from_a_checkpoint_file_merges_exactly(base, lora):
    from peft import PeftModel

    res = json.loads((lora / "retrofit.json").read_text())
    assert res["method"] == "lora" and res["laplacian_heads"] == 2 and "baseline_after_steps" not in res["metrics"]
    # timm's loader read the file (head kept: same 10 classes) into the model the base run evaluated
    assert res["metrics"]["before_conversion"]["top1"] == _final(base)["top1"]
    spec = json.loads((lora / "final" / "model.json").read_text())
    assert 0 < spec["n_trainable"] < spec["n_params"] / 10
    adapter = load_tensors(lora / "final" / "adapter" / "adapter_model.safetensors")
    assert {k.split(".")[-3] for k in adapter} == {"qkv", "proj"} and not any("patch_embed" in k for k in adapter)
    assert any("lora_B" in k and bool(v.abs().sum() > 0) for k, v in adapter.items())  # trained
    assert not any("lora" in k for k in load_tensors(lora / "final" / "model.safetensors"))  # plain timm keys

    x = _batch(lora)
    peft_model = PeftModel.from_pretrained(
        lap_timm.convert(C.load_model(base), 2), str(lora / "final" / "adapter")
    ).eval()
    reloaded = load_run(lora).model
    with torch.no_grad():
        unmerged = peft_model(x)
        merged = peft_model.merge_and_unload()(x)
        out = reloaded(x)
    assert lap_timm.laplacian_head_counts(reloaded) == [2, 2]
    assert torch.equal(merged, out)  # save + reload of the merged model is exact
    assert torch.allclose(unmerged, out, atol=1e-5)  # merging only rounds


def test_checkpoint_head_is_kept_only_for_the_same_classes(tmp_path):
    src = lap_timm.create_model(
        "vit_tiny_patch16_224", num_classes=7, img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4
    )
    path = tmp_path / "seven.safetensors"
    from safetensors.torch import save_file

    save_file(src.state_dict(), str(path))
    assert RV.checkpoint_classes(path) == 7
    cfg = load_config(RV.RetrofitViTConfig, RECIPE, [f"init_from={path}", *ARCH[:5]])
    model = RV.pretrained_model(cfg, 10)  # digits: 10 classes, so timm starts the head afresh
    assert model.head.weight.shape == (10, 32)
    assert torch.equal(model.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert torch.equal(RV.pretrained_model(cfg, 7).head.weight, src.head.weight)
    torn = tmp_path / "torn.pth"
    torn.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="torn.pth: not a readable timm checkpoint"):
        RV.checkpoint_classes(torn)
    with pytest.raises(CheckpointError, match="does not fit"):
        RV.pretrained_model(
            load_config(RV.RetrofitViTConfig, RECIPE, [f"init_from={path}", *ARCH[:5], "model.embed_dim=64"]), 7
        )


def test_bad_settings_fail_before_training(base, full, tmp_path, capsys):
    def refused(out: str, *sets: str, init_from: Path = base) -> str:
        assert cli(_argv(init_from, tmp_path / out, *sets)) == 2
        assert not (tmp_path / out / "final").exists()
        return capsys.readouterr().err

    assert "select: score" in refused("a", "select=score", "laplacian_heads=[[0],[1]]")
    assert "5" in refused("b", "laplacian_heads=5")
    assert "nope" in refused("c", "method=lora", "lora.target_modules=[nope]")
    assert "leave model unset" in refused("d", "model.embed_dim=64")
    assert "neither" in refused("e", init_from=tmp_path / "missing")
    assert "classify" in refused("f", init_from=tmp_path)  # a folder that is not a finished run
    with pytest.raises(ConfigError, match="init_from"):
        RV.RetrofitViTConfig().validate()


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3", "eva02_tiny_patch14_224"])
def test_retrofit_from_a_dinov3_or_eva02_checkpoint_file(name, tmp_path, capsys):
    """timm's DINOv3 and EVA-02 architectures (class Eva: RoPE, EvaAttention) retrofit from a
    checkpoint file like a ViT: the heads change the model, the final run reloads Laplacian."""
    import timm
    from safetensors.torch import save_file

    arch = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4)
    torch.manual_seed(0)
    src = timm.create_model(name, num_classes=10, **arch)  # plain timm: stock EvaAttention
    assert type(src.blocks[0].attn).__name__ == "EvaAttention"
    torch.nn.init.normal_(src.head.weight, std=0.5)  # timm starts this head at zero: make the logits depend on x
    with torch.no_grad():  # DINOv3's layer scale starts at 1e-5, which would hide what attention does
        for n, p in src.named_parameters():
            if n.rsplit(".", 1)[-1].startswith("gamma"):
                p.fill_(1.0)
    path = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    out = tmp_path / "run"
    sets = [f"model.name={name}", *(f"model.{k}={v}" for k, v in arch.items()), "baseline=false"]
    sets += ["select=score"] if "dinov3" in name else []
    assert cli(_argv(path, out, *sets)) == 0
    capsys.readouterr()
    res = json.loads((out / "retrofit.json").read_text())["metrics"]
    assert res["before_conversion"]["loss"] != res["after_conversion"]["loss"]  # the heads changed the model
    reloaded = load_run(out).model
    assert type(reloaded).__name__ == "Eva" and lap_timm.laplacian_head_counts(reloaded) == [2, 2]
    stock = timm.create_model(name, num_classes=10, **arch).eval()
    with pytest.raises(RuntimeError, match="lap_heads"):  # the marker: a stock model refuses the weights
        stock.load_state_dict(reloaded.state_dict())
    stock.load_state_dict(lap_timm.stock_state_dict(reloaded.state_dict()))  # the same weights, on purpose
    x = _batch(out)
    with torch.no_grad():
        assert not torch.allclose(reloaded.eval()(x), stock(x), atol=1e-4)  # not silently standard
