"""Expected-attention scores (Devoto et al., 2025): the attention that *future* queries are expected to pay each
token, from a Gaussian model of the queries, times the value norm.

Follows kvpress 0.5.5 `kvpress/presses/expected_attention_press.py` (`ExpectedAttentionPress` with its defaults:
n_future_positions=512, n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0):
1. mean mu and covariance S (divided by the count) of the pre-RoPE queries of positions [n_sink, region), per head;
2. R = the mean over future positions [region, region + 512) of the RoPE rotation cos * I + sin * P;
3. mu <- R mu, S <- R S R^T; logit_j = mu . k_j / sqrt(d) + k_j^T S k_j / (2 d) over the keys after the sinks;
4. softmax over those keys, mean over each KV group's query heads, times ||v_j||_2;
5. the sinks get the max score + 1 (kvpress's protection).
Difference: kvpress projects the hidden states with q_proj; kvcert's attention hands over the queries after RoPE,
so they are rotated back with the inverse rotation (cos, sin of their positions): equal up to float rounding, for
rotate-half RoPE (the layout kvpress assumes too). Models with q/k norms after the projection (Qwen3, Gemma3) are
handled alike, since the norm is applied before RoPE.
"""

from __future__ import annotations

import math

import torch

from kvcert.core.scorers.inputs import ScorerInputs, group_mean, pad_protected

N_FUTURE = 512
N_SINK = 4


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE queries from rotated ones: q = (y cos - rotate_half(y) sin) / (cos^2 + sin^2), which inverts
    y = q cos + rotate_half(q) sin (the denominator is the rotary attention scaling squared, 1 for plain RoPE)."""
    return (queries * cos - _rotate_half(queries) * sin) / (cos * cos + sin * sin)


def average_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(d, d): mean over positions of cos * I + sin * P, P = [[0, -I], [I, 0]] (kvpress's apply_avg_rope)."""
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=cos.dtype, device=cos.device)
    p = torch.zeros(d, d, dtype=cos.dtype, device=cos.device)
    p[d // 2 :, : d // 2], p[: d // 2, d // 2 :] = torch.eye(d // 2), -torch.eye(d // 2)
    return (cos[:, :, None] * eye + sin[:, :, None] * p).mean(0)


def expected_attention_scores(inputs: ScorerInputs, *, n_candidates: int) -> torch.Tensor:
    """Scores (L, Hkv, n_candidates) of the region's first n_candidates tokens."""
    if inputs.rotary is None:
        raise ValueError("expected_attention needs the model's rotary embedding (ScorerInputs.rotary)")
    queries = inputs.need_queries("expected_attention").float()
    n_layers, n_kv, n, d = inputs.keys.shape
    if n <= N_SINK:
        raise ValueError(f"expected_attention needs more than {N_SINK} tokens in the cache, got {n}")
    device = queries.device
    cos, sin = inputs.rotary(torch.arange(N_SINK, n, device=device))
    pre = unrotate(queries[:, :, N_SINK:], cos, sin)  # (L, Hq, n - sinks, d)
    mu = pre.mean(2, keepdim=True)
    centered = pre - mu
    cov = centered.transpose(-1, -2) @ centered / pre.shape[2]  # (L, Hq, d, d)
    rot = average_rotation(*inputs.rotary(torch.arange(n, n + N_FUTURE, device=device)))
    mu = mu.squeeze(2) @ rot.T  # (L, Hq, d)
    cov = rot @ cov @ rot.T
    group = queries.shape[1] // n_kv
    keys = inputs.keys[:, :, N_SINK:].float().repeat_interleave(group, 1)  # (L, Hq, n - sinks, d)
    logits = (keys @ mu[..., None]).squeeze(-1) / math.sqrt(d)
    logits = logits + ((keys @ cov) * keys).sum(-1) / d / 2
    scores = group_mean(logits.softmax(-1), n_kv) * inputs.values[:, :, N_SINK:].float().norm(dim=-1)
    scores = torch.cat([scores[..., :N_SINK], scores], dim=-1)  # placeholders for the sinks, set next
    return pad_protected(scores, 0, N_SINK)[..., :n_candidates]
