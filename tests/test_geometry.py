"""Geometry measures: brute-force NumPy references, known geometries, streaming == one-shot;
the registry of capture adapters (with a plain torch module, no timm / transformers)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lapheads.errors import ConfigError, DataError
from lapheads.geometry import (
    AnovaAccumulator,
    ClassAccumulator,
    CosineAccumulator,
    GeometryAccumulator,
    SpectraAccumulator,
    anova,
    cdnv,
    neural_collapse,
    pca_rgb,
    spectral_k99,
    within_sequence_cosine,
)
from lapheads.geometry.capture import ADAPTERS, ModelAdapter, analyze_model


def _data(seed=0, n_seq=12, t=(3, 9), d=6, n_cls=4, offset=0.0):
    """Random sequences of random length, one class per sequence; means far from zero."""
    rng = np.random.default_rng(seed)
    xs, sids, cids = [], [], []
    for s in range(n_seq):
        T = int(rng.integers(*t))
        c = s % n_cls
        xs.append(rng.normal(size=(T, d)) + rng.normal(size=d) * 2 + offset)
        sids += [s] * T
        cids += [c] * T
    return np.concatenate(xs), np.array(sids), np.array(cids)


# ---------------------------------------------------------------- brute-force references
def np_anova(x, s, c):
    mg = x.mean(0)
    tot = ((x - mg) ** 2).sum()
    within = sum(((x[s == k] - x[s == k].mean(0)) ** 2).sum() for k in np.unique(s))
    bswc = sum((s == k).sum() * ((x[s == k].mean(0) - x[c == c[s == k][0]].mean(0)) ** 2).sum() for k in np.unique(s))
    bc = sum((c == k).sum() * ((x[c == k].mean(0) - mg) ** 2).sum() for k in np.unique(c))
    return tot, within, bswc, bc


def np_nc(x, y, W=None, b=None):
    cls = np.unique(y)
    C = len(cls)
    mu = np.stack([x[y == k].mean(0) for k in cls])
    mg = mu.mean(0)
    M = mu - mg
    sw = sum((x[y == k] - mu[i]).T @ (x[y == k] - mu[i]) for i, k in enumerate(cls)) / len(x)
    sb = M.T @ M / C
    nc1 = np.trace(sw @ np.linalg.pinv(sb, rcond=1e-10, hermitian=True)) / C
    var = np.array([((x[y == k] - mu[i]) ** 2).sum(1).mean() for i, k in enumerate(cls)])
    pairs = list(itertools.combinations(range(C), 2))
    cd = np.mean([(var[i] + var[j]) / (2 * ((mu[i] - mu[j]) ** 2).sum()) for i, j in pairs])
    nrm = np.linalg.norm(M, axis=1)
    U = M / nrm[:, None]
    cos = np.array([U[i] @ U[j] for i, j in pairs])
    G = U @ U.T
    E = (np.eye(C) - np.ones((C, C)) / C) * C / (C - 1)
    etf = np.linalg.norm(G / np.linalg.norm(G) - E / np.linalg.norm(E))
    out = dict(
        nc1=nc1,
        cdnv=cd,
        nc2_equinorm=nrm.std() / nrm.mean(),
        nc2_equiangular_std=cos.std(),
        nc2_equiangular_mean=cos.mean(),
        nc2_equiangular_shift=np.abs(cos + 1 / (C - 1)).mean(),
        nc2_etf_distance=etf,
    )
    if W is not None:
        Wk = W[cls]
        out["nc3_self_duality"] = np.linalg.norm(Wk / np.linalg.norm(Wk) - M / np.linalg.norm(M))
        logits = x @ Wk.T + (b[cls] if b is not None else 0)
        ncc = np.argmin(((x[:, None, :] - mu[None]) ** 2).sum(-1), 1)
        out["nc4_agreement"] = (logits.argmax(1) == ncc).mean()
    return out


def np_k99(x, s, thr=0.99):
    ks = []
    for k in np.unique(s):
        xs = x[s == k]
        if len(xs) < 2:
            continue
        xc = xs - xs.mean(0)
        ev = np.linalg.eigh(xc.T @ xc / len(xs))[0][::-1].clip(0)
        ks.append(int(np.searchsorted(np.cumsum(ev) / ev.sum(), thr) + 1))
    return np.mean(ks), ks


def np_cos(x, s):
    vals = []
    for k in np.unique(s):
        xs = x[s == k]
        u = xs / np.linalg.norm(xs, axis=1, keepdims=True)
        G = u @ u.T
        T = len(xs)
        vals.append((G.sum() - np.trace(G)) / (T * (T - 1)))
    return np.mean(vals)


# ---------------------------------------------------------------- measures vs references
def test_anova_matches_bruteforce_and_adds_up():
    x, s, c = _data(offset=50.0)
    r = anova(x, s, c)
    tot, w, bswc, bc = np_anova(x, s, c)
    assert r["total"] == pytest.approx(tot, rel=1e-10)
    assert r["within_sequence"] == pytest.approx(w, rel=1e-10)
    assert r["between_sequence_within_class"] == pytest.approx(bswc, rel=1e-10)
    assert r["between_class"] == pytest.approx(bc, rel=1e-10)
    parts = r["within_sequence"] + r["between_sequence_within_class"] + r["between_class"]
    assert parts == pytest.approx(r["total"], rel=1e-12)
    assert r["between_sequence"] == pytest.approx(r["between_sequence_within_class"] + r["between_class"], rel=1e-12)
    fr = r["frac_within_sequence"] + r["frac_between_sequence_within_class"] + r["frac_between_class"]
    assert fr == pytest.approx(1.0, abs=1e-12)
    r2 = anova(x, s)  # language-model form: within vs between sequences
    assert "between_class" not in r2
    assert r2["within_sequence"] + r2["between_sequence"] == pytest.approx(r2["total"], rel=1e-12)


def test_neural_collapse_matches_bruteforce():
    rng = np.random.default_rng(1)
    x, _, y = _data(seed=1, n_seq=40, d=8, n_cls=5)
    W, b = rng.normal(size=(7, 8)), rng.normal(size=7)  # more classifier rows than classes
    r = neural_collapse(x, y, classifier=(W, b))
    ref = np_nc(x, y, W, b)
    for k, v in ref.items():
        assert r[k] == pytest.approx(v, rel=1e-8, abs=1e-12), k
    assert r["n_classes"] == 5
    assert cdnv(x, y)["cdnv"] == pytest.approx(ref["cdnv"], rel=1e-10)


def test_nc1_when_classes_exceed_dimension():
    x, _, y = _data(seed=2, n_seq=60, d=3, n_cls=9)  # C > D: Sigma_B full rank
    r = neural_collapse(x, y)
    assert r["nc1"] == pytest.approx(np_nc(x, y)["nc1"], rel=1e-8)


def test_cdnv_tiling_and_min_count():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 5))
    y = rng.integers(0, 40, size=300)
    y[:3] = 99  # a rare class
    full = cdnv(x, y, tile=4096)["cdnv"]
    assert cdnv(x, y, tile=7)["cdnv"] == pytest.approx(full, rel=1e-12)
    counts = np.bincount(y)
    keep = np.isin(y, np.nonzero(counts >= 5)[0])
    r = cdnv(x, y, min_count=5, tile=3)
    assert r["cdnv"] == pytest.approx(np_nc(x[keep], y[keep])["cdnv"], rel=1e-10)
    assert r["n_classes"] == (counts >= 5).sum()
    nc = neural_collapse(x, y, min_count=5, tile=5)
    assert nc["nc2_etf_distance"] == pytest.approx(np_nc(x[keep], y[keep])["nc2_etf_distance"], rel=1e-10)


def test_k99_and_cosine_match_bruteforce():
    x, s, _ = _data(seed=4, n_seq=10, t=(2, 14), d=8)
    r = spectral_k99(x, s)
    mean, ks = np_k99(x, s)
    assert r["k_mean"] == pytest.approx(mean)
    assert (r["k_min"], r["k_max"]) == (min(ks), max(ks))
    assert spectral_k99(x, s, threshold=0.5)["k_mean"] == pytest.approx(np_k99(x, s, 0.5)[0])
    xc = x - x.mean(0)
    ev = np.linalg.eigh(xc.T @ xc / len(x))[0][::-1]
    assert r["global_k"] == np.searchsorted(np.cumsum(ev) / ev.sum(), 0.99) + 1
    assert within_sequence_cosine(x, s)["cosine_mean"] == pytest.approx(np_cos(x, s), rel=1e-10)


# ---------------------------------------------------------------- known geometries
def _etf_means(C, D, scale=5.0):
    E = np.eye(C) - 1.0 / C
    Q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(D, D)))
    return scale * E @ Q[:C]  # C centred, equinorm, equiangular means in D dims


def test_collapsed_classes_on_etf():
    C, D, n = 4, 6, 5
    mu = _etf_means(C, D)
    x = np.repeat(mu, n, axis=0) + 3.0
    y = np.repeat(np.arange(C), n)
    W = mu.copy()
    r = neural_collapse(x, y, classifier=(W, np.zeros(C)))
    assert r["nc1"] == pytest.approx(0.0, abs=1e-10)
    assert r["within_class_variance"] == pytest.approx(0.0, abs=1e-10)
    assert r["nc2_etf_distance"] == pytest.approx(0.0, abs=1e-6)
    assert r["nc2_equinorm"] == pytest.approx(0.0, abs=1e-10)
    assert r["nc2_equiangular_shift"] == pytest.approx(0.0, abs=1e-10)
    assert r["nc3_self_duality"] == pytest.approx(0.0, abs=1e-10)
    # noisy, non-ETF classes are measurably far from all of that
    x2 = x + np.random.default_rng(1).normal(size=x.shape)
    x2[y == 0] += 4.0
    r2 = neural_collapse(x2, y)
    assert r2["nc1"] > 1e-3 and r2["nc2_etf_distance"] > 1e-2


def test_tokens_equal_within_sequences():
    rng = np.random.default_rng(5)
    base = rng.normal(size=(6, 5)) + 1.0
    s = np.repeat(np.arange(6), 4)
    c = s % 2
    x = base[s]
    r = anova(x, s, c)
    assert r["frac_within_sequence"] == pytest.approx(0.0, abs=1e-12)
    assert within_sequence_cosine(x, s)["cosine_mean"] == pytest.approx(1.0, abs=1e-12)
    assert spectral_k99(x, s)["k_mean"] == 0


# ---------------------------------------------------------------- streaming
def _batches(x, s, c, sizes):
    """Split at sequence boundaries into batches of roughly these many sequences."""
    bounds = np.nonzero(np.diff(s))[0] + 1
    starts = np.concatenate([[0], bounds, [len(s)]])
    i = 0
    for k in sizes:
        a, b = starts[i], starts[min(i + k, len(starts) - 1)]
        if a < b:
            yield torch.tensor(x[a:b]), torch.tensor(s[a:b] - s[a]), torch.tensor(c[a:b])
        i += k


# Merged, restored and one-shot accumulators add the same float64 terms in different orders (and
# another machine's BLAS adds them in yet another), so their results agree to rounding, not bit
# for bit. After the shift every measure is a well-conditioned function of sums of at most a few
# hundred terms: the relative difference is about n * eps * kappa, with n <= 300 terms,
# eps = 2.2e-16 and kappa <= 1e3 (NC1 goes through pinv(Sigma_B); cosine_std is a spread of
# cosines near 1), i.e. <= 7e-11. 1e-9 leaves a factor ten beyond that; measured across 30
# random batch splits and merge orders the largest difference is 2.5e-13 (cosine_std).
def _assert_same(a, b, rel=1e-9):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k], rel)
    elif isinstance(a, list):
        np.testing.assert_allclose(a, b, rtol=rel, atol=1e-12)
    else:
        assert a == pytest.approx(b, rel=rel, abs=1e-12)


def test_streaming_equals_one_shot():
    x, s, c = _data(seed=6, n_seq=30, d=7, n_cls=3, offset=100.0)
    acc = GeometryAccumulator(7)
    for xb, sb, cb in _batches(x, s, c, [1, 4, 2, 7, 3, 13]):
        acc.update(xb, sb, cb)
    res = acc.compute()
    _assert_same(res["anova"], anova(x, s, c))
    _assert_same(res["nc_tokens"], neural_collapse(x, c))
    seqm = np.stack([x[s == k].mean(0) for k in np.unique(s)])
    _assert_same(res["nc_sequence_means"], neural_collapse(seqm, np.array([c[s == k][0] for k in np.unique(s)])))
    k = spectral_k99(x, s)
    for key in ("k_mean", "k_std", "k_min", "k_max", "n_sequences", "global_k"):
        assert res["spectra"][key] == pytest.approx(k[key], rel=1e-12), key
    _assert_same(res["cosine"], within_sequence_cosine(x, s))


def test_cosine_spread_survives_a_large_common_component():
    """Tokens sharing a large common direction have cosines ~1 - 1e-6 with a spread ~1e-7:
    E[c^2] - E[c]^2 would cancel to noise; the centred sums keep it (and across merges)."""
    x, s, c = _data(seed=11, n_seq=40, d=6, n_cls=2, offset=1000.0)
    per_seq = []
    for k in np.unique(s):
        u = x[s == k] / np.linalg.norm(x[s == k], axis=1, keepdims=True)
        G, T = u @ u.T, int((s == k).sum())
        per_seq.append((G.sum() - np.trace(G)) / (T * (T - 1)))
    ref_std = float(np.std(per_seq))
    assert 0 < ref_std < 1e-5
    batches = list(_batches(x, s, c, [5] * 8))
    a, b = CosineAccumulator(), CosineAccumulator()
    for xb, sb, _ in batches[:3]:
        a.update(xb, sb)
    for xb, sb, _ in batches[3:]:
        b.update(xb, sb)
    r = a.merge(b).compute()
    # each cosine is itself rounded to ~T * eps ~ 2e-15 absolute, i.e. ~1e-8 of this spread
    assert r["cosine_std"] == pytest.approx(ref_std, rel=1e-6)
    assert r["cosine_mean"] == pytest.approx(float(np.mean(per_seq)), rel=1e-12)


def test_merge_equals_union_and_state_roundtrip(tmp_path):
    x, s, c = _data(seed=7, n_seq=24, d=5, n_cls=4, offset=-30.0)
    batches = list(_batches(x, s, c, [3] * 8))
    one = GeometryAccumulator(5)
    for b in batches:
        one.update(*b)
    a, b2 = GeometryAccumulator(5), GeometryAccumulator(5)
    for b in batches[:3]:
        a.update(*b)
    for b in batches[:2:-1]:  # the rest, reversed: another first batch, so another shift
        b2.update(*b)
    assert not torch.equal(a.anova.shift, b2.anova.shift)
    _assert_same(a.merge(b2).compute(), one.compute())
    # save mid-stream, restore into a fresh accumulator, continue
    acc = GeometryAccumulator(5)
    for b in batches[:4]:
        acc.update(*b)
    torch.save(acc.state_dict(), tmp_path / "acc.pt")
    fresh = GeometryAccumulator(5).load_state_dict(torch.load(tmp_path / "acc.pt", weights_only=False))
    for b in batches[4:]:
        fresh.update(*b)
    _assert_same(fresh.compute(), one.compute(), rel=1e-12)
    with pytest.raises(ConfigError, match="settings"):
        GeometryAccumulator(5, threshold=0.9).load_state_dict(acc.state_dict())


def test_class_table_grows_and_unlabelled_tokens():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(200, 4))
    y = rng.integers(0, 30, size=200)
    y[::10] = -1
    acc = ClassAccumulator(4, num_classes=2)
    for i in range(0, 200, 37):
        acc.update(torch.tensor(x[i : i + 37]), torch.tensor(y[i : i + 37]))
    m = y >= 0
    _assert_same(acc.compute(), neural_collapse(x[m], y[m]))
    cov = np.cov(x.T, bias=True)
    np.testing.assert_allclose(acc.covariance().numpy(), cov, rtol=1e-10, atol=1e-12)


def test_parts_merge_individually():
    x, s, c = _data(seed=9, n_seq=10, d=4)
    half = np.searchsorted(s, 5)
    for make, feed in [
        (lambda: AnovaAccumulator(4), lambda a, sl: a.update(x[sl], s[sl], c[sl])),
        (lambda: SpectraAccumulator(4), lambda a, sl: a.update(x[sl], s[sl])),
        (lambda: CosineAccumulator(), lambda a, sl: a.update(x[sl], s[sl])),
    ]:
        whole, p, q = make(), make(), make()
        feed(whole, slice(None))
        feed(p, slice(0, half))
        feed(q, slice(half, None))
        _assert_same(p.merge(q).compute(), whole.compute())


def test_all_reduce_is_noop_without_distributed():
    acc = AnovaAccumulator(3)
    acc.update(torch.randn(5, 3), torch.tensor([0, 0, 1, 1, 1]))
    before = acc.compute()
    assert acc.all_reduce() is acc
    assert acc.compute() == before


# ---------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    x = np.random.default_rng(0).normal(size=(6, 3))
    with pytest.raises(DataError, match="shape"):
        anova(x, np.arange(5))
    xn = x.copy()
    xn[2, 1] = np.nan
    with pytest.raises(DataError, match="NaN"):
        neural_collapse(xn, np.array([0, 0, 1, 1, 2, 2]))
    with pytest.raises(DataError, match="at least two classes"):
        neural_collapse(x, np.zeros(6, dtype=int))
    with pytest.raises(DataError, match="at least two classes"):
        cdnv(x, np.array([0, 0, 0, 1, 1, 2]), min_count=3)
    with pytest.raises(DataError, match="constant within each sequence"):
        anova(x, np.array([0, 0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 1, 1]))
    with pytest.raises(DataError, match="integers"):
        anova(x, np.arange(6) * 1.0)
    with pytest.raises(ConfigError, match="rows"):
        neural_collapse(x, np.array([0, 0, 1, 1, 2, 2]), classifier=(np.ones((2, 3)), None))
    with pytest.raises(ConfigError, match="threshold"):
        spectral_k99(x, np.zeros(6, dtype=int), threshold=1.5)
    with pytest.raises(DataError, match="dimension"):
        GeometryAccumulator(4).update(torch.randn(3, 3), torch.zeros(3, dtype=torch.long))


def test_pca_rgb_shape_and_range():
    t = torch.randn(2, 6, 5)
    img = pca_rgb(t, (2, 3))
    assert img.shape == (2, 2, 3, 3) and img.min() >= 0 and img.max() <= 1
    assert np.allclose(img.reshape(-1, 3).max(0), 1) and np.allclose(img.reshape(-1, 3).min(0), 0)
    with pytest.raises(ConfigError, match="grid"):
        pca_rgb(t, (2, 2))


def _all_reduce_worker(rank: int, world: int, init: str, out: str, batches) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        acc = GeometryAccumulator(5)
        for b in batches[rank::world]:  # interleaved: each rank gets a different first batch (shift)
            acc.update(*b)
        acc.all_reduce()
        if rank == 0:
            torch.save(acc.compute(), out)
    finally:
        dist.destroy_process_group()


def test_all_reduce_over_two_processes_equals_one_accumulator(tmp_path):
    """Two gloo ranks with different shifts (and cosine centres) all-reduce to the one-shot state."""
    import torch.multiprocessing as mp

    x, s, c = _data(seed=12, n_seq=20, d=5, n_cls=4, offset=50.0)
    batches = list(_batches(x, s, c, [2] * 10))
    one = GeometryAccumulator(5)
    for b in batches:
        one.update(*b)
    out = tmp_path / "reduced.pt"
    mp.spawn(_all_reduce_worker, args=(2, f"file://{tmp_path / 'store'}", str(out), batches), nprocs=2, join=True)
    _assert_same(torch.load(out, weights_only=False), one.compute())


# ---------------------------------------------------------------- capture: the adapter registry


class _OutputAdapter(ModelAdapter):
    """A new kind: the model's own output is its one layer."""

    kind = "output"

    def resolve(self, layers):
        return ["out"] if layers is None else list(layers)

    @staticmethod
    def layer_name(layer):
        return f"output.{layer}"

    def capture(self, inputs, mask, layers):
        return {"out": (self.model(inputs), None)}, mask, None


def test_adapter_registry_is_the_one_dispatch_point(monkeypatch):
    """analyze_model asks the adapter of ``kind`` everything kind-specific: a registered kind runs
    the whole pipeline and gives the numbers of the hooks adapter on the same tokens."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh())
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 5, 4, generator=g), torch.tensor([0, 1, 2])) for _ in range(2)]
    assert set(ADAPTERS) == {"vit", "hf", "hooks"}
    with pytest.raises(ConfigError, match=r"kind must be 'vit', 'hf' or 'hooks', got 'output'"):
        analyze_model(model, batches, "output")
    monkeypatch.setitem(ADAPTERS, "output", _OutputAdapter)
    res = analyze_model(model, batches, "output")
    hooked = analyze_model(model, batches, "hooks", layers=["1"])
    assert res["meta"]["layers"] == ["output.out"] and res["meta"]["classifier_layer"] is None
    assert res["meta"]["n_tokens"] == hooked["meta"]["n_tokens"] == 2 * 3 * 5
    _assert_same(res["layers"]["output.out"], hooked["layers"]["1"])
