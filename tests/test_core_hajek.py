"""Hajek attention, certificate variance and exact attention against direct float64 computations."""

import pytest
import torch

from kvcert.core import (
    certificate_radius,
    exact_attention,
    gather_tokens,
    get_design,
    hajek_attention,
    window_scores,
    z_value,
)


def _problem(n=300, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    return q, k, v, g


def test_offset_softmax_equals_hajek_ratio_in_float64():
    q, k, v, g = _problem()
    scale = 0.25
    scores = (k @ q * scale).softmax(-1)
    sel = get_design("randomized")(scores[None], 90, tail_fraction=0.6, floor=0.2, generator=g)
    idx, valid = sel.indices[0][sel.valid[0]], sel.valid[0]
    pi = sel.log_pi[0][valid].double().exp()  # the pi the offset encodes
    w = (k[idx] @ q * scale).exp()
    expected = ((w / pi)[:, None] * v[idx]).sum(0) / (w / pi).sum()
    res = hajek_attention(
        q[None, None],
        gather_tokens(k[None], sel.indices),
        gather_tokens(v[None], sel.indices),
        sel.offset.double(),
        scale=scale,
    )
    assert (res.output[0, 0] - expected).abs().max() < 1e-12


def test_certificate_variance_matches_direct_sum():
    q, k, v, g = _problem()
    scores = (k @ q * 0.25).softmax(-1)
    sel = get_design("randomized")(scores[None], 120, tail_fraction=0.5, generator=g)
    kk, vv = gather_tokens(k[None], sel.indices), gather_tokens(v[None], sel.indices)
    omp = sel.one_minus_pi.double()
    res = hajek_attention(q[None, None], kk, vv, sel.offset.double(), scale=0.25, one_minus_pi=omp)
    p, o = res.weights[0, 0], res.output[0, 0]
    direct = ((sel.one_minus_pi[0].double() * p**2) * (vv[0] - o).square().sum(-1)).sum()
    assert abs(float(res.variance[0, 0] - direct)) < 1e-12 * max(1.0, float(direct))
    # stopping the sum at tail_slots is exact
    res2 = hajek_attention(
        q[None, None],
        kk,
        vv,
        sel.offset.double(),
        scale=0.25,
        one_minus_pi=sel.one_minus_pi.double(),
        variance_slots=sel.tail_slots,
    )
    assert torch.allclose(res2.variance, res.variance, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("design", ["topk", "randomized", "randomized_no_offset", "uniform"])
def test_keep_all_reproduces_exact_attention(design):
    q, k, v, g = _problem()
    scores = torch.rand(1, 300, generator=g, dtype=torch.float64)
    sel = get_design(design)(scores, 300, generator=g)
    res = hajek_attention(
        q[None, None],
        gather_tokens(k[None], sel.indices),
        gather_tokens(v[None], sel.indices),
        sel.offset.double(),
        scale=0.3,
        one_minus_pi=sel.one_minus_pi.double(),
    )
    exact = exact_attention(q[None, None], k[None], v[None], scale=0.3)
    assert (res.output - exact).abs().max() < 1e-12
    assert float(res.variance.abs().max()) == 0.0


def test_head_tokens_add_nothing_to_the_variance():
    q, k, v, g = _problem()
    sel = get_design("topk")(torch.rand(1, 300, generator=g), 100)
    res = hajek_attention(
        q[None, None],
        gather_tokens(k[None], sel.indices),
        gather_tokens(v[None], sel.indices),
        sel.offset.double(),
        scale=0.3,
        one_minus_pi=sel.one_minus_pi.double(),
    )
    assert float(res.variance) == 0.0


def test_radius_and_z():
    assert abs(z_value(0.95) - 1.959964) < 1e-6
    assert torch.allclose(certificate_radius(torch.tensor([4.0]), 0.95), torch.tensor([2 * 1.959964]))
    with pytest.raises(ValueError, match="level"):
        z_value(1.0)


def test_window_scores_match_a_loop_and_respect_causality():
    g = torch.Generator().manual_seed(0)
    qw = torch.randn(4, 3, 8, generator=g)  # 4 query heads, window 3
    k = torch.randn(2, 10, 8, generator=g)  # 2 kv heads
    pos = torch.tensor([7, 8, 9])
    s = window_scores(qw, k, scale=0.5, query_positions=pos, pool_kernel=1)
    ref = torch.zeros(2, 10)
    for h in range(4):
        for j in range(3):
            logits = k[h // 2, : pos[j] + 1] @ qw[h, j] * 0.5
            ref[h // 2, : pos[j] + 1] += logits.softmax(-1) / 6
    assert torch.allclose(s, ref, atol=1e-6)
    assert torch.allclose(s.sum(-1), torch.ones(2))
    pooled = window_scores(qw, k, scale=0.5, query_positions=pos, pool_kernel=3)
    assert torch.allclose(pooled[:, 1], s[:, :3].max(-1).values)
    with pytest.raises(ValueError, match="multiple"):
        window_scores(torch.randn(3, 2, 8), k, scale=1.0)
