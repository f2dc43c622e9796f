"""Deterministic top-k: keep the n_keep highest scores. Every kept token has pi = 1, nothing is estimable."""

from __future__ import annotations

import torch

from kvcert.core.selection import Counts, Selection, assemble, check_design_inputs, top_head


def select(
    scores: torch.Tensor,
    n_keep: Counts,
    *,
    tail_fraction: float = 0.0,
    floor: float = 0.0,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    check_design_inputs(scores, n_keep, tail_fraction, floor, score_power, candidates)
    head = top_head(scores, n_keep, candidates, order)
    none = torch.zeros_like(head)
    return assemble(head, none, head.double(), design="topk", offset=False, has_certificate=False)
