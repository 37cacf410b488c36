"""Ablation heads as specs of the head operator: "identity:K" (V), "negated:K" (-P V), "mix(a,b):K"
(a V + b P V) on the trailing K heads, each against its formula written here, in the operator, the
reference, lapheads.nn, timm and transformers; K = 0 is plain attention."""

from __future__ import annotations

import math

import pytest
import torch

from lapheads import ConfigError, LaplacianHeads, laplacian_attention, laplacian_attention_reference

CASES = {"identity:2": (1.0, 0.0), "negated:2": (0.0, -1.0), "mix(0.5,-1.5):2": (0.5, -1.5)}


def _formula(q, k, v, coef, n, causal=False):
    """softmax(q k^T / sqrt(d)) by exp / sum; the trailing n heads apply a V + b P V."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    pv = (e / e.sum(-1, keepdim=True)) @ v
    out = pv.clone()
    h = q.shape[-3]
    a, b = coef
    out[..., h - n :, :, :] = a * v[..., h - n :, :, :] + b * pv[..., h - n :, :, :]
    return out


@pytest.mark.parametrize("spec", list(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_operator_and_reference_match_the_formula(spec, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = _formula(q, k, v, CASES[spec], 2, causal)
    fused = laplacian_attention(q, k, v, laplacian_heads=spec, is_causal=causal)
    ref, op = laplacian_attention_reference(q, k, v, laplacian_heads=spec, is_causal=causal)
    torch.testing.assert_close(fused, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(ref, want, atol=1e-12, rtol=0)
    gy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for got, exp in zip(torch.autograd.grad(fused, (q, k, v), gy), torch.autograd.grad(want, (q, k, v), gy)):
        torch.testing.assert_close(got, exp, atol=1e-10, rtol=0)
    if spec == "identity:2":  # the identity heads' operator is I: no attention at all
        torch.testing.assert_close(op[:, 2:], torch.eye(6, dtype=torch.float64).expand(2, 2, 6, 6))


@pytest.mark.parametrize("spec", ["identity:0", "negated:0", "mix(2,3):0"])
def test_k0_is_plain_sdpa(spec):
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    assert LaplacianHeads(spec).is_none()
    assert torch.equal(
        laplacian_attention(q, k, v, laplacian_heads=spec), torch.nn.functional.scaled_dot_product_attention(q, k, v)
    )


def test_negated_heads_need_no_own_position():
    """-P V has no identity term, so a query block longer than the keys is allowed (it is not for I - P)."""
    q, k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    laplacian_attention(q, k, v, laplacian_heads="negated:1")
    with pytest.raises(ConfigError, match="own position"):
        laplacian_attention(q, k, v, laplacian_heads="identity:1")


def test_spellings_labels_and_errors():
    assert LaplacianHeads(" Identity : 3 ").spec == "identity:3"
    assert LaplacianHeads("mix(1,0):2").spec == "identity:2"  # one setting, one spelling
    assert LaplacianHeads("mix(1,-1):3") == LaplacianHeads(3) and LaplacianHeads("mix(0,1):3") == LaplacianHeads(0)
    assert LaplacianHeads("mix(+0.50, -1e0):1").label() == "mix(0.5,-1):1"
    assert LaplacianHeads.parse_config_value("negated:2", "model.laplacian_heads") == "negated:2"
    for bad, words in [("identity:x", "int K"), ("mix(1):2", "two numbers"), ("negated:-1", "int K")]:
        with pytest.raises(ConfigError, match=words):
            LaplacianHeads(bad, name="model.laplacian_heads")
    with pytest.raises(ConfigError, match="only 4 heads"):
        LaplacianHeads("identity:5").resolve(1, 4)


def test_nn_timm_and_transformers_take_the_specs():
    import lapheads.timm as lt
    import lapheads.transformers as ltr
    from lapheads.nn import MultiheadAttention

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    # lapheads.nn: the formula on the module's own q, k, v
    m = MultiheadAttention(16, 4, batch_first=True, laplacian_heads="negated:2", dtype=torch.float64)
    w, bias = m.in_proj_weight, m.in_proj_bias
    q, k, v = (t.view(2, 5, 4, 4).transpose(1, 2) for t in torch.nn.functional.linear(x, w, bias).chunk(3, -1))
    want = m.out_proj(_formula(q, k, v, (0.0, -1.0), 2).transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(m(x, x, x, need_weights=False)[0], want, atol=1e-12, rtol=0)
    # timm: the formula on the layer's own q, k, v
    vit = lt.create_model(
        "vit_tiny_patch16_224",
        laplacian_heads="mix(0.5,-1.5):2",
        img_size=32,
        patch_size=8,
        depth=1,
        embed_dim=24,
        num_heads=4,
    ).double()
    attn = vit.blocks[0].attn
    y = torch.randn(2, 17, 24, dtype=torch.float64)
    q, k, v = attn.qkv(y).view(2, 17, 3, 4, 6).permute(2, 0, 3, 1, 4)
    want = attn.proj(_formula(q, k, v, (0.5, -1.5), 2).transpose(1, 2).reshape(2, 17, 24))
    torch.testing.assert_close(attn(y), want, atol=1e-12, rtol=0)
    # transformers: the fused and the eager implementation agree, and differ from no ablation
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=30,
    )
    ids = torch.randint(0, 30, (1, 7))
    logits = {}
    for name, spec, eager in [("fused", "identity:2", False), ("eager", "identity:2", True), ("none", 0, False)]:
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg).double()
        ltr.enable(model, spec, eager=eager)
        logits[name] = model(input_ids=ids).logits
    torch.testing.assert_close(logits["fused"], logits["eager"], atol=1e-10, rtol=0)
    assert not torch.allclose(logits["fused"], logits["none"])
