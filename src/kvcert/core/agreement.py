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
- `differs`: the share of the other draws whose own greedy answer (the text up to the stop) differs from draw 0's.
  Fed draw 0's tokens, a draw's answer equals draw 0's iff its own greedy token matches at every answer position of
  the span and, at the token that ended draw 0's answer, its own token ends the same answer there: draw 0's token,
  or another that does (an EOS where draw 0 reached the stop string, ...). Which tokens do needs the tokenizer and
  the stop strings, so the caller says it (`n_answer`, `ends_answer`); without them the span's tokens are compared
  one by one, and a different end token counts as a different answer (the definition study 5's records were
  collected with). `answers_differ` compares decoded answers (texts) directly.
- `confidence`: minus the lowest log-probability of the span under draw 0 (study 4's confidence, without the tokens
  the cache cannot change).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

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


def differs(
    leader_tokens: Sequence[int],
    own_tokens: Sequence[Sequence[int]],
    span: range,
    *,
    n_answer: int | None = None,
    ends_answer: Callable[[int], bool] | None = None,
) -> float:
    """Share of the other draws whose own greedy answer differs from draw 0's (NaN: none).

    A draw differs where its own greedy token differs from draw 0's at a position of the span, except at position
    `n_answer` (the token that ended draw 0's answer): there a different token differs only when
    `ends_answer(token)` is False, i.e. it does not end the same answer (text up to the stop) at that point. Without
    `n_answer` and `ends_answer` every position of the span compares tokens (a different end token counts)."""
    if not own_tokens:
        return math.nan
    if (n_answer is None) != (ends_answer is None):
        raise ValueError("differs: pass n_answer and ends_answer together (the end position and what ends there)")

    def other(own: Sequence[int]) -> bool:
        for t in span:
            if own[t] == leader_tokens[t]:
                continue
            if t == n_answer and ends_answer is not None and ends_answer(own[t]):
                continue
            return True
        return False

    return sum(other(own) for own in own_tokens) / len(own_tokens)


def answers_differ(leader_answer: str, answers: Sequence[str]) -> float:
    """Share of the other draws whose own answer (its text up to the stop) differs from draw 0's (NaN: none)."""
    if not answers:
        return math.nan
    return sum(a != leader_answer for a in answers) / len(answers)


def union_count(indices: Sequence[torch.Tensor], valid: Sequence[torch.Tensor], n_positions: int) -> int:
    """Distinct (head, position) pairs kept by several draws of one layer: indices / valid (Hkv, m) per draw, valid
    False on padding. The deterministic head, kept by every draw, counts once."""
    n_heads = indices[0].shape[0]
    kept = torch.zeros(n_heads * n_positions, dtype=torch.bool, device=indices[0].device)
    rows = torch.arange(n_heads, device=kept.device)[:, None] * n_positions
    for idx, ok in zip(indices, valid):
        kept[(rows + idx.long())[ok.to(torch.bool)]] = True
    return int(kept.sum())
