"""Round trips through transformers' own save_pretrained / from_pretrained, for every family of
tests/test_transformers_coverage.py (vision towers, encoders, encoder-decoders, decoders).

* Learnable mixing reloads: the mixing values are moved off their initialisation before saving,
  so a reload that re-initialised them (or dropped them) gives other outputs; the reloaded model
  equals the saved one and differs from the stock model with the same weights.
* A plain ``AutoModel.from_pretrained`` of an encoder checkpoint (ViT, DINOv2, CLIP) with
  lapheads imported is refused at its first forward in one line naming the fix, never run as a
  standard model, and ``lapheads.transformers.from_pretrained`` loads the same checkpoint Laplacian.

float64 throughout (comparisons at 1e-12).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from test_transformers_coverage import ARCHS, _build, _inputs, _max_diff, _run, _vision

import lapheads.transformers as lt
from lapheads import ConfigError


def _perturb_mixing(model) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in lt.mixing_modules(model):
            if not hasattr(m, "lap_mix_a"):  # a tower without learnable mixing
                continue
            m.lap_mix_a.add_(0.3 * torch.randn(m.lap_mix_a.shape, generator=g, dtype=m.lap_mix_a.dtype))
            m.lap_mix_b.add_(0.3 * torch.randn(m.lap_mix_b.shape, generator=g, dtype=m.lap_mix_b.dtype))


@pytest.mark.parametrize("arch", ARCHS)
def test_learnable_mixing_reloads(arch, tmp_path):
    model, _, _ = _build(arch)
    inputs = _inputs(arch)
    stock = _run(model, inputs)
    lt.enable(model, "learn:1")
    at_init = _run(model, inputs)
    _perturb_mixing(model)
    want = _run(model, inputs)
    assert _max_diff(want, stock) > 1e-4 and _max_diff(want, at_init) > 1e-4  # the checks below can fail
    model.save_pretrained(tmp_path)
    back = lt.from_pretrained(
        str(tmp_path), model_class=type(model), dtype=torch.float64, experts_implementation="eager"
    ).eval()
    assert _max_diff(_run(back, inputs), want) < 1e-12
    assert len(lt.mixing_modules(back)) == len(lt.mixing_modules(model))


def test_vit_classifier_with_learnable_mixing_reloads_as_itself_and_as_its_backbone(tmp_path):
    """The names on disk are not the module names (transformers renames ViT's ``vit.layers.<i>`` to
    ``vit.encoder.layer.<i>`` when saving); a classifier's checkpoint loads as the bare ViTModel too."""
    torch.manual_seed(0)
    model = tf.ViTForImageClassification._from_config(tf.ViTConfig(**_vision(num_labels=3)), dtype=torch.float64).eval()
    pixels = _inputs("vit")["pixel_values"]
    with torch.no_grad():
        stock = model(pixel_values=pixels, output_hidden_states=True)
    lt.enable(model, "learn")
    _perturb_mixing(model)
    with torch.no_grad():
        want = model(pixel_values=pixels, output_hidden_states=True)
    assert (want.logits - stock.logits).abs().max() > 1e-4
    model.save_pretrained(tmp_path)
    back = lt.from_pretrained(str(tmp_path), model_class=tf.ViTForImageClassification, dtype=torch.float64).eval()
    bare = lt.from_pretrained(str(tmp_path), model_class=tf.AutoModel, dtype=torch.float64).eval()
    assert type(bare) is tf.ViTModel
    with torch.no_grad():
        assert (back(pixel_values=pixels).logits - want.logits).abs().max() < 1e-12
        hidden = bare(pixel_values=pixels, output_hidden_states=True).hidden_states
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(hidden, want.hidden_states))


def _encoder(arch: str):
    if arch == "dinov2":
        torch.manual_seed(0)
        cfg = _vision(mlp_ratio=2)
        cfg.pop("intermediate_size")
        return tf.Dinov2Model._from_config(tf.Dinov2Config(**cfg), dtype=torch.float64).eval(), _inputs("vit")
    model, _, _ = _build(arch)
    return model, _inputs(arch)


@pytest.mark.parametrize("arch", ["vit", "dinov2", "clip"])
@pytest.mark.parametrize("spec", [2, "learn:2"])
def test_plain_auto_model_of_an_encoder_checkpoint_is_refused_in_one_line(arch, spec, tmp_path):
    model, inputs = _encoder(arch)
    stock = _run(model, inputs)
    lt.enable(model, spec)
    if spec != 2:
        _perturb_mixing(model)
    want = _run(model, inputs)
    assert _max_diff(want, stock) > 1e-4
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attn_implementation"]
    assert saved.endswith(lt.INDEXED_ATTN_IMPLEMENTATION_SUFFIX)
    plain = tf.AutoModel.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with pytest.raises(ConfigError, match="lapheads.transformers.from_pretrained") as refused:
        _run(plain, inputs)
    assert "\n" not in str(refused.value) and "The only possible arguments" not in str(refused.value)
    back = lt.from_pretrained(str(tmp_path), model_class=tf.AutoModel, dtype=torch.float64).eval()
    assert _max_diff(_run(back, inputs), want) < 1e-12


def test_clip_vision_tower_alone_with_learnable_mixing(tmp_path):
    """The vision path: a CLIP checkpoint's vision tower loaded alone keeps its learned mixing."""
    model, _, _ = _build("clip")
    pixels = _inputs("clip")["pixel_values"]
    with torch.no_grad():
        stock = model.vision_model(pixel_values=pixels).last_hidden_state
    lt.enable(model, {"vision_config": "learn:2", "text_config": 0})
    _perturb_mixing(model)
    with torch.no_grad():
        want = model.vision_model(pixel_values=pixels).last_hidden_state
    assert (want - stock).abs().max() > 1e-4
    model.save_pretrained(tmp_path)
    tower = lt.from_pretrained(str(tmp_path), model_class=tf.CLIPVisionModel, dtype=torch.float64).eval()
    assert tower.config.laplacian_heads == "learn:2"
    with torch.no_grad():
        got = tower(pixel_values=pixels).last_hidden_state
    assert (got - want).abs().max() < 1e-12
