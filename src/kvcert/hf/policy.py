"""A policy = scorer x design x budget, and how it compresses the recorded prompt of every layer.

Scorers: window_question (SnapKV window = the question, compression after the question is read), window_context
(window = the last context tokens, compression before the question exists), streaming, key_norm, random.
`none` + design `full` is the full-cache reference (budget 1.0).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvcert.core import get_design, keep_count, key_norm_scores, random_scores, streaming_scores, window_scores
from kvcert.core.selection import Selection

SCORERS = ("window_question", "window_context", "streaming", "key_norm", "random", "none")
DESIGN_NAMES = ("topk", "randomized", "randomized_no_offset", "uniform", "full")


@dataclass(frozen=True)
class Policy:
    scorer: str
    design: str
    budget: float
    tail_fraction: float = 0.5
    floor: float = 0.2
    score_power: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {list(SCORERS)}, got {self.scorer!r}")
        if self.design not in DESIGN_NAMES:
            raise ValueError(f"design must be one of {list(DESIGN_NAMES)}, got {self.design!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")
        if not 0.0 <= self.tail_fraction < 1.0:
            raise ValueError(f"tail_fraction must be in [0, 1), got {self.tail_fraction!r}")
        if (self.design == "full") != (self.scorer == "none"):
            raise ValueError("the full-cache reference is scorer 'none' with design 'full' (and only that pair)")

    @property
    def is_full(self) -> bool:
        return self.design == "full"

    @property
    def question_aware(self) -> bool:
        """Compressed after the question was read (all but window_context)."""
        return self.scorer != "window_context"

    @property
    def has_certificate(self) -> bool:
        return self.design in ("randomized", "randomized_no_offset", "uniform")

    @property
    def label(self) -> str:
        if self.is_full:
            return "full"
        rand = ""
        if self.has_certificate:
            rand = f"/t{self.tail_fraction:g}/f{self.floor:g}/p{self.score_power:g}/s{self.seed}"
        return f"{self.scorer}/{self.design}/b{self.budget:g}{rand}"

    def generator(self, example_id: str) -> torch.Generator:
        """Independent, reproducible draws per (example, seed): the seed never repeats a draw across examples."""
        return torch.Generator().manual_seed(zlib.crc32(f"{example_id}|{self.seed}".encode()) + 7919 * self.seed)


FULL = Policy("none", "full", 1.0)


@dataclass(frozen=True)
class Compressed:
    """Per layer: kept positions (Hkv, m) into the recorded prompt, offsets, validity; one policy."""

    indices: list[torch.Tensor]
    offset: list[torch.Tensor]
    one_minus_pi: list[torch.Tensor]
    tail_slots: list[int]
    kept_tokens: float  # mean kept prompt tokens per (layer, head)


def compress(
    policy: Policy,
    full_keys: list[torch.Tensor],
    region: int,
    window: tuple[int, int] | None,
    window_queries: list[torch.Tensor] | None,
    scale: float,
    example_id: str,
    pool_kernel: int = 5,
) -> Compressed:
    """Select the kept prompt tokens of every layer.

    region: tokens [0, region) of the recorded keys are the prompt at compression time.
    window: (lo, hi) positions always kept (the observation window), excluded from the candidates; the budget
    (a fraction of `region`) counts them.
    """
    n_layers = len(full_keys)
    n_kv = full_keys[0].shape[1]
    device = full_keys[0].device
    if policy.is_full:
        idx = torch.arange(region, device=device).expand(n_kv, region)
        zeros = torch.zeros(n_kv, region, device=device)
        return Compressed([idx] * n_layers, [zeros] * n_layers, [zeros[:, :0]] * n_layers, [0] * n_layers, region)
    lo, hi = window if window is not None else (region, region)
    n_cand = lo  # candidates are [0, lo); the window [lo, hi) is kept; nothing after hi exists yet
    n_forced = hi - lo
    n_keep = min(n_cand, max(0, keep_count(policy.budget, region) - n_forced))
    gen = policy.generator(example_id)
    keys = torch.stack([k[0, :, :n_cand] for k in full_keys])  # (L, Hkv, n_cand, d)
    if policy.scorer in ("window_question", "window_context"):
        q = torch.stack([w[0] for w in window_queries])  # (L, Hq, w, d) all after the candidates: no causal mask
        scores = window_scores(q, keys, scale=scale, pool_kernel=pool_kernel)
    elif policy.scorer == "streaming":
        scores = streaming_scores(tuple(keys.shape[:-1]), device=device)
    elif policy.scorer == "key_norm":
        scores = key_norm_scores(keys)
    else:
        scores = random_scores(tuple(keys.shape[:-1]), generator=gen).to(device)
    sel: Selection = get_design(policy.design)(
        scores.float().clamp_min(0), n_keep, tail_fraction=policy.tail_fraction, floor=policy.floor,
        score_power=policy.score_power, generator=gen,
    )
    forced = torch.arange(lo, hi, device=device).expand(n_layers, n_kv, n_forced)
    indices = torch.cat([sel.indices, forced], dim=-1)
    offset = torch.cat([sel.offset, torch.zeros(n_layers, n_kv, n_forced, device=device)], dim=-1)
    omp = sel.one_minus_pi[..., : sel.tail_slots]
    kept = float(sel.kept_counts.double().mean()) + n_forced
    return Compressed(list(indices), list(offset), list(omp), [sel.tail_slots] * n_layers, kept)
