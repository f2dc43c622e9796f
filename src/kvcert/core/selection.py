"""What a design returns: the kept tokens of every (batch..., head) row, padded to a common length.

Kept tokens are ordered tail first (sampled, pi < 1), then head (pi = 1), then padding, so that the certificate,
which only sums over tail tokens, can stop after the first `tail_slots` entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Selection:
    indices: torch.Tensor  # (..., m) long: positions in [0, n) of kept tokens; 0 on padding
    log_pi: torch.Tensor  # (..., m) log inclusion probability; 0 for head tokens, -inf on padding
    offset: torch.Tensor  # (..., m) logit offset added inside the softmax; -inf on padding
    valid: torch.Tensor  # (..., m) bool: False on padding
    tail_slots: int  # tail tokens occupy at most the first `tail_slots` entries of every row
    design: str
    has_certificate: bool  # False for deterministic designs: the certificate is undefined, not zero
    tail_counts: torch.Tensor | None = None  # (...,) sampled tail tokens per row (tail_slots is their max)

    @property
    def one_minus_pi(self) -> torch.Tensor:
        """1 - pi per kept token (0 for head tokens and padding): the weight of a token in V_hat."""
        return torch.where(self.valid, -torch.expm1(self.log_pi), torch.zeros_like(self.log_pi))

    @property
    def kept_counts(self) -> torch.Tensor:
        return self.valid.sum(-1)


def keep_count(budget: float, n: int) -> int:
    """Number of tokens a budget (fraction of the n cached tokens, in (0, 1]) keeps."""
    if not isinstance(budget, (int, float)) or math.isnan(budget) or not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be a fraction in (0, 1], got {budget!r}")
    return min(n, max(0, round(budget * n)))


Counts = int | torch.Tensor  # one count for every row, or one per row (..., ) (a head-wise allocation, AdaKV)


def check_design_inputs(
    scores: torch.Tensor,
    n_keep: Counts,
    tail_fraction: float,
    floor: float,
    score_power: float,
    candidates: torch.Tensor | None = None,
):
    if scores.dim() < 1 or scores.shape[-1] == 0:
        raise ValueError(f"scores must have shape (..., n) with n >= 1, got {tuple(scores.shape)}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores contain NaN or inf")
    if (scores < 0).any():
        raise ValueError("scores must be non-negative")
    n = scores.shape[-1]
    if isinstance(n_keep, torch.Tensor):
        if n_keep.shape != scores.shape[:-1] or n_keep.dtype != torch.long:
            raise ValueError(f"per-row n_keep must be a long tensor of shape {tuple(scores.shape[:-1])}")
        if ((n_keep < 0) | (n_keep > n)).any():
            raise ValueError(f"per-row n_keep must lie in [0, {n}]")
    elif not isinstance(n_keep, int) or not 0 <= n_keep <= n:
        raise ValueError(f"n_keep must be an int in [0, {n}], got {n_keep!r}")
    if candidates is not None:
        if candidates.shape != scores.shape or candidates.dtype != torch.bool:
            raise ValueError(f"candidates must be a bool mask of shape {tuple(scores.shape)}")
        if (torch.as_tensor(n_keep) > candidates.sum(-1)).any():
            raise ValueError("n_keep exceeds the number of candidates of a row")
    if not 0.0 <= tail_fraction < 1.0:
        raise ValueError(f"tail_fraction must be in [0, 1), got {tail_fraction!r}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")
    if not score_power > 0:
        raise ValueError(f"score_power must be > 0, got {score_power!r}")


def descending_order(scores: torch.Tensor) -> torch.Tensor:
    """Each row's positions by score, highest first, ties to the earlier position: what `top_head` sorts by. A caller
    that selects several budgets over the same scores sorts once and passes it to the designs as `order`."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def top_head(
    scores: torch.Tensor, n_head: Counts, candidates: torch.Tensor | None = None, order: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean mask of the n_head highest scores per row (ties to the earlier position, deterministic); n_head may
    be one count per row. candidates: only these entries can be chosen (non-candidates rank below every score).
    order: `descending_order` of these scores (candidates applied), when the caller has it: not sorted again."""
    if candidates is not None:
        scores = scores.masked_fill(~candidates, -1.0)  # scores are >= 0: a non-candidate ranks last
    if order is not None and order.shape != scores.shape:
        raise ValueError(f"order must have the scores' shape {tuple(scores.shape)}, got {tuple(order.shape)}")
    if isinstance(n_head, torch.Tensor):  # rank of every entry in its row, kept where rank < the row's count
        order = descending_order(scores) if order is None else order
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order).contiguous()
        )
        return rank < n_head.unsqueeze(-1)
    head = torch.zeros_like(scores, dtype=torch.bool)
    if n_head > 0:
        order = descending_order(scores) if order is None else order
        head.scatter_(-1, order[..., :n_head], True)
    return head


def split_head_tail(n_keep: Counts, tail_fraction: float) -> tuple[Counts, Counts]:
    """Deterministic head size and expected tail size of a budget of n_keep tokens (per row when a tensor; torch's
    round, like Python's, rounds halves to even)."""
    if isinstance(n_keep, torch.Tensor):
        n_head = n_keep - torch.round(n_keep.double() * tail_fraction).long()
        return n_head, n_keep - n_head
    n_head = n_keep - round(tail_fraction * n_keep)
    return n_head, n_keep - n_head


def assemble(
    head: torch.Tensor, tail: torch.Tensor, pi: torch.Tensor, *, design: str, offset: bool, has_certificate: bool
) -> Selection:
    """Pack boolean masks (..., n) of head and sampled-tail tokens into a padded, tail-first Selection."""
    kept = head | tail
    width = int(kept.sum(-1).max()) if kept.numel() else 0
    indices = tail_first_order(tail, head)[..., :width]
    valid = kept.gather(-1, indices)
    log_pi = torch.where(head, 0.0, torch.log(pi.clamp_min(1e-300))).to(torch.float32).gather(-1, indices)
    log_pi = log_pi.masked_fill(~valid, float("-inf"))
    off = -log_pi if offset else torch.zeros_like(log_pi)
    off = off.masked_fill(~valid, float("-inf"))
    indices = indices.masked_fill(~valid, 0)
    tail_counts = tail.sum(-1)
    tail_slots = int(tail_counts.max()) if tail.numel() else 0
    return Selection(indices, log_pi, off, valid, tail_slots, design, has_certificate, tail_counts)


def tail_first_order(tail: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The permutation (..., n) that puts each row's tail tokens first, then its head tokens, then the rest, each
    class by position (what a stable sort by class gives), from every token's place in its class: a count, no sort
    (32-bit counts; the rest's count is the position minus the tail's and the head's)."""
    head = head & ~tail
    in_tail = tail.cumsum(-1, dtype=torch.int32)
    in_head = head.cumsum(-1, dtype=torch.int32)
    n_tail, n_head = in_tail[..., -1:], in_head[..., -1:]
    in_rest = torch.arange(1, tail.shape[-1] + 1, device=tail.device, dtype=torch.int32) - in_tail - in_head
    place = torch.where(tail, in_tail, torch.where(head, n_tail + in_head, n_tail + n_head + in_rest))  # 1-based
    positions = torch.arange(tail.shape[-1], device=tail.device).expand(tail.shape)
    return torch.empty(tail.shape, dtype=torch.long, device=tail.device).scatter_(-1, (place - 1).long(), positions)
