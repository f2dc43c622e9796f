"""A second (third, ...) draw over an already compressed cache: compression during decoding (kvpress's DecodingPress).

Every N decode steps the cache, i.e. the prompt's kept tokens (with their log pi from the earlier draws) plus the
tokens generated since (pi = 1: never drawn), is compressed back to the budget's size by the same scorer, allocation
and design on the current keys. What pi means after a second draw:

    pi_i = prod over the draws token i survived of its conditional inclusion probability in that draw,

with a factor 1 for a draw that kept it in the deterministic top part (and for tokens generated after the last
draw). The offset is -log of that product. The k-th draw's pi_k is computed from the cache the earlier draws left,
so the product is not the token's marginal inclusion probability; it is the weight of sequential Poisson sampling
(two-phase sampling), for which, by iterated expectation over the draws,

    E[ sum_{S_k} y_i / (pi_1 ... pi_k) ] = sum_{all tokens ever seen} y_i

(each draw is Poisson given the ones before, so conditioning on S_{k-1} removes the last factor). The Hajek
estimator (the offset softmax) therefore stays the ratio estimator of the full-cache attention over every token
ever seen, and the certificate's V_hat = sum_S (1 - pi) p^2 ||v - o_hat||^2 with the product pi stays the
(linearized) Horvitz-Thompson variance estimator of the composed design: with y the linearized terms,
(1 - pi_1 pi_2) / (pi_1 pi_2)^2 has conditional expectation, given S_1, 1 / (pi_1^2 pi_2) - 1 / pi_1 per token of
S_1, which is the unbiased estimate of the first draw's variance (1 - pi_1) / pi_1^2 plus the second draw's
(1 - pi_2) / (pi_1^2 pi_2). A token is "tail" (it enters the certificate) when its product is below 1.
"""

from __future__ import annotations

import torch

from kvcert.core.designs import design_spec
from kvcert.core.selection import Counts, Selection


def pack(kept: torch.Tensor, log_pi: torch.Tensor, *, design: str, offset: bool, has_certificate: bool) -> Selection:
    """`selection.assemble` from a kept mask (..., n) and every entry's log pi (..., n), float64: kept entries
    with log pi < 0 (tail) first, then those with pi = 1 (head), then padding."""
    n = kept.shape[-1]
    tail = kept & (log_pi < 0)
    rank = torch.where(tail, 0, torch.where(kept, 1, 2))
    key = rank * (n + 1) + torch.arange(n, device=kept.device)
    width = int(kept.sum(-1).max()) if kept.numel() else 0
    indices = key.argsort(dim=-1)[..., :width]
    valid = kept.gather(-1, indices)
    lp = log_pi.to(torch.float32).gather(-1, indices).masked_fill(~valid, float("-inf"))
    off = (-lp if offset else torch.zeros_like(lp)).masked_fill(~valid, float("-inf"))
    tail_slots = int(tail.sum(-1).max()) if tail.numel() else 0
    return Selection(indices.masked_fill(~valid, 0), lp, off, valid, tail_slots, design, has_certificate)


def redraw(
    scores: torch.Tensor,
    prev_log_pi: torch.Tensor,
    valid: torch.Tensor,
    n_keep: Counts,
    *,
    design: str,
    tail_fraction: float,
    floor: float,
    score_power: float,
    generator: torch.Generator | None = None,
    draws: torch.Tensor | None = None,
) -> Selection:
    """Draw `design` again over a cache's entries (..., m): scores >= 0, prev_log_pi the log of each entry's
    product of earlier pi (0 for tokens never drawn), valid the filled entries (the candidates). Returns the kept
    entries (indices into the m entries) with log pi = prev_log_pi + this draw's log pi (see the module
    docstring); n_keep is clamped to each row's filled entries."""
    spec = design_spec(design)
    n_valid = valid.sum(-1)
    if isinstance(n_keep, torch.Tensor):
        n_keep = torch.minimum(n_keep, n_valid)
    elif bool((n_valid < n_keep).any()):
        n_keep = torch.minimum(torch.full_like(n_valid, n_keep), n_valid)
    sel = spec.select(
        scores.masked_fill(~valid, 0.0),
        n_keep,
        tail_fraction=tail_fraction,
        floor=floor,
        score_power=score_power,
        generator=generator,
        draws=draws,
        candidates=valid,
    )
    # this draw's log pi per entry (0: not kept), then the product with the earlier draws'; scatter_add, because
    # padding slots point at entry 0 too (adding their 0 leaves entry 0's value whatever the write order)
    this = torch.zeros(scores.shape, dtype=torch.float64, device=scores.device)
    this.scatter_add_(-1, sel.indices, sel.log_pi.double().masked_fill(~sel.valid, 0.0))
    kept = torch.zeros(scores.shape, dtype=torch.long, device=scores.device)
    kept = kept.scatter_add_(-1, sel.indices, sel.valid.long()) > 0
    total = torch.where(kept, prev_log_pi.double() + this, torch.zeros_like(this))
    return pack(kept, total, design=design, offset=spec.offset, has_certificate=spec.has_certificate)
