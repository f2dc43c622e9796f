"""The non-identifiability construction: deterministic designs cannot see it, randomized designs track it."""

import torch

from kvcert.core import evicted_mask, exact_attention, gather_tokens, get_design, hajek_attention, perturb_values
from kvcert.core.simulate import monte_carlo, random_problem


def test_deterministic_design_is_blind_while_true_error_grows_linearly():
    g = torch.Generator().manual_seed(0)
    p = random_problem(n=400, d=32, generator=g)
    sel = get_design("topk")(p.scores[None], 100)
    evicted = evicted_mask(sel.indices, sel.valid, 400)[0]
    u = torch.randn(32, generator=g, dtype=torch.float64)
    kept_k = gather_tokens(p.keys[None], sel.indices)
    errors, retained = [], []
    for lam in [0.0, 1.0, 3.0, 10.0, 30.0]:
        v = perturb_values(p.values, evicted, u, lam)
        kept_v = gather_tokens(v[None], sel.indices)
        est = hajek_attention(p.query[None, None], kept_k, kept_v, sel.offset.double(), scale=p.scale).output
        exact = exact_attention(p.query[None, None], p.keys[None], v[None], scale=p.scale)
        errors.append(float((est - exact).norm()))
        retained.append(kept_v)
    assert all(torch.equal(retained[0], r) for r in retained)  # bit-identical retained data
    # error(lambda) = || e0 - lambda * m u || with m = attention mass on evicted tokens: linear for large lambda
    slope = (errors[4] - errors[3]) / 20.0
    assert slope > 0 and abs((errors[3] - errors[2]) / 7.0 - slope) / slope < 0.05
    assert errors[4] > 10 * errors[0]


def test_randomized_mean_vhat_tracks_mse_as_lambda_grows():
    g = torch.Generator().manual_seed(3)
    p = random_problem(n=600, d=32, peakedness=1.5, generator=g)
    non_head = torch.ones(600, dtype=torch.bool)
    non_head[p.scores.topk(150).indices] = False  # head of budget 300 with tail fraction 0.5
    u = torch.randn(32, generator=g, dtype=torch.float64)
    ratios, mses = [], []
    for lam in [0.0, 3.0, 10.0, 30.0]:
        v = perturb_values(p.values, non_head, u, lam)
        r = monte_carlo(p, budget=0.5, draws=2000, generator=torch.Generator().manual_seed(11), values=v)
        ratios.append(r["vhat_over_mse"])
        mses.append(r["mse"])
    assert mses[-1] > 50 * mses[0]
    assert all(abs(x - 1) < 0.1 for x in ratios), ratios
