"""Random scores: the importance-free baseline."""

from __future__ import annotations

import torch


def random_scores(shape: tuple[int, ...], *, generator: torch.Generator) -> torch.Tensor:
    """Uniform(0, 1) scores of the given shape, drawn from the explicit generator."""
    return torch.rand(shape, generator=generator, device=generator.device)
