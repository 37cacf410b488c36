"""Every head setting round-trips through every lapheads.timm loader bit for bit, and no plain-timm path
loads a Laplacian checkpoint as a standard model.

The grid: each setting (a count k, ``"all"``, per-layer indices, learnable mixing with trained-looking
``(a, b)``, the identity / negated / mix ablations, and the XSA variant) x each path (a state dict into
the same-built model, ``save_for_hf`` + ``local-dir:``, ``checkpoint_path=``, ``pretrained_cfg_overlay``
with a ``.pth`` or ``.safetensors`` file, with and without the setting given again). Each reload gives
the saved model's logits exactly, which differ from the same weights' standard heads (so a test fails
when the heads are lost). Plain timm runs in a subprocess that never imports lapheads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

import lapheads.timm as lt
from lapheads.vision.attention import XSAAttention

NAME = "vit_tiny_patch16_224"
ARCH = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
SETTINGS = [2, "all", [[0], [1, 3]], "learn", "learn:2", "identity:2", "negated:1", "mix(0.5,-2):3", "xsa"]
PATHS = ["state_dict", "save_for_hf", "checkpoint_path", "overlay_pth", "overlay_safetensors", "overlay_given"]


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_images())


def _build(setting) -> torch.nn.Module:
    """The model of a setting, as a user builds it (random weights: seeded, then the parts made to matter)."""
    torch.manual_seed(0)
    if setting == "xsa":
        return timm.create_model(NAME, attn_layer=XSAAttention, **ARCH)
    return lt.create_model(NAME, laplacian_heads=setting, **ARCH)


def _saved_model(setting) -> torch.nn.Module:
    model = _build(setting)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # timm starts the head at zero: make the logits depend on every layer
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=g) * 0.5)
        for blk in model.blocks:
            if hasattr(blk.attn, "lap_mix_a"):  # learned mixing far from its initialisation
                blk.attn.lap_mix_a.copy_(torch.randn(4, generator=g))
                blk.attn.lap_mix_b.copy_(torch.randn(4, generator=g))
    return model.eval()


def _standard_logits(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same weights with standard heads: a stock timm model given the stock form of the state dict."""
    stock = timm.create_model(NAME, **ARCH)
    stock.load_state_dict({k: v for k, v in lt.stock_state_dict(state).items() if not k.endswith(".xsa")})
    return _logits(stock)


def _heads(model: torch.nn.Module) -> list:
    """Each layer's heads as they compute: the marker codes and fixed mixing, or the learned (a, b)."""
    out = []
    for blk in model.blocks:
        attn = blk.attn
        if isinstance(attn, lt.LaplacianLayer):
            mix = [attn.lap_mix_a.tolist(), attn.lap_mix_b.tolist()] if attn.laplacian_learnable else None
            out.append((attn.laplacian_codes(), attn.laplacian_coef(), mix))
        else:
            out.append(type(attn).__name__)
    return out


def _reload(setting, path: str, model: torch.nn.Module, tmp: Path) -> torch.nn.Module:
    state = model.state_dict()
    pth, st = tmp / "m.pth", tmp / "m.safetensors"
    torch.save(state, pth)
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    xsa = {"attn_layer": XSAAttention} if setting == "xsa" else {}
    create = (lambda name, **kw: timm.create_model(name, **xsa, **kw)) if xsa else lt.create_model
    if path == "state_dict":
        again = _build(setting)
        again.load_state_dict(torch.load(pth, weights_only=True))
        return again
    if path == "save_for_hf":
        timm.models.save_for_hf(model, str(tmp / "hf"), safe_serialization=True)
        return lt.create_model(f"local-dir:{tmp / 'hf'}", pretrained=True)
    if path == "checkpoint_path":
        return create(NAME, checkpoint_path=str(pth), **ARCH)
    file = st if path == "overlay_safetensors" else pth
    given = {"laplacian_heads": setting} if path == "overlay_given" and not xsa else {}
    return create(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=str(file), num_classes=10), **given, **ARCH)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_round_trip(tmp_path, setting, path):
    model = _saved_model(setting)
    ref = _logits(model)
    assert not torch.allclose(_standard_logits(model.state_dict()), ref, atol=1e-3)  # the heads matter
    if setting == "xsa" and path == "save_for_hf":
        # config.json cannot name the attention class: timm refuses to save it (lapheads' classify runs
        # save and rebuild the variant themselves)
        with pytest.raises(ValueError, match="Model argument 'attn_layer' is not serializable"):
            _reload(setting, path, model, tmp_path)
        return
    again = _reload(setting, path, model, tmp_path)
    assert _heads(again) == _heads(model)
    assert torch.equal(_logits(again), ref)


def _as_previous_release(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as lapheads 7f150a3 wrote it: markers, each proj.weight in its own shape, fixed mixing
    heads marked Laplacian (code 1), no lap_coef."""
    stock = lt.stock_state_dict(state)
    old = {k: v for k, v in state.items() if not k.endswith(".lap_coef")}
    old.update({k: stock[k] for k in old if k in stock})
    for k in [k for k in old if k.endswith(".lap_heads")]:
        old[k] = torch.where(old[k] == 3, 1, old[k]).to(torch.int8)
    return old


@pytest.mark.parametrize("setting", [2, [[0], [1, 3]], "learn", "identity:2"], ids=str)
def test_checkpoints_of_the_previous_release_still_load(tmp_path, setting):
    """Files written before the anchor and the fixed-mixing code still load: into the same-built model
    (fixed mixing heads there were marked Laplacian, so they load into the same fixed mixing), and through
    lapheads.timm's loaders, which rebuild the heads from the markers (and from config.json's selection,
    which is what tells an old ablation from Laplacian heads)."""
    model = _saved_model(setting)
    ref = _logits(model)
    old = _as_previous_release(model.state_dict())
    assert old["blocks.0.attn.proj.weight"].shape == (64, 64)
    same = _build(setting)
    same.load_state_dict(old)
    assert torch.equal(_logits(same), ref)
    torch.save(old, tmp_path / "old.pth")
    for kw in (dict(checkpoint_path=str(tmp_path / "old.pth")), {}):
        again = lt.create_model(
            NAME,
            pretrained=not kw,
            pretrained_cfg_overlay=None if kw else dict(file=str(tmp_path / "old.pth"), num_classes=10),
            laplacian_heads=setting if setting == "identity:2" else None,  # an old file cannot tell identity apart
            **kw,
            **ARCH,
        )
        assert torch.equal(_logits(again), ref)
    timm.models.save_for_hf(model, str(tmp_path / "hf"))  # then rewritten as the previous release had it
    (tmp_path / "hf" / "model.safetensors").unlink(missing_ok=True)
    torch.save(old, tmp_path / "hf" / "pytorch_model.bin")
    assert torch.equal(_logits(lt.create_model(f"local-dir:{tmp_path / 'hf'}")), ref)


def test_a_fixed_mixing_checkpoint_into_other_heads_is_refused_with_both_named():
    with pytest.raises(
        RuntimeError,
        match=r"blocks.0.attn: the checkpoint has heads \[2, 3\] of 4 mixing a I \+ b P with \(a, b\) = \(1, 0\) but "
        r"this layer has Laplacian heads \[2, 3\] of 4",
    ):
        _build(2).load_state_dict(_saved_model("identity:2").state_dict())
    with pytest.raises(
        RuntimeError,
        match=r"has heads \[3\] of 4 mixing a I \+ b P with \(a, b\) = \(0, -1\) but this layer has heads \[3\] of 4 "
        r"mixing a I \+ b P with \(a, b\) = \(1, 0\)",
    ):
        _build("identity:1").load_state_dict(_saved_model("negated:1").state_dict())


def test_the_anchor_is_a_view_so_the_ema_follows_the_model():
    """timm's ModelEmaV3 updates its copy in place through ``state_dict()`` values; the anchor entry must
    stay a view of the parameter for the EMA of ``proj.weight`` to move."""
    from timm.utils import ModelEmaV3

    model = _saved_model(2)
    ema = ModelEmaV3(model, decay=0.5)
    with torch.no_grad():
        model.blocks[0].attn.proj.weight.add_(1.0)
    ema.update(model, step=10)
    expect = 0.5 * (model.blocks[0].attn.proj.weight - 1.0) + 0.5 * model.blocks[0].attn.proj.weight
    torch.testing.assert_close(ema.module.blocks[0].attn.proj.weight, expect)


PLAIN_TIMM = textwrap.dedent(
    r"""
    import json, sys, torch, timm
    from pathlib import Path
    tmp = Path(sys.argv[1])
    arch = json.loads(sys.argv[2])
    out = {}

    def attempt(label, fn):
        try:
            fn()
            out[label] = "loaded"
        except Exception as e:  # what matters is that it raised, and the line it raised with
            out[label] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"

    def fresh(**kw):
        return timm.create_model("vit_tiny_patch16_224", **{**arch, **kw})

    for setting in json.loads(sys.argv[3]):
        d = tmp / setting
        for fmt in ("m.pth", "m.safetensors"):
            for classes in (10, 1000):  # the file's classes (strict load) or timm's 1000 (dropped head, non-strict)
                attempt(f"{setting} overlay file {fmt} cfg_classes={classes}", lambda: fresh(
                    pretrained=True, pretrained_cfg_overlay=dict(file=str(d / fmt), num_classes=classes)))
        state = timm.models.load_state_dict(str(d / "m.pth"))
        for classes in (10, 1000):
            attempt(f"{setting} overlay state_dict cfg_classes={classes}", lambda: fresh(
                pretrained=True, pretrained_cfg_overlay=dict(state_dict=dict(state), num_classes=classes)))
        attempt(f"{setting} local-dir", lambda: timm.create_model(f"local-dir:{d / 'hf'}", pretrained=True))
        attempt(f"{setting} local-dir without laplacian_heads",
                lambda: timm.create_model(f"local-dir:{d / 'hf_plain'}", pretrained=True))
        attempt(f"{setting} hf-hub", lambda: timm.create_model("hf-hub:someone/" + setting, pretrained=True))
        attempt(f"{setting} checkpoint_path", lambda: fresh(checkpoint_path=str(d / "m.pth")))
        for kw in (dict(), dict(strict=False), dict(remap=True)):
            attempt(f"{setting} load_checkpoint {kw}", lambda: timm.models.load_checkpoint(fresh(), str(d / "m.pth"), **kw))
        for strict in (True, False):
            attempt(f"{setting} load_state_dict strict={strict}", lambda: fresh().load_state_dict(state, strict=strict))
    out["lapheads imported"] = "lapheads" in sys.modules
    print(json.dumps(out))
    """
)
PLAIN_SETTINGS = {"k2": 2, "perlayer": [[0], [1, 3]], "learn": "learn", "identity": "identity:2"}


def test_no_plain_timm_path_loads_a_laplacian_checkpoint_as_standard(tmp_path):
    hub = tmp_path / "hub"
    for label, setting in PLAIN_SETTINGS.items():
        d = tmp_path / label
        d.mkdir()
        model = _saved_model(setting)
        state = model.state_dict()
        torch.save(state, d / "m.pth")
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "m.safetensors"))
        timm.models.save_for_hf(model, str(d / "hf"), safe_serialization=True)
        timm.models.save_for_hf(model, str(d / "hf_plain"), safe_serialization=True)
        cfg = json.loads((d / "hf_plain" / "config.json").read_text())  # a config.json plain timm can read
        del cfg["pretrained_cfg"]["laplacian_heads"]
        (d / "hf_plain" / "config.json").write_text(json.dumps(cfg))
        repo = hub / f"models--someone--{label}"  # the Hub cache as huggingface_hub lays it out, read offline
        timm.models.save_for_hf(model, str(repo / "snapshots" / ("0" * 40)), safe_serialization=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # nothing that could bring lapheads' timm registrations in
    args = [str(tmp_path), json.dumps(ARCH), json.dumps(list(PLAIN_SETTINGS))]
    r = subprocess.run(
        [sys.executable, "-c", PLAIN_TIMM, *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("lapheads imported") is False
    assert len(out) == 15 * len(PLAIN_SETTINGS)
    loaded = [k for k, v in out.items() if v == "loaded"]
    assert not loaded, f"plain timm loaded a Laplacian checkpoint: {loaded}"
    for label, why in out.items():  # each refusal names what is not stock timm's
        assert any(s in why for s in ("blocks.0.attn.proj.weight", "lap_heads", "laplacian_heads", "Remap")), (
            label,
            why,
        )
