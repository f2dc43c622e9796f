"""StreamingLLM scores: attention sinks first, then recency (Xiao et al., 2024)."""

from __future__ import annotations

import torch


def streaming_scores(shape: tuple[int, ...], *, sinks: int = 4, device: torch.device | str = "cpu") -> torch.Tensor:
    """Scores of the given shape (..., n): top-k by these keeps the `sinks` first tokens and then the most recent."""
    n = shape[-1]
    position = torch.arange(n, device=device, dtype=torch.float32)
    scores = (position + 1) / n
    scores[: min(sinks, n)] = 2.0
    return scores.expand(shape).clone()
