"""CriticalKV's value weighting (Feng et al., 2025): a base scorer's scores rescaled by how much each token's value
moves the layer's output, ||v_j W_o||_1, after a first stage that keeps the base scorer's top tokens outright.

Follows kvpress 0.5.5 `kvpress/presses/criticalkv_press.py` (`CriticalKVPress`, epsilon=1e-4,
first_stage_ratio=0.5): stage 1 keeps the int(first_stage_ratio * kept) top tokens by the base score (kvpress's
protected window counts in them: it holds the max score + 1); stage 2 scores the rest by (score + epsilon) * the
L1 norm of v_j W_o^h averaged over each KV group's query heads (`vwl1norm`). kvpress marks stage 1 with the float
maximum; kvcert gives it the stage-2 maximum + 1 per head, so the randomized design's sums stay finite (the order,
hence top-k, is the same). Unlike the other scorers it depends on the budget (the stage-1 count).
"""

from __future__ import annotations

import torch

from kvcert.core.scorers.inputs import ScorerInputs

EPSILON = 1e-4
FIRST_STAGE = 0.5


def value_output_norm(values: torch.Tensor, out_proj: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """(L, Hkv, n): ||v_j W_o^h||_1 averaged over the query heads h of each KV group. out_proj (L, hidden, Hq*d)."""
    n_layers, n_kv, n, d = values.shape
    group = n_q_heads // n_kv
    wo = out_proj.float().transpose(-1, -2).reshape(n_layers, n_q_heads, d, -1)  # (L, Hq, d, hidden)
    norms = []
    for h in range(n_q_heads):  # head by head: (n, hidden) at a time, as kvpress
        norms.append((values[:, h // group].float() @ wo[:, h]).abs().sum(-1))
    return torch.stack(norms, 1).reshape(n_layers, n_kv, group, n).mean(2)


def critical_scores(
    base: torch.Tensor, inputs: ScorerInputs, *, n_keep: int, n_forced: int, n_q_heads: int
) -> torch.Tensor:
    """Scores (L, Hkv, candidates) from the base scores of the candidates (the region's first tokens); n_keep
    candidates are kept besides the n_forced always-kept ones."""
    if inputs.out_proj is None:
        raise ValueError("critical scorers need the layers' output projections (ScorerInputs.out_proj)")
    n = base.shape[-1]
    norm = value_output_norm(inputs.values[:, :, :n], inputs.out_proj, n_q_heads)
    weighted = (base.float() + EPSILON) * norm
    first = min(n, max(0, int((n_keep + n_forced) * FIRST_STAGE) - n_forced))  # the window counts in stage 1
    if first > 0:
        top = base.topk(first, dim=-1, sorted=True).indices
        marks = weighted.amax(-1, keepdim=True).expand_as(top) + 1
        weighted = weighted.scatter(-1, top, marks)
    return weighted
