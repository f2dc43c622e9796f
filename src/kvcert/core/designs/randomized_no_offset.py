"""Ablation: the randomized design's draw, but the kept logits are NOT offset by -log(pi).

The softmax then weights sampled tail tokens as if they were certain, which biases the output toward the head;
comparing it with `randomized` shows that the Hajek correction matters. Its variance estimate is reported but
rests on a biased point estimate.
"""

from __future__ import annotations

import torch

from kvcert.core.designs.randomized import select as randomized_select
from kvcert.core.selection import Counts, Selection


def select(
    scores: torch.Tensor,
    n_keep: Counts,
    *,
    tail_fraction: float = 0.5,
    floor: float = 0.2,
    score_power: float = 1.0,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> Selection:
    return randomized_select(
        scores,
        n_keep,
        tail_fraction=tail_fraction,
        floor=floor,
        score_power=score_power,
        generator=generator,
        draws=draws,
        offset=False,
        design="randomized_no_offset",
        candidates=candidates,
        order=order,
    )
