"""Compression during decoding (`Policy.recompress_every = N`, kvpress's DecodingPress): every N decode steps a
bucket's cache, the kept prompt tokens plus every token appended since, is compressed back to the prompt
compression's size per head (`keep_count(budget, region)`, the always-kept tokens included) by the policy's scorer,
allocation and design on the current keys. The mathematics (pi = product over a token's draws, why the Hajek
estimator and the certificate carry on) is kvcert.core.recompress's; this file only rewrites the buffers.

- Scores: key_norm reads the current keys; window scorers read the last `window` queries the layer saw (decode
  steps, and the question read through the cache after a context-time compression), as kvpress's DecodingPress
  reads its buffered hidden states; random draws fresh scores. Nothing is protected at a re-compression (the
  question or observation window kept at the prompt compression may now be evicted); streaming is refused by
  `Policy` (its scores are positions, which the buffers do not keep).
- Each row draws from its own generator, seeded from the policy and the example (salted: not the prompt draw's).
- The buffers are reallocated at the new width with as many free slots as before, so the held memory follows the
  cache (`CompressedState.peak_bytes` records the largest); sliding-window (hybrid) models are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core.allocation import allocate
from kvcert.core.designs import DESIGN_SPECS
from kvcert.core.probabilities import uniform_draws
from kvcert.core.recompress import redraw
from kvcert.core.scorers import SCORERS, key_norm_scores, random_scores, window_scores
from kvcert.policy import Policy

SALT = 0x5EED_DEC0  # the re-compression draws' generator: policy.generator_seed(example) + SALT


@dataclass(kw_only=True)
class RowRecompress:
    """One row's re-compression: its policy, the per-head size to come back to, its generator, the scorer's
    window of recent queries and pooling."""

    policy: Policy
    target: int
    generator: torch.Generator
    window: int = 32
    pool_kernel: int = 5

    @classmethod
    def of(cls, policy: Policy, target: int, example_id: str, *, window: int, pool_kernel: int) -> RowRecompress:
        generator = torch.Generator().manual_seed(policy.generator_seed(example_id) + SALT)
        return cls(policy=policy, target=target, generator=generator, window=window, pool_kernel=pool_kernel)


def _scores(row: RowRecompress, keys: torch.Tensor, queries: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scores (L, Hkv, m) of a row's current keys (L, Hkv, m, d); queries (L, Hq, w, d) for window scorers."""
    scorer = row.policy.scorer
    if scorer == "key_norm":
        return key_norm_scores(keys)
    if scorer == "random":
        return random_scores(tuple(keys.shape[:-1]), generator=row.generator).to(keys.device)
    if SCORERS[scorer].window is not None:
        if queries is None:
            raise RuntimeError("a window scorer re-compresses from the layer's recent queries; none were recorded")
        return window_scores(queries, keys, scale=scale, pool_kernel=row.pool_kernel)
    raise ValueError(f"recompress_every does not support scorer {scorer!r}")


def recompress_bucket(bucket) -> None:
    """Re-compress every row of `bucket` (kvcert.hf.compressed_state.Bucket, all its rows due) in place."""
    layers = bucket.layers
    if any(not buf.compressed for buf in layers):
        raise NotImplementedError("recompress_every on a model with sliding-window layers is not supported")
    m = layers[0].length
    free = layers[0].capacity - m
    keys = torch.stack([buf.key_slots(m) for buf in layers])  # (L, B, Hkv, m, d)
    values = torch.stack([buf.values[:, :, :m] for buf in layers])
    offset = torch.stack([buf.offset[:, :, :m] for buf in layers])
    omp = torch.stack([buf.one_minus_pi for buf in layers])  # (L, B, Hkv, s)
    s = layers[0].tail_slots
    valid = torch.isfinite(offset)
    sels = []
    for b, row in enumerate(bucket.recompress):
        spec = DESIGN_SPECS[row.policy.design]
        if spec.offset:  # the offset is -log pi (the product of the earlier draws), exactly as attention used it
            prev = (-offset[:, b]).double().masked_fill(~valid[:, b], 0.0)
        else:  # no offset: log pi from the tail's 1 - pi (1 on the head and on appended tokens)
            prev = torch.zeros(valid[:, b].shape, dtype=torch.float64, device=offset.device)
            prev[..., :s] = torch.log1p(-omp[:, b].double().clamp_max(1.0 - 1e-12)).masked_fill(omp[:, b] == 0, 0.0)
        queries = bucket.recent_queries(b)
        scores = _scores(row, keys[:, b].float(), queries, bucket.scale).float().clamp_min(0)
        scores = scores.masked_fill(~valid[:, b], 0.0)
        target = min(row.target, m)
        n_keep = allocate(row.policy.allocation, scores, target, candidates=valid[:, b])
        draws = uniform_draws(tuple(scores.shape), row.generator) if spec.random else None
        p = row.policy
        sels.append(
            redraw(scores, prev, valid[:, b], n_keep, design=p.design, tail_fraction=p.tail_fraction,
                   floor=p.floor, score_power=p.score_power, draws=draws)
        )  # fmt: skip
    width = max(sel.indices.shape[-1] for sel in sels)
    slots = max(sel.tail_slots for sel in sels)
    for layer, buf in enumerate(layers):
        n_b, n_kv, d = buf.values.shape[0], buf.values.shape[1], buf.values.shape[-1]
        new_keys = buf.keys.new_zeros(n_b, n_kv, d, width + free)
        new_values = buf.values.new_zeros(n_b, n_kv, width + free, d)
        new_offset = torch.full((n_b, n_kv, width + free), float("-inf"), dtype=buf.offset.dtype, device=offset.device)
        new_omp = torch.zeros(n_b, n_kv, slots, dtype=buf.one_minus_pi.dtype, device=offset.device)
        for b, sel in enumerate(sels):
            idx, ok = sel.indices[layer], sel.valid[layer]  # (Hkv, w)
            w = idx.shape[-1]
            gathered = idx.unsqueeze(-1).expand(n_kv, w, d)
            new_keys[b, :, :, :w] = keys[layer, b].gather(-2, gathered).transpose(-1, -2)
            new_values[b, :, :w] = values[layer, b].gather(-2, gathered)
            new_offset[b, :, :w] = sel.offset[layer].masked_fill(~ok, float("-inf"))
            if sel.has_certificate:
                new_omp[b, :, : sel.tail_slots] = sel.one_minus_pi[layer, :, : sel.tail_slots].to(new_omp.dtype)
        buf.keys, buf.values, buf.offset, buf.one_minus_pi = new_keys, new_values, new_offset, new_omp
        buf.tail_slots, buf.length, buf.prefix = slots, width, width
    bucket.regroup()
