"""lapheads.timm: LaplacianAttention, convert, create_model and the registered variants."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer

import lapheads
import lapheads.timm as lt
from lapheads import ConfigError, laplacian_attention_reference

TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=3, num_heads=4, num_classes=5)


def tiny_vit(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**dict(TINY, **kw)).eval()


def set_fused(model, fused: bool) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = fused


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("spec", [0, "none", [0, 0, 0]])
def test_convert_without_laplacian_heads_is_identical(fused, spec):
    model = tiny_vit(qk_norm=True)
    set_fused(model, fused)
    x = images()
    with torch.no_grad():
        ref = model(x)
        lt.convert(model, spec)
        out = model(x)
    assert all(isinstance(b.attn, lt.LaplacianAttention) for b in model.blocks)
    assert lt.laplacian_head_counts(model) == [0, 0, 0]
    assert torch.equal(ref, out)


def _reference_block_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """One timm attention layer recomputed with the explicit operator."""
    B, N, _ = x.shape
    qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    out, op = laplacian_attention_reference(q, k, v, laplacian_heads=attn.laplacian_selection.mask())
    # sanity on the operator itself: rows of I - P sum to 0, rows of P to 1
    rows = op.sum(-1)
    expect = torch.where(attn.laplacian_selection.mask().view(-1, 1), torch.zeros(()), torch.ones(()))
    torch.testing.assert_close(rows, expect.expand_as(rows), atol=1e-5, rtol=0)
    return attn.proj(attn.norm(out.transpose(1, 2).reshape(B, N, -1)))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_convert_matches_eager_reference_layer_by_layer(fused, qk_norm):
    model = tiny_vit(qk_norm=qk_norm)
    lt.convert(model, [[3], [1, 2], [0, 1, 2, 3]])
    set_fused(model, fused)
    assert lt.laplacian_head_counts(model) == [1, 2, 4]
    seen = []

    def hook(mod, inputs, output):
        seen.append((mod, inputs[0].detach(), output.detach()))

    handles = [b.attn.register_forward_hook(hook) for b in model.blocks]
    with torch.no_grad():
        model(images())
    for h in handles:
        h.remove()
    assert len(seen) == 3
    with torch.no_grad():
        for mod, x, out in seen:
            torch.testing.assert_close(out, _reference_block_attention(mod, x), atol=2e-5, rtol=1e-5)


def test_laplacian_heads_change_the_output():
    model = tiny_vit()
    x = images()
    with torch.no_grad():
        ref = model(x)
        lt.convert(model, 2)
        assert not torch.allclose(model(x), ref)


@pytest.mark.parametrize("spec", [1, "all", [0, 4, 2]])
def test_fused_and_eager_paths_agree(spec):
    model = tiny_vit(qk_norm=True)
    lt.convert(model, spec)
    x = images(3)
    with torch.no_grad():
        set_fused(model, True)
        a = model(x)
        set_fused(model, False)
        b = model(x)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "causal"])
def test_layer_masks_fused_eager_reference(mask_kind):
    torch.manual_seed(0)
    layer = lt.LaplacianAttention(32, num_heads=4, qkv_bias=True, laplacian_heads=[0, 3]).eval()
    x = torch.randn(2, 7, 32)
    mask, causal = None, False
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 7, 7) > 0.3
        mask |= torch.eye(7, dtype=torch.bool)  # every query keeps its own key
    elif mask_kind == "additive":
        mask = torch.randn(2, 1, 7, 7)
    else:
        causal = True
    with torch.no_grad():
        layer.fused_attn = True
        a = layer(x, attn_mask=mask, is_causal=causal)
        layer.fused_attn = False
        b = layer(x, attn_mask=mask, is_causal=causal)
        qkv = layer.qkv(x).reshape(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
        ref, _ = laplacian_attention_reference(
            *qkv.unbind(0), laplacian_heads=layer.laplacian_selection.mask(), attn_mask=mask, is_causal=causal
        )
        ref = layer.proj(ref.transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(a, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_query_row_same_on_fused_and_eager(kind):
    """A query row whose mask hides every key has P = 0 on both paths (lapheads.ops "Edge cases"):
    standard heads give 0, Laplacian heads v; the eager softmax used to give NaN there."""
    torch.manual_seed(0)
    layer = lt.LaplacianAttention(32, num_heads=4, qkv_bias=True, laplacian_heads=[1, 3], proj_bias=False).eval()
    layer.proj.weight.data = torch.eye(32)
    x = torch.randn(2, 6, 32)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, :, 2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    v = layer.qkv(x).reshape(2, 6, 3, 4, 8)[:, :, 2]  # (B, N, heads, head_dim)
    outs = []
    with torch.no_grad():
        for fused in (True, False):
            layer.fused_attn = fused
            out = layer(x, attn_mask=mask).view(2, 6, 4, 8)
            assert not out.isnan().any(), fused
            torch.testing.assert_close(out[0, 2, [1, 3]], v[0, 2, [1, 3]])
            assert torch.equal(out[0, 2, [0, 2]], torch.zeros_like(out[0, 2, [0, 2]]))
            outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-5)


def test_eager_attention_dropout_acts_on_p_only():
    # attn_drop=1 drops all of P: a Laplacian head then outputs exactly V, a standard head 0.
    torch.manual_seed(0)
    layer = lt.LaplacianAttention(16, num_heads=2, attn_drop=1.0, laplacian_heads=1, proj_bias=False)
    layer.fused_attn = False
    layer.train()
    layer.proj.weight.data = torch.eye(16)
    x = torch.randn(1, 5, 16)
    out = layer(x)
    v = layer.qkv(x).reshape(1, 5, 3, 2, 8)[:, :, 2]  # (B, N, heads, head_dim)
    torch.testing.assert_close(out[..., 8:], v[:, :, 1])
    assert torch.equal(out[..., :8], torch.zeros_like(out[..., :8]))


@pytest.mark.parametrize("fused", [True, False])
def test_backward_pass_with_dropouts(fused):
    model = tiny_vit(qk_norm=True, attn_drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.1, init_values=1e-2)
    lt.convert(model, [1, 2, 4])
    set_fused(model, fused)
    model.train()
    loss = model(images()).logsumexp(-1).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.blocks[2].attn.qkv.weight.grad.abs().sum() > 0


def test_state_dict_round_trip_between_plain_and_converted():
    """Stock weights load into a converted model (retrofitting); a converted state dict carries one
    marker per layer (``lap_heads``) and each Laplacian layer's ``proj.weight`` with a leading axis of 1,
    which a stock model refuses strictly or not; ``stock_state_dict`` gives the stock form."""
    plain = tiny_vit()
    conv = lt.convert(tiny_vit(), 2)
    torch.manual_seed(5)
    for p in conv.parameters():  # weights that differ from `plain`'s
        p.data.normal_()
    sd = conv.state_dict()
    assert set(sd) - set(plain.state_dict()) == {f"blocks.{i}.attn.lap_heads" for i in range(3)}
    assert sd["blocks.0.attn.lap_heads"].tolist() == [0, 0, 1, 1]
    assert sd["blocks.0.attn.proj.weight"].shape == (1, *conv.blocks[0].attn.proj.weight.shape)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"blocks.0.attn.lap_heads\""):
        plain.load_state_dict(sd, strict=True)
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.0.attn.proj.weight"):
        plain.load_state_dict(sd, strict=False)  # the markers dropped, as timm's adapting loads do
    plain.load_state_dict(lt.stock_state_dict(sd), strict=True)
    back = lt.convert(tiny_vit(), 2)
    back.load_state_dict(plain.state_dict(), strict=True)  # stock weights: no marker, any selection
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(back(x), conv(x), atol=0, rtol=0)
        lt.convert(back, 0)
        torch.testing.assert_close(back(x), plain(x), atol=0, rtol=0)


def test_convert_keeps_parameter_objects_and_forward_intermediates():
    model = tiny_vit()
    params = [id(p) for p in model.parameters()]
    lt.convert(model, 3)
    assert [id(p) for p in model.parameters()] == params
    assert model.laplacian_heads == lapheads.LaplacianHeads(3)
    assert not hasattr(model, "pretrained_cfg")  # built without timm's factory: nothing to annotate
    made = lt.create_model("vit_tiny_patch16_224", laplacian_heads=[1, 2], depth=2, img_size=32)
    assert made.pretrained_cfg["laplacian_heads"] == [1, 2] and made.laplacian_heads.spec == [1, 2]
    x = images()
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        assert len(inter) == 3 and inter[0].shape == (2, 32, 4, 4)
        torch.testing.assert_close(model.forward_head(final), model(x))


def test_with_heads_as_timm_attn_layer():
    cls = lt.LaplacianAttention.with_heads(3)
    assert cls is lt.LaplacianAttention.with_heads(3) and issubclass(cls, Attention)
    model = VisionTransformer(**dict(TINY, attn_layer=cls))
    assert lt.laplacian_head_counts(model) == [3, 3, 3]
    assert model.blocks[0].attn.laplacian_selection == lapheads.LayerHeads((False, True, True, True))
    with pytest.raises(ConfigError, match="per-layer"):
        lt.LaplacianAttention.with_heads([1, 2, 3])
    with pytest.raises(ConfigError, match="only 4 heads"):
        VisionTransformer(**dict(TINY, attn_layer=lt.LaplacianAttention.with_heads(5)))


def test_set_laplacian_heads_per_layer_after_construction():
    model = lt.convert(tiny_vit(), 0)
    model.blocks[1].attn.set_laplacian_heads([0, 2])
    assert lt.laplacian_head_counts(model) == [0, 2, 0]
    assert model.blocks[1].attn.laplacian_selection.indices == (0, 2)


def test_registered_names_create_models_with_the_right_masks():
    assert len(lt.REGISTERED_MODELS) == 6 + 12 + 16
    assert set(timm.list_models("deit3_*_lap*")) == set(lt.REGISTERED_MODELS)
    for name, heads, k in [
        ("deit3_small_patch16_224_lap5", 6, 5),
        ("deit3_base_patch16_224_lap12", 12, 12),
        ("deit3_large_patch16_224_lap1", 16, 1),
    ]:
        # embed_dim shrunk (4 per head) so ViT-L builds in milliseconds; heads come from the variant
        model = timm.create_model(name, depth=2, img_size=32, num_classes=3, embed_dim=4 * heads)
        assert model.blocks[0].attn.num_heads == heads
        assert lt.laplacian_head_counts(model) == [k, k]
        expect = [False] * (heads - k) + [True] * k
        assert all(list(b.attn.laplacian_selection.flags) == expect for b in model.blocks)
        assert model.blocks[0].ls1.gamma.shape == (model.embed_dim,)  # DeiT-3 LayerScale kept
        assert model.pretrained_cfg["architecture"] == name
        same = lt.create_model(name, depth=2, img_size=32, num_classes=3, embed_dim=4 * heads)
        assert lt.laplacian_head_counts(same) == [k, k]


def test_create_model_equals_timm_for_k0_and_passes_kwargs():
    torch.manual_seed(3)
    ref = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=4).eval()
    torch.manual_seed(3)
    ours = lt.create_model("vit_tiny_patch16_224", laplacian_heads=0, img_size=32, depth=2, num_classes=4).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(ref(x), ours(x))
    qk = lt.create_model("vit_tiny_patch16_224", laplacian_heads="all", img_size=32, depth=1, qk_norm=True)
    assert isinstance(qk.blocks[0].attn.q_norm, torch.nn.LayerNorm)
    assert lt.laplacian_head_counts(qk) == [3]


def test_errors_are_clear_config_errors():
    with pytest.raises(ConfigError, match=r"laplacian_heads=7 but layers have only 6 heads"):
        lt.create_model("deit3_small_patch16_224", laplacian_heads=7, depth=1, img_size=32)
    with pytest.raises(ConfigError, match=r"unknown timm model name 'deit3_smal_patch16_224'.*deit3_small_patch16_224"):
        lt.create_model("deit3_smal_patch16_224", laplacian_heads=1)
    with pytest.raises(ConfigError, match="no pretrained weights"):
        timm.create_model("deit3_small_patch16_224_lap5", pretrained=True)
    with pytest.raises(ConfigError, match="no pretrained weights"):
        lt.create_model("deit3_small_patch16_224_lap5", pretrained=True)
    with pytest.raises(ConfigError, match="means laplacian_heads=5"):
        lt.create_model("deit3_small_patch16_224_lap5", laplacian_heads=2)
    with pytest.raises(ConfigError, match="resnet"):
        lt.create_model("resnet10t", laplacian_heads=1)
    model = tiny_vit()
    with pytest.raises(ConfigError, match="2 per-layer entries but the model has 3 layers"):
        lt.convert(model, [1, 1])
    # a refused conversion leaves the model untouched
    assert all(type(b.attn) is Attention for b in model.blocks)
    with pytest.raises(ConfigError, match="only 4 heads"):
        lt.LaplacianAttention(32, num_heads=4, laplacian_heads=9)


def test_torch_compile_fullgraph_and_reselection():
    """The hot path passes Python bool flags, so a Laplacian ViT compiles as ONE graph (a device
    mask read back with tolist() would be a graph break, an error under fullgraph=True), forward
    and backward, and re-selecting heads after compiling is seen by the compiled model (dynamo
    guards on the cached flags, so it recompiles instead of reusing stale ones)."""
    model = tiny_vit(depth=2)
    lt.convert(model, [1, 4])  # a mixed and an all-Laplacian layer
    x = images()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    out.sum().backward()  # aot_eager's backward graph
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5)
    before = out.detach()
    model.blocks[1].attn.set_laplacian_heads(0)  # now a standard layer (timm's own forward)
    out = compiled(x)
    assert not torch.allclose(out, before, atol=1e-3)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_a_subclass_defined_elsewhere_does_not_replace_the_twin_convert_uses():
    # convert() swaps in the class registered for timm's Attention; a user's own
    # LaplacianLayer subclass of Attention must not take that place silently
    before = dict(lt.LAPLACIAN_CLASSES)

    class MyLaplacianAttention(lt.LaplacianLayer, Attention):
        pass

    assert lt.LAPLACIAN_CLASSES == before
    assert lt.LAPLACIAN_CLASSES[Attention] is lt.LaplacianAttention
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32, patch_size=8)
    lt.convert(model, 1)
    assert {type(b.attn) for b in model.blocks} == {lt.LaplacianAttention}
