"""Randomized design: deterministic head (top scores, pi = 1) + Poisson tail at known pi, with the -log(pi) offset.

The offset turns softmax(l + b) into the Hajek ratio estimator sum_S (w/pi) v / sum_S (w/pi), and the tail makes
the error estimable (the certificate).
"""

from __future__ import annotations

import torch

from kvcert.core.probabilities import inclusion_probabilities, poisson_sample
from kvcert.core.selection import Selection, assemble, check_design_inputs, split_head_tail, top_head


def select(
    scores: torch.Tensor,
    n_keep: int,
    *,
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    offset: bool = True,
    design: str = "randomized",
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power)
    if generator is None and draws is None:
        raise ValueError("generator: the randomized design needs an explicit torch.Generator")
    n_head, n_tail = split_head_tail(n_keep, tail_fraction)
    head = top_head(scores, n_head)
    pi = inclusion_probabilities(scores, ~head, n_tail, floor=floor, score_power=score_power)
    tail = poisson_sample(pi, generator, draws) & ~head
    return assemble(head, tail, pi, design=design, offset=offset, has_certificate=True)
