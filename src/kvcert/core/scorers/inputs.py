"""What the scorers ported from kvpress read beyond the candidate keys: the layer's whole cache at compression time
(keys, values), its queries, and two model tensors (the rotary embedding, the output projection). Plain torch: the
HF glue (kvcert.hf.scorer_inputs) builds it from the attention layer; core never imports transformers.

Every tensor covers the *region* (the tokens in the cache when compression happens: the context for
compress_after="context", the prompt for "prompt"), the candidates [0, lo) and the always-kept tokens after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions (T,) -> (cos, sin), each (T, d)


@dataclass(frozen=True, kw_only=True)
class ScorerInputs:
    keys: torch.Tensor  # (L, Hkv, region, d), after RoPE (what the cache holds)
    values: torch.Tensor  # (L, Hkv, region, d)
    queries: torch.Tensor | None  # (L, Hq, region, d), after RoPE; None where they were not captured
    rotary: Rotary | None = None  # the model's rotary embedding (rotate-half layout), float32
    out_proj: torch.Tensor | None = None  # (L, hidden, Hq * d): each layer's o_proj weight

    def need_queries(self, scorer: str) -> torch.Tensor:
        if self.queries is None:
            raise ValueError(f"scorer {scorer!r} reads the prompt's queries, which this read did not capture")
        return self.queries


def group_mean(scores: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """(..., Hq, n) -> (..., Hkv, n): mean over each KV head's query heads (query head h reads KV head h // group,
    as transformers' repeat_kv)."""
    *lead, n_q, n = scores.shape
    return scores.reshape(*lead, n_kv_heads, n_q // n_kv_heads, n).mean(-2)


def pad_protected(scores: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """kvpress's protection of tokens it never prunes (sinks, window): the max score + 1 over columns [lo, hi),
    one value over the whole tensor (kvpress's `scores.max().item() + 1`)."""
    out = scores.clone()
    out[..., lo:hi] = scores.max() + 1
    return out
