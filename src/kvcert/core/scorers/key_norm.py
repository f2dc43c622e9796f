"""Key-norm scores: tokens with small key norms tend to receive large attention (Devoto et al., 2024)."""

from __future__ import annotations

import torch


def key_norm_scores(keys: torch.Tensor) -> torch.Tensor:
    """Scores (..., n) = 1 / ||k_i|| from keys (..., n, d); positive, larger = keep."""
    return 1.0 / keys.float().norm(dim=-1).clamp_min(1e-6)
