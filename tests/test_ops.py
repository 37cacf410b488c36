"""The fused operator against its eager twin, and the properties the paper states for it (docs/method.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lapheads import ConfigError, laplacian_attention, laplacian_attention_reference
from lapheads.ops import causal_lower_right_mask

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _qkv(b, h, tq, tk, d, hkv=None, dtype=torch.float64, dv=None, requires_grad=False):
    hkv = hkv or h
    q = torch.randn(b, h, tq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, hkv, tk, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, hkv, tk, dv or d, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def _both(q, k, v, **kw):
    out = laplacian_attention(q, k, v, **kw)
    ref, op = laplacian_attention_reference(
        q.double(), k.double(), v.double(), **{**kw, "attn_mask": _dbl(kw.get("attn_mask"))}
    )
    return out, ref, op


def _dbl(m):
    return m.double() if m is not None and m.is_floating_point() else m


# ----------------------------------------------------------------------------- fused == reference
@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 4),
    tq=st.integers(1, 9),
    extra=st.integers(0, 5),
    d=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    data=st.data(),
)
def test_fused_matches_reference_random_shapes(b, h, tq, extra, d, causal, dtype, data):
    tk = tq + extra
    heads = data.draw(st.lists(st.booleans(), min_size=h, max_size=h))
    q, k, v = _qkv(b, h, tq, tk, d, dtype=dtype)
    out, ref, op = _both(q, k, v, laplacian_heads=heads, is_causal=causal)
    assert out.shape == (b, h, tq, d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the returned operator is what was applied to V
    torch.testing.assert_close(op @ v.double(), ref)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_matches_float64_reference(causal):
    q, k, v = _qkv(2, 4, 16, 16, 32, dtype=torch.bfloat16)
    out, ref, _ = _both(q, k, v, laplacian_heads=[False, True, False, True], is_causal=causal)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_laplacian_head_is_v_minus_sdpa_and_standard_head_is_sdpa():
    q, k, v = _qkv(2, 4, 7, 7, 8)
    heads = torch.tensor([True, False, False, True])
    out = laplacian_attention(q, k, v, laplacian_heads=heads)
    sd = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out[:, heads], v[:, heads] - sd[:, heads], atol=0, rtol=0)
    torch.testing.assert_close(out[:, ~heads], sd[:, ~heads], atol=0, rtol=0)


@pytest.mark.parametrize(
    "spec,expected",
    [
        (2, [False, False, True, True]),
        ("all", [True] * 4),
        ("none", [False] * 4),
        ([0, 2], [True, False, True, False]),
    ],
)
def test_head_specs_select_the_right_heads(spec, expected):
    q, k, v = _qkv(1, 4, 5, 5, 4)
    out = laplacian_attention(q, k, v, laplacian_heads=spec)
    sd = F.scaled_dot_product_attention(q, k, v)
    lap = torch.tensor(expected)
    torch.testing.assert_close(out[:, lap], (v - sd)[:, lap])
    torch.testing.assert_close(out[:, ~lap], sd[:, ~lap])


def test_operator_rows():
    """Rows of P sum to 1, rows of I - P sum to 0; the identity sits at the query's own key."""
    q, k, v = _qkv(1, 2, 4, 6, 4)
    _, op = laplacian_attention_reference(q, k, v, laplacian_heads=[1])
    torch.testing.assert_close(op[:, 0].sum(-1), torch.ones(1, 4, dtype=op.dtype))
    torch.testing.assert_close(op[:, 1].sum(-1), torch.zeros(1, 4, dtype=op.dtype))
    diag = torch.stack([op[0, 1, i, 2 + i] for i in range(4)])
    assert bool((diag > 0).all())  # 1 - p_ii > 0 on the lower-right diagonal
    off = op[0, 1].clone()
    for i in range(4):
        off[i, 2 + i] = 0
    assert bool((off <= 0).all())  # -p_ij elsewhere


# ----------------------------------------------------------------------------- causal, padding, GQA, cache
def test_causal_token0_of_laplacian_head_is_exactly_zero():
    q, k, v = _qkv(2, 3, 10, 10, 16, dtype=torch.float32)
    out = laplacian_attention(q, k, v, laplacian_heads=[True, False, True], is_causal=True)
    assert torch.equal(out[:, [0, 2], 0], torch.zeros_like(out[:, [0, 2], 0]))
    assert out[:, 1, 0].abs().sum() > 0  # the standard head passes v_0 through
    assert out[:, [0, 2], 1:].abs().amin(dim=-1).sum() > 0


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_padding_masks(kind):
    b, h, t, d = 3, 4, 8, 8
    q, k, v = _qkv(b, h, t, t, d)
    lengths = torch.tensor([8, 5, 2])
    keep = torch.arange(t)[None, :] < lengths[:, None]  # (B, Tk), True = real token
    m = keep[:, None, None, :]
    if kind == "additive":
        m = torch.zeros(m.shape, dtype=q.dtype).masked_fill(~m, float("-inf"))
    heads = [False, True, True, False]
    out, ref, op = _both(q, k, v, laplacian_heads=heads, attn_mask=m)
    torch.testing.assert_close(out, ref)
    # padded keys get zero weight in P; the result of real queries must not depend on them
    k2, v2 = k.clone(), v.clone()
    for i in range(b):
        L = int(lengths[i])
        assert torch.equal(op[i, 0, :, L:], torch.zeros_like(op[i, 0, :, L:]))
        k2[i, :, L:] += 100.0
        v2[i, :, L:] -= 7.0
    out2 = laplacian_attention(q, k2, v2, laplacian_heads=heads, attn_mask=m)
    for i in range(b):
        L = int(lengths[i])
        torch.testing.assert_close(out2[i, :, :L], out[i, :, :L])


def test_causal_combined_with_padding_mask():
    q, k, v = _qkv(2, 2, 6, 6, 4)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    out, ref, _ = _both(q, k, v, laplacian_heads=[1], attn_mask=keep, is_causal=True)
    torch.testing.assert_close(out, ref)
    add = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    out2 = laplacian_attention(q, k, v, laplacian_heads=[1], attn_mask=add, is_causal=True)
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize("causal", [False, True])
def test_gqa(causal):
    h, hkv = 6, 2
    q, k, v = _qkv(2, h, 5, 7, 4, hkv=hkv)
    heads = [True, False, False, True, True, False]
    out, ref, _ = _both(q, k, v, laplacian_heads=heads, enable_gqa=True, is_causal=causal)
    torch.testing.assert_close(out, ref)
    # the same as repeating the KV heads first, then subtracting per query head
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    torch.testing.assert_close(out, laplacian_attention(q, kr, vr, laplacian_heads=heads, is_causal=causal))


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_kv_cache_chunk_equals_full_causal_pass(chunk):
    t = 8
    q, k, v = _qkv(2, 4, t, t, 8, hkv=2)
    heads = [False, True, True, True]
    full = laplacian_attention(q, k, v, laplacian_heads=heads, is_causal=True, enable_gqa=True)
    part = laplacian_attention(q[:, :, t - chunk :], k, v, laplacian_heads=heads, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(part, full[:, :, t - chunk :])
    ref, _ = laplacian_attention_reference(
        q[:, :, t - chunk :], k, v, laplacian_heads=heads, is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(part, ref)


def test_causal_lower_right_mask():
    m = causal_lower_right_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_no_laplacian_head_with_more_queries_than_keys_is_plain_sdpa():
    q, k, v = _qkv(1, 2, 6, 3, 4)
    out = laplacian_attention(q, k, v, laplacian_heads="none")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


# ----------------------------------------------------------------------------- gradients, compile
def test_gradcheck_float64():
    q, k, v = _qkv(1, 3, 4, 5, 3, requires_grad=True)
    keep = torch.ones(1, 1, 4, 5, dtype=torch.bool)
    keep[..., 0] = False

    def f(q, k, v):
        return laplacian_attention(q, k, v, laplacian_heads=[True, False, True], attn_mask=keep)

    assert torch.autograd.gradcheck(f, (q, k, v))

    def g(q, k, v):
        return laplacian_attention(q, k, v, laplacian_heads="all", is_causal=True)

    assert torch.autograd.gradcheck(g, (q, k, v))


def test_gradients_match_reference():
    q, k, v = _qkv(2, 4, 6, 6, 4, hkv=2, requires_grad=True)
    heads = [True, False, True, True]
    g = torch.randn(2, 4, 6, 4, dtype=torch.float64)
    out = laplacian_attention(q, k, v, laplacian_heads=heads, is_causal=True, enable_gqa=True)
    ga = torch.autograd.grad(out, (q, k, v), g)
    ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=heads, is_causal=True, enable_gqa=True)
    gb = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=4):
        super().__init__()
        self.h = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        y = laplacian_attention(q, k, v, laplacian_heads=[False, True, False, True], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    m = _TinyAttention()
    x = torch.randn(2, 9, 16)
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = cm(x)
    torch.testing.assert_close(y, m(x), atol=1e-6, rtol=1e-5)
    y.sum().backward()
    g_compiled = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).sum().backward()
    for a, p in zip(g_compiled, m.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- dropout
def test_dropout_acts_on_p_only_same_rng():
    """With the same RNG state, a Laplacian head with dropout equals v - dropout-SDPA exactly."""
    q, k, v = _qkv(2, 3, 6, 6, 4)
    torch.manual_seed(123)
    out = laplacian_attention(q, k, v, laplacian_heads="all", dropout_p=0.5)
    torch.manual_seed(123)
    sd = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(sd, F.scaled_dot_product_attention(q, k, v))  # dropout did act
    torch.testing.assert_close(out, v - sd)


def test_dropout_everything_leaves_the_identity():
    q, k, v = _qkv(1, 2, 5, 5, 4)
    out = laplacian_attention(q, k, v, laplacian_heads=[1], dropout_p=1.0)
    torch.testing.assert_close(out[:, 1], v[:, 1])  # identity term kept
    torch.testing.assert_close(out[:, 0], torch.zeros_like(out[:, 0]))  # P V fully dropped
    _, op = laplacian_attention_reference(q, k, v, laplacian_heads=[1], dropout_p=1.0)
    torch.testing.assert_close(op[0, 1], torch.eye(5, dtype=op.dtype))


def test_dropout_expectation_is_the_operator():
    """Dropout is rescaled, so E[out] = (I - P) V; the identity term has no variance."""
    n = 4000
    q1, k1, v1 = _qkv(1, 1, 4, 4, 3)
    q, k, v = (x.expand(n, -1, -1, -1) for x in (q1, k1, v1))
    out = laplacian_attention(q, k, v, laplacian_heads="all", dropout_p=0.3)
    expected = laplacian_attention(q1, k1, v1, laplacian_heads="all")[0]
    torch.testing.assert_close(out.mean(0), expected, atol=0.06, rtol=0)
    assert out.std(0).max() > 0.05  # it is random


# ----------------------------------------------------------------------------- validation errors
def _err(fn, *needles):
    with pytest.raises(ValueError) as ei:
        fn()
    assert isinstance(ei.value, ConfigError)
    for n in needles:
        assert n in str(ei.value), str(ei.value)


@pytest.mark.parametrize("fn", [laplacian_attention, laplacian_attention_reference])
def test_validation_errors(fn):
    q, k, v = _qkv(1, 4, 6, 4, 8)
    _err(lambda: fn(q, k, v, laplacian_heads=1), "Tq=6", "Tk=4")
    q, k, v = _qkv(1, 4, 4, 4, 8)
    _err(lambda: fn(q, k, v, laplacian_heads=[4]), "4", "0..3")
    _err(lambda: fn(q, k, v, laplacian_heads=5), "5")
    _err(lambda: fn(q, k, v, laplacian_heads=torch.ones(3, dtype=torch.bool)), "(3,)")
    _err(lambda: fn(q, k, v, laplacian_heads=1, attn_mask=torch.ones(1, 4, 4, 5, dtype=torch.bool)), "(1, 4, 4, 5)")
    _err(lambda: fn(q, k, v, laplacian_heads=1, attn_mask=torch.ones(2, 1, 4, 4, dtype=torch.bool)), "(2, 1, 4, 4)")
    _err(lambda: fn(q, k, v, laplacian_heads=1, attn_mask=torch.ones(4, 4, dtype=torch.int64)), "torch.int64")
    qg, kg, vg = _qkv(1, 4, 4, 4, 8, hkv=2)
    _err(lambda: fn(qg, kg, vg, laplacian_heads=1), "enable_gqa")
    qg, kg, vg = _qkv(1, 4, 4, 4, 8, hkv=3)
    _err(lambda: fn(qg, kg, vg, laplacian_heads=1, enable_gqa=True), "(4)", "(3)")
    _err(lambda: fn(q, k[:, :2], v, laplacian_heads=1, enable_gqa=True), "v has 4")
    _err(lambda: fn(q, k, v[:, :, :3], laplacian_heads=1), "v has 3")
    _err(lambda: fn(q[0], k, v, laplacian_heads=1), "same rank")


# ----------------------------------------------------------------------------- edge cases (one meaning on both paths)
def _dead_row_mask(kind, b, tq, tk, dtype):
    """Keys hidden per query row; row 1 of batch 0 hides every key."""
    keep = torch.rand(b, 1, tq, tk) > 0.4
    keep[..., -tq:].diagonal(dim1=-2, dim2=-1).fill_(True)  # every other query sees its own key
    keep[0, :, 1, :] = False
    if kind == "bool":
        return keep
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fully_masked_row_is_p_zero_on_both_paths(kind, dtype):
    """P = 0 on a row that sees no key: standard heads output 0, Laplacian heads v_self; no NaN anywhere."""
    q, k, v = _qkv(2, 4, 5, 7, 8, hkv=2, dtype=dtype)
    heads = [False, True, False, True]
    m = _dead_row_mask(kind, 2, 5, 7, dtype)
    out = laplacian_attention(q, k, v, laplacian_heads=heads, attn_mask=m, enable_gqa=True)
    ref, op = laplacian_attention_reference(q, k, v, laplacian_heads=heads, attn_mask=m, enable_gqa=True)
    assert not out.isnan().any() and not ref.isnan().any() and not op.isnan().any()
    v_self = v[0, :, 7 - 5 + 1].repeat_interleave(2, dim=0)  # query 1's own value, per query head
    for o in (out, ref):
        assert torch.equal(o[0, [0, 2], 1], torch.zeros_like(o[0, [0, 2], 1]))
        torch.testing.assert_close(o[0, [1, 3], 1], v_self[[1, 3]], atol=0, rtol=0)
    assert torch.equal(op[0, [0, 2], 1], torch.zeros_like(op[0, [0, 2], 1]))  # P = 0
    torch.testing.assert_close(out.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


def test_fully_masked_rows_with_causal_and_no_laplacian_head():
    """tq > tk with lower-right causality leaves the first queries without keys: P = 0 there too."""
    q, k, v = _qkv(1, 2, 5, 3, 4)
    out = laplacian_attention(q, k, v, laplacian_heads="none", is_causal=True)
    ref, op = laplacian_attention_reference(q, k, v, laplacian_heads="none", is_causal=True)
    assert torch.equal(out[..., :2, :], torch.zeros_like(out[..., :2, :]))
    assert torch.equal(op[..., :2, :], torch.zeros_like(op[..., :2, :]))
    torch.testing.assert_close(out, ref)


def test_fully_masked_row_gradients_are_finite_and_agree():
    q, k, v = _qkv(2, 4, 5, 5, 4, requires_grad=True)
    m = _dead_row_mask("bool", 2, 5, 5, q.dtype)
    heads = [True, False, True, False]
    g = torch.randn(2, 4, 5, 4, dtype=torch.float64)
    ga = torch.autograd.grad(laplacian_attention(q, k, v, laplacian_heads=heads, attn_mask=m), (q, k, v), g)
    ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=heads, attn_mask=m)
    gb = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ga, gb):
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


def test_fp16_large_logits_reference_is_finite_and_matches_fused():
    """Logits beyond float16's range: the reference (float32 softmax) must not give NaN."""
    q, k, v = _qkv(1, 4, 6, 6, 16, dtype=torch.float32)
    q, k, v = (q * 150).half(), (k * 150).half(), v.half()
    assert ((q.float() @ k.float().transpose(-1, -2)).abs() > 65504).any()  # the fp16 product overflows
    heads = [False, True, True, False]
    out = laplacian_attention(q, k, v, laplacian_heads=heads, is_causal=True)
    ref, op = laplacian_attention_reference(q, k, v, laplacian_heads=heads, is_causal=True)
    assert ref.dtype == op.dtype == torch.float16
    assert torch.isfinite(ref).all() and torch.isfinite(op).all()
    exact, _ = laplacian_attention_reference(q.double(), k.double(), v.double(), laplacian_heads=heads, is_causal=True)
    torch.testing.assert_close(ref.double(), exact, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), exact, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("fn", [laplacian_attention, laplacian_attention_reference])
def test_scale_dropout_and_mask_dtype_are_validated(fn):
    q, k, v = _qkv(1, 4, 4, 4, 8, dtype=torch.float32)
    for bad in (float("nan"), float("inf"), -1.0, "0.5", True):
        _err(lambda bad=bad: fn(q, k, v, laplacian_heads=1, scale=bad), f"scale={bad!r}")
    for bad in (-0.1, 1.5, float("nan"), None):
        _err(lambda bad=bad: fn(q, k, v, laplacian_heads=1, dropout_p=bad), f"dropout_p={bad!r}", "[0, 1]")
    _err(
        lambda: fn(q, k, v, laplacian_heads=1, attn_mask=torch.zeros(4, 4, dtype=torch.float64)),
        "torch.float64",
        "torch.float32",
    )
    # what stays accepted: scale 0 (uniform attention), ints, dropout 0 and 1
    fn(q, k, v, laplacian_heads=1, scale=0, dropout_p=1)
    fn(q, k, v, laplacian_heads=1, scale=0.25, dropout_p=0.0, attn_mask=torch.zeros(4, 4))


def test_transformers_eager_function_casts_its_float_mask_under_autocast():
    """transformers' eager_mask has the embeddings' dtype (float32) while autocast makes q bf16; the
    registered eager function hands the operator a mask in q's dtype instead of tripping the check."""
    import types

    import lapheads.transformers as lt

    config = types.SimpleNamespace(laplacian_heads=1, num_hidden_layers=1, num_attention_heads=2)
    module = types.SimpleNamespace(config=config, layer_idx=0, is_causal=True)
    q, k, v = _qkv(1, 2, 4, 4, 8, dtype=torch.bfloat16)
    keep = causal_lower_right_mask(4, 4)[None, None]
    mask32 = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    out, op = lt.laplacian_eager_attention_forward(module, q, k, v, mask32, scaling=8**-0.5)
    assert out.dtype == torch.bfloat16
    ref, _ = laplacian_attention_reference(q, k, v, laplacian_heads=[False, True], is_causal=True)
    torch.testing.assert_close(out.transpose(1, 2), ref, atol=3e-2, rtol=3e-2)
