"""lapheads.nn.MultiheadAttention: a drop-in for torch.nn.MultiheadAttention.

With no Laplacian head it must compute what torch's module computes (our own code path, tested
over many configurations); with Laplacian heads it must equal a manual computation built from the
eager reference operator."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lapheads import ConfigError, LayerHeads, laplacian_attention_reference
from lapheads.nn import MultiheadAttention

E, H = 16, 4


def _pair(seed=0, dtype=torch.float64, laplacian_heads="none", **kw):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    # torch zero-initialises the biases; random ones make the comparison meaningful
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    ours = MultiheadAttention(E, H, dtype=dtype, laplacian_heads=laplacian_heads, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(n, tq, s, kdim, vdim, batch_first, batched, self_attn, dtype=torch.float64):
    def mk(t, d):
        if not batched:
            return torch.randn(t, d, dtype=dtype)
        return torch.randn(n, t, d, dtype=dtype) if batch_first else torch.randn(t, n, d, dtype=dtype)

    if self_attn:
        x = mk(tq, E)
        return x, x, x
    return mk(tq, E), mk(s, kdim), mk(s, vdim)


def _masks(n, tq, s, kind_attn, kind_kpm, batched, dtype=torch.float64):
    am = kpm = None
    if kind_attn != "none":
        shape = (tq, s) if kind_attn.endswith("2d") else ((n if batched else 1) * H, tq, s)
        blocked = torch.rand(shape) < 0.3
        blocked[..., 0] = False  # no fully masked row (torch and SDPA would give NaN)
        am = (
            blocked if kind_attn.startswith("bool") else torch.randn(shape, dtype=dtype).masked_fill(blocked, -math.inf)
        )
    if kind_kpm != "none":
        shape = (n, s) if batched else (s,)
        pad = torch.rand(shape) < 0.3
        pad[..., 0] = False
        kpm = pad if kind_kpm == "bool" else torch.randn(shape, dtype=dtype).masked_fill(pad, -math.inf)
    return am, kpm


def _close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- matches torch
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_first=st.booleans(),
    batched=st.booleans(),
    self_attn=st.booleans(),
    kvdim=st.sampled_from([(None, None), (5, 7), (E, 3)]),
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    bias=st.booleans(),
    attn=st.sampled_from(["none", "bool2d", "bool3d", "float2d", "float3d"]),
    kpm=st.sampled_from(["none", "bool", "float"]),
    need_weights=st.booleans(),
    average=st.booleans(),
    n=st.integers(1, 3),
    tq=st.integers(1, 6),
    s=st.integers(1, 6),
)
def test_matches_torch(
    batch_first, batched, self_attn, kvdim, add_bias_kv, add_zero_attn, bias, attn, kpm, need_weights, average, n, tq, s
):
    kdim, vdim = kvdim
    if self_attn:
        kdim = vdim = None
        s = tq
    if add_bias_kv and not bias:
        bias = True  # irrelevant combination; keep the draw useful
    ref, ours = _pair(
        batch_first=batch_first, kdim=kdim, vdim=vdim, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, bias=bias
    )
    q, k, v = _inputs(n, tq, s, kdim or E, vdim or E, batch_first, batched, self_attn)
    am, km = _masks(n, tq, s, attn, kpm, batched)
    kw = dict(key_padding_mask=km, attn_mask=am, need_weights=need_weights, average_attn_weights=average)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about mixing bool and float masks
        a_out, a_w = ref(q, k, v, **kw)
    b_out, b_w = ours(q, k, v, **kw)
    assert b_out.shape == a_out.shape
    _close(b_out, a_out)
    if need_weights:
        assert b_w.shape == a_w.shape
        _close(b_w, a_w)
    else:
        assert a_w is None and b_w is None


@pytest.mark.parametrize("batch_first", [False, True])
def test_causal_matches_torch(batch_first):
    ref, ours = _pair(batch_first=batch_first)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64)
    for nw in (False, True):
        a, _ = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)
        _close(ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw)[0], a)
        # unlike torch, the mask may be left out with is_causal=True
        _close(ours(x, x, x, is_causal=True, need_weights=nw)[0], a)


def test_matches_torch_fast_path_in_inference():
    """torch's C++ inference fast path (eval, batch_first, self-attention, no grad) gives the same."""
    ref, ours = _pair(dtype=torch.float32, batch_first=True)
    ref.eval(), ours.eval()
    x = torch.randn(2, 9, E)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    with torch.no_grad():
        a, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
        b, _ = ours(x, x, x, key_padding_mask=pad, need_weights=False)
    torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[1, :6], a[1, :6], atol=1e-5, rtol=1e-5)


def test_gradients_match_torch():
    ref, ours = _pair(add_bias_kv=True, kdim=5, vdim=7)
    q, k, v = (
        torch.randn(4, 2, E, dtype=torch.float64),
        torch.randn(6, 2, 5, dtype=torch.float64),
        torch.randn(6, 2, 7, dtype=torch.float64),
    )
    ref(q, k, v, need_weights=False)[0].square().sum().backward()
    ours(q, k, v, need_weights=False)[0].square().sum().backward()
    g_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        _close(p.grad, g_ref[name].grad)


# ----------------------------------------------------------------------------- state_dict
@pytest.mark.parametrize("kw", [dict(), dict(kdim=5, vdim=7), dict(add_bias_kv=True), dict(bias=False)])
def test_state_dict_roundtrip_both_ways(kw):
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(E, H, **kw)
    ours = MultiheadAttention(E, H, laplacian_heads=2, **kw)
    assert list(ours.state_dict().keys()) == list(t.state_dict().keys())
    ours.load_state_dict(t.state_dict())  # strict
    for key, val in t.state_dict().items():
        assert torch.equal(ours.state_dict()[key], val)
    # and back: random weights of ours into a fresh torch module
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    t2 = torch.nn.MultiheadAttention(E, H, **kw)
    t2.load_state_dict(ours.state_dict())
    for key, val in ours.state_dict().items():
        assert torch.equal(t2.state_dict()[key], val)
    base = MultiheadAttention.from_torch(t2)  # no Laplacian head: same function as torch
    x = torch.randn(5, 2, E)
    kk = torch.randn(5, 2, kw.get("kdim", E))
    vv = torch.randn(5, 2, kw.get("vdim", E))
    torch.testing.assert_close(base(x, kk, vv)[0], t2(x, kk, vv)[0], atol=1e-5, rtol=1e-5)


def test_from_torch_keeps_options():
    t = torch.nn.MultiheadAttention(E, H, dropout=0.1, add_zero_attn=True, batch_first=True, kdim=3)
    m = MultiheadAttention.from_torch(t, laplacian_heads="all")
    assert (m.dropout, m.add_zero_attn, m.batch_first, m.kdim, m.vdim) == (0.1, True, True, 3, E)
    assert m.laplacian_selection == LayerHeads((True,) * H)
    assert "laplacian_heads='all' (4 of 4)" in repr(m)


# ----------------------------------------------------------------------------- Laplacian heads
def _manual(mod, q, k, v, heads, attn_mask=None, kpm=None):
    """Batch-first manual computation: projections, torch-order extra keys, reference operator
    with the identity on the real keys' last Tq positions, output projection."""
    n, tq, _ = q.shape
    s = k.shape[1]
    w, b = mod.in_proj_weight, mod.in_proj_bias
    if w is not None:
        wq, wk, wv = w.chunk(3)
    else:
        wq, wk, wv = mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight
    bq, bk, bv = b.chunk(3)
    hd = E // H

    def split(x):
        return x.view(n, -1, H, hd).transpose(1, 2)

    qh, kh, vh = split(F.linear(q, wq, bq)), split(F.linear(k, wk, bk)), split(F.linear(v, wv, bv))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(hd)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask, -math.inf)
    if kpm is not None:
        scores = scores.masked_fill(kpm[:, None, None, :], -math.inf)
    if mod.bias_k is not None:
        kh = torch.cat([kh, mod.bias_k.view(1, H, 1, hd).expand(n, -1, -1, -1)], 2)
        vh = torch.cat([vh, mod.bias_v.view(1, H, 1, hd).expand(n, -1, -1, -1)], 2)
        scores = torch.cat([scores, qh @ kh[..., -1:, :].transpose(-1, -2) / math.sqrt(hd)], -1)
    if mod.add_zero_attn:
        vh = torch.cat([vh, torch.zeros_like(vh[..., :1, :])], 2)
        scores = torch.cat([scores, torch.zeros_like(scores[..., :1])], -1)
    p = scores.softmax(-1)
    eye = torch.zeros(tq, p.shape[-1], dtype=p.dtype)
    eye[torch.arange(tq), s - tq + torch.arange(tq)] = 1
    op = torch.where(torch.tensor(heads).view(H, 1, 1), eye - p, p)
    out = (op @ vh).transpose(1, 2).reshape(n, tq, E)
    return mod.out_proj(out), op


@pytest.mark.parametrize("heads", [[False, True, False, True], [True] * 4, [True, False, False, False]])
@pytest.mark.parametrize(
    "extras", [dict(), dict(add_bias_kv=True), dict(add_zero_attn=True), dict(add_bias_kv=True, add_zero_attn=True)]
)
def test_laplacian_heads_self_attention_vs_manual(heads, extras):
    _, m = _pair(laplacian_heads=heads, batch_first=True, **extras)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    blocked = torch.rand(6, 6) < 0.3
    blocked.fill_diagonal_(False)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True
    want, op = _manual(m, x, x, x, heads, attn_mask=blocked, kpm=pad)
    got, w = m(x, x, x, attn_mask=blocked, key_padding_mask=pad, need_weights=False)
    _close(got, want)
    got2, w = m(x, x, x, attn_mask=blocked, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    _close(got2, want)
    _close(w, op)
    _, wavg = m(x, x, x, attn_mask=blocked, key_padding_mask=pad)
    _close(wavg, op.mean(1))
    # the reference operator is what need_weights returns for a plain SDPA-shaped call too
    if not extras:
        hd = E // H
        qh = F.linear(x, m.in_proj_weight[:E], m.in_proj_bias[:E]).view(2, 6, H, hd).transpose(1, 2)
        kh = F.linear(x, m.in_proj_weight[E : 2 * E], m.in_proj_bias[E : 2 * E]).view(2, 6, H, hd).transpose(1, 2)
        vh = F.linear(x, m.in_proj_weight[2 * E :], m.in_proj_bias[2 * E :]).view(2, 6, H, hd).transpose(1, 2)
        keep = ~(blocked[None, None] | pad[:, None, None, :])
        _, op_ref = laplacian_attention_reference(qh, kh, vh, laplacian_heads=heads, attn_mask=keep)
        _close(w, op_ref)


def test_laplacian_cross_attention_uses_last_tq_values():
    _, m = _pair(laplacian_heads=[False, True, True, True], kdim=5, vdim=7)
    q, k, v = (
        torch.randn(3, 2, E, dtype=torch.float64),
        torch.randn(8, 2, 5, dtype=torch.float64),
        torch.randn(8, 2, 7, dtype=torch.float64),
    )
    want, op = _manual(m, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), [False, True, True, True])
    got, w = m(q, k, v, average_attn_weights=False)
    _close(got, want.transpose(0, 1))
    _close(w, op)
    assert op[0, 1, 0, 5] > 0.5 and op[0, 1, 2, 7] > 0.5  # identity at key Tk - Tq + i


def test_laplacian_unbatched_equals_batched():
    _, m = _pair(laplacian_heads=2, add_zero_attn=True)
    x = torch.randn(5, E, dtype=torch.float64)
    pad = torch.tensor([False, False, False, True, False])
    a, wa = m(x, x, x, key_padding_mask=pad)
    b, wb = m(x[:, None], x[:, None], x[:, None], key_padding_mask=pad[None])
    _close(a, b[:, 0])
    _close(wa, wb[0])


def test_causal_laplacian_first_token():
    """Causal self-attention: token 0's Laplacian heads give exactly zero before out_proj."""
    _, m = _pair(laplacian_heads="all", batch_first=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    out, _ = m(x, x, x, is_causal=True, need_weights=False)
    torch.testing.assert_close(out[:, 0], m.out_proj.bias.expand(2, E), atol=1e-12, rtol=0)


def test_dropout_never_drops_the_identity():
    _, m = _pair(laplacian_heads="all", dropout=1.0, batch_first=True)
    m.train()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    v = F.linear(x, m.in_proj_weight[2 * E :], m.in_proj_bias[2 * E :])
    for nw in (False, True):
        out, _ = m(x, x, x, need_weights=nw)
        _close(out, m.out_proj(v))  # P dropped entirely, V itself kept
    m.eval()
    assert not torch.allclose(m(x, x, x)[0], m.out_proj(v))


def test_compile_fullgraph():
    torch._dynamo.reset()
    _, m = _pair(dtype=torch.float32, laplacian_heads=[True, False, True, False], batch_first=True)
    x = torch.randn(2, 6, E)
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(
        cm(x, x, x, need_weights=False, is_causal=True)[0],
        m(x, x, x, need_weights=False, is_causal=True)[0],
        atol=1e-5,
        rtol=1e-5,
    )


# ----------------------------------------------------------------------------- errors
def _err(fn, *needles):
    with pytest.raises(ValueError) as ei:
        fn()
    assert isinstance(ei.value, ConfigError)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


def test_errors():
    _err(lambda: MultiheadAttention(E, H, laplacian_heads=5), "5")
    _err(lambda: MultiheadAttention(E, H, laplacian_heads=[9]), "9")
    _err(lambda: MultiheadAttention(E, H, laplacian_heads="some"), "'some'")
    m = MultiheadAttention(E, H, laplacian_heads=1)
    q, kv = torch.randn(6, 2, E), torch.randn(4, 2, E)
    _err(lambda: m(q, kv, kv), "6 positions", "only 4")
    MultiheadAttention(E, H)(q, kv, kv)  # no Laplacian head: Tq > Tk is fine
    x = torch.randn(4, 2, E)
    _err(lambda: m(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool)), "(4, 5)", "(4, 4)")
    _err(lambda: m(x, x, x, attn_mask=torch.zeros(3, 4, 4, dtype=torch.bool)), "(3, 4, 4)", "(8, 4, 4)")
    _err(lambda: m(x, x, x, attn_mask=torch.zeros(1, 1, 4, 4)), "2-D or 3-D")
    _err(lambda: m(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int32)), "torch.int32")
    _err(lambda: m(x, x, x, key_padding_mask=torch.zeros(4, 2, dtype=torch.bool)), "(4, 2)", "(2, 4)")
    _err(lambda: m(torch.randn(4, 2, E + 1), x, x), str(E + 1))
    _err(lambda: m(x, x[:3], x), "key (3, 2, 16)", "value (4, 2, 16)")
    _err(lambda: m(x, torch.randn(4, 2, 3), x), "key (4, 2, 3)", "kdim=16")
    _err(lambda: m(x[0, 0], x, x), "3-D")


def test_autocast_bf16_masks_follow_projected_dtype():
    """Under autocast the projections are bf16; the merged mask must be too (SDPA requires it)."""
    ref, ours = _pair(dtype=torch.float32, batch_first=True)
    x = torch.randn(2, 5, E)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = ref(x, x, x, key_padding_mask=pad)
        b, _ = ours(x, x, x, key_padding_mask=pad)
        lap = MultiheadAttention.from_torch(ref, laplacian_heads=2)
        c, _ = lap(x, x, x, key_padding_mask=pad, need_weights=False)
        d, _ = lap(x, x, x, key_padding_mask=pad, need_weights=True)
    assert b.dtype == a.dtype and c.dtype == torch.bfloat16
    torch.testing.assert_close(b.float(), a.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(c.float(), d.float(), atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------- inside torch's Transformer layers
def _encoder_layer(heads, norm_first=False, seed=0):
    """A torch TransformerEncoderLayer (eval-able, dropout 0) whose self_attn is ours, random biases."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        E, H, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name:
                p.normal_()
    layer.self_attn = MultiheadAttention.from_torch(layer.self_attn, heads)
    return layer


def _encoder_layer_reference(layer, x, pad=None, causal=False):
    """The layer recomputed by hand with the eager reference operator (torch semantics of the masks)."""
    mha = layer.self_attn
    n, t, _ = x.shape
    hd = E // H

    def attn(y):
        qkv = F.linear(y, mha.in_proj_weight, mha.in_proj_bias).view(n, t, 3, H, hd).permute(2, 0, 3, 1, 4)
        keep = torch.ones(n, 1, t, t, dtype=torch.bool)
        if pad is not None:
            keep &= ~pad[:, None, None, :]
        if causal:
            keep &= torch.ones(t, t, dtype=torch.bool).tril()
        out, _ = laplacian_attention_reference(*qkv.unbind(0), laplacian_heads=mha.laplacian_selection, attn_mask=keep)
        return mha.out_proj(out.transpose(1, 2).reshape(n, t, E))

    ff = lambda y: layer.linear2(layer.activation(layer.linear1(y)))  # noqa: E731
    if layer.norm_first:
        x = x + attn(layer.norm1(x))
        return x + ff(layer.norm2(x))
    x = layer.norm1(x + attn(x))
    return layer.norm2(x + ff(x))


def _run_mode(module, mode, *args, **kwargs):
    """Run ``module`` in one of the modes torch may route through its fused inference kernel."""
    if mode == "train":
        module.train()
        return module(*args, **kwargs)
    module.eval()
    if mode == "eval":
        return module(*args, **kwargs)
    if mode == "no_grad":
        with torch.no_grad():
            return module(*args, **kwargs)
    if mode == "inference_mode":
        with torch.inference_mode():
            return module(*args, **kwargs)
    assert mode == "compile_no_grad", mode
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(module, backend="aot_eager")(*args, **kwargs)


MODES = ["train", "eval", "no_grad", "inference_mode", "compile_no_grad"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "both"])
def test_encoder_layer_keeps_laplacian_heads_in_every_mode(mode, masks):
    """torch's fused encoder kernel (eval + no grad) must not replace our attention (issue: ~0.9 off)."""
    layer = _encoder_layer([False, True, False, True])
    x = torch.randn(2, 6, E)
    pad = causal = None
    if masks in ("padding", "both"):
        pad = torch.zeros(2, 6, dtype=torch.bool)
        pad[1, 4:] = True
    if masks in ("causal", "both"):
        causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True = not allowed (torch)
    with torch.no_grad():
        want = _encoder_layer_reference(layer, x, pad, causal is not None)
        plain = _encoder_layer_reference(_encoder_layer(0), x, pad, causal is not None)
    assert (want - plain).abs().max() > 0.1  # the heads matter, so losing them would show
    got = _run_mode(layer, mode, x, src_mask=causal, src_key_padding_mask=pad, is_causal=causal is not None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_encoder_norm_first_every_mode(mode):
    layer = _encoder_layer("all", norm_first=True)
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        want = _encoder_layer_reference(layer, x)
    torch.testing.assert_close(_run_mode(layer, mode, x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_transformer_encoder_with_nested_tensors(mode):
    """TransformerEncoder(enable_nested_tensor=True) packs a padded batch into a nested tensor (eval, no
    grad); the layers then get nested input. Real positions must equal the reference, in every mode."""
    layer = _encoder_layer(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: nested tensors are a prototype
        enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
        assert enc.use_nested_tensor  # torch will take its nested path in eval + no grad
        x = torch.randn(3, 6, E)
        pad = torch.zeros(3, 6, dtype=torch.bool)
        pad[1, 4:] = True
        pad[2, 2:] = True
        with torch.no_grad():
            want = x
            for lay in enc.layers:
                want = _encoder_layer_reference(lay, want, pad)
        got = _run_mode(enc, mode, x, src_key_padding_mask=pad)
    for i, n in enumerate([6, 4, 2]):
        torch.testing.assert_close(got[i, :n], want[i, :n], atol=1e-5, rtol=1e-5)


def test_nested_tensor_input_to_layer_and_module():
    layer = _encoder_layer([True, False, True, False]).eval()
    seqs = [torch.randn(5, E), torch.randn(3, E)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor(seqs)
        with torch.inference_mode():
            out = layer(nt)
        assert out.is_nested
        for o, s in zip(out.unbind(), seqs):
            torch.testing.assert_close(o, _encoder_layer_reference(layer, s[None])[0], atol=1e-5, rtol=1e-5)
        mha = layer.self_attn
        _err(lambda: mha(nt, nt, nt, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)), "no attn_mask")
        _err(lambda: mha(nt, torch.nested.nested_tensor(seqs), nt), "self-attention only")


def test_decoder_layer_keeps_laplacian_heads():
    """TransformerDecoderLayer has no fused path; its self-attention must still be ours in no_grad eval."""
    torch.manual_seed(0)
    dec = torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
    dec.self_attn = MultiheadAttention.from_torch(dec.self_attn, "all")
    x, mem = torch.randn(2, 5, E), torch.randn(2, 7, E)
    with torch.no_grad():
        want = dec.train()(x, mem)
        ref = torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True)
        ref.load_state_dict(dec.state_dict())
        assert (want - ref.eval()(x, mem)).abs().max() > 0.1
        for mode in ("no_grad", "inference_mode"):
            torch.testing.assert_close(_run_mode(dec, mode, x, mem), want)


def test_fast_path_hook_survives_copy_and_pickle():
    import copy
    import pickle

    m = MultiheadAttention(E, H, batch_first=True, laplacian_heads=1)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert list(clone._forward_pre_hooks.values()) == list(m._forward_pre_hooks.values())
        assert len(clone._forward_pre_hooks) == 1


def test_fully_masked_query_is_p_zero_on_both_paths():
    """A sample whose key_padding_mask hides every key: standard heads give 0, Laplacian heads v (before
    out_proj), for need_weights False (fused) and True (reference) alike; no NaN."""
    _, m = _pair(laplacian_heads=[False, True, False, True], batch_first=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True
    v = F.linear(x, m.in_proj_weight[2 * E :], m.in_proj_bias[2 * E :]).view(2, 5, H, E // H)
    heads = torch.tensor([False, True, False, True]).view(1, 1, H, 1)
    want = m.out_proj(torch.where(heads, v, torch.zeros_like(v)).reshape(2, 5, E))[1]
    fused, _ = m(x, x, x, key_padding_mask=pad, need_weights=False)
    eager, w = m(x, x, x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    _close(fused[1], want)
    _close(eager[1], want)
    _close(fused, eager)
    assert not w.isnan().any()
    eye = torch.eye(5, dtype=w.dtype)
    _close(w[1], torch.stack([torch.zeros_like(eye), eye, torch.zeros_like(eye), eye]))  # P = 0, I - P = I
