"""Agreement between independent draws of one randomized policy: per-answer signals, in plain torch / Python.

One draw's certificate sees only the tokens that draw kept: a needle that was not drawn leaves no trace in its
variance estimate. A second, independent draw of the same policy (or the other half of the same draw's tail) either
kept it or not, so where draws disagree about the answer, the answer depends on what was sampled. Draw 0 decodes the
answer; every other draw is fed draw 0's tokens (teacher forcing, kvcert.hf.draws) and gives each its own
log-probability and its own greedy choice.

The scored span is the answer's cache-dependent tokens: the answer and the token that ended it (an EOS or the token
that reached a stop string, whose probability says whether the answer stops there), without the first answer token
when it came from the full-cache prefill (compress_after="prompt": the same log-probability at every budget and in
every draw, so it carries no information about the cache).

Signals (larger: more likely a cache-induced failure):
- `disagreement`: the mean over the other draws of the largest drop, over the span, of the log-probability of draw
  0's token under that draw against draw 0's own: max_t [log p_0(a_t) - log p_r(a_t)]. 0 when another draw is as
  sure of every token; graded where the answer-level flag is all or nothing.
- `differs`: the share of the other draws whose own greedy answer differs from draw 0's (exact: fed draw 0's tokens,
  a draw's greedy answer equals draw 0's iff its own greedy token matches at every step of the span).
- `confidence`: minus the lowest log-probability of the span under draw 0 (study 4's confidence, without the tokens
  the cache cannot change).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def scored_span(n_answer: int, n_tokens: int, *, first_from_prefill: bool) -> range:
    """Token positions of the cache-dependent span: the answer and the token that ended it (when one did)."""
    end = min(n_answer + 1, n_tokens)
    return range(1 if first_from_prefill else 0, end)


def confidence(logprobs: Sequence[float], span: range) -> float:
    """Minus the lowest log-probability over the span (NaN when the span is empty)."""
    values = [logprobs[t] for t in span]
    return -min(values) if values else math.nan


def disagreement(leader: Sequence[float], followers: Sequence[Sequence[float]], span: range) -> float:
    """Mean over the other draws of max over the span of log p_0(a_t) - log p_r(a_t) (NaN: no other draw or an empty
    span)."""
    if not followers or not len(span):
        return math.nan
    drops = [max(leader[t] - lp[t] for t in span) for lp in followers]
    return sum(drops) / len(drops)


def differs(leader_tokens: Sequence[int], own_tokens: Sequence[Sequence[int]], span: range) -> float:
    """Share of the other draws whose own greedy token differs from draw 0's somewhere in the span (NaN: none)."""
    if not own_tokens:
        return math.nan
    return sum(any(own[t] != leader_tokens[t] for t in span) for own in own_tokens) / len(own_tokens)


def union_count(indices: Sequence[torch.Tensor], valid: Sequence[torch.Tensor], n_positions: int) -> int:
    """Distinct (head, position) pairs kept by several draws of one layer: indices / valid (Hkv, m) per draw, valid
    False on padding. The deterministic head, kept by every draw, counts once."""
    n_heads = indices[0].shape[0]
    kept = torch.zeros(n_heads * n_positions, dtype=torch.bool, device=indices[0].device)
    rows = torch.arange(n_heads, device=kept.device)[:, None] * n_positions
    for idx, ok in zip(indices, valid):
        kept[(rows + idx.long())[ok.to(torch.bool)]] = True
    return int(kept.sum())
