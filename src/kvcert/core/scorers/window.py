"""SnapKV-style observation-window scores: attention of the window's queries to every key, pooled.

Question-aware when the window is the question (compression after the question is read), question-agnostic when the
window is the last tokens of the context (compression before the question exists).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_scores(
    window_queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scale: float,
    query_positions: torch.Tensor | None = None,
    pool_kernel: int = 5,
) -> torch.Tensor:
    """Scores (..., Hkv, n) from window queries (..., Hq, w, d) and keys (..., Hkv, n, d).

    Mean over the window queries and over the GQA group of the softmax attention, then 1-D max pooling so that a
    kept token brings its neighbours (SnapKV's clustering). query_positions (w,) applies the causal mask: a window
    query does not see keys after its own position.
    """
    *lead, n_q_heads, w, d = window_queries.shape
    n_kv_heads, n = keys.shape[-3], keys.shape[-2]
    if n_q_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_q_heads}) must be a multiple of key/value heads ({n_kv_heads})")
    group = n_q_heads // n_kv_heads
    q = window_queries.float().reshape(*lead, n_kv_heads, group * w, d)
    logits = q @ keys.float().transpose(-1, -2) * scale
    if query_positions is not None:
        future = torch.arange(n, device=keys.device)[None, :] > query_positions.to(keys.device)[:, None]
        logits = logits.masked_fill(future.repeat(group, 1), float("-inf"))
    scores = logits.softmax(-1).mean(-2)
    if pool_kernel > 1:
        flat = scores.reshape(-1, 1, n)
        flat = F.max_pool1d(flat, pool_kernel, stride=1, padding=pool_kernel // 2)
        scores = flat.reshape(*scores.shape)
    return scores
