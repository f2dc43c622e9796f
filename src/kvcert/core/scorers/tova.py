"""TOVA scores (Oren et al., 2024): the attention the last token of the cache pays to every earlier token.

Follows kvpress 0.5.5 `kvpress/presses/tova_press.py` (`TOVAPress.score` via `SnapKVPress.compute_window_attention`
with a window of 1): the last query's softmax attention over every key of the cache (itself included, causal),
averaged over *all* query heads (not per KV group), the same scores for every KV head. kvpress keeps the last token
by giving it the max score + 1; kvcert keeps it as the always-kept window (policy window "last"), so the scores
cover the candidates before it. The softmax is in float32, as kvpress's.
"""

from __future__ import annotations

import torch

from kvcert.core.scorers.inputs import ScorerInputs


def tova_scores(inputs: ScorerInputs, *, scale: float, n_candidates: int) -> torch.Tensor:
    """Scores (L, Hkv, n_candidates) of the region's first n_candidates tokens."""
    keys = inputs.keys.float()
    last = inputs.need_queries("tova")[:, :, -1:].float()  # (L, Hq, 1, d): the region's last query
    n_kv, n_q = keys.shape[1], last.shape[1]
    group = n_q // n_kv
    q = last.reshape(last.shape[0], n_kv, group, keys.shape[-1])  # query head h reads KV head h // group
    weights = (q @ keys.transpose(-1, -2) * scale).softmax(-1)  # (L, Hkv, group, region)
    scores = weights.mean(dim=(1, 2))  # over all query heads
    return scores[:, None, :n_candidates].expand(-1, n_kv, -1).clone()
