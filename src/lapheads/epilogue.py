"""The head operator after SDPA: ``out_h = a_h v_self + b_h (P V)_h`` for every head, in one pass.

For fixed coefficients (:class:`Runs`: standard ``(0, 1)``, Laplacian ``(1, -1)``) and learnable
``(H,)`` tensors alike; :func:`lapheads.laplacian_attention` calls it, a model never needs to.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

import torch

__all__ = ["Runs", "Tape", "tap", "combine", "explicit", "traced"]

#: ``(a, b)`` of a standard head.
STANDARD = (0.0, 1.0)
#: ``(a, b)`` of a Laplacian head.
LAPLACIAN = (1.0, -1.0)


@dataclasses.dataclass(frozen=True)
class Runs:
    """Fixed per-head coefficients as runs of heads sharing ``(a, b)``: ``((start, end, a, b), ...)`` over 0..H-1."""

    runs: tuple[tuple[int, int, float, float], ...]

    @classmethod
    def of(cls, coefs: tuple[tuple[float, float], ...]) -> "Runs":
        out: list[tuple[int, int, float, float]] = []
        for h, (a, b) in enumerate(coefs):
            if out and out[-1][2:] == (a, b):
                out[-1] = (out[-1][0], h + 1, a, b)
            else:
                out.append((h, h + 1, float(a), float(b)))
        return cls(tuple(out))

    @property
    def n_heads(self) -> int:
        return self.runs[-1][1]

    @property
    def identity(self) -> bool:
        """Some head has an identity term (``a != 0``): it needs ``v_self``."""
        return any(a != 0 for _, _, a, _ in self.runs)

    def vectors(self) -> tuple[list[float], list[float]]:
        """``(a, b)`` per head, as lists."""
        a: list[float] = []
        b: list[float] = []
        for s, e, x, y in self.runs:
            a += [x] * (e - s)
            b += [y] * (e - s)
        return a, b

    def tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, b)`` per head as ``(H,)`` tensors in the dtype and device of ``like``."""
        a, b = (torch.tensor(x, dtype=like.dtype, device=like.device) for x in self.vectors())
        return a, b


Coefs = Union[Runs, tuple[torch.Tensor, torch.Tensor]]


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``(..., H, T, D)`` -> ``(..., H_kv, G, T, D)`` (a view)."""
    return x.unflatten(-3, (hkv, x.shape[-3] // hkv))


@functools.lru_cache(maxsize=4096)
def _run_blocks(runs: Runs, group: int) -> tuple[tuple[int, int, int, int, float, float], ...]:
    """Every run of ``runs`` as rectangles ``(g0, g1, j0, j1, a, b)`` of the ``(H_kv, G)`` grid (cached)."""
    return tuple((*blk, a, b) for start, end, a, b in runs.runs for blk in _blocks(start, end, group))


def _blocks(start: int, end: int, group: int) -> list[tuple[int, int, int, int]]:
    """Heads ``start..end-1`` as rectangles ``(g0, g1, j0, j1)`` of the ``(H_kv, G)`` grid."""
    out = []
    h = start
    while h < end:
        g, j = divmod(h, group)
        if j == 0 and end - h >= group:  # whole groups
            n = (end - h) // group
            out.append((g, g + n, 0, group))
            h += n * group
        else:
            stop = min(end, (g + 1) * group)
            out.append((g, g + 1, j, stop - g * group))
            h = stop
    return out


def _fresh_like(pv: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``(..., H, T, D)`` tensor laid out ``(..., T, H, D)`` in memory, in the dtype
    the formula's type promotion gives (under autocast SDPA's output is half, ``v`` may be float32)."""
    dtype = pv.dtype
    for t in others:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    t = pv.transpose(-3, -2)
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format).transpose(-3, -2)


def _token_major(x: torch.Tensor) -> bool:
    """``x`` ``(..., H, T, D)`` has its strides in the order ``(..., T, H, D)``, strictly decreasing (size-1 and
    broadcast dims aside)."""
    t = x.transpose(-3, -2)
    strides = [st for st, n in zip(t.stride(), t.shape) if n > 1 and st != 0]
    return all(x > y for x, y in zip(strides, strides[1:]))


def _direct(pv: torch.Tensor, first: Optional[torch.Tensor], *others: torch.Tensor) -> bool:
    """Whether one out-of-place op over ``first`` (its first operand; None: ``pv`` is), ``pv`` and ``others``
    returns what :func:`_fresh_like` filled by ``out=`` ops holds, dtype and layout: one dtype, ``pv`` dense
    ``(..., T, H, D)`` and ``first`` in that stride order. (An op lays its output out in the stride order of its
    first operand, taking broadcast dims from the next.)"""
    return (
        all(t.dtype == pv.dtype for t in others)
        and pv.transpose(-3, -2).is_contiguous()
        and (first is None or (first.dtype == pv.dtype and _token_major(first)))
    )


_Block = tuple[int, int, torch.Tensor, Optional[torch.Tensor]]


class Tape:
    """What the epilogue's backward adds to ``v``'s gradient, handed to :func:`tap`'s backward.

    ``pending`` is ``(tq, blocks)``: each block ``(g0, g1, t, w)`` adds ``t`` (times ``w`` when
    given) to key-value heads ``g0..g1-1`` of the last ``Tq`` positions of SDPA's ``dv``.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: Optional[tuple[int, list[_Block]]] = None


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, tape: Tape) -> torch.Tensor:
        ctx.tape = tape
        return v.view_as(v)

    @staticmethod
    def backward(ctx: Any, dv: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        tape: Tape = ctx.tape
        pending, tape.pending = tape.pending, None
        if pending is None or dv is None:
            return dv, None
        tq, blocks = pending
        inplace = not torch.is_grad_enabled() and 0 not in dv.stride()
        if not inplace:
            dv = dv.clone()
        tail = dv[..., dv.shape[-2] - tq :, :]
        for g0, g1, t, w in blocks:
            part = tail[..., g0:g1, :, :]
            if t.shape != part.shape:  # batch dims that broadcast against v's
                t, w = (t if w is None else t * w).sum_to_size(part.shape), None
            if w is None:
                part.add_(t)
            else:  # learnable: part += a * dy, one query head of each group at a time
                part.addcmul_(t, w)
        return dv, None


def tap(v: torch.Tensor) -> tuple[torch.Tensor, Optional[Tape]]:
    """``v`` to hand to SDPA, and the tape the epilogue's backward writes ``v``'s other gradient to.

    Returns ``(v, None)`` when no tape is needed or possible (no gradient for ``v``, or inside
    ``torch.compile`` / export / tracing): then :func:`combine` returns that gradient the plain way.
    """
    if not (torch.is_grad_enabled() and v.requires_grad) or traced():
        return v, None
    tape = Tape()
    return _Tap.apply(v, tape), tape


def traced() -> bool:
    """Inside ``torch.compile``, ``torch.export``, ``torch.jit.trace`` or an ONNX export: plain ops only."""
    return bool(
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or torch.fx._symbolic_trace.is_fx_symbolic_tracing()
        or torch.onnx.is_in_onnx_export()
    )


def _write(o: Optional[torch.Tensor], p: torch.Tensor, s: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """``a s + b p`` into ``o`` in one pass where (a, b) allow it; ``o=None`` (only for ``b != 0``): into a new
    tensor, from the same ops."""
    if a == 0:
        if b == 1:
            return p.clone() if o is None else o.copy_(p)
        if b == -1:
            return torch.neg(p, out=o)
        if b == 0:
            assert o is not None
            return o.zero_()
        return torch.mul(p, b, out=o)
    if b == 0:
        assert o is not None
        return torch.mul(s, a, out=o) if a != 1 else o.copy_(s.expand_as(o))
    if b == -1 and a == 1:
        return torch.sub(s, p, out=o)
    if b == 1:
        return torch.add(p, s, alpha=a, out=o)
    return torch.mul(p, b, out=o).add_(s, alpha=a)


def _fixed_forward(pv: torch.Tensor, vs: torch.Tensor, runs: Runs) -> torch.Tensor:
    hkv = vs.shape[-3]
    group = pv.shape[-3] // hkv
    p5, s5 = _grouped(pv, hkv), vs.unsqueeze(-3)
    if len(runs.runs) == 1 and runs.runs[0][3] != 0 and _direct(pv, vs, vs):  # one op, its output the result
        _, _, a, b = runs.runs[0]
        return _write(None, p5, s5, a, b).flatten(-4, -3)
    out = _fresh_like(pv, vs)
    o5 = _grouped(out, hkv)
    for g0, g1, j0, j1, a, b in _run_blocks(runs, group):
        _write(o5[..., g0:g1, j0:j1, :, :], p5[..., g0:g1, j0:j1, :, :], s5[..., g0:g1, :, :, :], a, b)
    return out


@functools.lru_cache(maxsize=256)
def _signs(runs: Runs, hkv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``b`` per head as an ``(H_kv, G, 1, 1)`` tensor (cached: one host-to-device copy per operator and device)."""
    return torch.tensor(runs.vectors()[1], dtype=dtype, device=device).view(hkv, -1, 1, 1)


def _times_b(dy: torch.Tensor, runs: Runs, hkv: int) -> Optional[torch.Tensor]:
    """``b_h dy`` per head by one op, with no buffer of its own, bit for bit what :func:`_write` gives run by run:
    ``dy`` itself when every b is 1, ``-dy`` when every b is -1, ``dy`` times the per-head b when each is 1 or -1
    (for a plain tensor: the cached signs must not meet a fake or distributed one); None otherwise."""
    bs = {b for _, _, _, b in runs.runs}
    if bs == {1.0}:
        return dy
    if len(bs) == 1 and 0.0 not in bs:
        return _write(None, dy, dy, 0.0, bs.pop())
    if bs == {1.0, -1.0} and type(dy) is torch.Tensor and not traced():
        return (_grouped(dy, hkv) * _signs(runs, hkv, dy.dtype, dy.device)).flatten(-4, -3)
    return None


def _fixed_backward(dy: torch.Tensor, runs: Runs, hkv: int) -> tuple[torch.Tensor, list[_Block]]:
    """``d_pv`` (one pass, or none) and the blocks ``a dy`` summed over the group, to add into ``dv``."""
    group = dy.shape[-3] // hkv
    y5 = _grouped(dy, hkv)
    d_pv = _times_b(dy, runs, hkv)
    if d_pv is None:
        d_pv = torch.empty_like(dy)
        d5 = _grouped(d_pv, hkv)
        for g0, g1, j0, j1, _, b in _run_blocks(runs, group):
            y = y5[..., g0:g1, j0:j1, :, :]
            _write(d5[..., g0:g1, j0:j1, :, :], y, y, 0.0, b)
    blocks: list[_Block] = []
    for g0, g1, j0, j1, a, _ in _run_blocks(runs, group):
        if a != 0:
            y = y5[..., g0:g1, j0:j1, :, :]
            t = y.squeeze(-3) if j1 - j0 == 1 else y.sum(-3)
            blocks.append((g0, g1, t if a == 1 else t * a, None))
    return d_pv, blocks


def _scatter(blocks: list[_Block], like: torch.Tensor) -> torch.Tensor:
    """The blocks as one ``v_self``-shaped gradient (when there is no tape to add them in place)."""
    grad = torch.zeros_like(like)
    for g0, g1, t, _ in blocks:
        part = grad[..., g0:g1, :, :]
        part.add_(t if t.shape == part.shape else t.sum_to_size(part.shape))
    return grad


def _plain_backward(
    dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, hkv: int, tape: Optional[Tape]
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(b dy, sum over the group of a dy)`` by differentiable ops (a backward with ``create_graph=True``)."""
    group = dy.shape[-3] // hkv
    y5 = _grouped(dy, hkv)
    d_pv = (y5 * b.view(hkv, group, 1, 1)).flatten(-4, -3)
    d_vs = (y5 * a.view(hkv, group, 1, 1)).sum(-3)
    if tape is not None:
        tape.pending = (dy.shape[-2], [(0, hkv, d_vs, None)])
        return d_pv, None
    return d_pv, d_vs


class _Fixed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, pv: torch.Tensor, vs: torch.Tensor, runs: Runs, tape: Optional[Tape]) -> torch.Tensor:
        ctx.runs, ctx.tape, ctx.hkv, ctx.vs_meta = runs, tape, vs.shape[-3], (vs.shape, vs.dtype, vs.device)
        return _fixed_forward(pv, vs, runs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops, v's gradient returned
            a, b = ctx.runs.tensors(dy)
            d_pv, d_vs = _plain_backward(dy, a, b, ctx.hkv, ctx.tape)
            return d_pv, d_vs, None, None
        d_pv, blocks = _fixed_backward(dy, ctx.runs, ctx.hkv)
        if ctx.tape is not None:
            ctx.tape.pending = (dy.shape[-2], blocks)
            return d_pv, None, None, None
        if not ctx.needs_input_grad[1]:
            return d_pv, None, None, None
        shape, dtype, device = ctx.vs_meta
        return d_pv, _scatter(blocks, torch.empty(shape, dtype=dtype, device=device)), None, None


def _mix_forward(pv: torch.Tensor, vs: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    hkv = vs.shape[-3]
    group = pv.shape[-3] // hkv
    p5, a5, b5 = _grouped(pv, hkv), a.view(hkv, group, 1, 1), b.view(hkv, group, 1, 1)
    if _direct(pv, None, vs, a, b):  # the product is the result's buffer
        return torch.mul(p5, b5).addcmul_(vs.unsqueeze(-3), a5).flatten(-4, -3)
    out = _fresh_like(pv, vs, a, b)
    o5 = _grouped(out, hkv)
    torch.mul(p5, b5, out=o5)
    o5.addcmul_(vs.unsqueeze(-3), a5)
    return out


def _head_dot(x: torch.Tensor, y: torch.Tensor, h: int) -> torch.Tensor:
    """``sum(x * y)`` over every dim but the heads (dim -3) -> ``(H,)``, ``y`` with ``H_kv`` heads: one batched
    ``(H, D) @ (D, H_kv)`` matmul per token (no output-sized product) where the layouts allow."""
    hkv = y.shape[-3]
    try:
        xt = x.transpose(-3, -2).reshape(-1, h, x.shape[-1]) if x.transpose(-3, -2).is_contiguous() else None
        yt = y.transpose(-3, -2)
        yt = yt.view(-1, hkv, y.shape[-1]) if xt is not None else None
    except RuntimeError:
        xt = yt = None
    if xt is None or yt is None or xt.shape[0] != yt.shape[0]:
        prod = _grouped(x, hkv) * y.unsqueeze(-3)
        return prod.sum_to_size((hkv, h // hkv, 1, 1)).reshape(h)
    m = torch.bmm(xt, yt.transpose(-2, -1))  # (N, H, H_kv): entry (h, h // G) is head h's dot
    diag = m.unflatten(1, (hkv, h // hkv)).diagonal(dim1=1, dim2=3)  # (N, G, H_kv), a view
    return diag.transpose(1, 2).sum(0).view(h)  # (H_kv, G) -> head order


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, pv: torch.Tensor, vs: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tape: Optional[Tape]
    ) -> torch.Tensor:
        ctx.save_for_backward(pv, vs, a, b)
        ctx.tape = tape
        return _mix_forward(pv, vs, a, b)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        pv, vs, a, b = ctx.saved_tensors
        need_pv, need_vs, need_a, need_b, _ = ctx.needs_input_grad
        h, hkv = pv.shape[-3], vs.shape[-3]
        group = h // hkv
        d_a = _head_dot(dy, vs, h) if need_a else None
        d_b = _head_dot(dy, pv, h) if need_b else None
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            d_pv, d_vs = _plain_backward(dy, a, b, hkv, ctx.tape)
            return d_pv, d_vs, d_a, d_b, None
        y5, a5 = _grouped(dy, hkv), a.view(hkv, group, 1, 1)
        d_pv = (y5 * b.view(hkv, group, 1, 1)).flatten(-4, -3) if need_pv else None
        d_vs = None
        if ctx.tape is not None:  # dv += a dy, one query head of each group at a time, in place
            ctx.tape.pending = (dy.shape[-2], [(0, hkv, y5[..., j, :, :], a5[:, j]) for j in range(group)])
        elif need_vs:
            d_vs = (y5 * a5).sum(-3)
        return d_pv, d_vs, d_a, d_b, None


def _plain(pv: torch.Tensor, vs: torch.Tensor, coefs: Coefs) -> torch.Tensor:
    """The same formula as differentiable aten ops (no ``cat``, no ``out=``): for compile, export, tracing."""
    hkv = vs.shape[-3]
    h = pv.shape[-3]
    group = h // hkv
    p5, s5 = _grouped(pv, hkv), vs.unsqueeze(-3)
    if isinstance(coefs, Runs):
        if coefs.runs == ((0, h, *LAPLACIAN),):
            return (s5 - p5).flatten(-4, -3)
        a, b = coefs.tensors(pv)
    else:
        a, b = coefs
    return (p5 * b.view(hkv, group, 1, 1) + s5 * a.view(hkv, group, 1, 1)).flatten(-4, -3)


def combine(pv: torch.Tensor, v_self: torch.Tensor, coefs: Coefs, tape: Optional[Tape] = None) -> torch.Tensor:
    """``a_h v_self + b_h pv`` per head (heads on dim -3).

    Args:
        pv: SDPA's output ``(..., H, Tq, D)``.
        v_self: ``(..., H_kv, Tq, D)``, the values at the queries' own positions (GQA as SDPA).
        coefs: :class:`Runs` (fixed) or ``(a, b)`` tensors of shape ``(H,)`` in ``pv``'s dtype.
        tape: from :func:`tap` when ``v_self`` is a slice of the ``v`` SDPA read through it.

    Returns:
        a fresh ``(..., H, Tq, D)`` tensor (laid out ``(..., Tq, H, D)`` in memory on the eager path).
    """
    grad = torch.is_grad_enabled() and (pv.requires_grad or v_self.requires_grad or _coefs_grad(coefs))
    if traced() or pv.shape[:-3] != v_self.shape[:-3]:  # (batch dims that broadcast: the plain formula)
        return _plain(pv, v_self, coefs)
    if isinstance(coefs, Runs):
        if not grad:
            return _fixed_forward(pv, v_self, coefs)
        out: torch.Tensor = _Fixed.apply(pv, v_self.detach() if tape is not None else v_self, coefs, tape)
        return out
    a, b = coefs
    if not grad:
        return _mix_forward(pv, v_self, a, b)
    mixed: torch.Tensor = _Mix.apply(pv, v_self.detach() if tape is not None else v_self, a, b, tape)
    return mixed


def _coefs_grad(coefs: Coefs) -> bool:
    return not isinstance(coefs, Runs) and (coefs[0].requires_grad or coefs[1].requires_grad)


def explicit(coefs: Coefs, p: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """The operator ``a_h I + b_h P`` per head (heads on dim -3 of ``p``; ``eye`` is ``(Tq, Tk)``)."""
    h = p.shape[-3]
    if isinstance(coefs, Runs):
        a, b = coefs.tensors(p)
    else:
        a, b = coefs[0].to(p.dtype), coefs[1].to(p.dtype)
    return a.view(h, 1, 1) * eye + b.view(h, 1, 1) * p
