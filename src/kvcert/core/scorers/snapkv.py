"""SnapKV scores as kvpress computes them (Li et al., 2024): the attention of the last context tokens (the
observation window) to every earlier token, averaged, then smoothed.

Follows kvpress 0.5.5 `kvpress/presses/snapkv_press.py` (`SnapKVPress.score` / `compute_window_attention`): each
window query's causal softmax over *every* key of the cache (the window's own keys included), the columns before the
window kept, mean over the window queries, `avg_pool1d(kernel, padding=kernel // 2, stride=1)` (zero padding counted),
then the mean over each KV group's query heads. kvpress keeps the window with the max score + 1; kvcert keeps it as
the always-kept window (policy window "context", its width DecodeOptions.context_window; kvpress's default is 64).

kvcert's own `window_context` differs on three points, kept for the pre-registered studies: its softmax runs over the
candidates only, it averages over the group before pooling, and it max-pools.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcert.core.scorers.inputs import ScorerInputs, group_mean


def snapkv_scores(
    window_queries: torch.Tensor, inputs: ScorerInputs, *, scale: float, pool_kernel: int, n_candidates: int
) -> torch.Tensor:
    """Scores (L, Hkv, n_candidates) from the window's queries (L, Hq, w, d), the last w tokens of the region."""
    keys = inputs.keys.float()
    n_layers, n_kv, n, _ = keys.shape
    n_q, w = window_queries.shape[1], window_queries.shape[2]
    group = n_q // n_kv
    logits = window_queries.float() @ keys.repeat_interleave(group, 1).transpose(-1, -2) * scale  # (L, Hq, w, n)
    positions = torch.arange(n - w, n, device=keys.device)
    future = torch.arange(n, device=keys.device)[None, :] > positions[:, None]
    weights = logits.masked_fill(future, float("-inf")).softmax(-1)[..., :n_candidates]
    scores = weights.mean(-2)  # (L, Hq, candidates)
    if pool_kernel > 1:
        flat = F.avg_pool1d(scores.reshape(-1, 1, n_candidates), pool_kernel, padding=pool_kernel // 2, stride=1)
        scores = flat.reshape(n_layers, n_q, n_candidates)
    return group_mean(scores, n_kv)
