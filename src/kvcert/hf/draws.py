"""Several draws of one randomized policy, decoded as rows of one batch, and their agreement (kvcert.core.agreement).

Two variants:
- "independent": R draws of the policy (seeds s, s + 1, ..., s + R - 1). They share the deterministic head (the
  top scores do not depend on the seed) and differ in their Poisson tails; the KV they hold together is the union,
  the head once and R tails (`union_kv_bytes`).
- "split" (split halves, memory-free): one draw (seed s) whose tail is split at random into two halves, each
  decoded with weights 2/pi over its half (`Policy.half`); the halves hold exactly the draw's kept set.

Draw 0 (the policy itself) decodes the answer. Every other row (the other draws, or the two halves) follows it: it
is fed draw 0's tokens (teacher forcing, in the same batch and the same decode steps as draw 0, so no second forward
over the answer), and records the log-probability its cache gives each of them and its own greedy choice. The
engine today holds each row's kept set in its own buffers (the head once per row); `union_kv_bytes` is the KV a
server that stores the shared head once holds, which is what `kvcert.generate` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvcert.core import agreement
from kvcert.hf.decode import VariantResult, answer_length
from kvcert.policy import Policy

VARIANTS = ("independent", "split")


@dataclass(frozen=True, kw_only=True)
class Draws:
    """How many draws of the policy and which variant: R >= 2 independent draws, or the two split halves."""

    count: int = 2
    variant: str = "independent"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"draws variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 2:
            raise ValueError(
                f"draws count={self.count!r}: agreement needs at least 2 draws; pass draws=2 or more (--draws 2), "
                "or draws=None for one draw"
            )
        if self.variant == "split" and self.count != 2:
            raise ValueError("split halves are 2 rows (half 0 and half 1 of one draw's tail): set count=2")

    @property
    def label(self) -> str:
        return f"{self.variant}x{self.count}"


def as_draws(value: Draws | int | None) -> Draws | None:
    """`generate(draws=...)`'s argument: None (one draw), an int R (R independent draws) or a Draws as given."""
    if value is None or isinstance(value, Draws):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"draws={value!r}: pass None (one draw), an int >= 2 (independent draws) or a Draws")
    return Draws(count=value)


def draw_policies(policy: Policy, draws: Draws) -> tuple[list[Policy], dict[int, int]]:
    """The rows to decode (draw 0 first) and who follows whom (row -> 0)."""
    if not policy.has_certificate or policy.design != "randomized" or policy.half is not None:
        raise ValueError(f"draws need a whole randomized policy (design=randomized, half=None), got {policy.label}")
    if draws.variant == "independent":
        rows = [replace(policy, seed=policy.seed + r) for r in range(draws.count)]
    else:
        rows = [policy, replace(policy, half=0), replace(policy, half=1)]
    return rows, {r: 0 for r in range(1, len(rows))}


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """Draw 0's answer read by the other rows: the signals of kvcert.core.agreement and what they came from."""

    disagreement: float  # mean over the other rows of max_t log p_0(a_t) - log p_r(a_t)
    differs: float  # share of the other rows whose own greedy answer differs
    confidence: float  # minus draw 0's lowest log-probability over the same span
    span: tuple[int, int]  # the scored token positions [lo, hi)
    logprobs: list[list[float]]  # per other row, the log-probability of each of draw 0's tokens
    drops: list[float] = field(default_factory=list)  # per other row, its max_t log p_0(a_t) - log p_r(a_t)
    row_differs: list[bool] = field(default_factory=list)  # per other row, whether its own greedy answer differs

    def as_dict(self) -> dict:
        return dict(
            disagreement=self.disagreement,
            differs=self.differs,
            confidence=self.confidence,
            span=list(self.span),
            logprobs=[list(map(float, lp)) for lp in self.logprobs],
            drops=list(map(float, self.drops)),
            row_differs=list(map(bool, self.row_differs)),
        )


def answer_end(tokenizer, eos: set[int], stops: tuple[str, ...], leader: VariantResult) -> Callable[[int], bool]:
    """Whether a token in place of the one that ended draw 0's answer ends the same answer (its text up to the stop):
    `answer_length` of draw 0's answer tokens followed by it gives draw 0's answer length and text."""
    head, want = list(leader.tokens[: leader.n_answer]), (leader.n_answer, leader.answer)

    def ends(token: int) -> bool:
        return answer_length(tokenizer, [*head, int(token)], eos, stops) == want

    return ends


def agreement_of(
    leader: VariantResult, followers: list[VariantResult], ends_answer: Callable[[int], bool] | None = None
) -> Agreement:
    """The signals of draw 0's answer from the rows that followed it (kvcert.core.agreement). ends_answer (e.g.
    `answer_end(...)`): `differs` compares the draws' answers, so another token that ends the same answer where draw
    0's ended is no difference; without it the span's tokens are compared one by one."""
    if any(f.own_tokens is None or f.tokens[: len(leader.tokens)] != leader.tokens for f in followers):
        raise ValueError("every follower must have been fed draw 0's tokens (decode with follow=...)")
    span = agreement.scored_span(
        leader.n_answer, len(leader.tokens), first_from_prefill=leader.policy.compress_after == "prompt"
    )
    ended = ends_answer is not None and len(leader.tokens) > leader.n_answer
    end = dict(n_answer=leader.n_answer, ends_answer=ends_answer) if ended else {}
    return Agreement(
        disagreement=agreement.disagreement(leader.logprobs, [f.logprobs for f in followers], span),
        differs=agreement.differs(leader.tokens, [f.own_tokens for f in followers], span, **end),
        confidence=agreement.confidence(leader.logprobs, span),
        span=(span.start, span.stop),
        logprobs=[f.logprobs for f in followers],
        drops=[agreement.disagreement(leader.logprobs, [f.logprobs], span) for f in followers],
        row_differs=[agreement.differs(leader.tokens, [f.own_tokens], span, **end) == 1.0 for f in followers],
    )


def union_kv_bytes(batch, policy_rows: list[int], appended: dict[int, int]) -> int:
    """Bytes of keys and values that the rows `policy_rows` (policy indices) of a CompressedBatch hold together when
    the positions several of them keep are stored once: per layer, the union of their kept prompt positions (the
    shared head once), plus each row's own appended tokens (`appended`: policy index -> tokens appended after the
    compression; their keys differ between rows)."""
    comps = dict(zip(batch.rows, batch.comps))
    first = batch.state.layers[0].values  # (B, Hkv, capacity, d)
    d, item, n_kv = first.shape[-1], first.element_size(), first.shape[1]
    n_layers = len(comps[policy_rows[0]].indices)
    entries = 0
    for layer in range(n_layers):
        idx = [comps[i].indices[layer] for i in policy_rows]
        valid = [comps[i].offset[layer].isfinite() for i in policy_rows]
        n_pos = max((int(ix.max()) + 1 for ix in idx if ix.numel()), default=0)
        entries += agreement.union_count(idx, valid, n_pos) if n_pos else 0
    entries += n_layers * n_kv * sum(appended[i] for i in policy_rows)
    return 2 * d * item * entries
