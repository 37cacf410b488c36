"""One resolved selection under one name: lapheads.nn, lapheads.timm and lapheads.transformers each
store a layer's heads as ``laplacian_selection``, a :class:`lapheads.LayerHeads`, equal across the
three for the same spec, and hand it to the operator as is; every layer's attention equals the
eager reference operator (the explicit ``I - P`` / ``P`` per head) given that selection's mask.

float64 throughout, so the comparisons are at 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import lapheads.timm as ltimm
import lapheads.transformers as ltf
from lapheads import LaplacianHeads, LayerHeads, laplacian_attention, laplacian_attention_reference
from lapheads.nn import MultiheadAttention

SPEC = [[0, 2], [1, 2, 3]]  # 2 layers of 4 heads: a mixed layer and a trailing-3 layer
E, H = 32, 4
TOL = dict(atol=1e-10, rtol=1e-10)


def _expected() -> list[LayerHeads]:
    return LaplacianHeads(SPEC).resolve(2, H)


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def test_operator_takes_a_layer_heads_as_is_and_equals_the_reference():
    q, k, v = _x(3, 2, H, 6, 8).unbind(0)
    for sel in _expected() + [LayerHeads((False,) * H), LayerHeads((True,) * H)]:
        ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=sel.mask(), is_causal=True)
        torch.testing.assert_close(laplacian_attention(q, k, v, laplacian_heads=sel, is_causal=True), ref, **TOL)
        # the reference takes the selection itself too
        torch.testing.assert_close(
            laplacian_attention_reference(q, k, v, laplacian_heads=sel, is_causal=True)[0], ref, **TOL
        )


# --------------------------------------------------------------------------- the three integrations
def _nn_layers() -> list[MultiheadAttention]:
    torch.manual_seed(0)
    return [
        MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, laplacian_heads=sel).eval()
        for sel in _expected()
    ]


def _timm_layers() -> list[ltimm.LaplacianAttention]:
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=16, patch_size=4, embed_dim=E, depth=2, num_heads=H, num_classes=5)
    ltimm.convert(vit.double().eval(), SPEC)
    return [b.attn for b in vit.blocks]


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=E,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_key_value_heads=2,
    )  # grouped-query attention
    return ltf.enable(LlamaForCausalLM(cfg).double().eval(), SPEC)


def test_every_integration_stores_the_same_layer_heads_under_one_name():
    want = _expected()
    hf = [layer.self_attn for layer in _llama().model.layers]  # set by enable(), before any forward
    for layers in (_nn_layers(), _timm_layers(), hf):
        got = [m.laplacian_selection for m in layers]
        assert all(type(s) is LayerHeads for s in got)
        assert got == want


def test_nn_layer_equals_the_reference_operator():
    x = _x(2, 5, E)
    for mha in _nn_layers():
        with torch.no_grad():
            out, _ = mha(x, x, x, need_weights=False)
            q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).view(2, 5, 3, H, E // H).permute(2, 0, 3, 1, 4)
            ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=mha.laplacian_selection.mask())
            ref = mha.out_proj(ref.transpose(1, 2).reshape(2, 5, E))
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("fused", [True, False])
def test_timm_layer_equals_the_reference_operator(fused):
    x = _x(2, 7, E)
    for attn in _timm_layers():
        attn.fused_attn = fused
        with torch.no_grad():
            out = attn(x)
            q, k, v = attn.qkv(x).reshape(2, 7, 3, H, E // H).permute(2, 0, 3, 1, 4)
            ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=attn.laplacian_selection.mask())
            ref = attn.proj(ref.transpose(1, 2).reshape(2, 7, E))
        torch.testing.assert_close(out, ref, **TOL)


_CHECK = "lapheads_test_reference_check"
_CHECKED: list[int] = []


def _checking_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """lapheads' fused attention function, checked against the reference on the module's selection."""
    out, _ = ltf.laplacian_sdpa_attention_forward(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )
    sel = module.laplacian_selection  # what the function just resolved and used
    assert type(sel) is LayerHeads and sel == _expected()[module.layer_idx]
    ref, _ = laplacian_attention_reference(
        query,
        key,
        value,
        laplacian_heads=sel.mask(query.device),
        attn_mask=attention_mask,
        is_causal=attention_mask is None,
        scale=scaling,
        enable_gqa=True,
    )
    torch.testing.assert_close(out, ref.transpose(1, 2), **TOL)
    _CHECKED.append(module.layer_idx)
    return out, None


def test_transformers_layer_equals_the_reference_operator():
    AttentionInterface.register(_CHECK, _checking_attention)
    AttentionMaskInterface.register(_CHECK, sdpa_mask)
    model = _llama()
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fused = model(ids).logits
        model.set_attn_implementation(_CHECK)
        _CHECKED.clear()
        checked = model(ids).logits
    assert sorted(_CHECKED) == [0, 1]
    torch.testing.assert_close(checked, fused, atol=0, rtol=0)


def test_transformers_selection_follows_config_edits():
    model = _llama()
    attn = model.model.layers[0].self_attn
    assert attn.laplacian_selection.indices == (0, 2)
    model.config.laplacian_heads = 1
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert attn.laplacian_selection == LayerHeads((False, False, False, True))
