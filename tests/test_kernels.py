"""The learnable path's compiled CPU node (``src/lapheads/csrc/flash_mix.cpp``, ``lapheads.kernels``).

Where SDPA would run its CPU flash kernel, ``laplacian_attention(..., laplacian_heads=HeadMix(a, b))``
runs one C++ autograd node (``lapheads::flash_mix``) when it is built. It computes the operator two
ways: float32 up to T = 1024 with its own attention kernel and the mixing inside ("fused"), anything
else with SDPA's flash kernel and fused mixing passes ("flash"). Both are checked here against the
explicit operator ``a I + b P`` (outputs, first and second derivatives), finite differences, the
Python node they stand in for, odd memory layouts, thread counts, NaN inputs, tracing, and a model's
training step; the fused kernel's vectorised exp on every width the build has; and the node's
loading, switching off, broken builds and build errors. ``make setup`` builds it (``lapheads kernels
build``); the tests of the node itself need that build and say so when skipped, and the first test
fails outright on a machine that has the tool chain but no build.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lapheads import HeadMix, kernels, laplacian_attention, laplacian_attention_reference
from lapheads.errors import ConfigError

NODE = "torch::autograd::CppNode<lapheads::FlashMix>"
PY_NODE = "_FlashMixBackward"

needs_build = pytest.mark.skipif(not kernels.library_path().is_file(),
                                 reason="the CPU kernel is not built (`lapheads kernels build`, run by `make setup`)")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    monkeypatch.delenv("LAPHEADS_KERNELS", raising=False)


def test_the_kernel_is_built_and_loads_wherever_a_tool_chain_exists():
    problem = kernels.toolchain_problem()
    if problem:
        pytest.skip(f"{problem}: the learnable path runs its Python node")
    st = kernels.status()
    assert st["built"] and st["loaded"] and st["error"] is None, st
    if torch.backends.mkl.is_available() and len(torch.ops.lapheads.exp_widths()) > 1:
        assert st["float32"] == "fused", st  # torch's sgemm is MKL's and the exp is vectorised: it must run


def _fused() -> bool:
    return kernels.library_path().is_file() and kernels.flash_mix_op() is not None and kernels.float32_path() == "fused"


needs_fused = pytest.mark.skipif(not _fused(), reason="the float32 kernel needs the build, AVX2 and torch's sgemm")


def _inputs(b=2, h=3, t=9, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g, dtype=dtype) for _ in range(3))
    a, bb = torch.randn(h, generator=g, dtype=dtype), torch.randn(h, generator=g, dtype=dtype)
    gy = torch.randn(b, h, t, d, generator=g, dtype=dtype)
    return [q, k, v, a, bb], gy


def _run(ins, gy, wants="qkvab", **kw):
    leaves = [t.detach().clone().requires_grad_(n in wants) for n, t in zip("qkvab", ins)]
    out = laplacian_attention(*leaves[:3], laplacian_heads=HeadMix(leaves[3], leaves[4]), **kw)
    node = out.grad_fn.name()
    out.backward(gy)
    return out.detach(), [t.grad for t in leaves], node


def _reference(ins, gy, wants="qkvab", **kw):
    leaves = [t.detach().clone().requires_grad_(n in wants) for n, t in zip("qkvab", ins)]
    out, _ = laplacian_attention_reference(*leaves[:3], laplacian_heads=HeadMix(leaves[3], leaves[4]), **kw)
    out.backward(gy)
    return out.detach(), [t.grad for t in leaves]


@needs_build
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("wants", ["qkvab", "ab", "qkv", "v", "a"])
def test_outputs_and_gradients_equal_the_explicit_operator(causal, wants):
    ins, gy = _inputs()
    out, grads, node = _run(ins, gy, wants, is_causal=causal)
    assert node == NODE
    ref, ref_grads = _reference(ins, gy, wants, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, got, want in zip("qkvab", grads, ref_grads):
        assert (got is None) == (name not in wants) == (want is None), name
        if got is not None:
            torch.testing.assert_close(got, want, atol=1e-10, rtol=0, msg=f"gradient of {name}")


@needs_build
def test_gradcheck_against_finite_differences():
    ins, _ = _inputs(b=1, h=2, t=5, d=3, seed=1)
    leaves = tuple(t.clone().requires_grad_() for t in ins)

    def fn(q, k, v, a, b):
        return laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b), is_causal=True)

    assert fn(*leaves).grad_fn.name() == NODE
    assert torch.autograd.gradcheck(fn, leaves)


@needs_build
def test_second_derivatives_through_the_mixing_equal_the_reference():
    """create_graph=True: the node's backward is built from differentiable ops, so d(grad a)/d b and
    d(grad b)/d a (which need no second derivative of SDPA's kernel) match the explicit operator."""
    ins, _ = _inputs(b=1, h=2, t=6, d=4, seed=2)
    results = []
    for fn in (laplacian_attention, lambda *t, **kw: laplacian_attention_reference(*t, **kw)[0]):
        q, k, v = ins[:3]
        a, b = (t.clone().requires_grad_() for t in ins[3:])
        loss = fn(q, k, v, laplacian_heads=HeadMix(a, b)).square().sum()
        ga, gb = torch.autograd.grad(loss, (a, b), create_graph=True)
        results.append((ga, gb, torch.autograd.grad(ga.sum() + 2 * gb.sum(), (a, b))))
    (ga, gb, second), (ra, rb, rsecond) = results
    torch.testing.assert_close(ga.detach(), ra.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(gb.detach(), rb.detach(), atol=1e-10, rtol=0)
    for got, want in zip(second, rsecond):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@needs_build
def test_double_backward_through_sdpa_fails_as_sdpa_does():
    ins, _ = _inputs(dtype=torch.float32)
    errors = []
    for fn in (lambda *t: F.scaled_dot_product_attention(*t[:3]),
               lambda *t: laplacian_attention(*t[:3], laplacian_heads=HeadMix(t[3], t[4]))):
        leaves = [t.clone().requires_grad_() for t in ins]
        (gq,) = torch.autograd.grad(fn(*leaves).square().sum(), leaves[0], create_graph=True)
        with pytest.raises(RuntimeError) as err:
            torch.autograd.grad(gq.sum(), leaves[0])
        errors.append(str(err.value))
    assert "not implemented" in errors[0] and "not implemented" in errors[1], errors


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_agrees_with_the_python_node(dtype, causal, monkeypatch):
    """Same kernels, the mixing fused: the same results to rounding (one fused multiply-add per element,
    sums in a different order), in float32 and in half precision (computed in float32 inside)."""
    ins, gy = _inputs(b=2, h=4, t=40, d=16, dtype=dtype, seed=3)
    out, grads, node = _run(ins, gy, is_causal=causal)
    monkeypatch.setattr(kernels, "flash_mix_op", lambda: None)
    out_py, grads_py, node_py = _run(ins, gy, is_causal=causal)
    assert (node, node_py) == (NODE, PY_NODE)
    tol = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2),
           torch.float16: dict(atol=5e-3, rtol=5e-3)}[dtype]
    torch.testing.assert_close(out, out_py, **tol)
    for name, got, want in zip("qkvab", grads, grads_py):
        scale = want.abs().max().item() if name in "ab" else 1.0  # a, b: sums over 2 x 40 x 16 products
        torch.testing.assert_close(got / scale, want / scale, **tol, msg=f"gradient of {name}")


@needs_build
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_odd_layouts_of_inputs_and_incoming_gradient(dtype):
    """q, k, v as views of a packed projection (rows not contiguous, as in a timm or nn attention
    layer) and the incoming gradient of ``out.sum()`` (an expanded tensor with zero strides), on the
    flash path (float64) and the fused kernel (float32, against the float64 operator). A v whose last
    dim is strided is not SDPA's flash case: the general path runs, and the operator refuses it."""
    g = torch.Generator().manual_seed(4)
    b, h, t, d = 2, 3, 7, 4
    qkv = torch.randn(b, t, 3, h, d, generator=g, dtype=torch.float64)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    a, bb = torch.randn(h, generator=g, dtype=torch.float64), torch.randn(h, generator=g, dtype=torch.float64)
    leaves = [x.detach().to(dtype).requires_grad_() for x in (qkv, a, bb)]
    lq, lk, lv = leaves[0].permute(2, 0, 3, 1, 4).unbind(0)
    assert lq.stride(-1) == 1 and not lq.is_contiguous()
    want_path = "fused" if dtype == torch.float32 and _fused() else "flash"
    assert torch.ops.lapheads.flash_mix_path(lq, lk, lv) == want_path
    out = laplacian_attention(lq, lk, lv, laplacian_heads=HeadMix(leaves[1], leaves[2]))
    assert out.grad_fn.name() == NODE
    out.sum().backward()
    ref, ref_grads = _reference([q, k, v, a, bb], torch.ones(out.shape, dtype=torch.float64))
    tol = dict(atol=1e-12, rtol=0) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.detach().double(), ref, **tol)
    want_qkv = torch.stack(ref_grads[:3]).permute(1, 3, 0, 2, 4)  # (3, B, H, T, D) -> (B, T, 3, H, D)
    tol = dict(atol=1e-10, rtol=0) if dtype == torch.float64 else dict(atol=1e-4, rtol=2e-5)
    torch.testing.assert_close(leaves[0].grad.double(), want_qkv, **tol)
    for x, want in zip(leaves[1:], ref_grads[3:]):
        torch.testing.assert_close(x.grad.double(), want, **tol)
    if dtype == torch.float32:
        return
    v_strided = torch.randn(b, h, d, t, generator=g, dtype=torch.float64).transpose(-1, -2)
    ins = [q.contiguous(), k.contiguous(), v_strided, a, bb]
    got, _, node = _run(ins, torch.ones(b, h, t, d, dtype=torch.float64))
    assert node == "_MixHeadsBackward"
    torch.testing.assert_close(got, _reference(ins, torch.ones(b, h, t, d, dtype=torch.float64))[0])
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        kernels.flash_mix_op()(*ins, False, None)


@needs_build
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mixing_results_do_not_depend_on_the_thread_count(dtype):
    """Work is split between threads (per head and block of rows in the float32 kernel, per chunk of
    rows in the flash path's passes); the per-head sums are added in row order afterwards and no block
    size depends on the thread count, so the output and a, b's gradients are the same bits on 1 and 2
    threads (and q, k, v's too in the float32 kernel, where each head's are one thread's work)."""
    ins, gy = _inputs(b=1, h=4, t=256, d=64, dtype=dtype, seed=5)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(_run(ins, gy))
    finally:
        torch.set_num_threads(threads)
    (out1, g1, _), (out2, g2, _) = runs
    assert torch.equal(out1, out2)
    assert torch.equal(g1[3], g2[3]) and torch.equal(g1[4], g2[4])
    fused = dtype == torch.float32 and _fused()
    for x, y in zip(g1[:3], g2[:3]):  # SDPA's own backward may split its sums by thread
        assert torch.equal(x, y) if fused else torch.allclose(x, y)


def _relative_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """|got - want| <= tol * max(max|want|, 0.1) (float32 against the float64 operator: rounding relative to the
    scale; the floor for gradients that vanish, such as q's when every key is the same)."""
    scale = max(want.abs().max().item(), 0.1)
    err = (got.double() - want).abs().max().item() / scale
    assert err <= tol, f"{what}: max error {err:.2e} of the largest value (allowed {tol:.0e})"


@needs_fused
@pytest.mark.parametrize("shape", [(2, 3, 9, 8), (1, 2, 300, 33), (1, 1, 600, 16), (3, 1, 70, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_float32_kernel_equals_the_explicit_operator(shape, causal, scale):
    """The fused float32 kernel against the float64 operator on the same (float32) inputs: one block and
    several with a short last one (blocks of 64 rows for T = 70 and 600, where fewer than 4 blocks of 256
    would be left; of 256 for T = 300), odd head dims, causal, an explicit scale."""
    b, h, t, d = shape
    ins, gy = _inputs(b, h, t, d, dtype=torch.float32, seed=t + d)
    assert torch.ops.lapheads.flash_mix_path(*ins[:3]) == "fused"
    out, grads, node = _run(ins, gy, is_causal=causal, scale=scale)
    assert node == NODE
    ref, ref_grads = _reference([x.double() for x in ins], gy.double(), is_causal=causal, scale=scale)
    _relative_close(out, ref, 2e-6, "output")
    for name, got, want in zip("qkvab", grads, ref_grads):
        _relative_close(got, want, 2e-5, f"gradient of {name}")


@needs_fused
@pytest.mark.parametrize("wants", ["ab", "qkv", "v", "a", "qb"])
def test_float32_kernel_computes_only_the_gradients_wanted(wants):
    ins, gy = _inputs(1, 2, 300, 33, dtype=torch.float32, seed=11)
    _, grads, node = _run(ins, gy, wants, is_causal=True)
    _, ref_grads = _reference([x.double() for x in ins], gy.double(), wants, is_causal=True)
    assert node == NODE
    for name, got, want in zip("qkvab", grads, ref_grads):
        assert (got is None) == (name not in wants) == (want is None), name
        if got is not None:
            _relative_close(got, want, 2e-5, f"gradient of {name}")


@needs_fused
def test_float32_long_sequences_take_the_flash_path():
    ins, gy = _inputs(1, 1, 1025, 4, dtype=torch.float32, seed=12)
    assert torch.ops.lapheads.flash_mix_path(*ins[:3]) == "flash"
    assert torch.ops.lapheads.flash_mix_path(*(x[:, :, :1024] for x in ins[:3])) == "fused"
    out, grads, node = _run(ins, gy, is_causal=True)
    ref, ref_grads = _reference([x.double() for x in ins], gy.double(), is_causal=True)
    assert node == NODE
    _relative_close(out, ref, 2e-6, "output")
    for name, got, want in zip("qkvab", grads, ref_grads):
        _relative_close(got, want, 2e-5, f"gradient of {name}")


@needs_fused
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("layout", ["expanded", "overlapping"])
def test_float32_rows_that_are_not_blas_matrices_take_the_flash_path(which, layout):
    """q, k or v expanded along T (row stride 0) or with rows overlapping (row stride 2 < D = 4): BLAS
    refuses a leading dimension below the row length, and MKL then writes NO result, only a message. Such
    inputs take the flash way; outputs and gradients (through the view, into its base) stay exact."""
    ins, gy = _inputs(1, 2, 6, 4, dtype=torch.float32, seed=14)
    i = "qkv".index(which)
    g = torch.Generator().manual_seed(15)
    base = torch.randn(1, 2, 1, 4, generator=g) if layout == "expanded" else torch.randn(48, generator=g)

    def view(t: torch.Tensor) -> torch.Tensor:
        return t.expand(1, 2, 6, 4) if layout == "expanded" else t.as_strided((1, 2, 6, 4), (24, 12, 2, 1))

    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.detach().to(dtype).requires_grad_() for t in [*ins, base]]
        args = leaves[:3]
        args[i] = view(leaves[5])
        assert args[i].stride(2) < 4
        mix = HeadMix(leaves[3], leaves[4])
        if dtype == torch.float32:
            assert torch.ops.lapheads.flash_mix_path(*args) == "flash"
            out = laplacian_attention(*args, laplacian_heads=mix)
            assert out.grad_fn.name() == NODE
        else:
            out = laplacian_attention_reference(*args, laplacian_heads=mix)[0]
        out.backward(gy.to(dtype))
        results.append((out.detach(), [t.grad for j, t in enumerate(leaves) if j != i]))
    (out, grads), (ref, ref_grads) = results
    _relative_close(out, ref, 2e-6, "output")
    for name, got, want in zip([n for n in "qkvab" if n != which] + [f"base of {which}"], grads, ref_grads):
        _relative_close(got, want, 2e-5, f"gradient of {name}")


@needs_fused
@pytest.mark.parametrize("where", ["q", "k"])
def test_float32_kernel_keeps_nan_where_sdpa_does(where):
    """A NaN in one query (that row) or one key (every row that sees it) makes the same outputs NaN as
    SDPA's: the kernel's max and exp must not skip it."""
    ins, _ = _inputs(1, 2, 70, 8, dtype=torch.float32, seed=13)
    ins["qk".index(where)][0, 1, 30, 2] = float("nan")
    for causal in (False, True):
        with torch.no_grad():
            want = F.scaled_dot_product_attention(*ins[:3], is_causal=causal) * ins[4].view(-1, 1, 1) \
                + ins[2] * ins[3].view(-1, 1, 1)
        leaves = [x.clone().requires_grad_() for x in ins]
        got = laplacian_attention(*leaves[:3], laplacian_heads=HeadMix(leaves[3], leaves[4]), is_causal=causal)
        assert got.grad_fn.name() == NODE
        assert torch.isnan(want).any() and torch.equal(torch.isnan(got), torch.isnan(want)), (where, causal)


@needs_build
def test_every_exp_width_of_the_build_is_accurate():
    """The kernel's exp(x - c), each vector width this build has (1 = std::exp, 8 = AVX2, 16 = AVX-512):
    within 3 float ulps of exp in float64 over the whole range, 0 far below it, NaN kept, the sum right."""
    special = torch.tensor([float("nan"), float("-inf"), 0.0])  # first: inside a vector, not the scalar tail
    x = torch.cat([special, torch.linspace(-120.0, 5.0, 20011)])
    want = torch.exp((x - 1.5).double())
    widths = list(torch.ops.lapheads.exp_widths())
    assert 1 in widths
    for w in widths:
        y = torch.ops.lapheads.exp_shift_sum(x, 1.5, w)
        got, total = y[:-1].double(), y[-1].item()
        normal = want > 1.2e-38
        rel = ((got[normal] - want[normal]).abs() / want[normal]).max().item()
        assert rel < 3.6e-7, (w, rel)
        assert (got[~normal & ~torch.isnan(want)] <= 1.2e-38).all(), w
        assert torch.isnan(got[0]) and got[1] == 0 and math.isnan(total), w
        finite = torch.ops.lapheads.exp_shift_sum(x[1:], 1.5, w)
        assert abs(finite[-1].item() / want[1:].sum().item() - 1) < 1e-6, w


def _node_names(out: torch.Tensor) -> set[str]:
    names, seen, stack = set(), set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        names.add(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names


@needs_build
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:`torch.jit.trace:FutureWarning")
def test_tracing_records_plain_aten_ops_not_the_compiled_node():
    """torch.jit.trace of a learnable layer with gradients on: the trace must load and run without
    lapheads' library, so it records SDPA + the mixing, never lapheads::flash_mix (nor a Python node)."""
    from lapheads.nn import MultiheadAttention

    torch.manual_seed(0)
    model = MultiheadAttention(16, 2, batch_first=True, laplacian_heads="learn")
    x = torch.randn(2, 5, 16)
    assert NODE in _node_names(model(x, x, x, need_weights=False)[0])  # eager: the compiled node
    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = model

        def forward(self, t):
            return self.attn(t, t, t, need_weights=False)[0]

    traced = torch.jit.trace(SelfAttention(), (x,), check_trace=False)
    graph = str(traced.graph)
    assert "lapheads::" not in graph and "PythonOp" not in graph, graph
    y = torch.randn(3, 7, 16)
    torch.testing.assert_close(traced(y), model(y, y, y, need_weights=False)[0])


@needs_build
def test_torch_compile_keeps_plain_aten_ops_and_the_operator():
    """Under torch.compile the learnable call is traced as SDPA + the mixing (not the compiled node, which
    has no fake-tensor kernel); its gradients equal the explicit operator's."""
    ins, gy = _inputs(b=1, h=2, t=6, d=4, dtype=torch.float32, seed=8)

    def loss(q, k, v, a, b):
        return (laplacian_attention(q, k, v, laplacian_heads=HeadMix(a, b), is_causal=True) * gy).sum()

    leaves = [t.clone().requires_grad_() for t in ins]
    got = torch.autograd.grad(torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    _, want = _reference(ins, gy, is_causal=True)
    for name, x, y in zip("qkvab", got, want):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5, msg=f"gradient of {name}")


@needs_build
def test_a_learnable_model_trains_through_the_compiled_node(monkeypatch):
    """lapheads.nn's attention with laplacian_heads="learn": the node is what a training step runs, and
    one step gives the Python node's loss and gradients."""
    from lapheads.nn import MultiheadAttention

    torch.manual_seed(0)
    model = MultiheadAttention(32, 4, batch_first=True, laplacian_heads="learn")
    x = torch.randn(2, 12, 32)
    results = []
    for node in (NODE, PY_NODE):
        if node == PY_NODE:
            monkeypatch.setattr(kernels, "flash_mix_op", lambda: None)
        model.zero_grad()
        out = model(x, x, x, need_weights=False)[0]
        names = _node_names(out)
        assert node in names, names
        out.square().mean().backward()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], atol=1e-6, rtol=1e-5, msg=name)


@needs_build
def test_the_operator_refuses_bad_arguments_loudly():
    op = kernels.flash_mix_op()
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(RuntimeError, match="shape \\(H,\\)"):
        op(q, q, q, torch.ones(3), torch.ones(2), False, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        op(q, q, q.double(), torch.ones(2), torch.ones(2), False, None)
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        op(q, q, q, torch.ones(2, device="meta"), torch.ones(2), False, None)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LAPHEADS_KERNELS", "0")
    monkeypatch.setattr(kernels, "_state", {"tried": False, "op": None, "error": None})  # a fresh process
    assert kernels.flash_mix_op() is None and kernels.status()["enabled"] is False
    ins, gy = _inputs(dtype=torch.float32)
    assert _run(ins, gy)[2] == PY_NODE


def test_a_broken_build_warns_once_and_the_python_node_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("LAPHEADS_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {"tried": False, "op": None, "error": None})
    path = kernels.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert kernels.flash_mix_op() is None
    assert kernels.flash_mix_op() is None  # looked up once: no second warning (pytest fails on none here)
    assert str(path) in kernels.status()["error"]
    ins, gy = _inputs(dtype=torch.float32)
    assert _run(ins, gy)[2] == PY_NODE
    with pytest.raises(ConfigError, match="does not load"):
        kernels.build()


def test_build_errors_are_one_clear_line(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("LAPHEADS_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {"tried": False, "op": None, "error": None})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(ConfigError, match="needs ninja"):
        kernels.build()
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler: 'no-such-compiler-here'"):
        kernels.build()
    monkeypatch.delenv("CXX")

    def fail(**kw):
        raise RuntimeError("Error building extension 'lapheads_flash_mix': [1/2] c++ -c flash_mix.cpp\n"
                           "flash_mix.cpp:12:3: error: expected ';' before 'return'\nninja: build stopped")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(ConfigError, match="flash_mix.cpp:12:3: error: expected ';' before 'return'"):
        kernels.build()
    assert not kernels.library_path().exists()


def test_the_cache_key_follows_what_the_binary_depends_on(monkeypatch, tmp_path):
    monkeypatch.setenv("LAPHEADS_KERNEL_DIR", str(tmp_path))
    first = kernels.library_path()
    assert first.parent.parent == tmp_path and kernels.library_path() == first
    with monkeypatch.context() as m:
        m.setattr(kernels, "compile_flags", lambda: ["-O3"])  # another CPU: another directory
        assert kernels.library_path() != first
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.0")  # another torch: another directory
        assert kernels.library_path() != first
    assert kernels.library_path() == first


def test_cli_status(capsys, monkeypatch):
    from lapheads.cli import main

    monkeypatch.setenv("LAPHEADS_KERNELS", "0")
    assert main(["kernels", "status"]) == 0
    text = capsys.readouterr().out
    assert "Python node" in text and "LAPHEADS_KERNELS=0" in text and str(kernels.library_path()) in text


@needs_fused
def test_cli_status_says_how_float32_is_computed(capsys):
    from lapheads.cli import main

    assert main(["kernels", "status"]) == 0
    text = capsys.readouterr().out
    assert "compiled C++ node" in text and "own attention kernel with the mixing inside (fused)" in text
    assert main(["kernels", "status", "--json"]) == 0
    assert '"float32": "fused"' in capsys.readouterr().out
