"""Randomized design: deterministic head (top scores, pi = 1) + Poisson tail at known pi, with the -log(pi) offset.

The offset turns softmax(l + b) into the Hajek ratio estimator sum_S (w/pi) v / sum_S (w/pi), and the tail makes
the error estimable (the certificate).

n_keep is one count, or one per row (a head-wise allocation, kvcert.core.allocation): each row then keeps its own
head and draws its tail at its own pi. candidates: a mask of the entries that may be kept (a re-compression during
decoding passes the cache's filled slots, kvcert.core.recompress); None: every entry.

half (split halves): 0 keeps the tail tokens with u < pi/2, 1 those with pi/2 <= u < pi, where u are the draw's own
uniforms. Given u < pi, u / pi is Uniform(0, 1) and independent of the inclusion, so each half is a Poisson sample at
pi/2, the halves are disjoint and their union is the whole draw; the offset is -log(pi/2).

order: `core.selection.descending_order(scores)`, when the caller has it (several budgets over the same scores sort
once): the same selection, without sorting.
"""

from __future__ import annotations

import torch

from kvcert.core.probabilities import inclusion_probabilities, poisson_sample, uniform_draws
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
    half: int | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power, candidates)
    if generator is None and draws is None:
        raise ValueError("generator: the randomized design needs an explicit torch.Generator")
    n_head, n_tail = split_head_tail(n_keep, tail_fraction)
    head = top_head(scores, n_head, candidates, order)
    rest = ~head if candidates is None else candidates & ~head
    rest_order = None  # the tail's candidates by score: the order after each row's first n_head (the head, u = 0)
    if order is not None and candidates is None:
        n = scores.shape[-1]
        shift = torch.arange(n, device=order.device) + torch.as_tensor(n_head, device=order.device).unsqueeze(-1)
        rest_order = order.gather(-1, (shift % n).expand(order.shape))
    pi = inclusion_probabilities(scores, rest, n_tail, floor=floor, score_power=score_power, order=rest_order)
    if half is not None and draws is None:  # a half is read off the draw's own uniforms
        draws = uniform_draws(tuple(pi.shape), generator)
    tail = poisson_sample(pi, generator, draws) & ~head
    if half is not None:
        lower = draws.to(pi.device) < pi / 2
        tail = tail & (lower if half == 0 else ~lower)
        pi = pi / 2
    return assemble(head, tail, pi, design=design, offset=offset, has_certificate=True)
