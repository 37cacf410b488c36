"""lapheads.timm checkpoints through timm's own paths: ``torch.save`` / safetensors files loaded with
``pretrained_cfg_overlay=dict(file=...)`` or ``checkpoint_path``, ``timm.models.save_for_hf`` then
``create_model("local-dir:...")``; a stock timm model refuses the weights, never loads them silently
standard. Each reload is compared with the original model's logits (bit-identical) and with the
stock model built from the same weights (different)."""

from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

import lapheads.timm as lt
from lapheads import ConfigError, LaplacianHeads

NAME = "vit_tiny_patch16_224"
ARCH = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _model(heads) -> torch.nn.Module:
    torch.manual_seed(0)
    model = lt.create_model(NAME, laplacian_heads=heads, **ARCH).eval()
    with torch.no_grad():  # timm starts the head at zero: make the logits depend on every layer
        torch.nn.init.normal_(model.head.weight, std=0.5)
    return model


def _perturb_mixing(model) -> None:
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.lap_mix_a.copy_(torch.tensor([0.9, -0.2, 0.4, 1.3]))
            blk.attn.lap_mix_b.copy_(torch.tensor([0.1, 1.1, -0.6, -0.8]))


def _stock_logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same weights in a stock timm model (their stock form: no markers or mixing, anchors unsqueezed)."""
    stock = timm.create_model(NAME, **ARCH).eval()
    stock.load_state_dict(lt.stock_state_dict(state))
    with torch.no_grad():
        return stock(_images())


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_images())


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("heads", [2, [[1], [0, 3]], "learn:2"])
def test_file_round_trip_through_timm_overlay(tmp_path, fmt, heads):
    model = _model(heads)
    if heads == "learn:2":
        _perturb_mixing(model)
    ref = _logits(model)
    state = model.state_dict()
    path = tmp_path / ("m.pth" if fmt == "torch" else "m.safetensors")
    if fmt == "torch":
        torch.save(state, path)
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    overlay = dict(file=str(path), num_classes=5)
    # plain timm: the strict load refuses the marker and the anchor's shape (never a silently standard model)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: .*lap_heads.*\n.*size mismatch"):
        timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=overlay, **ARCH)
    again = lt.create_model(NAME, pretrained=True, pretrained_cfg_overlay=overlay, **ARCH)
    assert lt.laplacian_head_counts(again) == lt.laplacian_head_counts(model)
    assert again.laplacian_heads == (LaplacianHeads("learn") if heads == "learn:2" else LaplacianHeads(heads))
    assert again.pretrained_cfg["file"] == str(path) and "state_dict" not in again.pretrained_cfg
    assert torch.equal(_logits(again), ref)
    assert not torch.allclose(_stock_logits(state), ref, atol=1e-3)
    # timm's checkpoint_path (loaded after the model is built) takes the same route
    third = lt.create_model(NAME, checkpoint_path=str(path), **ARCH)
    assert torch.equal(_logits(third), ref)


def test_timm_non_strict_load_refuses_the_anchor(tmp_path):
    """A class count other than the file's makes timm drop the head and load non-strictly, which
    would drop the markers; the anchor's shape is refused all the same."""
    path = tmp_path / "m.pth"
    torch.save(_model(2).state_dict(), path)
    with pytest.raises(
        RuntimeError, match=r"size mismatch for blocks.0.attn.proj.weight: .* torch.Size\(\[1, 32, 32\]\)"
    ):
        timm.create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **ARCH)


@pytest.mark.parametrize("heads", [3, [[0, 2], []], "learn"])
def test_save_for_hf_then_local_dir(tmp_path, heads):
    model = _model(heads)
    if heads == "learn":
        _perturb_mixing(model)
    ref = _logits(model)
    out = tmp_path / "saved"
    timm.models.save_for_hf(model, str(out), safe_serialization="both")
    assert (
        json.loads((out / "config.json").read_text())["pretrained_cfg"]["laplacian_heads"]
        == LaplacianHeads(heads).to_config()
    )
    again = lt.create_model(f"local-dir:{out}")  # architecture, arguments and weights from the directory
    assert again.laplacian_heads == LaplacianHeads(heads)
    assert torch.equal(_logits(again), ref)
    assert not torch.allclose(_stock_logits(model.state_dict()), ref, atol=1e-3)
    # the architecture only, as timm's pretrained=False means
    fresh = lt.create_model(f"local-dir:{out}", pretrained=False)
    assert fresh.laplacian_heads == LaplacianHeads(heads) and not torch.equal(_logits(fresh), ref)
    # again, without the saved selection: the markers alone rebuild the heads
    cfg = json.loads((out / "config.json").read_text())
    del cfg["pretrained_cfg"]["laplacian_heads"]
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "pytorch_model.bin").unlink()  # the safetensors file alone
    assert torch.equal(_logits(lt.create_model(f"local-dir:{out}")), ref)


def test_plain_timm_local_dir_fails_loudly_or_works(tmp_path):
    """Plain timm on a saved converted model refuses it (the saved selection is no PretrainedCfg
    field); a registered ``_lap<k>`` variant reloads through plain timm, heads included."""
    model = _model(2)
    timm.models.save_for_hf(model, str(tmp_path / "vit"))
    with pytest.raises(TypeError, match="laplacian_heads"):
        timm.create_model(f"local-dir:{tmp_path / 'vit'}", pretrained=True)
    torch.manual_seed(0)
    variant = timm.create_model("deit3_small_patch16_224_lap5", depth=2, img_size=32, embed_dim=24, num_classes=3)
    timm.models.save_for_hf(variant, str(tmp_path / "lap5"), safe_serialization=True)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    for loaded in (
        timm.create_model(f"local-dir:{tmp_path / 'lap5'}", pretrained=True),
        lt.create_model(f"local-dir:{tmp_path / 'lap5'}"),
    ):
        assert lt.laplacian_head_counts(loaded) == [5, 5]
        assert loaded.pretrained_cfg["architecture"] == "deit3_small_patch16_224_lap5"
        with torch.no_grad():
            assert torch.equal(loaded.eval()(x), variant.eval()(x))
    with pytest.raises(ConfigError, match="no pretrained weights"):  # still: no weights without a file
        timm.create_model("deit3_small_patch16_224_lap5", pretrained=True)


def test_selection_given_with_a_laplacian_checkpoint_replaces_it_on_purpose(tmp_path):
    path = tmp_path / "m.pth"
    model = _model(1)
    torch.save(model.state_dict(), path)
    overlay = dict(file=str(path), num_classes=5)
    retro = lt.create_model(NAME, laplacian_heads=3, pretrained=True, pretrained_cfg_overlay=overlay, **ARCH)
    assert lt.laplacian_head_counts(retro) == [3, 3]
    assert torch.equal(retro.blocks[1].attn.qkv.weight, model.blocks[1].attn.qkv.weight)
    assert retro.state_dict()["blocks.0.attn.lap_heads"].tolist() == [0, 1, 1, 1]


def test_stock_weights_load_into_any_selection(tmp_path):
    torch.manual_seed(0)
    stock = timm.create_model(NAME, **ARCH).eval()
    path = tmp_path / "stock.safetensors"
    save_file({k: v.contiguous() for k, v in stock.state_dict().items()}, str(path))
    overlay = dict(file=str(path), num_classes=5)
    none = lt.create_model(NAME, pretrained=True, pretrained_cfg_overlay=overlay, **ARCH)
    assert lt.laplacian_head_counts(none) == [0, 0] and torch.equal(_logits(none), _logits(stock))
    two = lt.create_model(NAME, laplacian_heads=2, pretrained=True, pretrained_cfg_overlay=overlay, **ARCH)
    assert lt.laplacian_head_counts(two) == [2, 2]
    assert torch.equal(two.blocks[0].attn.qkv.weight, stock.blocks[0].attn.qkv.weight)


def test_loading_other_heads_is_refused():
    model = _model([[1], [0, 3]])
    other = _model(3)
    with pytest.raises(RuntimeError, match=r"blocks.0.attn: the checkpoint has Laplacian heads \[1\] of 4 but this"):
        other.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="has learnable mixing of 4 heads but this layer has Laplacian heads"):
        other.load_state_dict(_model("learn").state_dict(), strict=False)  # refused even non-strictly
    same = _model([[1], [0, 3]])
    same.load_state_dict(model.state_dict())
    assert torch.equal(_logits(same), _logits(model))
    assert lt.laplacian_head_counts(same) == [1, 2]  # the marker follows the selection, not the file
    with pytest.raises(ConfigError, match="local-dir"):
        lt.create_model("local-dir:/nonexistent/lapheads-model")


def test_project_loader_takes_its_own_weights_and_refuses_other_heads():
    """lapheads.engine.checkpoint.load_weights (runs, backbones with --weights): a Laplacian state dict
    loads into the same model; one with other heads, or with a weight missing, is refused."""
    from lapheads.engine.checkpoint import load_weights
    from lapheads.errors import CheckpointError

    src, model = _model(2), _model(2)
    with torch.no_grad():
        src.blocks[0].attn.proj.weight.add_(1.0)
    load_weights(model, src.state_dict())
    assert torch.equal(_logits(model), _logits(src))
    with pytest.raises(CheckpointError, match=r"blocks.0.attn: the checkpoint has Laplacian heads \[1\] of 4"):
        load_weights(model, _model([[1], [1]]).state_dict())
    with pytest.raises(CheckpointError, match="missing keys: blocks.1.attn.qkv.weight"):
        load_weights(model, {k: v for k, v in src.state_dict().items() if k != "blocks.1.attn.qkv.weight"})


def test_project_loader_takes_stock_weights():
    """A stock timm state dict has no marker and loads into a Laplacian model (retrofitting)."""
    from lapheads.engine.checkpoint import load_weights

    torch.manual_seed(0)
    stock = timm.create_model(NAME, **ARCH)
    model = _model(2)
    load_weights(model, stock.state_dict())
    assert torch.equal(model.blocks[0].attn.proj.weight, stock.blocks[0].attn.proj.weight)
    assert lt.laplacian_head_counts(model) == [2, 2]


def test_hf_hub_name_through_the_hub_cache(tmp_path):
    """``hf-hub:`` takes the same path as ``local-dir:``; here timm's Hub loaders read a Hub cache
    laid out as huggingface_hub writes it, offline (in a fresh process, which reads the settings)."""
    import os
    import subprocess
    import sys

    model = _model([[0, 3], [2]])
    repo = tmp_path / "hub" / "models--someone--lapvit"
    timm.models.save_for_hf(model, str(repo / "snapshots" / ("0" * 40)), safe_serialization=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    torch.save({"x": _images(), "ref": _logits(model)}, tmp_path / "io.pt")
    code = (
        "import sys, torch, lapheads.timm as lt\n"
        f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
        "m = lt.create_model('hf-hub:someone/lapvit').eval()\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(m(io['x']), io['ref'])\n"
        "print(m.laplacian_heads.to_config(), m.pretrained_cfg['hf_hub_id'])\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[[0,", "3],", "[2]]", "someone/lapvit"]


def test_marker_follows_a_layer_reselected_after_conversion(tmp_path):
    """The marker is written from the selection when the state dict is taken, so a layer re-selected
    by hand is saved as it is; on reload the markers win over the (now stale) saved pretrained_cfg."""
    model = _model(2)
    model.blocks[1].attn.set_laplacian_heads([0, 2])
    with torch.inference_mode():
        assert model.state_dict()["blocks.1.attn.lap_heads"].tolist() == [1, 0, 1, 0]
    assert model.pretrained_cfg["laplacian_heads"] == 2  # stale: describes the conversion only
    timm.models.save_for_hf(model, str(tmp_path / "m"), safe_serialization=True)
    again = lt.create_model(f"local-dir:{tmp_path / 'm'}")
    assert [b.attn.laplacian_selection.indices for b in again.blocks] == [(2, 3), (0, 2)]
    assert torch.equal(_logits(again), _logits(model))


def test_a_variant_name_loads_only_its_own_heads(tmp_path):
    """A ``_lap<k>`` name means k heads: a checkpoint with k heads loads, one with other heads is refused."""
    arch = dict(depth=2, img_size=32, embed_dim=24, num_classes=3)
    for k in (5, 3):
        torch.manual_seed(0)
        src = lt.create_model("deit3_small_patch16_224", laplacian_heads=k, **arch)
        torch.save(src.state_dict(), tmp_path / f"k{k}.pth")
    overlay = dict(file=str(tmp_path / "k5.pth"), num_classes=3)
    same = lt.create_model("deit3_small_patch16_224_lap5", pretrained=True, pretrained_cfg_overlay=overlay, **arch)
    assert lt.laplacian_head_counts(same) == [5, 5] and same.pretrained_cfg["file"] == overlay["file"]
    overlay["file"] = str(tmp_path / "k3.pth")
    with pytest.raises(ConfigError, match=r"has Laplacian heads \[3, 4, 5\] of 6 but this layer has Laplacian heads"):
        timm.create_model("deit3_small_patch16_224_lap5", pretrained=True, pretrained_cfg_overlay=overlay, **arch)
