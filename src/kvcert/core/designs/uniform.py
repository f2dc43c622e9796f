"""Uniform tail: deterministic head + a Poisson tail with one constant pi = t / n_tail, offset -log(pi).

The scorer then only decides the head; it is the randomized design with floor = 1.
"""

from __future__ import annotations

import torch

from kvcert.core.probabilities import poisson_sample
from kvcert.core.selection import Counts, Selection, assemble, check_design_inputs, split_head_tail, top_head


def select(
    scores: torch.Tensor,
    n_keep: Counts,
    *,
    tail_fraction: float = 0.5,
    floor: float = 1.0,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power, candidates)
    if generator is None and draws is None:
        raise ValueError("generator: the uniform design needs an explicit torch.Generator")
    n_head, n_tail = split_head_tail(n_keep, tail_fraction)
    head = top_head(scores, n_head, candidates, order)
    if isinstance(n_keep, torch.Tensor) or candidates is not None:  # per-row counts or candidates: pi per row
        n_all = scores.shape[-1] if candidates is None else candidates.sum(-1)
        rate = (torch.as_tensor(n_tail) / torch.as_tensor(n_all - n_head).clamp_min(1)).double().clamp_max(1.0)
        pi = torch.where(head, 0.0, rate.unsqueeze(-1).expand(scores.shape)).double()
        pi = pi if candidates is None else pi * candidates
    else:
        n_cand = scores.shape[-1] - n_head
        pi = torch.where(head, 0.0, min(1.0, n_tail / max(n_cand, 1))).double()
    tail = poisson_sample(pi, generator, draws) & ~head
    return assemble(head, tail, pi, design="uniform", offset=True, has_certificate=True)
