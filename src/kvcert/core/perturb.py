"""The non-identifiability construction (the paper's theorem, demonstrated).

Add lambda * u to the values of tokens a design may drop. For a deterministic design (perturb the evicted tokens)
everything retained is bit-identical while the true error grows linearly in lambda, so no estimator computed from
the retained data can follow it. For the randomized design the same perturbation, applied to every non-head token
independently of the draw, leaves the variance estimator unbiased: mean V_hat tracks the mean squared error.
"""

from __future__ import annotations

import torch


def perturb_values(values: torch.Tensor, tokens: torch.Tensor, direction: torch.Tensor, lam: float) -> torch.Tensor:
    """values (..., n, d) plus lam * direction ((d,) or (..., n, d)) at the tokens where the mask (..., n) is True."""
    if tokens.shape != values.shape[:-1]:
        raise ValueError(f"tokens: mask shape {tuple(tokens.shape)} must equal values.shape[:-1]")
    return values + lam * tokens.unsqueeze(-1).to(values.dtype) * direction.to(values.dtype)


def evicted_mask(indices: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean (..., n) mask of tokens NOT kept by a selection (indices, valid) over n tokens."""
    # scatter_add, not scatter: padding entries point at position 0 and must not overwrite a kept token 0
    kept = torch.zeros(*indices.shape[:-1], n, dtype=torch.long, device=indices.device)
    kept.scatter_add_(-1, indices, valid.long())
    return kept == 0
