"""Inclusion probabilities of the Poisson tail: pi_i = min(1, c * u_i) with sum pi = expected tail size."""

from __future__ import annotations

import torch


def inclusion_probabilities(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    expected_size: float | torch.Tensor,
    *,
    floor: float,
    score_power: float,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Solve pi over the candidate tokens of every row (float64, 0 outside the candidates); expected_size is one
    number or one per row (..., ) (a head-wise allocation gives every head its own tail size).

    u_i = (1 - floor) * s_i^power / sum_cand(s^power) + floor / n_cand  (the floor keeps every pi_i > 0),
    pi_i = min(1, c u_i) with c chosen so that sum_cand pi_i = expected_size exactly (iterated cap, done in closed
    form: with the k largest u capped at 1, c = (t - k) / sum of the other u; the right k is the smallest for which the
    (k+1)-th largest u stays below 1/c).

    order: an arrangement of each row's entries under which u should be non-increasing (the candidates by score,
    highest first, then the others), when the caller has one: checked, and u's descending values read off it instead
    of sorting (the same values); u is sorted as before when it is not non-increasing.
    """
    s = scores.double().clamp_min(0) ** score_power * candidates
    n_cand = candidates.sum(-1, keepdim=True).double()
    total = s.sum(-1, keepdim=True)
    uniform = candidates / n_cand.clamp_min(1)
    share = torch.where(total > 0, s / total.clamp_min(1e-300), uniform)
    u = (1.0 - floor) * share + floor * uniform

    # a per-row size broadcasts as (..., 1) against the (..., n) columns; one size stays a Python float
    t = expected_size.double().unsqueeze(-1) if isinstance(expected_size, torch.Tensor) else float(expected_size)
    u_sorted = None
    if order is not None:
        arranged = u.gather(-1, order)
        if bool((arranged[..., 1:] <= arranged[..., :-1]).all()):
            u_sorted = arranged
    if u_sorted is None:
        u_sorted = u.sort(dim=-1, descending=True).values
    before = u_sorted.cumsum(-1) - u_sorted  # mass of the k larger u, k = column index
    k = torch.arange(u.shape[-1], device=u.device, dtype=torch.float64)
    remaining = u_sorted.sum(-1, keepdim=True) - before
    c_k = (t - k) / remaining.clamp_min(1e-300)
    ok = (c_k * u_sorted <= 1.0 + 1e-12) & (k < n_cand) & (remaining > 0)
    # first feasible k per row; rows with none (t >= number of positive u) cap everything at 1
    first = torch.where(ok.any(-1, keepdim=True), ok.double().argmax(-1, keepdim=True), torch.zeros_like(n_cand).long())
    c = c_k.gather(-1, first)
    c = torch.where(ok.any(-1, keepdim=True), c, torch.full_like(c, float("inf")))
    pi = torch.where(u > 0, torch.minimum(c * u, torch.ones_like(u)), torch.zeros_like(u))
    pi = torch.where(torch.as_tensor(t >= n_cand, device=u.device), candidates.double(), pi)
    if isinstance(t, torch.Tensor):
        pi = torch.where(t <= 0, torch.zeros_like(pi), pi)
    elif t <= 0:
        pi = torch.zeros_like(pi)
    return pi * candidates


def uniform_draws(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The Uniform(0, 1) numbers behind a Poisson sample of `shape`, float64, on the generator's device."""
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)


def poisson_sample(
    pi: torch.Tensor, generator: torch.Generator | None, draws: torch.Tensor | None = None
) -> torch.Tensor:
    """Independent Bernoulli(pi_i) draws; the generator is the only source of randomness. `draws`: the uniforms,
    drawn earlier by `uniform_draws(pi.shape, generator)` (a layer-by-layer compression draws every layer's at once,
    so it keeps exactly what the all-layer call keeps)."""
    if draws is None:
        if generator is None:
            raise ValueError("poisson_sample needs a generator or pre-drawn uniforms")
        draws = uniform_draws(tuple(pi.shape), generator)
    elif tuple(draws.shape) != tuple(pi.shape):
        raise ValueError(f"pre-drawn uniforms have shape {tuple(draws.shape)}, pi has {tuple(pi.shape)}")
    return draws.to(pi.device) < pi
