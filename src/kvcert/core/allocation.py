"""How a layer's budget is shared across its KV heads: every head the same count ("uniform"), or by score mass
("adakv", Feng et al. 2024, as kvpress's AdaKVPress does it).

AdaKV pools the scores of all heads of a layer and keeps the global top (heads x n_keep) entries, so that a head
whose attention is spread keeps more tokens than a peaked one; a safeguard first reserves each head its own top
int(alpha x n_keep) entries (kvpress's `alpha_safeguard`, default 0.20), so no head is starved. Here the allocation
only decides the per-head counts, deterministically from the scores; the design then draws within every head at
that head's count (topk: exactly AdaKV's kept set; randomized: the head's top part plus a Poisson tail at the head's
own pi), so the inclusion probabilities, the Hajek offset and the certificate stay per head.
"""

from __future__ import annotations

import torch

ALLOCATIONS = ("uniform", "adakv")
ADAKV_SAFEGUARD = 0.20  # kvpress AdaKVPress.alpha_safeguard


def adakv_counts(
    scores: torch.Tensor,
    n_keep: int,
    *,
    alpha_safeguard: float = ADAKV_SAFEGUARD,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head counts (..., H) long of scores (..., H, n): the safeguarded global top (H x n_keep) of the heads'
    pooled scores, counted per head. The counts sum to H x n_keep in every (...) slice. Ties go to the earlier
    (head, position), so the counts are deterministic. candidates: entries that may be kept (None: all)."""
    *lead, n_heads, n = scores.shape
    if not 0 <= n_keep <= n:
        raise ValueError(f"n_keep must be in [0, {n}], got {n_keep!r}")
    if not 0.0 <= alpha_safeguard <= 1.0:
        raise ValueError(f"alpha_safeguard must be in [0, 1], got {alpha_safeguard!r}")
    s = scores.double()
    if candidates is not None:
        s = s.masked_fill(~candidates, float("-inf"))  # never chosen while enough candidates remain
    n_safe = int(n_keep * alpha_safeguard)  # kvpress: int(n_kept * alpha_safeguard)
    if n_safe:  # each head's own top n_safe rank above every pooled score
        safe = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :n_safe]
        s = s.scatter(-1, safe, float("inf"))
        if candidates is not None:  # a head with fewer candidates than n_safe: its non-candidates stay out
            s = s.masked_fill(~candidates, float("-inf"))
    flat = s.reshape(*lead, n_heads * n)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[..., : n_heads * n_keep]
    kept = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, order, True)
    return kept.reshape(*lead, n_heads, n).sum(-1)


def allocate(
    allocation: str, scores: torch.Tensor, n_keep: int, *, candidates: torch.Tensor | None = None
) -> int | torch.Tensor:
    """The design's n_keep for scores (..., H, n): the same int for every head ("uniform": unchanged), or the
    per-head counts of `adakv_counts`."""
    if allocation == "uniform":
        return n_keep
    if allocation == "adakv":
        return adakv_counts(scores, n_keep, candidates=candidates)
    raise ValueError(f"allocation must be one of {list(ALLOCATIONS)}, got {allocation!r}")
