"""The per-token certificate: one calibrated number per generated token, from the per-cell statistics the decoder
records (plain torch, no transformers).

A cell is (layer, query head) at one decode step. Its calibrated radius is m_layer * r_tight, where r_tight is the
Satterthwaite radius at level 0.95 (`core.certificate.tight_radius` of V_hat and tr(C^2)) and m_layer the layer's
split-conformal multiplier (study 2's S2 method: the level-quantile of error / r_tight on calibration examples).
Divided by ||o_hat||, it bounds the relative error of that head's attention output with probability 0.95 on data
like the calibration data. The token's certificate reduces the compressed layers' cells:

- "max": the largest calibrated relative radius over compressed layers and heads (the worst head);
- "mean": their mean.

Which reduction a calibration file uses is chosen by held-out AUROC for cache-induced failures
(`kvcert.serve.calibration`). A token read with the full cache (the first token after a prompt is read, and
everything after an escalation to the full cache) has certificate 0.
"""

from __future__ import annotations

import torch

from kvcert.core.certificate import tight_radius

REDUCTIONS = ("max", "mean")
LEVEL = 0.95


def relative_radius(stats: dict[str, torch.Tensor], multipliers: torch.Tensor | None) -> torch.Tensor:
    """Per cell m_layer * r_tight / ||o_hat||, float64 (..., layers, heads); NaN where the certificate is undefined
    (top-k rows, layers kept exactly). stats: variance, trace_c2, out_norm (..., layers, heads); multipliers:
    (layers,) or None (uncalibrated: m = 1)."""
    variance = stats["variance"].to(torch.float64)
    radius = tight_radius(variance, stats["trace_c2"].to(torch.float64), LEVEL)
    radius = torch.where(torch.isfinite(variance), radius, torch.full_like(radius, float("nan")))
    if multipliers is not None:
        radius = radius * multipliers.to(radius)[:, None]
    return radius / stats["out_norm"].to(torch.float64).clamp_min(1e-12)


def token_certificate(
    stats: dict[str, torch.Tensor], multipliers: torch.Tensor | None, reduction: str = "max"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token's certificate (...), its per-layer values: the largest head per layer (..., layers), NaN on layers
    kept exactly). stats as `relative_radius`, for one or more tokens."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; choose one of {', '.join(REDUCTIONS)}")
    cells = relative_radius(stats, multipliers)
    defined = ~torch.isnan(cells)
    per_layer = torch.where(defined, cells, torch.full_like(cells, -torch.inf)).amax(-1)
    per_layer = torch.where(defined.any(-1), per_layer, torch.full_like(per_layer, float("nan")))
    flat = cells.flatten(-2)
    ok = ~torch.isnan(flat)
    if reduction == "max":
        value = torch.where(ok, flat, torch.full_like(flat, -torch.inf)).amax(-1)
    else:
        value = torch.where(ok, flat, torch.zeros_like(flat)).sum(-1) / ok.sum(-1).clamp_min(1)
    value = torch.where(ok.any(-1), value, torch.full_like(value, float("nan")))
    return value, per_layer
