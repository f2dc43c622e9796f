"""The prefill probe (kvcert.core.probe) against a float64 recomputation written out query by query, and its
certificate's V_hat against the Monte Carlo variance of the Hajek estimate over Poisson draws."""

from __future__ import annotations

import math

import torch

from kvcert.core.certificate import trace_c2_exact
from kvcert.core.probe import window_probe


def _problem(seed: int = 0, n: int = 60, w: int = 6, n_kv: int = 2, g: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_kv, n, d, generator=gen, dtype=torch.float64)
    values = torch.randn(n_kv, n, d, generator=gen, dtype=torch.float64)
    queries = torch.randn(n_kv * g, w, d, generator=gen, dtype=torch.float64)
    positions = torch.arange(n - w, n)
    return keys, values, queries, positions


def _naive(queries, keys, values, positions, kept, log_pi, scale, window=None):
    """o and o_hat per (query head, window query), one query at a time in float64."""
    n_q, w, _ = queries.shape
    g = n_q // keys.shape[0]
    exact = torch.zeros(n_q, w, keys.shape[-1], dtype=torch.float64)
    hat = torch.zeros_like(exact)
    for h in range(n_q):
        kv = h // g
        for i, t in enumerate(positions.tolist()):
            lo = 0 if window is None else t - window + 1
            visible = list(range(max(lo, 0), t + 1))
            p = torch.softmax(keys[kv, visible] @ queries[h, i] * scale, 0)
            exact[h, i] = p @ values[kv, visible]
            sel = [j for j, pos in enumerate(kept[kv].tolist()) if lo <= pos <= t]
            pos = kept[kv, sel]
            p_hat = torch.softmax(keys[kv, pos] @ queries[h, i] * scale - log_pi[kv, sel], 0)
            hat[h, i] = p_hat @ values[kv, pos]
    return exact, hat


def test_probe_equals_a_float64_recomputation_query_by_query():
    keys, values, queries, positions = _problem()
    n_kv, n = keys.shape[:2]
    gen = torch.Generator().manual_seed(1)
    # kept: a random tail of 20 context tokens at pi = 0.4, then the window's own tokens for sure
    tail = torch.stack([torch.randperm(n - 6, generator=gen)[:20].sort().values for _ in range(n_kv)])
    forced = positions.expand(n_kv, -1)
    kept = torch.cat([tail, forced], -1)
    pi = torch.cat([torch.full((n_kv, 20), 0.4, dtype=torch.float64), torch.ones(n_kv, 6, dtype=torch.float64)], -1)
    scale = 1 / math.sqrt(keys.shape[-1])
    for window in (None, 30):
        res = window_probe(queries, keys, values, kept, -pi.log(), 1 - pi, 20, scale=scale, positions=positions,
                           window=window)  # fmt: skip
        exact, hat = _naive(queries, keys, values, positions, kept, pi.log(), scale, window)
        assert torch.allclose(res.error, (hat - exact).norm(dim=-1), atol=1e-12)
        assert torch.allclose(res.exact_norm, exact.norm(dim=-1), atol=1e-12)
        assert torch.allclose(res.out_norm, hat.norm(dim=-1), atol=1e-12)
        assert (res.relative_error > 0).all()


def test_full_cache_has_zero_error_and_zero_certificate():
    keys, values, queries, positions = _problem(seed=2)
    n_kv, n = keys.shape[:2]
    kept = torch.arange(n).expand(n_kv, -1)
    zeros = torch.zeros(n_kv, n, dtype=torch.float64)
    res = window_probe(queries, keys, values, kept, zeros, zeros, 0, scale=0.3, positions=positions)
    assert res.error.abs().max() < 1e-12 and (res.variance == 0).all() and (res.trace_c2 == 0).all()


def test_probe_variance_matches_the_design_variance_over_poisson_draws():
    """V_hat of the probe, averaged over Poisson draws, tracks the Monte Carlo mean squared error of o_hat (the
    estimator's linearized variance; same setting as the core Monte Carlo's well-scored regime, small n)."""
    keys, values, queries, positions = _problem(seed=3, n=200, w=2, n_kv=1, g=1, d=8)
    keys = keys * 0.3  # a flat attention: no token dominates
    n = keys.shape[1]
    cand = n - 2
    pi = torch.full((1, cand), 0.5, dtype=torch.float64)
    scale = 1 / math.sqrt(8)
    gen = torch.Generator().manual_seed(4)
    errs, vs, tc2 = [], [], []
    for _ in range(400):
        draw = torch.rand(1, cand, generator=gen, dtype=torch.float64) < pi
        tail = draw[0].nonzero()[:, 0][None]
        s = tail.shape[1]
        kept = torch.cat([tail, positions[None]], -1)
        p = torch.cat([pi[:, :s], torch.ones(1, 2, dtype=torch.float64)], -1)
        res = window_probe(queries, keys, values, kept, -p.log(), 1 - p, s, scale=scale, positions=positions)
        errs.append(res.error.square())
        vs.append(res.variance)
        tc2.append(res.trace_c2)
    mse, mean_v = torch.stack(errs).mean(0), torch.stack(vs).mean(0)
    assert torch.allclose(mean_v, mse, rtol=0.25), (mean_v, mse)
    assert (torch.stack(tc2) <= torch.stack(vs).square() + 1e-15).all()  # tr(C^2) <= tr(C)^2


def test_sketched_trace_c2_is_near_the_exact_value():
    keys, values, queries, positions = _problem(seed=5, n=120, w=3, n_kv=1, g=1, d=16)
    n = keys.shape[1]
    tail = torch.arange(0, n - 3, 2)[None]
    s = tail.shape[1]
    kept = torch.cat([tail, positions[None]], -1)
    p = torch.cat([torch.full((1, s), 0.5, dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64)], -1)
    sketch = torch.randn(16, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    res = window_probe(queries, keys, values, kept, -p.log(), 1 - p, s, scale=0.25, positions=positions, sketch=sketch)
    # the exact tr(C^2) from the same weights, recomputed through the covariance matrix
    k_kept, v_kept = keys[:, kept[0]], values[:, kept[0]]
    hidden = kept[0][None, :] > positions[:, None]  # causal: a window token after the query is not seen
    logits = (queries @ k_kept.transpose(-1, -2) * 0.25 - p.log()[:, None]).masked_fill(hidden, float("-inf"))
    weights = logits.softmax(-1)
    out = weights @ v_kept
    exact = trace_c2_exact(weights, v_kept, out, (1 - p), tail_slots=s)
    assert torch.allclose(res.trace_c2, exact, rtol=0.35)
