"""Monte Carlo of the design composed with what kvcert adds around it: a layer's budget shared across heads
(`monte_carlo_heads`, kvcert.core.allocation) and a second draw over a compressed cache (`monte_carlo_two_draws`,
kvcert.core.recompress). The problems are kvcert.core.simulate's; the certificate is checked against the truth.
"""

from __future__ import annotations

import torch

from kvcert.core.allocation import allocate
from kvcert.core.designs import get_design
from kvcert.core.hajek import certificate_radius, exact_attention, gather_tokens, hajek_attention
from kvcert.core.recompress import redraw
from kvcert.core.simulate import AttentionProblem


def monte_carlo_heads(
    problems: list[AttentionProblem],
    *,
    allocation: str = "uniform",
    design: str = "randomized",
    budget: float = 0.5,
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    draws: int = 2000,
    level: float = 0.95,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """`monte_carlo` for the heads of one layer (problems of one n and d): the layer's budget shared by `allocation`
    (kvcert.core.allocation, from the heads' scores), one design draw per head at that head's count, and the
    certificate per head. Returns per head (H,): counts, coverage, vhat_over_mse, kept_mean."""
    scores = torch.stack([p.scores for p in problems])  # (H, n)
    n_heads, n = scores.shape
    counts = allocate(allocation, scores, round(budget * n))
    counts = torch.as_tensor(counts).expand(n_heads).contiguous()
    sel = get_design(design)(
        scores.expand(draws, n_heads, n).contiguous(),
        counts.expand(draws, n_heads).contiguous(),
        tail_fraction=tail_fraction,
        floor=floor,
        generator=generator,
    )
    keys = torch.stack([p.keys for p in problems])  # (H, n, d)
    values = torch.stack([p.values for p in problems])
    queries = torch.stack([p.query for p in problems])[:, None]  # (H, 1, d)
    k = gather_tokens(keys.expand(draws, -1, -1, -1), sel.indices)
    v = gather_tokens(values.expand(draws, -1, -1, -1), sel.indices)
    res = hajek_attention(
        queries.expand(draws, -1, -1, -1),
        k,
        v,
        sel.offset.to(values.dtype),
        scale=problems[0].scale,
        one_minus_pi=sel.one_minus_pi.to(values.dtype),
    )
    exact = exact_attention(queries, keys, values, scale=problems[0].scale)[:, 0]  # (H, d)
    sq_err = (res.output[:, :, 0] - exact).square().sum(-1)  # (draws, H)
    var = res.variance[:, :, 0]
    return {
        "counts": counts,
        "coverage": (sq_err.sqrt() <= certificate_radius(var, level)).double().mean(0),
        "vhat_over_mse": var.mean(0) / sq_err.mean(0),
        "kept_mean": sel.kept_counts.double().mean(0),
    }


def monte_carlo_two_draws(
    problem: AttentionProblem,
    *,
    design: str = "randomized",
    budgets: tuple[float, float] = (0.5, 0.5),
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    draws: int = 4000,
    level: float = 0.95,
    generator: torch.Generator,
) -> dict[str, float | torch.Tensor]:
    """Two draws in sequence (kvcert.core.recompress): the first keeps budgets[0] of the n tokens by the problem's
    scores; the second keeps budgets[1] of those by the decode query's own attention weights (scores that see only
    what the first draw left, as a re-compression does), with pi = the product of the two draws'. Returns the
    Horvitz-Thompson sums per draw, num (draws, d) = sum_S w v / pi and den (draws,) = sum_S w / pi, next to the
    exact num_exact = sum_all w v and den_exact = sum_all w (w = exp(logit - max)), and the certificate's coverage
    and E[V_hat] / MSE of the composed design."""
    n = problem.keys.shape[0]
    first = get_design(design)(
        problem.scores.expand(draws, n).contiguous(),
        round(budgets[0] * n),
        tail_fraction=tail_fraction,
        floor=floor,
        generator=generator,
    )
    logits = problem.keys @ problem.query * problem.scale
    w_all = (logits - logits.max()).exp()  # (n,)
    w1 = w_all[first.indices]  # (draws, m1): the first draw's entries, as a cache holds them
    second = redraw(
        (w1 / w_all.sum()).masked_fill(~first.valid, 0.0).float(),
        first.log_pi.double().masked_fill(~first.valid, 0.0),
        first.valid,
        round(budgets[1] * budgets[0] * n),
        design=design,
        tail_fraction=tail_fraction,
        floor=floor,
        score_power=1.0,
        generator=generator,
    )
    tokens = first.indices.gather(-1, second.indices)  # (draws, m2) positions in [0, n)
    inv_pi = (-second.log_pi.double()).exp().masked_fill(~second.valid, 0.0)
    w = w_all[tokens] * inv_pi
    num = (w.unsqueeze(-1) * problem.values[tokens]).sum(-2)
    v = problem.values[tokens]
    res = hajek_attention(
        problem.query.expand(draws, 1, -1),
        problem.keys[tokens],
        v,
        second.offset.to(v.dtype),
        scale=problem.scale,
        one_minus_pi=second.one_minus_pi.to(v.dtype),
    )
    exact = exact_attention(problem.query[None, None], problem.keys[None], problem.values[None], scale=problem.scale)
    sq_err = (res.output[:, 0] - exact[0, 0]).square().sum(-1)
    var = res.variance[:, 0]
    return {
        "num": num,
        "den": w.sum(-1),
        "num_exact": (w_all.unsqueeze(-1) * problem.values).sum(0),
        "den_exact": w_all.sum(),
        "coverage": float((sq_err.sqrt() <= certificate_radius(var, level)).double().mean()),
        "vhat_over_mse": float(var.mean() / sq_err.mean()),
        "kept_mean": float(second.kept_counts.double().mean()),
    }
