"""Scorers: importance s_i per (layer, KV head, token). One file per scorer, one registry here.

Every registered scorer has the signature of kvpress's single `score` method, adapted to kvcert's recorded
prompt: `score(keys, *, window_queries, scale, pool_kernel, generator) -> (..., Hkv, n)` over keys
(..., Hkv, n, d); scorers ignore what they do not use. `window` names the observation window a scorer reads:
"question" (the question's queries, so compression happens after the prompt), "context" (the last context tokens,
before the question exists), "last" (the last token of the cache, always kept: TOVA) or None.

The scorers ported from kvpress 0.5.5 (`reads_inputs`) read more than the candidate keys: they are also given
`inputs` (a ScorerInputs: the cache's keys, values and queries at compression time, the rotary embedding, the output
projection), `n_keep` (candidates the design keeps) and `n_forced` (always-kept tokens). The original five are
called exactly as before, with no extra argument, so their scores do not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.core.scorers.critical import critical_scores
from kvcert.core.scorers.expected_attention import expected_attention_scores
from kvcert.core.scorers.inputs import ScorerInputs
from kvcert.core.scorers.key_norm import key_norm_scores
from kvcert.core.scorers.observed_attention import observed_attention_scores
from kvcert.core.scorers.random import random_scores
from kvcert.core.scorers.snapkv import snapkv_scores
from kvcert.core.scorers.streaming import streaming_scores
from kvcert.core.scorers.tova import tova_scores
from kvcert.core.scorers.window import window_scores


def _window(keys, *, window_queries, scale, pool_kernel, generator):
    return window_scores(window_queries, keys, scale=scale, pool_kernel=pool_kernel)


def _streaming(keys, *, window_queries, scale, pool_kernel, generator):
    return streaming_scores(tuple(keys.shape[:-1]), device=keys.device)


def _key_norm(keys, *, window_queries, scale, pool_kernel, generator):
    return key_norm_scores(keys)


def _random(keys, *, window_queries, scale, pool_kernel, generator):
    return random_scores(tuple(keys.shape[:-1]), generator=generator).to(keys.device)


# ---------------------------------------------------------------------- ported from kvpress 0.5.5 (reads_inputs)
def _tova(keys, *, window_queries, scale, pool_kernel, generator, inputs, n_keep, n_forced):
    return tova_scores(inputs, scale=scale, n_candidates=keys.shape[-2])


def _observed_attention(keys, *, window_queries, scale, pool_kernel, generator, inputs, n_keep, n_forced):
    return observed_attention_scores(inputs, scale=scale, n_candidates=keys.shape[-2])


def _expected_attention(keys, *, window_queries, scale, pool_kernel, generator, inputs, n_keep, n_forced):
    return expected_attention_scores(inputs, n_candidates=keys.shape[-2])


def _snapkv(keys, *, window_queries, scale, pool_kernel, generator, inputs, n_keep, n_forced):
    return snapkv_scores(window_queries, inputs, scale=scale, pool_kernel=pool_kernel, n_candidates=keys.shape[-2])


def _critical_snapkv(keys, *, window_queries, scale, pool_kernel, generator, inputs, n_keep, n_forced):
    base = snapkv_scores(window_queries, inputs, scale=scale, pool_kernel=pool_kernel, n_candidates=keys.shape[-2])
    return critical_scores(base, inputs, n_keep=n_keep, n_forced=n_forced, n_q_heads=window_queries.shape[-3])


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    score: Callable[..., torch.Tensor]
    window: str | None  # "question" | "context" | "last" | None: the observation window the scorer reads
    reads_inputs: bool = False  # called with inputs=, n_keep=, n_forced= (the ported kvpress scorers)
    reads_budget: bool = False  # its scores depend on n_keep (so they are shared only between equal budgets)


SCORERS: dict[str, ScorerSpec] = {
    "window_question": ScorerSpec("window_question", _window, window="question"),
    "window_context": ScorerSpec("window_context", _window, window="context"),
    "streaming": ScorerSpec("streaming", _streaming, window=None),
    "key_norm": ScorerSpec("key_norm", _key_norm, window=None),
    "random": ScorerSpec("random", _random, window=None),
    "snapkv": ScorerSpec("snapkv", _snapkv, window="context", reads_inputs=True),
    "tova": ScorerSpec("tova", _tova, window="last", reads_inputs=True),
    "observed_attention": ScorerSpec("observed_attention", _observed_attention, window=None, reads_inputs=True),
    "expected_attention": ScorerSpec("expected_attention", _expected_attention, window=None, reads_inputs=True),
    "critical_snapkv": ScorerSpec(
        "critical_snapkv", _critical_snapkv, window="context", reads_inputs=True, reads_budget=True
    ),
}


def scorer_spec(name: str) -> ScorerSpec:
    if name not in SCORERS:
        raise ValueError(f"scorer must be one of {sorted(SCORERS)}, got {name!r}")
    return SCORERS[name]


__all__ = [
    "SCORERS",
    "ScorerInputs",
    "ScorerSpec",
    "critical_scores",
    "expected_attention_scores",
    "key_norm_scores",
    "observed_attention_scores",
    "random_scores",
    "scorer_spec",
    "snapkv_scores",
    "streaming_scores",
    "tova_scores",
    "window_scores",
]
