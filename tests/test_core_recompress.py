"""A second draw over a compressed cache (kvcert.core.recompress): pi is the product over a token's draws, the
Horvitz-Thompson sums stay unbiased for the full sums (Monte Carlo), and the certificate still covers."""

from dataclasses import replace

import torch

from kvcert.core.recompress import redraw
from kvcert.core.simulate import random_problem
from kvcert.core.simulate_composed import monte_carlo_two_draws


def test_redraw_multiplies_pi_and_puts_every_token_below_one_in_the_tail():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 40, generator=g)
    valid = torch.ones(3, 40, dtype=torch.bool)
    valid[1, 30:] = False  # padding is never kept
    prev = torch.where(torch.rand(3, 40, generator=g) < 0.5, torch.log(torch.rand(3, 40, generator=g)), 0.0).double()
    # the design alone, same draws: redraw's kept set and this draw's pi are its, the product is added
    from kvcert.core import get_design
    from kvcert.core.probabilities import uniform_draws

    draws = uniform_draws((3, 40), torch.Generator().manual_seed(1))
    sel = redraw(scores, prev, valid, 12, design="randomized", tail_fraction=0.5, floor=0.2, score_power=1.0,
                 draws=draws)  # fmt: skip
    alone = get_design("randomized")(scores.masked_fill(~valid, 0), 12, draws=draws, candidates=valid)
    for r in range(3):
        kept = sel.indices[r][sel.valid[r]]
        assert set(kept.tolist()) == set(alone.indices[r][alone.valid[r]].tolist())
        assert valid[r, kept].all()
        this = dict(zip(alone.indices[r][alone.valid[r]].tolist(), alone.log_pi[r][alone.valid[r]].tolist()))
        for i, lp in zip(kept.tolist(), sel.log_pi[r][sel.valid[r]].tolist()):
            assert abs(lp - (prev[r, i].item() + this[i])) < 1e-5
        tail = sel.valid[r] & (sel.log_pi[r] < 0)
        assert not tail[sel.tail_slots :].any() and torch.equal(
            tail[: int(tail.sum())], torch.ones(int(tail.sum()), dtype=torch.bool)
        )
    assert torch.allclose(sel.offset[sel.valid], -sel.log_pi[sel.valid])


def test_two_stage_poisson_with_product_pi_is_unbiased_and_the_certificate_covers():
    """Sequential Poisson sampling, the second draw's pi computed on what the first kept: the mean of the
    Horvitz-Thompson numerator and denominator over many seeds matches the exact full sums within Monte Carlo
    error; the Hajek output's certificate keeps E[V_hat] ~ MSE and its coverage."""
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        p = random_problem(n=600, d=32, peakedness=1.5, window_noise=0.3, generator=g)
        p = replace(p, values=p.values[:, :2])
        for design in ("randomized", "uniform"):
            r = monte_carlo_two_draws(p, design=design, draws=10000, generator=torch.Generator().manual_seed(7 + seed))
            num, den = r["num"], r["den"]
            z_den = (den.mean() - r["den_exact"]) / (den.std() / len(den) ** 0.5)
            z_num = (num.mean(0) - r["num_exact"]) / (num.std(0) / len(num) ** 0.5)
            assert abs(float(z_den)) < 4 and (z_num.abs() < 4).all(), (design, z_den, z_num)
            assert abs(r["kept_mean"] - 150) < 2
            assert abs(r["vhat_over_mse"] - 1) < 0.1 and r["coverage"] > 0.93, r
