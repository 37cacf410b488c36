"""The explicit reference's soft-cap, sinks and position bias against formulas written here, in float64.

Each formula is written out with loops over heads and an explicit exponential normalisation (no
``masked_softmax``, no ``torch.softmax``), so a slip in the operator's order of operations (cap
before bias, bias before mask, the sink as an extra key whose probability is dropped) shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from lapheads import ConfigError, laplacian_attention_reference

B, H, HKV, TQ, TK, D = 2, 4, 2, 3, 5, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, TQ, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, HKV, TK, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, HKV, TK, D, generator=g, dtype=torch.float64)
    return q, k, v, g


def _formula(q, k, v, lap, *, softcap=None, sinks=None, bias=None, causal=False):
    """Per batch, head and query row: scores -> cap -> + bias -> causal (lower right) -> exp-normalise with
    the sink as one more term of the denominator -> sum_j p_j v_j, subtracted from v_self on Laplacian heads."""
    out = torch.zeros(B, H, TQ, D, dtype=torch.float64)
    scale = 1 / math.sqrt(D)
    for b in range(B):
        for h in range(H):
            g = h // (H // HKV)
            for i in range(TQ):
                s = [float(q[b, h, i] @ k[b, g, j]) * scale for j in range(TK)]
                if softcap is not None:
                    s = [softcap * math.tanh(x / softcap) for x in s]
                if bias is not None:
                    bb = bias.expand(B, H, TQ, TK)
                    s = [x + float(bb[b, h, i, j]) for j, x in enumerate(s)]
                visible = [not causal or j <= i + TK - TQ for j in range(TK)]
                extra = []
                if sinks is not None:
                    extra = [float(sinks[h]) if sinks.dim() == 1 else float(sinks[b, h, i, 0])]
                top = max([x for x, ok in zip(s, visible) if ok] + extra)
                e = [math.exp(x - top) if ok else 0.0 for x, ok in zip(s, visible)]
                z = sum(e) + sum(math.exp(x - top) for x in extra)
                pv = sum(e[j] / z * v[b, g, j] for j in range(TK))
                out[b, h, i] = v[b, g, TK - TQ + i] - pv if lap[h] else pv
    return out


LAP = [False, True, False, True]


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_matches_formula(causal):
    q, k, v, _ = _inputs(1)
    out, op = laplacian_attention_reference(
        q, k, v, laplacian_heads=LAP, enable_gqa=True, softcap=1.5, is_causal=causal
    )
    torch.testing.assert_close(out, _formula(q, k, v, LAP, softcap=1.5, causal=causal), rtol=1e-12, atol=1e-12)
    # without the cap the logits (scaled by 2) give another result: the cap is applied
    plain, _ = laplacian_attention_reference(q, k, v, laplacian_heads=LAP, enable_gqa=True, is_causal=causal)
    assert not torch.allclose(out, plain)


@pytest.mark.parametrize("per_query", [False, True])
def test_sinks_match_formula(per_query):
    q, k, v, g = _inputs(2)
    sinks = (
        torch.randn(B, H, TQ, 1, generator=g, dtype=torch.float64)
        if per_query
        else torch.randn(H, generator=g, dtype=torch.float64)
    )
    out, op = laplacian_attention_reference(q, k, v, laplacian_heads=LAP, enable_gqa=True, sinks=sinks, is_causal=True)
    torch.testing.assert_close(out, _formula(q, k, v, LAP, sinks=sinks, causal=True), rtol=1e-12, atol=1e-12)
    # the sink's probability is dropped: the rows of P (standard heads) sum to less than 1
    assert (op[:, 0].sum(-1) < 1 - 1e-6).all()
    # and the Laplacian heads' rows of I - P sum to the sink's probability, > 0
    assert (op[:, 1].sum(-1) > 1e-6).all()


def test_bias_matches_formula_and_follows_the_cap():
    q, k, v, g = _inputs(3)
    bias = torch.randn(1, H, TQ, TK, generator=g, dtype=torch.float64)
    out, _ = laplacian_attention_reference(q, k, v, laplacian_heads=LAP, enable_gqa=True, bias=bias)
    torch.testing.assert_close(out, _formula(q, k, v, LAP, bias=bias), rtol=1e-12, atol=1e-12)
    both, _ = laplacian_attention_reference(
        q, k, v, laplacian_heads=LAP, enable_gqa=True, bias=bias, softcap=0.7, is_causal=True
    )
    want = _formula(q, k, v, LAP, bias=bias, softcap=0.7, causal=True)
    torch.testing.assert_close(both, want, rtol=1e-12, atol=1e-12)


def test_all_extras_match_the_transformers_explicit_attention():
    """The reference and the transformers integration's own explicit form agree on every extra at once."""
    tr = pytest.importorskip("lapheads.transformers")
    explicit = getattr(tr, "_explicit_attention", None)
    extras_cls = getattr(tr, "_Extras", None)
    if explicit is None or extras_cls is None:
        pytest.skip("the transformers integration calls the reference itself")
    from lapheads.heads import LayerHeads

    q, k, v, g = _inputs(4)
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    bias = torch.randn(B, H, TQ, TK, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 1, TQ, TK, generator=g) > 0.3
    heads = LayerHeads(tuple(LAP))
    want, want_op = explicit(q, k, v, heads, mask, True, 0.3, 0.0, extras_cls(1.2, sinks, bias), False)
    got, got_op = laplacian_attention_reference(
        q,
        k,
        v,
        laplacian_heads=heads,
        attn_mask=mask,
        is_causal=True,
        scale=0.3,
        enable_gqa=True,
        softcap=1.2,
        sinks=sinks,
        bias=bias,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_op, want_op, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"softcap": 0.0}, "softcap=0.0"),
        ({"softcap": float("nan")}, "softcap=nan"),
        ({"sinks": torch.zeros(3, dtype=torch.float64)}, "sinks has shape (3,)"),
        ({"sinks": torch.zeros(H, dtype=torch.long)}, "sinks must be a floating tensor"),
        ({"bias": torch.zeros(1, H, TQ, TK + 1, dtype=torch.float64)}, "bias has shape"),
    ],
)
def test_bad_extras_are_one_line(kw, words):
    q, k, v, _ = _inputs()
    with pytest.raises(ConfigError, match="^" + __import__("re").escape(words)):
        laplacian_attention_reference(q, k, v, laplacian_heads=LAP, enable_gqa=True, **kw)
