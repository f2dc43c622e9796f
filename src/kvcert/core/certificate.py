"""The certificate as a distribution, not just a variance: tr(C), tr(C^2), a tight radius, per-cell diagnostics.

The linearized error of the Hajek estimator under Poisson sampling has covariance estimated by

    C_hat = sum_{tail} (1 - pi_i) p_i^2 (v_i - o_hat)(v_i - o_hat)^T,      tr(C_hat) = V_hat.

V_hat alone bounds ||e||^2 only in expectation, so z * sqrt(V_hat) is a conservative region of a d-dimensional
Gaussian error only for z^2 >= 1.5365 (levels above ~0.785). With tr(C^2) as well, ||e||^2 is approximated by a
scaled chi-square with the same first two moments (Satterthwaite):

    ||e||^2 ~ g * chi2_h,   g = tr(C^2) / tr(C),   h = tr(C)^2 / tr(C^2)  (effective dimension, 1 <= h <= d),

so r_tight(level) = sqrt(g * chi2.ppf(level, h)). h = 1 (rank-one error) gives back the two-sided normal radius
z * sqrt(V_hat); h = d (isotropic) gives the radius of a d-dimensional Gaussian ball.

tr(C^2) exactly needs a d x d matrix (`trace_c2_exact`: the reference for tests and small tails); the decode
hot path estimates it through a fixed Gaussian sketch of the value space (kvcert.core.sketch).

Debiasing. tr(C_hat^2) over-estimates tr(C^2) by the i = j terms (E[tr(C_hat^2)] = tr(C^2) + E[D],
D = sum_tail (1 - pi) a^2 ||v - o_hat||^4); without removing D the effective dimension is too small and the
radius mis-calibrated (Monte Carlo, well-scored regime: 0.47 / 0.83 / 0.98 coverage at levels 0.5 / 0.8 / 0.95,
against 0.48 / 0.79-0.81 / 0.95-0.96 debiased). Both estimators subtract D (the sketch one with a sketched D).

The quantile: `chi2_quantile` is exact (Newton steps on torch.special.gammainc from the Wilson-Hilferty start,
float64, agreeing with scipy.stats.chi2.ppf to ~1e-10 relative; tested); `tight_radius` uses it.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from kvcert.core.hajek import z_value
from kvcert.core.sketch import sketch_tail, sketched_trace_c2

#: z^2 above which z * sqrt(V_hat) is a conservative region of any d-dimensional Gaussian error (Szekely & Bakirov)
CONSERVATIVE_Z2 = 1.5365


# ------------------------------------------------------------------------------------------ the covariance's traces
def _tail_weights(weights: torch.Tensor, one_minus_pi: torch.Tensor, tail_slots: int | None) -> torch.Tensor:
    """a_i = (1 - pi_i) p_i^2 over the first tail_slots entries: weights (..., T, m), one_minus_pi (..., m or s)."""
    s = weights.shape[-1] if tail_slots is None else tail_slots
    return one_minus_pi[..., :s].unsqueeze(-2).to(weights.dtype) * weights[..., :s].square()


def trace_c(weights, values, output, one_minus_pi, *, tail_slots: int | None = None) -> torch.Tensor:
    """tr(C_hat) = V_hat (..., T), the same number hajek_attention returns (direct form, for tests)."""
    a = _tail_weights(weights, one_minus_pi, tail_slots)
    s = a.shape[-1]
    centred = values[..., :s, :].unsqueeze(-3) - output.unsqueeze(-2)  # (..., T, s, d)
    return (a * centred.square().sum(-1)).sum(-1)


def covariance(weights, values, output, one_minus_pi, *, tail_slots: int | None = None) -> torch.Tensor:
    """C_hat (..., T, d, d) itself: the reference (2 T d^2 flops per query; tests and small tails only)."""
    a = _tail_weights(weights, one_minus_pi, tail_slots)
    s = a.shape[-1]
    centred = values[..., :s, :].unsqueeze(-3) - output.unsqueeze(-2)  # (..., T, s, d)
    return (centred * a.unsqueeze(-1)).transpose(-1, -2) @ centred


def diagonal_term(weights, values, output, one_minus_pi, *, tail_slots: int | None = None) -> torch.Tensor:
    """D = sum_tail (1 - pi_i) a_i^2 ||v_i - o_hat||^4 (..., T): the part of tr(C_hat^2) that is design bias.

    Under Poisson sampling E[tr(C_hat^2)] = tr(C^2) + E[D] (the i = j terms carry 1/pi_i^2 where an unbiased
    estimator carries 1/pi_i), so tr(C_hat^2) - D is design-unbiased for tr(C^2). D is also the Horvitz-Thompson
    estimate of Var(V_hat)."""
    a = _tail_weights(weights, one_minus_pi, tail_slots)
    s = a.shape[-1]
    x2 = (values[..., :s, :].unsqueeze(-3) - output.unsqueeze(-2)).square().sum(-1)  # (..., T, s)
    return (one_minus_pi[..., :s].unsqueeze(-2).to(a.dtype) * a.square() * x2.square()).sum(-1)


def trace_c2_exact(
    weights, values, output, one_minus_pi, *, tail_slots: int | None = None, debias: bool = True
) -> torch.Tensor:
    """tr(C^2) (..., T) from the exact C_hat: ||C_hat||_F^2, minus the diagonal_term when debias (default).

    weights (..., T, m), values (..., m, d), output (..., T, d); 2 T d^2 flops per query (reference / small tails).
    The debiased value is what calibrates the radius (Monte Carlo, tests); it is clamped to [tr(C)^2/d, tr(C)^2].
    """
    c = covariance(weights, values, output, one_minus_pi, tail_slots=tail_slots)
    tc2 = c.square().sum((-1, -2))
    if not debias:
        return tc2
    tc = c.diagonal(dim1=-2, dim2=-1).sum(-1)
    tc2 = tc2 - diagonal_term(weights, values, output, one_minus_pi, tail_slots=tail_slots)
    return torch.minimum(torch.maximum(tc2, tc.square() / c.shape[-1]), tc.square())


def effective_dimension(trace_c: torch.Tensor, trace_c2: torch.Tensor) -> torch.Tensor:
    """h = tr(C)^2 / tr(C^2) (1 for a rank-one error, d for an isotropic one); 1 where tr(C) = 0."""
    h = trace_c.square() / trace_c2.clamp_min(torch.finfo(trace_c2.dtype).tiny)
    return torch.where(trace_c2 > 0, h, torch.ones_like(h)).clamp_min(1.0)


# ---------------------------------------------------------------------------------------------- quantile, radius
def chi2_quantile(level: float, dof: torch.Tensor, *, newton_steps: int = 20) -> torch.Tensor:
    """chi2.ppf(level, dof) for real dof > 0 (tensor), in float64: Newton on gammainc in log(x / 2), started at
    the larger of Wilson-Hilferty and the small-x lower bound (level Gamma(a + 1))^(1/a), a = dof / 2."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    h = dof.to(torch.float64).clamp_min(1e-6)
    z = NormalDist().inv_cdf(level)
    c = 2.0 / (9.0 * h)
    x = h * (1 - c + z * c.sqrt()).clamp_min(1e-3) ** 3
    a = h / 2
    lg = torch.lgamma(a)
    low = (math.log(level) + torch.lgamma(a + 1)) / a  # log y with y^a / Gamma(a+1) = level (P(a, y) <= that)
    u = torch.maximum((x / 2).log(), low)  # Newton in log(y), y = x / 2: f(u) = P(a, e^u) - level
    for _ in range(newton_steps):
        y = u.exp()
        f = torch.special.gammainc(a, y) - level
        dens = torch.exp(a * u - y - lg)  # y * d/dy P(a, y) = y^a e^-y / Gamma(a)
        u = u - (f / dens.clamp_min(1e-300)).clamp(-2.0, 2.0)
    return 2 * u.exp()


def tight_radius(trace_c: torch.Tensor, trace_c2: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """Satterthwaite radius sqrt(g * chi2.ppf(level, h)), g = tr(C^2)/tr(C), h = tr(C)^2/tr(C^2); 0 where V_hat = 0.

    Exact chi-square quantile (float64 Newton, see chi2_quantile), returned in trace_c's dtype.
    """
    tc = trace_c.to(torch.float64).clamp_min(0)
    h = effective_dimension(tc, trace_c2.to(torch.float64))
    # g * q = tr(C) * q / h avoids dividing by a tiny tr(C^2)
    r = (tc * chi2_quantile(level, h) / h).sqrt()
    return r.to(trace_c.dtype)


def conservative_radius(trace_c: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """The documented conservative bound z_{1-alpha/2} sqrt(V_hat) (hajek.certificate_radius); a valid Gaussian
    region in any dimension only when z^2 >= 1.5365, i.e. level >= ~0.785."""
    if z_value(level) ** 2 < CONSERVATIVE_Z2:
        raise ValueError(f"z*sqrt(V_hat) is not conservative below level ~0.785 (z^2 < 1.5365), got {level!r}")
    return z_value(level) * trace_c.clamp_min(0).sqrt()


# --------------------------------------------------------------------------------------------- per-cell diagnostics
def tail_diagnostics(
    weights: torch.Tensor,
    one_minus_pi: torch.Tensor,
    *,
    tail_slots: int,
    prefix: int | None = None,
    tail_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Cheap reductions of one step's attention weights p (..., T, L) over the slot layout of a Selection / bucket:
    tail tokens first (pi < 1, one_minus_pi > 0, within the first tail_slots), then head (pi = 1), then padding
    (p = 0), then -- from `prefix` on -- tokens appended after compression (pi = 1, not counted as head).

    Returns (..., T) tensors:
      tail_mass  sum of p over tail tokens
      ess_tail   Kish effective sample size of the tail weights, (sum p)^2 / sum p^2 over tail tokens (0 if none)
      n_tail     number of sampled tail tokens (the same for every query of a row)
      tail_max   largest tail weight
      head_mass  mass of the retained prompt head: prompt tokens with pi = 1 (p over [0, prefix) minus tail_mass)

    tail_sums: (sum of p, sum of p^2) over the tail tokens, (..., T) each, when the caller has them already (the
    deferred decode statistics get both from one matmul); None computes them here.
    """
    s = tail_slots
    tail = (one_minus_pi[..., :s] > 0).unsqueeze(-2).to(weights.dtype)  # (..., 1, s)
    pt = weights[..., :s] * tail
    if tail_sums is None:
        mass = pt.sum(-1)
        sq = pt.square().sum(-1)
    else:
        mass, sq = tail_sums
    ess = torch.where(sq > 0, mass.square() / sq.clamp_min(torch.finfo(sq.dtype).tiny), torch.zeros_like(sq))
    n_tail = tail.sum(-1).expand_as(mass)
    prefix_mass = weights[..., : (weights.shape[-1] if prefix is None else prefix)].sum(-1)
    return {
        "tail_mass": mass,
        "ess_tail": ess,
        "n_tail": n_tail,
        "tail_max": pt.amax(-1) if s > 0 else torch.zeros_like(mass),
        "head_mass": (prefix_mass - mass).clamp_min(0),
    }


def certificate_stats(
    weights: torch.Tensor,
    values: torch.Tensor,
    output: torch.Tensor,
    one_minus_pi: torch.Tensor,
    variance: torch.Tensor,
    *,
    tail_slots: int,
    prefix: int | None = None,
    sketch: torch.Tensor | None = None,
    values_sketch: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Everything a decode step records beside V_hat: the diagnostics and trace_c2 (sketched when a sketch and
    its precomputed values_sketch are given, exact otherwise)."""
    out = tail_diagnostics(weights, one_minus_pi, tail_slots=tail_slots, prefix=prefix)
    if sketch is not None:
        if values_sketch is None:
            values_sketch = sketch_tail(values[..., :tail_slots, :], sketch)
        tc2 = sketched_trace_c2(weights, one_minus_pi, values_sketch, output, sketch, variance)
    else:
        tc2 = trace_c2_exact(weights, values, output, one_minus_pi, tail_slots=tail_slots)
    out["trace_c2"] = tc2
    out["eff_dim"] = effective_dimension(variance, tc2)
    return out


def radius_ratio(eff_dim: float, level: float = 0.95) -> float:
    """r_tight / r_conservative at a given effective dimension (a scalar helper for documentation)."""
    q = float(chi2_quantile(level, torch.tensor([float(eff_dim)], dtype=torch.float64))[0])
    return math.sqrt(q / eff_dim) / z_value(level)


# ------------------------------------------------------------------------------------------- the regime flag
TRUSTED_ESS_MIN = 10.0  # the tail has at least this many effective samples
TRUSTED_TAIL_MASS_MIN = 1e-2  # and carries at least this share of the attention
TRUSTED_ESS_RATIO_MIN = 0.3  # and its Hajek weights are nearly equal (ess_tail / n_tail): pi tracks the query


def certificate_trusted(ess_tail, tail_mass, n_tail):
    """Where the certificate is not known to be wrong (torch or numpy arrays; NaN -> False). In the Monte Carlo of
    kvcert.exploratory.certificate_mc no remedy reaches nominal coverage outside this set (peaked and mis-scored
    attention: few effective samples, small pi on tokens that carry real mass); inside it the tight radius covers
    0.949 at level 0.95. A certificate outside it is reported as untrusted, never as a bound."""
    ratio = ess_tail / (n_tail + (n_tail == 0))
    return (ess_tail >= TRUSTED_ESS_MIN) & (tail_mass >= TRUSTED_TAIL_MASS_MIN) & (ratio >= TRUSTED_ESS_RATIO_MIN)
