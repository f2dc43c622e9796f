"""The certificate as a distribution, not just a variance: tr(C), tr(C^2), a tight radius, per-cell diagnostics.

The linearized error of the Hajek estimator under Poisson sampling has covariance estimated by

    C_hat = sum_{tail} (1 - pi_i) p_i^2 (v_i - o_hat)(v_i - o_hat)^T,      tr(C_hat) = V_hat.

V_hat alone bounds ||e||^2 only in expectation, so z * sqrt(V_hat) is a conservative region of a d-dimensional
Gaussian error only for z^2 >= 1.5365 (levels above ~0.785). With tr(C^2) as well, ||e||^2 is approximated by a
scaled chi-square with the same first two moments (Satterthwaite):

    ||e||^2 ~ g * chi2_h,   g = tr(C^2) / tr(C),   h = tr(C)^2 / tr(C^2)  (effective dimension, 1 <= h <= d),

so r_tight(level) = sqrt(g * chi2.ppf(level, h)). h = 1 (rank-one error) gives back the two-sided normal radius
z * sqrt(V_hat); h = d (isotropic) gives the radius of a d-dimensional Gaussian ball.

Cost. tr(C^2) exactly needs a d x d matrix (2 T d^2 flops) or a T x T Gram (2 T^2 d) per query head and step, too
much for the decode hot path. The cheap estimator sketches the value space with a fixed Gaussian R (d x k):

    (a) once per compression (values are fixed then):  sketch_tail(V_tail, R) -> VR = V_tail R and per-token
        features (triu of VR_i VR_i^T, VR_i, ||VR_i||^2 VR_i, ||VR_i||^2, ||VR_i||^4, 1)
    (b) per step and query head:  C_S = sum a_i (VR_i - o_hat R)(VR_i - o_hat R)^T = R^T C_hat R  (k x k),
        a = (1 - pi) p^2, from one GEMM [a; (1 - pi) a^2] @ features (`sketched_trace_c2`)

and for R with iid N(0, 1) entries (C = U diag(l) U^T, R^T C R = sum_j l_j g_j g_j^T with g_j iid N(0, I_k)):

    E[tr(C_S)]   = k tr(C)
    E[tr(C_S^2)] = k(k+2) sum l_j^2 + k sum_{j != m} l_j l_m = k(k+1) tr(C^2) + k tr(C)^2.

Two estimators of tr(C^2) follow (`sketched_trace_c2`):
- "moment": (tr(C_S^2) - k tr(C)^2) / (k(k+1)), unbiased (tr(C) = V_hat is known exactly), clamped to the
  feasible [tr(C)^2 / d, tr(C)^2];
- "ratio" (default): psi = tr(C_S^2) / tr(C_S)^2 is scale free, exactly 1 for a rank-one C whatever R is, and
  psi ~ ((k+1) x + 1) / (k + 2 x) with x = tr(C^2)/tr(C)^2 = 1/h (ratio of the expectations above, using
  E[tr(C_S)^2] = k^2 tr(C)^2 + 2k tr(C^2)); solved x = (k psi - 1) / (k + 1 - 2 psi), clamped to [1/d, 1],
  tr(C^2) = x tr(C)^2. Biased (a ratio) but with much smaller spread; measured in tests against the exact value.

Per-step cost of (b) per query head (T tail tokens, m kept, F = k(k+1)/2 + 3k + 3 = 63 at k = 8): ~4 T F + 2 d k
flops (~100k at T = 400) against ~4 m d for the attention (~136k at m = 530) and ~2 T d for V_hat; memory of (a):
T F floats per (variant, layer, KV head). Measured on one CPU thread (24 variants x 3 KV heads x 3 query heads,
T = 400, m = 530): attention 2.8-4.4 ms per layer, V_hat +0.8-1.4, sketch +1.8-3.0, tail_diagnostics +0.2-0.5:
every step that is roughly +20-35% over attention + dense layers, so compute trace_c2 on a stride of decode steps
(e.g. every 4th) or accept k = 4 (F = 25) if the 1.15x budget is binding.

Debiasing. tr(C_hat^2) over-estimates tr(C^2) by the i = j terms (E[tr(C_hat^2)] = tr(C^2) + E[D],
D = sum_tail (1 - pi) a^2 ||v - o_hat||^4); without removing D the effective dimension is too small and the
radius mis-calibrated (Monte Carlo, well-scored regime: 0.47 / 0.83 / 0.98 coverage at levels 0.5 / 0.8 / 0.95,
against 0.48 / 0.79-0.81 / 0.95-0.96 debiased). Both estimators subtract D (the sketch one with a sketched D).

The quantile: `chi2_quantile` is exact (Newton steps on torch.special.gammainc from the Wilson-Hilferty start,
float64, agreeing with scipy.stats.chi2.ppf to ~1e-10 relative; tested); `tight_radius` uses it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from kvcert.core.hajek import z_value

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


# -------------------------------------------------------------------------------------------- the cheap estimator
def make_sketch(d: int, k: int = 8, *, generator: torch.Generator, dtype=torch.float32, device=None) -> torch.Tensor:
    """A fixed Gaussian sketch R (d, k), iid N(0, 1); drawn once per run (its seed is part of the record)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    r = torch.randn(d, k, generator=generator, dtype=torch.float64)
    return r.to(dtype=dtype, device=device)


def sketch_values(values_tail: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """V_tail @ R, (..., T, d) -> (..., T, k)."""
    return values_tail @ sketch.to(values_tail.dtype)


@dataclass(frozen=True)
class SketchedTail:
    """(a) once per compression, per (variant, layer, KV head): what the per-step estimator reads.

    features = [vec_triu(VR_i VR_i^T) | VR_i | ||VR_i||^2 VR_i | ||VR_i||^2 | ||VR_i||^4 | 1] per tail token, so that
    every tail sum the step needs (C_S and the sketched diagonal term) is ONE GEMM [a; b] @ features shared by the
    query group of a KV head."""

    vr: torch.Tensor  # (..., s, k)   V_tail R (a view into features)
    features: torch.Tensor  # (..., s, k(k+1)/2 + 3k + 3)

    @property
    def k(self) -> int:
        return self.vr.shape[-1]


def sketch_tail(values_tail: torch.Tensor, sketch: torch.Tensor) -> SketchedTail:
    """(a) once per compression: V_tail R and its per-token features, 2 s d k + ~4 s F flops. Memory s F floats
    per (variant, layer, KV head), F = k(k+1)/2 + 3k + 3 = 63 at k = 8 (the values themselves are d = 64)."""
    return sketch_tail_from_vr(sketch_values(values_tail, sketch))


def sketch_tail_from_vr(vr: torch.Tensor) -> SketchedTail:
    k = vr.shape[-1]
    iu = torch.triu_indices(k, k, device=vr.device)
    outer = (vr.unsqueeze(-1) * vr.unsqueeze(-2))[..., iu[0], iu[1]]
    sq = vr.square().sum(-1, keepdim=True)
    feats = torch.cat([outer, vr, sq * vr, sq, sq.square(), torch.ones_like(sq)], -1)
    n_t = outer.shape[-1]
    return SketchedTail(feats[..., n_t : n_t + k], feats)  # vr is a view: 63 floats per tail token at k = 8


def sketched_trace_c2(
    weights: torch.Tensor,
    one_minus_pi: torch.Tensor,
    values_sketch: torch.Tensor | SketchedTail,
    output: torch.Tensor,
    sketch: torch.Tensor,
    trace_c: torch.Tensor,
    *,
    method: str = "ratio",
    debias: bool | str = "sketch",
    values_tail: torch.Tensor | None = None,
    value_sq_norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """(b) per step: estimate of tr(C_hat^2) (..., T) from the SketchedTail (or just V_tail R (..., s, k)) of (a).

    C_S = sum a_i (VR_i - oR)(VR_i - oR)^T = P - oR u^T - u oR^T + (sum a) oR oR^T with P = sum a VR_i VR_i^T and
    u = sum a VR_i, and the sketched diagonal term expanded likewise: all tail sums come from one GEMM
    [a; b] @ features (b = (1 - pi) a^2), 4 T s F flops for T queries, F = k(k+1)/2 + 3k + 3 = 63 at k = 8; no
    (T, s, k) temporary.
    weights (..., T, m) with the tail in the first s slots; one_minus_pi (..., >= s);
    output o_hat (..., T, d); trace_c = V_hat (..., T) from hajek_attention. Returns a value in
    [tr(C)^2 / d, tr(C)^2] (h in [1, d]). debias subtracts the diagonal_term D: "sketch" (default) from
    sum (1 - pi) a^2 ||S_i||^4 / (k (k + 2))  (E||S_i||^4 = k(k+2) ||v_i - o_hat||^4; no extra matvec, and it
    cancels with the sketch's own noise where a few tokens dominate: in the mis-scored Monte Carlo, coverage of the
    sketched radius 0.78 (k = 8) / 0.94 (k = 16) against 0.88 exact, while "exact" D gave 0.80 at k = 8),
    or "exact" from
    ||v_i - o_hat||^2 = ||v_i||^2 - 2 v_i.o_hat + ||o_hat||^2 (needs values_tail, one extra 2 T d matvec per query,
    value_sq_norms as cached by the KV state).
    """
    d, k = sketch.shape
    tail = values_sketch if isinstance(values_sketch, SketchedTail) else sketch_tail_from_vr(values_sketch)
    s = tail.vr.shape[-2]
    n_t = k * (k + 1) // 2
    iu = torch.triu_indices(k, k, device=output.device)
    w = torch.where(iu[0] == iu[1], 1.0, 2.0).to(output.dtype)  # multiplicity of each triu entry in a sum over (j, l)
    omp = one_minus_pi[..., :s].unsqueeze(-2).to(weights.dtype)
    a = omp * weights[..., :s].square()  # (..., T, s)
    sketch_diag = debias == "sketch"
    n_q = a.shape[-2]
    lhs = torch.cat([a, omp * a.square()], -2) if sketch_diag else a  # (..., 2T or T, s)
    sums = lhs @ tail.features  # (..., 2T or T, F): every tail sum in one GEMM
    sa = sums[..., :n_q, :]
    y = output @ sketch.to(output.dtype)  # (..., T, k)  o_hat R
    yy = (y.unsqueeze(-1) * y.unsqueeze(-2))[..., iu[0], iu[1]]  # (..., T, n_t)
    u = sa[..., n_t : n_t + k]  # sum a VR_i
    uy = (u.unsqueeze(-1) * y.unsqueeze(-2))[..., iu[0], iu[1]] + (y.unsqueeze(-1) * u.unsqueeze(-2))[..., iu[0], iu[1]]
    c_s = sa[..., :n_t] - uy + sa[..., -1:] * yy  # triu of C_S = R^T C_hat R
    t2 = (w * c_s.square()).sum(-1)
    tc2_max = trace_c.square()
    if method == "moment":
        est = (t2 - k * tc2_max) / (k * (k + 1))
    elif method == "ratio":
        t1 = c_s[..., iu[0] == iu[1]].sum(-1)
        psi = t2 / t1.square().clamp_min(torch.finfo(t1.dtype).tiny)
        x = (k * psi - 1) / (k + 1 - 2 * psi).clamp_min(1e-12)
        est = x * tc2_max
    else:
        raise ValueError(f"method must be 'ratio' or 'moment', got {method!r}")
    if sketch_diag:  # sum b ||S_i||^4, ||S_i||^2 = sq_i - 2 VR_i.y + ||y||^2, expanded over the GEMM's sums
        sb = sums[..., n_q:, :]
        y2 = y.square().sum(-1)
        b_outer, b_vr = sb[..., :n_t], sb[..., n_t : n_t + k]
        b_sqvr, b_sq, b_sq2, b_1 = sb[..., n_t + k : n_t + 2 * k], sb[..., -3], sb[..., -2], sb[..., -1]
        d4 = (
            b_sq2
            + 4 * (w * yy * b_outer).sum(-1)
            + y2.square() * b_1
            - 4 * (y * b_sqvr).sum(-1)
            + 2 * y2 * b_sq
            - 4 * y2 * (y * b_vr).sum(-1)
        )
        est = est - d4.clamp_min(0) / (k * (k + 2))
    elif debias in (True, "exact"):
        if values_tail is None:
            raise ValueError("debias='exact' needs values_tail (..., s, d) (and optionally value_sq_norms)")
        vt = values_tail[..., :s, :].to(output.dtype)
        vsq = vt.square().sum(-1) if value_sq_norms is None else value_sq_norms[..., :s].to(output.dtype)
        x2 = vsq.unsqueeze(-2) - 2 * (output @ vt.transpose(-1, -2)) + output.square().sum(-1, keepdim=True)
        est = est - (omp * a.square() * x2.clamp_min(0).square()).sum(-1)
    elif debias:
        raise ValueError(f"debias must be 'sketch', 'exact' or False, got {debias!r}")
    return torch.minimum(torch.maximum(est, tc2_max / d), tc2_max)


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


# ------------------------------------------------------------------------------------------------ the hot path
def tail_features(values_tail: torch.Tensor, sketch: torch.Tensor, *, packed: bool = False) -> torch.Tensor:
    """(a) once per compression, for `trace_c2_from_features`: per tail token [VR_i VR_i^T (k^2) | VR_i | q_i VR_i |
    q_i | q_i^2 | 1], q_i = ||VR_i||^2, VR = V_tail R: (..., s, k^2 + 2k + 3) floats (83 at k = 8).

    packed: VR_i VR_i^T as its upper triangle only (k (k + 1) / 2 entries, row-major): 55 floats at k = 8, a third
    less to store and to read at every step; `trace_c2_from_features` recognises the layout by its width."""
    vr = values_tail @ sketch.to(values_tail.dtype)
    q = vr.square().sum(-1, keepdim=True)
    outer = (vr.unsqueeze(-1) * vr.unsqueeze(-2)).flatten(-2)
    if packed:
        k = vr.shape[-1]
        outer = outer[..., _upper_triangle(k, vr.device)]
    return torch.cat([outer, vr, q * vr, q, q.square(), torch.ones_like(q)], -1)


@functools.lru_cache(maxsize=8)  # built once per (k, device): trace_c2_from_features runs at every decode step
def _upper_triangle(k: int, device) -> torch.Tensor:
    """Flat indices (into a row-major k x k) of the upper triangle, row-major: the packed layout's order."""
    rows, cols = torch.triu_indices(k, k, device=device)
    return rows * k + cols


@functools.lru_cache(maxsize=8)
def _unpack_index(k: int, device) -> torch.Tensor:
    """(k, k) positions in the packed upper triangle of each entry of the symmetric matrix."""
    rows, cols = torch.triu_indices(k, k, device=device)
    index = torch.empty(k, k, dtype=torch.long, device=device)
    index[rows, cols] = torch.arange(len(rows), device=device)
    index[cols, rows] = index[rows, cols]
    return index


def trace_c2_from_features(
    weights: torch.Tensor,
    one_minus_pi: torch.Tensor,
    features: torch.Tensor,
    output: torch.Tensor,
    sketch: torch.Tensor,
    trace_c: torch.Tensor,
    *,
    tail_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """(b) per step: `sketched_trace_c2(method="ratio", debias="sketch")` with few kernel launches (the decode loop
    calls it for every layer and bucket): every tail sum from one GEMM [a; (1 - pi) a^2] @ features, then k x k
    algebra. C_S = P - u y^T - y u^T + A y y^T (P = sum a VR VR^T, u = sum a VR, A = sum a, y = o_hat R), and
    sum b ||S_i||^4 expanded with ||S_i||^2 = q_i - 2 VR_i.y + ||y||^2. Features full or packed (`tail_features`).
    tail_rows: [a; (1 - pi) a^2] (..., 2T, s) with a = (1 - pi) p^2, when the caller has them already."""
    d, k = sketch.shape
    s = features.shape[-2]
    packed = features.shape[-1] == k * (k + 1) // 2 + 2 * k + 3
    kk = k * (k + 1) // 2 if packed else k * k  # where the k x k block of the features ends
    if tail_rows is None:
        omp = one_minus_pi[..., :s].unsqueeze(-2).to(weights.dtype)
        a = omp * weights[..., :s].square()  # (..., T, s)
        tail_rows = torch.cat([a, omp * a.square()], -2)
    n_q = tail_rows.shape[-2] // 2
    sums = tail_rows @ features  # (..., 2T, F)
    sa, sb = sums[..., :n_q, :], sums[..., n_q:, :]
    if packed:
        index = _unpack_index(k, sums.device)
        p_mat, b_mat = sa[..., index], sb[..., index]
    else:
        p_mat, b_mat = sa[..., :kk].unflatten(-1, (k, k)), sb[..., :kk].unflatten(-1, (k, k))
    y = output @ sketch.to(output.dtype)  # (..., T, k)
    u = sa[..., kk : kk + k]
    uy = u.unsqueeze(-1) * y.unsqueeze(-2)
    c_s = p_mat - uy - uy.transpose(-1, -2) + sa[..., -1:, None] * (y.unsqueeze(-1) * y.unsqueeze(-2))
    t2 = c_s.square().sum((-1, -2))
    t1 = c_s.diagonal(dim1=-2, dim2=-1).sum(-1)
    psi = t2 / t1.square().clamp_min(torch.finfo(t1.dtype).tiny)
    x = (k * psi - 1) / (k + 1 - 2 * psi).clamp_min(1e-12)
    y2 = y.square().sum(-1)
    quad = (b_mat @ y.unsqueeze(-1)).squeeze(-1)  # (sum b VR VR^T) y
    d4 = (
        sb[..., -2]
        - 4 * (sb[..., kk + k : kk + 2 * k] * y).sum(-1)
        + 4 * (quad * y).sum(-1)
        + 2 * y2 * sb[..., -3]
        - 4 * y2 * (sb[..., kk : kk + k] * y).sum(-1)
        + y2.square() * sb[..., -1]
    )
    tc2_max = trace_c.square()
    est = x * tc2_max - d4.clamp_min(0) / (k * (k + 2))
    return torch.minimum(torch.maximum(est, tc2_max / d), tc2_max)
