"""Uniform tail: deterministic head + a Poisson tail with one constant pi = t / n_tail, offset -log(pi).

The scorer then only decides the head; it is the randomized design with floor = 1.
"""

from __future__ import annotations

import torch

from kvcert.core.probabilities import poisson_sample
from kvcert.core.selection import Selection, assemble, check_design_inputs, split_head_tail, top_head


def select(
    scores: torch.Tensor,
    n_keep: int,
    *,
    tail_fraction: float = 0.5,
    floor: float = 1.0,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power)
    if generator is None and draws is None:
        raise ValueError("generator: the uniform design needs an explicit torch.Generator")
    n_head, n_tail = split_head_tail(n_keep, tail_fraction)
    head = top_head(scores, n_head)
    n_cand = scores.shape[-1] - n_head
    pi = torch.where(head, 0.0, min(1.0, n_tail / max(n_cand, 1))).double()
    tail = poisson_sample(pi, generator, draws) & ~head
    return assemble(head, tail, pi, design="uniform", offset=True, has_certificate=True)
