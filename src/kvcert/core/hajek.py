"""Hajek attention with the -log(pi) offset, its certificate, and the exact (oracle) attention.

Shapes: queries (..., T, d), keys (..., m, d), values (..., m, dv), per-token vectors (..., m); the leading dims
broadcast. The offset is -log(pi) on kept tokens (0 for head tokens) and -inf on padding, so that

    softmax(l + b) @ V  =  sum_S (w_i / pi_i) v_i / sum_S (w_i / pi_i),   w_i = exp(l_i)

and the linearized variance of that ratio estimator under Poisson sampling is

    V_hat = sum_S (1 - pi_i) p_i^2 ||v_i - o_hat||^2.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import torch


@dataclass(frozen=True)
class HajekResult:
    output: torch.Tensor  # (..., T, dv) o_hat
    weights: torch.Tensor  # (..., T, m) p = softmax(l + b)
    variance: torch.Tensor | None  # (..., T) V_hat, None when not asked for


def z_value(level: float) -> float:
    """Two-sided normal quantile z_{1 - alpha/2} of a confidence level 1 - alpha (0.95 -> 1.95996)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    return NormalDist().inv_cdf(0.5 + level / 2)


def certificate_radius(variance: torch.Tensor, level: float = 0.95) -> torch.Tensor:
    """Radius r = z * sqrt(V_hat): the certificate holds at a step when ||o_hat - o|| <= r."""
    return z_value(level) * variance.clamp_min(0).sqrt()


def offset_softmax(
    query: torch.Tensor,
    keys_t: torch.Tensor,
    offset: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """p = softmax(q K^T * scale + offset [+ mask]) with the keys given transposed, (..., d, m): the offset
    attention's weights, written into `out` when given (the decode engine's work buffers). The one place the
    offset logits are computed."""
    logits = torch.matmul(query, keys_t).mul_(scale).add_(offset.unsqueeze(-2))
    if mask is not None:
        logits.add_(mask)
    return torch.softmax(logits, -1, out=out) if out is not None else logits.softmax(-1)


def variance_from_sums(
    a_sq_norms: torch.Tensor, a_values: torch.Tensor, output: torch.Tensor, a_sum: torch.Tensor
) -> torch.Tensor:
    """V_hat = sum a ||v - o||^2 = sum a ||v||^2 - 2 o . (sum a v) + ||o||^2 sum a, with a = (1 - pi) p^2 on the tail:
    the certificate from three tail sums (one extra matmul over the tail), clamped at 0 against rounding."""
    return (a_sq_norms - 2 * (output * a_values).sum(-1) + output.square().sum(-1) * a_sum).clamp_min(0)


def hajek_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    offset: torch.Tensor,
    *,
    scale: float,
    one_minus_pi: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    variance_slots: int | None = None,
    value_sq_norms: torch.Tensor | None = None,
) -> HajekResult:
    """Offset attention over the retained tokens and, when one_minus_pi is given, the certificate variance.

    mask: optional additive (..., T, m) mask (0 / -inf), e.g. causal among new tokens.
    variance_slots: tail tokens sit in the first `variance_slots` entries (Selection.tail_slots); the variance sum
    stops there, which is exact because 1 - pi = 0 everywhere after.
    value_sq_norms: ||v_i||^2 (..., m), cached by callers that reuse the same values at every step.
    """
    weights = offset_softmax(query, keys.transpose(-1, -2), offset, scale=scale, mask=mask)
    output = weights @ values
    if one_minus_pi is None:
        return HajekResult(output, weights, None)
    s = keys.shape[-2] if variance_slots is None else variance_slots
    if value_sq_norms is None:
        value_sq_norms = values[..., :s, :].square().sum(-1)
    a = one_minus_pi[..., :s].unsqueeze(-2) * weights[..., :s].square()  # (..., T, s)
    variance = variance_from_sums(
        (a * value_sq_norms[..., :s].unsqueeze(-2)).sum(-1), a @ values[..., :s, :], output, a.sum(-1)
    )
    return HajekResult(output, weights, variance)


def exact_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q K^T * scale) V over the full cache: the oracle the certificate is checked against."""
    logits = (query @ keys.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits + mask
    return logits.softmax(-1) @ values


def error_norm(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """||o_hat - o||_2 over the last dimension."""
    return (estimate - exact).norm(dim=-1)


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Kept rows of x (..., n, d) at indices (..., m) -> (..., m, d)."""
    return x.gather(-2, indices.unsqueeze(-1).expand(*indices.shape, x.shape[-1]))
