"""lapheads.timm beyond timm.layers.Attention: EVA-02, DINOv3, RoPE ViT, BEiT, Swin, Swin v2, RelPos ViT,
Hiera, LeViT, MaxViT / CoAtNet; the refused families; the generated coverage table (docs/coverage-timm.md).

Each converted family is checked against a reference WRITTEN HERE, independent of lapheads.ops and of
lapheads' forward code: explicit scores + position bias + window mask, a softmax, then ``V - P V`` on the
selected heads, plugged into a copy of the stock model in place of each attention module's forward.
Tiny models in float64, every parameter perturbed (timm zero-initialises some biases and layer scales).
"""

from __future__ import annotations

import copy
import functools
import math
import pathlib
import sys

import pytest
import timm
import torch
from timm.layers import AttentionRope
from timm.models.beit import Attention as BeitAttention
from timm.models.eva import EvaAttention
from timm.models.hiera import MaskUnitAttention
from timm.models.levit import Attention as LevitAttention
from timm.models.maxxvit import Attention2d, AttentionCl
from timm.models.swin_transformer import WindowAttention as SwinAttention
from timm.models.swin_transformer_v2 import WindowAttention as SwinV2Attention
from timm.models.vision_transformer_relpos import RelPosAttention

import lapheads.timm as lt
from lapheads import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the coverage harness is a repository tool (tools/), not part of the package
    sys.path.insert(0, str(REPO))
from tools.coverage import table  # noqa: E402
from tools.coverage import timm_table as tc  # noqa: E402

TOL = dict(atol=1e-10, rtol=1e-9)
TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)
DOC = REPO / "docs" / "coverage-timm.md"


# --------------------------------------------------------------------------- the written reference
def _heads_out(scores: torch.Tensor, v: torch.Tensor, flags: tuple[bool, ...], head_dim: int = 1) -> torch.Tensor:
    """softmax(scores) V, with V - P V on the Laplacian heads; heads on ``head_dim`` of both."""
    p = torch.softmax(scores, dim=-1)
    pv = p @ v
    shape = [1] * pv.dim()
    shape[head_dim] = len(flags)
    lap = torch.tensor(flags).view(shape)
    return torch.where(lap, v - pv, pv)


def _linear_qkv(m, x):
    """The fused projection with timm's q/v bias (k gets none)."""
    if getattr(m, "q_bias", None) is not None:
        bias = torch.cat([m.q_bias, torch.zeros_like(m.q_bias), m.v_bias])
    else:
        bias = m.qkv.bias
    out = x @ m.qkv.weight.T
    return out if bias is None else out + bias


def _heads(t, b, n, h):
    return t.reshape(b, n, 3, h, -1).permute(2, 0, 3, 1, 4)


def _rotate(t, rope, npt, half):
    sin, cos = rope.chunk(2, -1)
    body = t[:, :, npt:]
    if half:
        a, b = body.chunk(2, -1)
        turned = torch.cat([-b, a], -1)
    else:
        turned = torch.stack([-body[..., 1::2], body[..., ::2]], -1).reshape(body.shape)
    return torch.cat([t[:, :, :npt], body * cos + turned * sin], dim=2)


def ref_rope(m, flags, x, rope=None, attn_mask=None, is_causal=False):
    assert attn_mask is None and not is_causal
    B, N, _ = x.shape
    if m.qkv is not None:
        q, k, v = _heads(_linear_qkv(m, x), B, N, m.num_heads)
    else:
        q = m.q_proj(x).view(B, N, m.num_heads, -1).transpose(1, 2)
        k = m.k_proj(x).view(B, N, -1, q.shape[-1]).transpose(1, 2)
        v = m.v_proj(x).view(B, N, -1, q.shape[-1]).transpose(1, 2)
    q, k = m.q_norm(q), m.k_norm(k)
    if rope is not None:
        half = getattr(m, "rotate_half", False)
        q, k = _rotate(q, rope, m.num_prefix_tokens, half), _rotate(k, rope, m.num_prefix_tokens, half)
    out = _heads_out(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), v, flags).transpose(1, 2).reshape(B, N, -1)
    out = m.norm(out)
    if getattr(m, "gate", None) is not None:
        out = out * torch.sigmoid(m.gate(x))
    return m.proj(out)


def ref_beit(m, flags, x, shared_rel_pos_bias=None):
    B, N, _ = x.shape
    q, k, v = _heads(_linear_qkv(m, x), B, N, m.num_heads)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if m.relative_position_bias_table is not None:
        bias = m.relative_position_bias_table[m.relative_position_index.reshape(-1)].view(N, N, -1)
        scores = scores + bias.permute(2, 0, 1)
    if shared_rel_pos_bias is not None:
        scores = scores + shared_rel_pos_bias
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(B, N, -1))


def _windowed(scores, mask):
    if mask is None:
        return scores
    nw, h, n = mask.shape[0], scores.shape[1], scores.shape[-1]
    return (scores.view(-1, nw, h, n, n) + mask[None, :, None]).view(-1, h, n, n)


def ref_swin(m, flags, x, mask=None):
    B, N, _ = x.shape
    q, k, v = _heads(_linear_qkv(m, x), B, N, m.num_heads)
    bias = m.relative_position_bias_table[m.relative_position_index.reshape(-1)].view(N, N, -1).permute(2, 0, 1)
    scores = _windowed(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + bias, mask)
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(B, N, -1))


def ref_swinv2(m, flags, x, mask=None):
    B, N, _ = x.shape
    q, k, v = _heads(_linear_qkv(m, x), B, N, m.num_heads)
    qn, kn = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12), k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    cosine = qn @ kn.transpose(-2, -1)
    scale = torch.exp(torch.minimum(m.logit_scale, torch.tensor(math.log(100.0), dtype=m.logit_scale.dtype)))
    table = m.cpb_mlp(m.relative_coords_table).view(-1, m.num_heads)
    bias = 16 * torch.sigmoid(table[m.relative_position_index.reshape(-1)].view(N, N, -1).permute(2, 0, 1))
    scores = _windowed(cosine * scale + bias, mask)
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(B, N, -1))


def ref_relpos(m, flags, x, shared_rel_pos=None):
    B, N, _ = x.shape
    q, k, v = _heads(m.qkv(x), B, N, m.num_heads)
    q, k = m.q_norm(q), m.k_norm(k)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = m.rel_pos(scores) if m.rel_pos is not None else scores + shared_rel_pos
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(B, N, -1))


def ref_hiera(m, flags, x):
    assert m.q_stride == 1
    B, N, _ = x.shape
    if m.use_mask_unit_attn:
        windows = N // m.window_size
        q, k, v = m.qkv(x).reshape(B, -1, windows, 3, m.heads, m.head_dim).permute(3, 0, 4, 2, 1, 5)  # B H W T D
        out = _heads_out(q @ k.transpose(-2, -1) / math.sqrt(m.head_dim), v, flags)
        return m.proj(out.transpose(1, 3).reshape(B, -1, m.dim_out))
    q, k, v = _heads(m.qkv(x), B, N, m.heads)
    out = _heads_out(q @ k.transpose(-2, -1) / math.sqrt(m.head_dim), v, flags)
    return m.proj(out.transpose(1, 2).reshape(B, N, -1))


def ref_levit(m, flags, x):
    assert not m.use_conv
    B, N, _ = x.shape
    q, k, v = m.qkv(x).view(B, N, m.num_heads, -1).split([m.key_dim, m.key_dim, m.val_dim], dim=3)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(m.key_dim) + m.attention_biases[:, m.attention_bias_idxs]
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(B, N, -1))


def ref_attention_cl(m, flags, x, shared_rel_pos=None):
    assert m.head_first
    B, shape = x.shape[0], x.shape[:-1]
    q, k, v = m.qkv(x).view(B, -1, m.num_heads, 3 * m.dim_head).transpose(1, 2).chunk(3, dim=3)
    scores = m.rel_pos(q @ k.transpose(-2, -1) / math.sqrt(m.dim_head))
    return m.proj(_heads_out(scores, v, flags).transpose(1, 2).reshape(shape + (-1,)))


def ref_attention_2d(m, flags, x, shared_rel_pos=None):
    assert m.head_first
    B, _, H, W = x.shape
    q, k, v = (t.transpose(-1, -2) for t in m.qkv(x).view(B, m.num_heads, 3 * m.dim_head, -1).chunk(3, dim=2))
    scores = q @ k.transpose(-2, -1) / math.sqrt(m.dim_head)
    scores = m.rel_pos(scores) if m.rel_pos is not None else scores
    return m.proj(_heads_out(scores, v, flags).transpose(-1, -2).reshape(B, -1, H, W))


# --------------------------------------------------------------------------- the families
SWIN = dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=5)

#: name -> (timm model, kwargs, image size, attention class, reference)
CASES = {
    "eva02": ("eva02_tiny_patch14_224", dict(TINY, img_size=28), 28, EvaAttention, ref_rope),
    "dinov3": ("vit_small_patch16_dinov3", dict(TINY, img_size=32), 32, EvaAttention, ref_rope),
    "rope_vit": ("vit_small_patch16_rope_224", dict(TINY, img_size=32), 32, AttentionRope, ref_rope),
    "sbb_rope_vit": ("vit_medium_patch16_rope_reg1_gap_256", dict(TINY, img_size=32), 32, EvaAttention, ref_rope),
    "rope_mixed_vit": ("vit_small_patch16_rope_mixed_224", dict(TINY, img_size=32), 32, AttentionRope, ref_rope),
    "beit": ("beit_base_patch16_224", dict(TINY, img_size=32, patch_size=8), 32, BeitAttention, ref_beit),
    "beit_shared_bias": (
        "beit_base_patch16_224",
        dict(TINY, img_size=32, patch_size=8, use_rel_pos_bias=False, use_shared_rel_pos_bias=True),
        32,
        BeitAttention,
        ref_beit,
    ),
    "swin": ("swin_tiny_patch4_window7_224", SWIN, 32, SwinAttention, ref_swin),
    "swinv2": ("swinv2_tiny_window8_256", SWIN, 32, SwinV2Attention, ref_swinv2),
    "relpos_vit": ("test_vit_relpos", dict(img_size=32, num_classes=5), 32, RelPosAttention, ref_relpos),
    "hiera": (
        "hiera_tiny_224",
        dict(img_size=64, embed_dim=16, num_heads=1, stages=(1, 2, 1, 1), num_classes=5),
        64,
        MaskUnitAttention,
        ref_hiera,
    ),
    "levit": (
        "levit_128s",
        dict(img_size=128, embed_dim=(32, 48, 64), key_dim=8, num_heads=(2, 2, 2), depth=(1, 1, 1), num_classes=5),
        128,
        LevitAttention,
        ref_levit,
    ),
    "maxvit": ("test_maxvit", dict(img_size=64, num_classes=5), 64, AttentionCl, ref_attention_cl),
    "coatnet": ("test_coatnet", dict(img_size=64, num_classes=5), 64, Attention2d, ref_attention_2d),
}


def build(case: str) -> torch.nn.Module:
    name, kwargs, _, _, _ = CASES[case]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **kwargs).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype), alpha=0.1)
    return model


def images(case: str) -> torch.Tensor:
    size = CASES[case][2]
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def set_fused(model, fused: bool) -> None:
    for m in model.modules():
        if "fused_attn" in m.__dict__:
            m.fused_attn = fused


def mixed_spec(model) -> list[list[int]]:
    """Layer i makes head i % H Laplacian (every layer mixes standard and Laplacian heads where H > 1)."""
    return [[i % lt._heads_of(m)] for i, (_, m) in enumerate(lt.laplacian_attention_layers(model))]


def reference_model(stock, converted, cls, ref):
    """A copy of the stock model whose attention modules of ``cls`` run the written reference."""
    model = copy.deepcopy(stock)
    selection = {
        n: m.laplacian_selection.flags for n, m in converted.named_modules() if isinstance(m, lt.LaplacianLayer)
    }
    plugged = 0
    for n, m in model.named_modules():
        if type(m) is cls and n in selection:
            m.forward = functools.partial(ref, m, selection[n])
            plugged += 1
    assert plugged == len(selection) > 0
    return model


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_laplacian_equals_the_written_reference(case, fused):
    stock = build(case)
    _, _, _, cls, ref = CASES[case]
    model = lt.convert(copy.deepcopy(stock), "none")
    lt.convert(model, mixed_spec(model))
    set_fused(model, fused)
    assert all(type(m) is lt.LAPLACIAN_CLASSES[cls] for _, m in lt.laplacian_attention_layers(model))
    assert sum(lt.laplacian_head_counts(model)) > 0
    x = images(case)
    with torch.no_grad():
        out = model(x)
        assert (out - stock(x)).abs().max() > 1e-4  # the conversion changed the model
        torch.testing.assert_close(out, reference_model(stock, model, cls, ref)(x), **TOL)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_k0_is_bit_identical_to_stock(case, fused):
    stock = build(case)
    set_fused(stock, fused)
    model = lt.convert(copy.deepcopy(stock), 0)
    assert len(lt.laplacian_attention_layers(model)) > 0 and sum(lt.laplacian_head_counts(model)) == 0
    x = images(case)
    with torch.no_grad():
        assert torch.equal(model(x), stock(x))
        lt.convert(model, "all")
        lt.convert(model, "none")  # back from Laplacian: timm's forward again
        assert torch.equal(model(x), stock(x))


@pytest.mark.parametrize(
    "case", ["eva02", "dinov3", "rope_vit", "beit", "swin", "swinv2", "relpos_vit", "hiera", "levit", "maxvit"]
)
def test_gradients_flow_and_equal_the_reference_gradients(case):
    stock = build(case)
    _, _, _, cls, ref = CASES[case]
    model = lt.convert(copy.deepcopy(stock), 1)
    reference = reference_model(stock, model, cls, ref)
    x = images(case)
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if grads[name].grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-9, rtol=1e-7, msg=name)
    qkv = [
        next(m.qkv.parameters()).grad
        for _, m in lt.laplacian_attention_layers(model)
        if getattr(m, "qkv", None) is not None
    ]  # LeViT's qkv is a Linear + BatchNorm
    assert qkv and all(g is not None and g.abs().sum() > 0 for g in qkv)


def test_torch_compile_fullgraph_on_new_families():
    """The selection is Python bools on every family, so a Laplacian Swin compiles as one graph."""
    model = lt.convert(build("swin").float(), 1)  # shifted windows, per-window mask, two widths
    set_fused(model, True)
    x = images("swin").float()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


def test_swin_masks_shifted_windows_and_takes_per_layer_heads():
    model = lt.convert(build("swin"), [[1], [0, 1], [3], [0, 1, 2, 3]])
    assert lt.laplacian_head_counts(model) == [1, 2, 1, 4]
    shifted = [m for m in model.modules() if type(m).__name__ == "SwinTransformerBlock" and m.attn_mask is not None]
    assert shifted  # the tiny model does exercise the shifted-window mask
    # each entry is checked against ITS layer's head count (2 in stage 1, 4 in stage 2), naming the entry
    with pytest.raises(ConfigError, match=r"laplacian_heads\[1\] contains head index 3, but layers have 2 heads"):
        lt.convert(model, [[1], [3], [3], [0]])
    with pytest.raises(ConfigError, match=r"laplacian_heads\[0\]=3 but layers have only 2 heads"):
        lt.convert(model, [3, 0, 4, 4])
    assert lt.laplacian_head_counts(model) == [1, 2, 1, 4]  # a refused selection changed nothing
    assert lt.laplacian_head_counts(lt.convert(model, [2, 2, 4, 4])) == [2, 2, 4, 4]


def test_learnable_mixing_on_a_new_family():
    model = lt.convert(build("eva02"), "learn:1")
    attn = model.blocks[0].attn
    assert attn.laplacian_learnable and tuple(attn.lap_mix_a.shape) == (2,)
    model(images("eva02")).sum().backward()
    assert attn.lap_mix_a.grad is not None and attn.lap_mix_b.grad.abs().sum() > 0
    lt.convert(model, 1)  # back to a fixed selection: the parameters go away
    assert not attn.laplacian_learnable and "lap_mix_a" not in dict(attn.named_parameters())


def test_query_pooling_layers_stay_standard_with_the_reason():
    model = lt.convert(build("hiera"), 1)
    skipped = lt.skipped_attention_layers(model)
    assert skipped and all(cls == "MaskUnitAttention" and "pools its queries" in why for _, cls, why in skipped)
    assert len(lt.laplacian_head_counts(model)) == len(lt.laplacian_attention_layers(model)) == 2
    levit = lt.convert(build("levit"), 1)
    assert {cls for _, cls, _ in lt.skipped_attention_layers(levit)} == {"AttentionDownsample"}


def _meta(name: str, **kwargs):
    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, **kwargs)


@pytest.mark.parametrize(
    "name, cls, reason",
    [
        ("pvt_v2_b0", "PyramidVisionTransformerV2", "Attention (spatial-reduction attention"),
        ("xcit_nano_12_p8_224", "Xcit", "XCA (cross-covariance attention"),
        ("xcit_nano_12_p8_224", "Xcit", "ClassAttn (class attention"),
        ("cait_xxs24_224", "Cait", "TalkingHeadAttn (talking-heads"),
        ("mvitv2_tiny", "MultiScaleVit", "MultiScaleAttention (pooling attention"),
        ("edgenext_xx_small", "EdgeNeXt", "CrossCovarianceAttn (cross-covariance"),
        ("twins_svt_small", "Twins", "GlobalSubSampleAttn (spatial-reduction"),
        ("efficientvit_b0", "EfficientVit", "LiteMLA (linear"),
        ("resnet18", "ResNet", "has no self-attention layer"),
    ],
)
def test_refused_families_name_the_class_and_reason(name, cls, reason):
    model = _meta(name)
    with pytest.raises(ConfigError) as err:
        lt.convert(model, 1)
    msg = str(err.value)
    assert msg.startswith(cls + " has no") and reason in msg and "\n" not in msg
    assert not any(isinstance(m, lt.LaplacianLayer) for m in model.modules())  # nothing changed
    with pytest.raises(ConfigError, match=f"model '{name}': {cls}"), torch.device("meta"):
        lt.create_model(name, laplacian_heads=1, pretrained=False)


def test_pooling_and_cross_attention_stay_standard_inside_converted_models():
    vit = lt.convert(_meta("vit_tiny_patch16_224", global_pool="map", depth=2), 1)
    assert [(n, c) for n, c, _ in lt.skipped_attention_layers(vit)] == [("attn_pool", "AttentionPoolLatent")]
    assert "latent-query pooling" in lt.skipped_attention_layers(vit)[0][2]
    crossvit = lt.convert(_meta("crossvit_tiny_240"), 1)
    reasons = {c: why for _, c, why in lt.skipped_attention_layers(crossvit)}
    assert reasons.keys() == {"CrossAttention"} and reasons["CrossAttention"].startswith("cross-attention")


# --------------------------------------------------------------------------- the coverage table
def test_reference_forward_catches_a_wrong_layer():
    """The table's reference is no tautology: a Laplacian forward that drops Swin's window mask fails."""
    model = lt.convert(build("swin"), 1)
    x = images("swin")
    with torch.no_grad():
        ref = tc.reference_forward(model, x)
        torch.testing.assert_close(model(x), ref, **TOL)
        good = lt._layers._window_mask
        try:
            lt._layers._window_mask = lambda bias, mask, batch: bias
            assert (model(x) - ref).abs().max() > 1e-4
        finally:
            lt._layers._window_mask = good
    assert all(isinstance(m, lt.LaplacianLayer) for _, m in lt.laplacian_attention_layers(model))  # restored


@pytest.mark.slow  # scheduled first: the table builds one model per family
def test_coverage_table_is_current():
    """Regenerate docs/coverage-timm.md (every timm family) and compare; also: no family crashes or is silently
    standard (about 10 s of CPU: refused models are only built on the meta device)."""
    rows = tc.timm_coverage()
    failed = [(r.family, r.model, r.detail) for r in rows if r.status in ("failed", "not built")]
    assert not failed
    assert {r.family for r in rows} == set(tc.families())
    counts, _ = table.counts(rows)
    assert counts["supported"] >= 17 and sum(counts.values()) == len(tc.families())
    for family in (
        "eva",
        "beit",
        "swin_transformer",
        "swin_transformer_v2",
        "vision_transformer_relpos",
        "hiera",
        "levit",
        "maxxvit",
        "vision_transformer",
        "deit",
    ):
        assert all(r.status == "supported" for r in rows if r.family == family), family
    for family in ("pvt_v2", "xcit", "cait", "mvitv2", "resnet"):
        assert all(r.status == "refused" for r in rows if r.family == family), family
    text = tc.timm_markdown(rows)
    assert DOC.exists(), "docs/coverage-timm.md is missing: python -m tools.coverage timm --write <it>"
    assert DOC.read_text(encoding="utf-8") == text, (
        "docs/coverage-timm.md is stale: regenerate it with python -m tools.coverage timm --write docs/coverage-timm.md"
    )
