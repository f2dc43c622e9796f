"""kvcert.core.certificate and kvcert.core.sketch: traces of the certificate's covariance, the sketch, the tight
radius, the diagnostics."""

import math

import pytest
import torch
from scipy import stats

from kvcert.core import gather_tokens, get_design, hajek_attention, z_value
from kvcert.core.certificate import (
    chi2_quantile,
    conservative_radius,
    covariance,
    diagonal_term,
    effective_dimension,
    tail_diagnostics,
    tight_radius,
    trace_c,
    trace_c2_exact,
)
from kvcert.core.simulate import monte_carlo, random_problem
from kvcert.core.sketch import make_sketch, sketch_tail, sketch_values, sketched_trace_c2

LEVELS = (0.5, 0.8, 0.9, 0.95, 0.99)


@pytest.fixture(autouse=True)
def _one_thread(torch_threads):
    """One intra-op thread in this module (reproducible float sums in the Monte Carlo), restored after each test."""
    torch_threads(1)


def _spectrum(name, d=64):
    lam = torch.zeros(d, dtype=torch.float64)
    if name == "rank1":
        lam[0] = 1
    elif name == "two":
        lam[:2] = torch.tensor([1.0, 0.1])
    elif name == "geometric":
        lam = 0.8 ** torch.arange(d, dtype=torch.float64)
    elif name == "isotropic":
        lam[:] = 1
    return lam


def test_chi2_quantile_matches_scipy():
    dof = torch.tensor([1.0, 1.3, 2.0, 5.5, 17.0, 64.0], dtype=torch.float64)
    for level in (0.05, 0.5, 0.8, 0.95, 0.99, 0.999):
        ref = stats.chi2.ppf(level, dof.numpy())
        assert torch.allclose(chi2_quantile(level, dof), torch.as_tensor(ref), rtol=1e-8)


def test_tight_radius_is_the_normal_radius_at_rank_one_and_smaller_above():
    v = torch.tensor([2.0, 0.5], dtype=torch.float64)
    assert torch.allclose(tight_radius(v, v.square(), 0.95), z_value(0.95) * v.sqrt(), rtol=1e-9)
    assert torch.allclose(tight_radius(v, v.square(), 0.95), conservative_radius(v, 0.95), rtol=1e-9)
    iso = tight_radius(v, v.square() / 64, 0.95)
    assert torch.allclose(iso, (v / 64 * stats.chi2.ppf(0.95, 64)).sqrt(), rtol=1e-9)
    assert (iso < conservative_radius(v)).all()
    assert float(tight_radius(torch.zeros(1), torch.zeros(1))[0]) == 0.0
    with pytest.raises(ValueError):
        conservative_radius(v, 0.5)  # z*sqrt(V_hat) is not a conservative region below ~0.785


@pytest.mark.parametrize("name", ["rank1", "two", "geometric", "isotropic"])
def test_tight_radius_is_calibrated_for_a_gaussian_error_with_known_covariance(name):
    g = torch.Generator().manual_seed(1)
    lam = _spectrum(name)
    err = (torch.randn(40000, 64, generator=g, dtype=torch.float64).square() * lam).sum(-1).sqrt()
    tc, tc2 = lam.sum()[None], lam.square().sum()[None]
    for level in LEVELS:
        cov = float((err <= tight_radius(tc, tc2, level)).double().mean())
        assert abs(cov - level) < 0.02, (name, level, cov)


def test_sketch_moment_identity():
    """E[tr(C_S^2)] = k(k+1) tr(C^2) + k tr(C)^2 and E[tr(C_S)] = k tr(C) for C_S = R^T C R, R iid N(0, 1)."""
    g = torch.Generator().manual_seed(2)
    d, k = 64, 8
    u = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    lam = _spectrum("geometric")
    c = u @ torch.diag(lam) @ u.T
    r = torch.randn(40000, d, k, generator=g, dtype=torch.float64)
    cs = r.transpose(-1, -2) @ c @ r
    t2 = cs.square().sum((-1, -2)).mean()
    expected = k * (k + 1) * lam.square().sum() + k * lam.sum() ** 2
    assert abs(float(t2 / expected) - 1) < 0.02
    assert abs(float(cs.diagonal(dim1=-2, dim2=-1).sum(-1).mean() / (k * lam.sum())) - 1) < 0.01


def _one_draw(n=200, d=16, seed=0, n_keep=80):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    scores = (k @ q * 0.25).softmax(-1)
    sel = get_design("randomized")(scores[None], n_keep, tail_fraction=0.75, floor=0.2, generator=g)
    kk, vv = gather_tokens(k[None], sel.indices), gather_tokens(v[None], sel.indices)
    omp = sel.one_minus_pi.double()
    res = hajek_attention(q[None, None], kk, vv, sel.offset.double(), scale=0.25, one_minus_pi=omp)
    return res, vv, omp, sel


def test_traces_against_direct_sums():
    res, vv, omp, sel = _one_draw()
    w, o, s = res.weights, res.output, sel.tail_slots
    assert torch.allclose(trace_c(w, vv, o, omp, tail_slots=s), res.variance, rtol=1e-10)
    a = (omp[0, :s] * w[0, 0, :s] ** 2).tolist()
    x = vv[0, :s] - o[0, 0]
    gram = (x @ x.T).square()
    full = sum(a[i] * a[j] * float(gram[i, j]) for i in range(s) for j in range(s))
    diag = sum(float(omp[0, i]) * a[i] ** 2 * float(gram[i, i]) for i in range(s))
    assert math.isclose(float(trace_c2_exact(w, vv, o, omp, tail_slots=s, debias=False)[0, 0]), full, rel_tol=1e-10)
    assert math.isclose(float(diagonal_term(w, vv, o, omp, tail_slots=s)[0, 0]), diag, rel_tol=1e-10)
    tc = float(res.variance[0, 0])
    expected = min(max(full - diag, tc**2 / 16), tc**2)
    assert math.isclose(float(trace_c2_exact(w, vv, o, omp, tail_slots=s)[0, 0]), expected, rel_tol=1e-10)
    c = covariance(w, vv, o, omp, tail_slots=s)[0, 0]
    assert torch.allclose(c, c.T) and float(torch.linalg.eigvalsh(c).min()) > -1e-12
    h = effective_dimension(res.variance, trace_c2_exact(w, vv, o, omp, tail_slots=s))
    assert 1 <= float(h) <= 16


def test_sketched_trace_c2_is_unbiased_over_sketches_before_clamping():
    """With a fixed C_hat, the moment estimator (debias off, no clamp active) averages to tr(C_hat^2)."""
    res, vv, omp, sel = _one_draw(seed=3)
    w, o, s = res.weights, res.output, sel.tail_slots
    exact = trace_c2_exact(w, vv, o, omp, tail_slots=s, debias=False)
    g = torch.Generator().manual_seed(5)
    k = 8
    r = torch.randn(4000, 16, k, generator=g, dtype=torch.float64)
    vs = vv[:, :s] @ r  # (4000, s, k)
    c_s = sketch_values(vv[:, :s], r[0])
    assert c_s.shape == (1, s, k)
    o_r = o[0] @ r  # (4000, 1, k)
    centred = vs.unsqueeze(1) - o_r.unsqueeze(-2)
    a = omp[0, :s] * w[0, 0, :s] ** 2
    cs = (centred * a[:, None]).transpose(-1, -2) @ centred
    t2 = cs.square().sum((-1, -2))[:, 0]
    est = (t2 - k * res.variance[0, 0] ** 2) / (k * (k + 1))
    assert abs(float(est.mean() / exact[0, 0]) - 1) < 0.05


def test_sketched_estimator_tracks_the_exact_one_and_its_radius_covers_alike():
    g = torch.Generator().manual_seed(3)
    p = random_problem(generator=g, peakedness=1.5, window_noise=0.3)
    r = monte_carlo(p, budget=0.25, tail_fraction=0.75, floor=0.2, draws=600, generator=g, moments=True, sketch_k=8)
    v, exact, sk = r["variance"], r["trace_c2"], r["trace_c2_sketch"]
    assert float((sk / exact).log().abs().median()) < 0.3  # effective dimension within ~35% for half the cells
    e = r["sq_err"].sqrt()
    cov_exact = float((e <= tight_radius(v, exact)).double().mean())
    cov_sketch = float((e <= tight_radius(v, sk)).double().mean())
    assert abs(cov_exact - cov_sketch) < 0.02
    assert abs(float((tight_radius(v, sk) / tight_radius(v, exact)).median()) - 1) < 0.03
    with pytest.raises(ValueError):
        sketched_trace_c2(
            torch.ones(1, 1, 2),
            torch.ones(1, 2),
            torch.ones(1, 2, 3),
            torch.ones(1, 1, 4),
            torch.ones(4, 3),
            torch.ones(1, 1),
            method="nope",
        )


def test_tight_radius_is_calibrated_in_the_well_scored_regime():
    """Where V_hat is unbiased (well-scored, E[V_hat]/MSE ~ 1), the debiased Satterthwaite radius is within 0.02
    of nominal at levels 0.5-0.99 (pooled over eight problems x 500 design draws; single problems scatter by
    about +-0.03 at level 0.5, which is Monte Carlo noise plus the problem's own conditional law)."""
    errs, vs, tc2s = [], [], []
    for seed, peak, budget in [(s, pk, b) for s in (3, 4, 5, 6) for pk, b in ((1.5, 0.25), (1.0, 0.5))]:
        g = torch.Generator().manual_seed(seed)
        p = random_problem(generator=g, peakedness=peak, window_noise=0.3)
        r = monte_carlo(p, budget=budget, tail_fraction=0.75, floor=0.2, draws=500, generator=g, moments=True)
        errs.append(r["sq_err"].sqrt())
        vs.append(r["variance"])
        tc2s.append(r["trace_c2"])
    e, v, tc2 = torch.cat(errs), torch.cat(vs), torch.cat(tc2s)
    for level in LEVELS:
        cov = float((e <= tight_radius(v, tc2, level)).double().mean())
        assert abs(cov - level) < 0.02, (level, cov)
    # without debiasing the effective dimension is too small and the radius mis-calibrated at 0.95
    assert float((e <= conservative_radius(v)).double().mean()) > 0.99


def test_tail_diagnostics_on_a_known_layout():
    # slots: 3 tail slots (the last one is a head token in this row: 1 - pi = 0), 2 head, 1 padding, 2 appended
    p = torch.tensor([[[0.1, 0.3, 0.05, 0.2, 0.15, 0.0, 0.1, 0.1]]], dtype=torch.float64)
    omp = torch.tensor([[0.5, 0.9, 0.0]], dtype=torch.float64)
    out = tail_diagnostics(p, omp, tail_slots=3, prefix=6)
    assert math.isclose(float(out["tail_mass"]), 0.4)
    assert math.isclose(float(out["ess_tail"]), 0.4**2 / (0.1**2 + 0.3**2))
    assert float(out["n_tail"]) == 2
    assert math.isclose(float(out["tail_max"]), 0.3)
    assert math.isclose(float(out["head_mass"]), 0.05 + 0.2 + 0.15)
    none = tail_diagnostics(p, torch.zeros(1, 3, dtype=torch.float64), tail_slots=3)
    assert float(none["ess_tail"]) == 0 and float(none["tail_mass"]) == 0 and float(none["n_tail"]) == 0


def test_make_sketch_and_errors():
    g = torch.Generator().manual_seed(0)
    r = make_sketch(64, 8, generator=g)
    assert r.shape == (64, 8) and r.dtype == torch.float32
    with pytest.raises(ValueError):
        make_sketch(64, 0, generator=g)
    with pytest.raises(ValueError):
        chi2_quantile(1.0, torch.ones(1))


def test_sketched_estimator_equals_the_direct_sketch_formula():
    """The GEMM form (P - oR u^T - u oR^T + sum(a) oR oR^T) equals S^T diag(a) S with S = VR - oR, for a fixed R."""
    res, vv, omp, sel = _one_draw(seed=4)
    w, o, s = res.weights, res.output, sel.tail_slots
    r = make_sketch(16, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tail = sketch_tail(vv[:, :s], r)
    sq = (vv[0, :s] - o[0, 0]) @ r  # (s, k)
    a = omp[0, :s] * w[0, 0, :s] ** 2
    c_s = (sq * a[:, None]).T @ sq
    k, v = 6, res.variance[0, 0]
    t2 = c_s.square().sum()
    direct = ((t2 - k * v**2) / (k * (k + 1))).clamp(v**2 / 16, v**2)
    got = sketched_trace_c2(w, omp, tail, o, r, res.variance, method="moment", debias=False)[0, 0]
    assert torch.isclose(got, direct, rtol=1e-9)
    d_sketch = (omp[0, :s] * a**2 * sq.square().sum(-1).square()).sum() / (k * (k + 2))
    got_d = sketched_trace_c2(w, omp, tail, o, r, res.variance, method="moment", debias="sketch")[0, 0]
    assert torch.isclose(
        got_d, (direct_unclamped := (t2 - k * v**2) / (k * (k + 1)) - d_sketch).clamp(v**2 / 16, v**2), rtol=1e-9
    ), direct_unclamped


def test_kvstate_layout_batches_like_single_rows():
    """The hot-path layout: weights (B, Hkv, G, L), one_minus_pi (B, Hkv, s), output (B, Hkv, G, d), variance
    (B, Hkv, G); a SketchedTail per (B, Hkv). Batched results equal row-by-row ones."""
    g = torch.Generator().manual_seed(9)
    b, hkv, grp, s, length, d = 2, 3, 2, 7, 12, 16
    w = torch.rand(b, hkv, grp, length, generator=g, dtype=torch.float64)
    w = w / w.sum(-1, keepdim=True)
    omp = torch.rand(b, hkv, s, generator=g, dtype=torch.float64)
    omp[0, 1, -2:] = 0  # a row with fewer tail tokens (head tokens in its last tail slots)
    vals = torch.randn(b, hkv, length, d, generator=g, dtype=torch.float64)
    out = w @ vals
    var = trace_c(w, vals, out, omp, tail_slots=s)
    r = make_sketch(d, 8, generator=g, dtype=torch.float64)
    tail = sketch_tail(vals[:, :, :s], r)
    est = sketched_trace_c2(w, omp, tail, out, r, var)
    diag = tail_diagnostics(w, omp, tail_slots=s, prefix=10)
    exact = trace_c2_exact(w, vals, out, omp, tail_slots=s)
    assert est.shape == exact.shape == var.shape == (b, hkv, grp)
    for i in range(b):
        for j in range(hkv):
            one = sketch_tail(vals[i, j, :s], r)
            e1 = sketched_trace_c2(w[i, j], omp[i, j], one, out[i, j], r, var[i, j])
            assert torch.allclose(e1, est[i, j], rtol=1e-10)
            x1 = trace_c2_exact(w[i, j], vals[i, j], out[i, j], omp[i, j], tail_slots=s)
            assert torch.allclose(x1, exact[i, j], rtol=1e-10)
            d1 = tail_diagnostics(w[i, j], omp[i, j], tail_slots=s, prefix=10)
            for key in d1:
                assert torch.allclose(d1[key], diag[key][i, j]), key
    assert float(diag["n_tail"][0, 1, 0]) == s - 2


def test_hot_path_sketch_estimate_equals_the_reference_form():
    """The decode loop's trace_c2_from_features gives the same tr(C^2) estimate as sketched_trace_c2."""
    from kvcert.core.sketch import (
        make_sketch,
        sketch_tail,
        sketched_trace_c2,
        tail_features,
        trace_c2_from_features,
    )

    g = torch.Generator().manual_seed(4)
    b, h, t, s, m, d = 2, 3, 2, 40, 60, 16
    p = torch.rand(b, h, t, m, generator=g, dtype=torch.float64).softmax(-1)
    v = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    omp = torch.rand(b, h, s, generator=g, dtype=torch.float64)
    o = torch.randn(b, h, t, d, generator=g, dtype=torch.float64)
    r = make_sketch(d, 8, generator=g, dtype=torch.float64)
    vhat = (omp.unsqueeze(-2) * p[..., :s].square() * ((v.unsqueeze(-3) - o.unsqueeze(-2)).square().sum(-1))).sum(-1)
    ref = sketched_trace_c2(p, omp, sketch_tail(v, r), o, r, vhat)
    fast = trace_c2_from_features(p, omp, tail_features(v, r), o, r, vhat)
    assert torch.allclose(ref, fast, rtol=1e-9, atol=1e-12)
    packed = tail_features(v, r, packed=True)
    assert packed.shape[-1] == 8 * 9 // 2 + 2 * 8 + 3 == 55  # the symmetric block stored once
    assert torch.allclose(ref, trace_c2_from_features(p, omp, packed, o, r, vhat), rtol=1e-9, atol=1e-12)
    # the packed layout is the full layout's upper triangle, row-major, the same floats bit for bit (float32 too)
    rows, cols = torch.triu_indices(8, 8)
    for x, sketch in ((v, r), (v.float(), r.float())):
        full, tri = tail_features(x, sketch), tail_features(x, sketch, packed=True)
        assert torch.equal(tri[..., :36], full[..., :64][..., rows * 8 + cols])
        assert torch.equal(tri[..., 36:], full[..., 64:])
        out = torch.empty_like(tri)
        assert tail_features(x, sketch, packed=True, out=out) is out and torch.equal(out, tri)
