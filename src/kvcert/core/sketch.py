"""The cheap estimator of tr(C^2), behind the certificate's tight radius (kvcert.core.certificate): a fixed
Gaussian sketch of the value space, per-token features once per compression, one GEMM per decode step.

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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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


# ------------------------------------------------------------------------------------------------ the hot path
def tail_features(
    values_tail: torch.Tensor, sketch: torch.Tensor, *, packed: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(a) once per compression, for `trace_c2_from_features`: per tail token [VR_i VR_i^T (k^2) | VR_i | q_i VR_i |
    q_i | q_i^2 | 1], q_i = ||VR_i||^2, VR = V_tail R: (..., s, k^2 + 2k + 3) floats (83 at k = 8).

    packed: VR_i VR_i^T as its upper triangle only (k (k + 1) / 2 entries, row-major): 55 floats at k = 8, a third
    less to store and to read at every step; `trace_c2_from_features` recognises the layout by its width (only the
    triangle's products are computed, row by row). out: where to write the features."""
    vr = values_tail @ sketch.to(values_tail.dtype)
    q = vr.square().sum(-1, keepdim=True)
    if packed:  # row i of the triangle: VR_i[i] * VR_i[i:]
        outer = [vr[..., i : i + 1] * vr[..., i:] for i in range(vr.shape[-1])]
    else:
        outer = [(vr.unsqueeze(-1) * vr.unsqueeze(-2)).flatten(-2)]
    return torch.cat([*outer, vr, q * vr, q, q.square(), torch.ones_like(q)], -1, out=out)


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
