"""A policy = scorer x design x budget, plus *when* it compresses. Plain Python: no torch model, no transformers.

When compression happens is an explicit field (`compress_after`), for every scorer:
- "prompt": after the whole prompt was read (context, question, chat suffix, answer prefix); the first answer
  token comes from the full prefill. kvcert's default for every scorer but `window_context`.
- "context": after the context only (kvpress's protocol): the question, chat suffix and answer prefix are then read
  through the compressed cache. The default of `window_context`, whose window is the last context tokens.
`protect_question` (compress_after="prompt" only) keeps the question's tokens out of eviction; it is the observation
window of `window_question` (always kept), and off by default for the other scorers, which may evict them.
The defaults reproduce the scorers' earlier implicit behaviour, and the label (the record's `variant`) only names
the two fields when they differ from the scorer's default.
`none` + design `full` is the full-cache reference (budget 1.0).

Two choices beside the design (the defaults keep every earlier output and label unchanged):
- `allocation`: how a layer's budget is shared across its KV heads, "uniform" (every head the same count) or
  "adakv" (by score mass, AdaKV; kvcert.core.allocation). The certificate stays per head.
- `recompress_every`: None, or N: during decoding the cache (kept prompt tokens + tokens generated since) is
  compressed back to the prompt compression's size every N decode steps (kvpress's DecodingPress;
  kvcert.core.recompress, docs/decoding_compression.md). A policy field, not a decoding option, because it changes
  what is kept and what pi means (the product over a token's draws).
- `half`: None, or 0 / 1: one half of the randomized design's draw (split halves, kvcert.hf.draws): the head, plus
  the tail tokens whose uniform u fell below pi/2 (half 0) or in [pi/2, pi) (half 1). Each half is a Poisson sample
  at pi/2 (weights 2/pi), the two are disjoint and their union is the draw of the same seed, so two halves hold no
  more KV than one draw.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from kvcert.core.allocation import ALLOCATIONS
from kvcert.core.designs import DESIGN_SPECS
from kvcert.core.scorers import SCORERS

SCORER_NAMES = (*SCORERS, "none")
DESIGN_NAMES = (*DESIGN_SPECS, "full")
COMPRESS_AFTER = ("prompt", "context")


def default_compress_after(scorer: str) -> str:
    return "context" if scorer in SCORERS and SCORERS[scorer].window == "context" else "prompt"


def default_protect_question(scorer: str) -> bool:
    return scorer in SCORERS and SCORERS[scorer].window == "question"


@dataclass(frozen=True, kw_only=True)
class Policy:
    scorer: str
    design: str
    budget: float
    tail_fraction: float = 0.5
    floor: float = 0.2
    score_power: float = 1.0
    seed: int = 0
    compress_after: str | None = None  # None: the scorer's default (see module docstring)
    protect_question: bool | None = None  # None: the scorer's default
    allocation: str = "uniform"  # uniform | adakv: how a layer's budget is shared across its KV heads
    recompress_every: int | None = None  # N: re-compress the cache to the budget every N decode steps
    half: int | None = None  # 0 | 1: one half of the draw's tail at pi/2 (split halves); None: the whole draw

    def __post_init__(self):
        if self.scorer not in SCORER_NAMES:
            raise ValueError(f"scorer must be one of {list(SCORER_NAMES)}, got {self.scorer!r}")
        if self.design not in DESIGN_NAMES:
            raise ValueError(f"design must be one of {list(DESIGN_NAMES)}, got {self.design!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget!r}")
        if not 0.0 <= self.tail_fraction < 1.0:
            raise ValueError(f"tail_fraction must be in [0, 1), got {self.tail_fraction!r}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"floor must be in [0, 1], got {self.floor!r}")
        if not self.score_power > 0:
            raise ValueError(f"score_power must be > 0, got {self.score_power!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {list(ALLOCATIONS)}, got {self.allocation!r}")
        n = self.recompress_every
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"recompress_every must be None or an integer >= 1, got {n!r}")
        if (self.design == "full") != (self.scorer == "none"):
            raise ValueError("the full-cache reference is scorer 'none' with design 'full' (and only that pair)")
        if self.compress_after is None:
            object.__setattr__(self, "compress_after", default_compress_after(self.scorer))
        if self.protect_question is None:
            object.__setattr__(self, "protect_question", default_protect_question(self.scorer))
        if self.compress_after not in COMPRESS_AFTER:
            raise ValueError(f"compress_after must be one of {list(COMPRESS_AFTER)}, got {self.compress_after!r}")
        window = SCORERS[self.scorer].window if self.scorer in SCORERS else None
        if window == "question" and (self.compress_after != "prompt" or not self.protect_question):
            raise ValueError(f"{self.scorer} reads the question: it needs compress_after=prompt and protect_question")
        if window == "context" and self.compress_after != "context":
            raise ValueError(f"{self.scorer} reads the last context tokens: it needs compress_after=context")
        if self.compress_after == "context" and self.protect_question:
            raise ValueError(
                "protect_question applies to compress_after=prompt (after the context the question "
                "is not in the cache yet)"
            )
        if self.is_full and (self.allocation != "uniform" or self.recompress_every is not None):
            raise ValueError("the full-cache reference keeps everything: allocation and recompress_every do not apply")
        if self.half is not None and (self.half not in (0, 1) or isinstance(self.half, bool)):
            raise ValueError(f"half must be None, 0 or 1, got {self.half!r}")
        if self.half is not None and (self.design != "randomized" or self.recompress_every is not None):
            raise ValueError(
                "half splits the randomized design's tail: it needs design=randomized, no recompress_every"
            )
        if self.recompress_every is not None and self.scorer == "streaming":
            raise ValueError("recompress_every needs a scorer that reads keys or queries; streaming reads positions")

    @property
    def is_full(self) -> bool:
        return self.design == "full"

    @property
    def scorer_window(self) -> str | None:
        """The observation window the scorer reads: "question", "context" or None."""
        return SCORERS[self.scorer].window if self.scorer in SCORERS else None

    @property
    def question_aware(self) -> bool:
        """Compressed after the question was read."""
        return self.compress_after == "prompt"

    @property
    def has_certificate(self) -> bool:
        return self.design in DESIGN_SPECS and DESIGN_SPECS[self.design].has_certificate

    @property
    def label(self) -> str:
        if self.is_full:
            return "full"
        rand = ""
        if self.has_certificate:
            rand = f"/t{self.tail_fraction:g}/f{self.floor:g}/p{self.score_power:g}/s{self.seed}"
        when = ""
        if self.compress_after != default_compress_after(self.scorer):
            when += f"/after-{self.compress_after}"
        if self.protect_question != default_protect_question(self.scorer):
            when += "/protect-q" if self.protect_question else "/evict-q"
        if self.allocation != "uniform":
            when += f"/{self.allocation}"
        if self.recompress_every is not None:
            when += f"/re{self.recompress_every}"
        if self.half is not None:
            when += f"/half{self.half}"
        return f"{self.scorer}/{self.design}/b{self.budget:g}{rand}{when}"

    def generator_seed(self, example_id: str) -> int:
        """Independent, reproducible draws per (example, seed): the seed never repeats a draw across examples."""
        return zlib.crc32(f"{example_id}|{self.seed}".encode()) + 7919 * self.seed


FULL = Policy(scorer="none", design="full", budget=1.0)
