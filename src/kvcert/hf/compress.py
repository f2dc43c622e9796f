"""How one policy compresses the recorded prompt of every layer: scores from the registered scorer, a draw from the
registered design, and the tokens that are always kept (the observation window, or the protected question).

Budget accounting: a budget is a fraction of the tokens in the cache at compression time (`region`: the whole
prompt when compress_after=prompt, the context when compress_after=context); the always-kept tokens count against
it and the design draws the rest from the candidates before them.

Sliding-window layers (Gemma 2/3, Mistral-style, gpt-oss-style alternating layers) are not compressed: their window
already bounds their cache, so they keep exactly the last `window - 1` tokens before the next position (every
policy, pi = 1, no certificate), and a budget applies to the full-attention layers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core import get_design, keep_count
from kvcert.core.scorers import SCORERS
from kvcert.core.selection import Selection
from kvcert.policy import Policy


@dataclass(frozen=True, kw_only=True)
class Compressed:
    """Per layer: kept positions (Hkv, m) into the recorded prompt, offsets, 1 - pi of the tail slots; one policy."""

    indices: list[torch.Tensor]
    offset: list[torch.Tensor]
    one_minus_pi: list[torch.Tensor]
    tail_slots: list[int]
    kept_tokens: float  # mean kept prompt tokens per (layer, head)


def compress(
    policy: Policy,
    full_keys: list[torch.Tensor],
    *,
    region: int,
    forced: tuple[int, int] | None,
    window_queries: list[torch.Tensor] | None,
    scale: float,
    generator: torch.Generator,
    pool_kernel: int = 5,
    layer_windows: list[int | None] | None = None,
    score_cache: dict | None = None,
) -> Compressed:
    """Select the kept prompt tokens of every layer.

    region: tokens [0, region) of the recorded keys are the prompt at compression time.
    forced: (lo, hi) positions always kept (the observation window or the protected question), excluded from the
    candidates [0, lo); the budget (a fraction of `region`) counts them. None: every token is a candidate.
    """
    n_layers = len(full_keys)
    n_kv = full_keys[0].shape[1]
    device = full_keys[0].device
    if policy.is_full:  # every token (a sliding-window layer's mask hides those that left its window)
        idx = torch.arange(region, device=device).expand(n_kv, region)
        zeros = torch.zeros(n_kv, region, device=device)
        return Compressed(
            indices=[idx] * n_layers,
            offset=[zeros] * n_layers,
            one_minus_pi=[zeros[:, :0]] * n_layers,
            tail_slots=[0] * n_layers,
            kept_tokens=region,
        )
    lo, hi = forced if forced is not None else (region, region)
    n_cand = lo  # candidates are [0, lo); the forced tokens [lo, hi) are kept; nothing after hi exists yet
    n_forced = hi - lo
    n_keep = min(n_cand, max(0, keep_count(policy.budget, region) - n_forced))
    # scores depend on the scorer and the candidates only, so policies that differ in design or budget share them
    # (random scores are drawn from the policy's own generator and never shared)
    key = (policy.scorer, n_cand, forced, pool_kernel)
    scores = score_cache.get(key) if score_cache is not None and policy.scorer != "random" else None
    if scores is None:
        keys = torch.stack([k[0, :, :n_cand] for k in full_keys])  # (L, Hkv, n_cand, d)
        queries = torch.stack([w[0] for w in window_queries]) if window_queries is not None else None  # (L,Hq,w,d)
        scores = SCORERS[policy.scorer].score(
            keys, window_queries=queries, scale=scale, pool_kernel=pool_kernel, generator=generator
        )
        if score_cache is not None and policy.scorer != "random":
            score_cache[key] = scores
    sel: Selection = get_design(policy.design)(
        scores.float().clamp_min(0),
        n_keep,
        tail_fraction=policy.tail_fraction,
        floor=policy.floor,
        score_power=policy.score_power,
        generator=generator,
    )
    always = torch.arange(lo, hi, device=device).expand(n_layers, n_kv, n_forced)
    indices = torch.cat([sel.indices, always], dim=-1)
    offset = torch.cat([sel.offset, torch.zeros(n_layers, n_kv, n_forced, device=device)], dim=-1)
    omp = sel.one_minus_pi[..., : sel.tail_slots]
    kept_counts = sel.kept_counts.double()  # (L, Hkv) drawn tokens; + n_forced after the mean (float order)
    out = Compressed(
        indices=list(indices),
        offset=list(offset),
        one_minus_pi=list(omp),
        tail_slots=[sel.tail_slots] * n_layers,
        kept_tokens=float(kept_counts.mean()) + n_forced,
    )
    windows = layer_windows or [None] * n_layers
    if all(w is None for w in windows):
        return out
    full = [layer for layer, w in enumerate(windows) if w is None]
    for layer, w in enumerate(windows):
        if w is not None:  # keep the window exactly
            lo_w = max(0, region - (w - 1))
            out.indices[layer] = torch.arange(lo_w, region, device=device).expand(n_kv, region - lo_w)
            out.offset[layer] = torch.zeros(n_kv, region - lo_w, device=device)
            out.one_minus_pi[layer] = out.one_minus_pi[layer][:, :0]
            out.tail_slots[layer] = 0
    kept = float(kept_counts[full].mean()) + n_forced if full else float("nan")  # the budget's layers only
    return Compressed(
        indices=out.indices,
        offset=out.offset,
        one_minus_pi=out.one_minus_pi,
        tail_slots=out.tail_slots,
        kept_tokens=kept,
    )
