"""Scorers: importance s_i per (layer, KV head, token). One file per scorer, one registry here.

Every registered scorer has the signature of kvpress's single `score` method, adapted to kvcert's recorded
prompt: `score(keys, *, window_queries, scale, pool_kernel, generator) -> (..., Hkv, n)` over keys
(..., Hkv, n, d); scorers ignore what they do not use. `window` names the observation window a scorer reads:
"question" (the question's queries, so compression happens after the prompt), "context" (the last context tokens,
before the question exists) or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.core.scorers.key_norm import key_norm_scores
from kvcert.core.scorers.random import random_scores
from kvcert.core.scorers.streaming import streaming_scores
from kvcert.core.scorers.window import window_scores


def _window(keys, *, window_queries, scale, pool_kernel, generator):
    return window_scores(window_queries, keys, scale=scale, pool_kernel=pool_kernel)


def _streaming(keys, *, window_queries, scale, pool_kernel, generator):
    return streaming_scores(tuple(keys.shape[:-1]), device=keys.device)


def _key_norm(keys, *, window_queries, scale, pool_kernel, generator):
    return key_norm_scores(keys)


def _random(keys, *, window_queries, scale, pool_kernel, generator):
    return random_scores(tuple(keys.shape[:-1]), generator=generator).to(keys.device)


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    score: Callable[..., torch.Tensor]
    window: str | None  # "question" | "context" | None: the observation window the scorer reads


SCORERS: dict[str, ScorerSpec] = {
    "window_question": ScorerSpec("window_question", _window, window="question"),
    "window_context": ScorerSpec("window_context", _window, window="context"),
    "streaming": ScorerSpec("streaming", _streaming, window=None),
    "key_norm": ScorerSpec("key_norm", _key_norm, window=None),
    "random": ScorerSpec("random", _random, window=None),
}


def scorer_spec(name: str) -> ScorerSpec:
    if name not in SCORERS:
        raise ValueError(f"scorer must be one of {sorted(SCORERS)}, got {name!r}")
    return SCORERS[name]


__all__ = [
    "SCORERS",
    "ScorerSpec",
    "key_norm_scores",
    "random_scores",
    "scorer_spec",
    "streaming_scores",
    "window_scores",
]
