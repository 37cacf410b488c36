"""The learnable path's fused multiply-add: SDPA, then ``lapheads.epilogue._Mix``, one autograd Function
with a hand-written backward. Outputs and gradients (q, k, v, a, b) are checked against the explicit
operator ``a I + b P`` (``laplacian_attention_reference``), against finite differences (gradcheck,
float64) and against the generic autograd graph (the forward bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lapheads import HeadMix, laplacian_attention, laplacian_attention_reference
from lapheads.epilogue import _Mix


def _case(name: str, dtype=torch.float64):
    """(q, k, v, keyword arguments) for one masking / shape case, small enough for gradcheck."""
    g = torch.Generator().manual_seed(3)
    h, hkv, tq, tk, d, lead = 3, 3, 5, 5, 4, (2,)
    kw: dict = {}
    if name == "causal":
        kw["is_causal"] = True
    elif name == "kv-cache":
        tq, tk = 2, 6
        kw["is_causal"] = True
    elif name == "gqa":
        h, hkv = 4, 2
        kw["enable_gqa"] = True
    elif name == "gqa-kv-cache":
        h, hkv, tq, tk = 4, 2, 3, 5
        kw.update(enable_gqa=True, is_causal=True)
    elif name == "bool-mask":
        m = torch.ones(2, 1, tq, tk, dtype=torch.bool)
        m[0, :, 1] = False  # a query that sees nothing: P = 0, output a * v_self
        m[1, :, :, 0] = False
        kw["attn_mask"] = m
    elif name == "additive-mask":
        m = torch.randn(tq, tk, generator=g, dtype=dtype)
        m[2, :] = float("-inf")
        kw["attn_mask"] = m
    elif name == "two-batch-dims":
        lead = (2, 2)
    elif name == "unbatched-1x1":  # (H, 1, 1): the backward's scratch buffer must not alias a gradient
        lead, tq, tk, d = (), 1, 1, 1
    elif name != "self":
        raise ValueError(name)
    q = torch.randn(*lead, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(*lead, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(*lead, hkv, tk, d, generator=g, dtype=dtype)
    return q, k, v, kw


CASES = [
    "self",
    "causal",
    "kv-cache",
    "gqa",
    "gqa-kv-cache",
    "bool-mask",
    "additive-mask",
    "two-batch-dims",
    "unbatched-1x1",
]


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in ts]


def _mix(h: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(h, generator=g, dtype=dtype), torch.randn(h, generator=g, dtype=dtype)


@pytest.mark.parametrize("case", CASES)
def test_outputs_and_gradients_equal_the_explicit_operator(case):
    q, k, v, kw = _case(case)
    a, b = _mix(q.shape[-3])
    gy = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(7), dtype=q.dtype)
    results = []
    for fn in (laplacian_attention, laplacian_attention_reference):
        ins = _leaves(q, k, v, a, b)
        out = fn(*ins[:3], laplacian_heads=HeadMix(ins[3], ins[4]), **kw)
        out = out[0] if isinstance(out, tuple) else out
        results.append((out, torch.autograd.grad(out, ins, gy)))
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, got, want in zip("qkvab", grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"gradient of {name} ({case})")
    assert out.grad_fn is not None and out.grad_fn.name() == "_MixBackward"  # the fused Function ran


@pytest.mark.parametrize("case", CASES)
def test_gradcheck_float64(case):
    q, k, v, kw = _case(case)
    a, b = _mix(q.shape[-3])

    def fn(q, k, v, a, b):
        return laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b), **kw)

    assert torch.autograd.gradcheck(fn, tuple(_leaves(q, k, v, a, b)))


def test_the_function_alone_passes_gradcheck_and_gradgradcheck():
    """create_graph=True takes the out-of-place branch, so a second derivative exists (SDPA's CPU
    flash kernel has none, hence the Function is checked on its own here)."""
    g = torch.Generator().manual_seed(0)
    out, vs = (torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) for _ in range(2))
    a, b = _mix(3)
    ins = tuple(_leaves(out, vs, a, b))

    def mix(out, vs, a, b):
        return _Mix.apply(out, vs, a, b, None)

    assert torch.autograd.gradcheck(mix, ins)
    assert torch.autograd.gradgradcheck(mix, ins)


@pytest.mark.parametrize("case", ["self", "causal", "kv-cache", "gqa", "bool-mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bit_identical_to_the_generic_graph(case, dtype):
    """The fused Function changes allocations, not the forward: the same bits as
    ``torch.addcmul(out * b, v_self, a)``; its gradients agree with autograd's to the dtype's rounding
    (the gradients of a and b are reduced by a batched matmul, v's is added into SDPA's in place)."""
    q, k, v, kw = _case(case, dtype)
    a, b = _mix(q.shape[-3], dtype)
    gy = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(7), dtype=dtype)
    h, hkv, tq = q.shape[-3], k.shape[-3], q.shape[-2]

    def generic(q, k, v, a, b):
        m = kw.get("attn_mask")
        if kw.get("is_causal"):
            i = torch.arange(tq).unsqueeze(1)
            m = torch.arange(k.shape[-2]).unsqueeze(0) <= i + (k.shape[-2] - tq)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=h != hkv)
        if m is not None:
            out = out.masked_fill(~m.any(-1, keepdim=True), 0.0)
        vs = v[..., v.shape[-2] - tq :, :]
        vs = vs if h == hkv else vs.repeat_interleave(h // hkv, dim=-3)
        return torch.addcmul(out * b.view(h, 1, 1), vs, a.view(h, 1, 1))

    ins_f, ins_g = _leaves(q, k, v, a, b), _leaves(q, k, v, a, b)
    out_f = laplacian_attention(*ins_f[:3], laplacian_heads=HeadMix(ins_f[3], ins_f[4]), **kw)
    out_g = generic(*ins_g)
    assert torch.equal(out_f, out_g)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, x, y in zip("qkvab", torch.autograd.grad(out_f, ins_f, gy), torch.autograd.grad(out_g, ins_g, gy)):
        scale = max(1.0, float(y.abs().max()))
        torch.testing.assert_close(x, y, atol=tol * scale, rtol=tol, msg=f"gradient of {name} ({case}, {dtype})")


@pytest.mark.parametrize("trainable", ["a", "b", "ab", "none", "qkv-frozen"])
def test_only_the_requested_gradients(trainable):
    """needs_input_grad: frozen a or b (or frozen q, k, v) get no gradient; the others match."""
    q, k, v, kw = _case("causal")
    a, b = _mix(q.shape[-3])
    grads = []
    for fn in (laplacian_attention, laplacian_attention_reference):
        qkv = [t.detach().clone().requires_grad_(trainable != "qkv-frozen") for t in (q, k, v)]
        ab = [
            t.detach().clone().requires_grad_(n in trainable or trainable == "qkv-frozen") for n, t in zip("ab", (a, b))
        ]
        out = fn(*qkv, laplacian_heads=HeadMix(*ab), **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        grads.append([t.grad for t in qkv + ab])
    for name, got, want in zip("qkvab", *grads):
        assert (got is None) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_no_grad_path_gives_the_same_output():
    q, k, v, kw = _case("kv-cache")
    a, b = _mix(q.shape[-3])
    with torch.no_grad():
        plain = laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b), **kw)
    assert plain.grad_fn is None
    ins = _leaves(q, k, v, a, b)
    fused = laplacian_attention(*ins[:3], laplacian_heads=HeadMix(ins[3], ins[4]), **kw)
    assert torch.equal(plain, fused.detach())  # the no-grad path and the autograd path: bit for bit
    # ... and both are a_h v_self + b_h P V, computed apart by the explicit operator
    want, _ = laplacian_attention_reference(q, k, v, laplacian_heads=HeadMix(a, b), **kw)
    torch.testing.assert_close(plain, want, atol=1e-10, rtol=0)


def test_half_precision_activations_float32_mixing():
    """bf16 activations with float32 (a, b) (autocast): the gradients of a and b come back in float32."""
    q, k, v, kw = _case("self", torch.bfloat16)
    a, b = (t.float().requires_grad_() for t in _mix(q.shape[-3]))
    out = laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b))
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert a.grad.dtype == b.grad.dtype == torch.float32
    a32, b32 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = laplacian_attention_reference(q.float(), k.float(), v.float(), laplacian_heads=HeadMix(a32, b32))[0]
    ref.square().sum().backward()
    torch.testing.assert_close(a.grad, a32.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(b.grad, b32.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("case", ["kv-cache", "causal"])
def test_torch_compile_fullgraph_matches_eager_gradients(case):
    """Compiled graphs trace SDPA + the plain formula (no graph break): the eager gradients."""
    q, k, v, kw = _case(case, torch.float32)
    a, b = _mix(q.shape[-3], torch.float32)

    def loss(q, k, v, a, b):
        return laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b), **kw).square().sum()

    eager_ins, comp_ins = _leaves(q, k, v, a, b), _leaves(q, k, v, a, b)
    want = torch.autograd.grad(loss(*eager_ins), eager_ins)
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*comp_ins), comp_ins)
    for name, x, y in zip("qkvab", got, want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


@pytest.mark.parametrize("case", ["self", "causal", "kv-cache", "gqa", "bool-mask", "additive-mask", "two-batch-dims"])
def test_every_case_is_sdpa_then_one_mix_heads_node(case):
    q, k, v, kw = _case(case, torch.float32)
    ins = _leaves(q, k, v, *_mix(q.shape[-3], torch.float32))
    out = laplacian_attention(*ins[:3], laplacian_heads=HeadMix(ins[3], ins[4]), **kw)
    assert out.grad_fn.name() == "_MixBackward"
    # dropout too
    q, k, v, _ = _case("self", torch.float32)
    ins = _leaves(q, k, v, *_mix(q.shape[-3], torch.float32))
    out = laplacian_attention(*ins[:3], laplacian_heads=HeadMix(ins[3], ins[4]), dropout_p=0.5)
    assert out.grad_fn.name() == "_MixBackward"


def test_under_autocast_the_learnable_path_computes_as_sdpa_does():
    """Under autocast SDPA runs in bfloat16; the mixing then runs in (a, b)'s float32, as the same
    two ops written out would."""
    q, k, v, _ = _case("self", torch.float32)
    a, b = _mix(q.shape[-3], torch.float32)
    ins = _leaves(q, k, v, a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = laplacian_attention(*ins[:3], laplacian_heads=HeadMix(ins[3], ins[4]))
        pv = F.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name() == "_MixBackward" and pv.dtype == torch.bfloat16  # SDPA ran in bfloat16
    want = b.view(-1, 1, 1) * pv + a.view(-1, 1, 1) * v  # the mixing itself in (a, b)'s float32
    assert out.dtype == want.dtype
    torch.testing.assert_close(out.detach(), want, atol=1e-6, rtol=1e-6)  # float32 SDPA would be ~1e-2 away


def test_double_backward_fails_as_sdpa_does():
    """SDPA's CPU flash backward has no derivative; create_graph=True through it fails the same
    way with or without the mixing, never with a silently wrong second derivative."""
    q, k, v, _ = _case("self", torch.float32)
    errors = []
    for fn in (
        lambda *t: F.scaled_dot_product_attention(*t[:3]),
        lambda *t: laplacian_attention(*t[:3], laplacian_heads=HeadMix(t[3], t[4])),
    ):
        ins = _leaves(q, k, v, *_mix(q.shape[-3], torch.float32))
        (gq,) = torch.autograd.grad(fn(*ins).square().sum(), ins[0], create_graph=True)
        with pytest.raises(RuntimeError) as err:
            torch.autograd.grad(gq.sum(), ins[0])
        errors.append(str(err.value))
    assert "not implemented" in errors[0] and "not implemented" in errors[1], errors
