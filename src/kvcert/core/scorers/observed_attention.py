"""Observed-attention scores (H2O-like): the mean attention each token receives from the queries that see it.

Follows kvpress 0.5.5 `kvpress/presses/observed_attention_press.py` (`ObservedAttentionPress.score`): the prefill's
attention weights (eager, causal softmax in float32) summed over the queries, divided by the number of queries that
see the key (n - j), averaged over the query heads of each KV group. kvpress reads the weights the eager attention
returns; kvcert recomputes them from the region's queries and keys, a block of queries at a time (the full
(heads, n, n) matrix of every layer never exists). Nothing is protected.
"""

from __future__ import annotations

import torch

from kvcert.core.scorers.inputs import ScorerInputs, group_mean

QUERY_BLOCK = 512  # queries per block: bounds the attention matrix held at once to (Hq, 512, n) per layer


def observed_attention_scores(inputs: ScorerInputs, *, scale: float, n_candidates: int) -> torch.Tensor:
    """Scores (L, Hkv, n_candidates) of the region's first n_candidates tokens."""
    queries = inputs.need_queries("observed_attention")
    n_layers, n_kv, n, _ = inputs.keys.shape
    n_q = queries.shape[1]
    group = n_q // n_kv
    out = []
    for layer in range(n_layers):
        keys = inputs.keys[layer].float().repeat_interleave(group, 0)  # (Hq, n, d), as repeat_kv
        sums = torch.zeros(n_q, n, device=keys.device)
        for lo in range(0, n, QUERY_BLOCK):
            hi = min(n, lo + QUERY_BLOCK)
            logits = queries[layer, :, lo:hi].float() @ keys.transpose(-1, -2) * scale
            future = torch.arange(n, device=keys.device)[None, :] > torch.arange(lo, hi, device=keys.device)[:, None]
            sums += logits.masked_fill(future, float("-inf")).softmax(-1).sum(-2)
        seen_by = torch.arange(n, 0, -1, device=keys.device, dtype=sums.dtype)  # key j is seen by n - j queries
        out.append(group_mean(sums / seen_by, n_kv))
    return torch.stack(out)[..., :n_candidates]
