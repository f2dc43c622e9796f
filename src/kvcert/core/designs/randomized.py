"""Randomized design: deterministic head (top scores, pi = 1) + Poisson tail at known pi, with the -log(pi) offset.

The offset turns softmax(l + b) into the Hajek ratio estimator sum_S (w/pi) v / sum_S (w/pi), and the tail makes
the error estimable (the certificate).

n_keep is one count, or one per row (a head-wise allocation, kvcert.core.allocation): each row then keeps its own
head and draws its tail at its own pi. candidates: a mask of the entries that may be kept (a re-compression during
decoding passes the cache's filled slots, kvcert.core.recompress); None: every entry.
"""

from __future__ import annotations

import torch

from kvcert.core.probabilities import inclusion_probabilities, poisson_sample
from kvcert.core.selection import Counts, Selection, assemble, check_design_inputs, split_head_tail, top_head


def select(
    scores: torch.Tensor,
    n_keep: Counts,
    *,
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    offset: bool = True,
    design: str = "randomized",
    candidates: torch.Tensor | None = None,
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power, candidates)
    if generator is None and draws is None:
        raise ValueError("generator: the randomized design needs an explicit torch.Generator")
    n_head, n_tail = split_head_tail(n_keep, tail_fraction)
    head = top_head(scores, n_head, candidates)
    rest = ~head if candidates is None else candidates & ~head
    pi = inclusion_probabilities(scores, rest, n_tail, floor=floor, score_power=score_power)
    tail = poisson_sample(pi, generator, draws) & ~head
    return assemble(head, tail, pi, design=design, offset=offset, has_certificate=True)
