"""One example's flow in three stages:

    prefill = Prefill.record(model, prompt)           # exact attention; full keys/values kept as the oracle
    batch = prefill.compress(policies, options)        # every variant's compressed cache, from that one prefill
    results = batch.decode(options, tokenizer)         # all variants decoded together, certificate + oracle

Variants compressed after the prompt take their first token from the full prefill (compression happens after the
prefill, as in kvpress' `compress after prefill`); variants compressed after the context read the question, chat
suffix and answer prefix through their compressed caches first. Both then sit at the same next position and decode
as one batch.

This module reads the prompt (`Prompt`, `Prefill`); the variants' caches are built in kvcert.hf.compressed_batch.
Serving mode reads the prompt and compresses it in one pass instead (kvcert.hf.serving_prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcert.core.scorers import SCORERS
from kvcert.hf.attention import RecordState, attention_scale, forward_with_state, kvcert_attention_on, layer_windows
from kvcert.hf.compress import Compressed, compress
from kvcert.hf.compressed_batch import (
    CompressedBatch,
    KeptTokens,
    _batch,
    _buckets,
    _by_time,
    _take_tokens,
    resolve_backend,
)
from kvcert.hf.decode import DecodeOptions
from kvcert.hf.scorer_inputs import ModelTensors
from kvcert.policy import Policy


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt as token ids with the context/question boundary (kvcert.tasks.Rendered is another)."""

    input_ids: list[int]
    question_start: int
    example_id: str = ""


def _example_id(prompt) -> str:
    example = getattr(prompt, "example", None)
    return str(getattr(prompt, "example_id", None) or getattr(example, "id", "") or "")


@dataclass(kw_only=True)
class Prefill:
    """The full prompt read once with exact attention: what every variant is built from."""

    model: object
    input_ids: list[int]
    question_start: int  # input_ids[:question_start] is the context (with the template's opening)
    example_id: str  # seeds the design draws
    full_keys: list[torch.Tensor]  # per layer (1, Hkv, n, d)
    full_values: list[torch.Tensor]
    window_queries: dict[str, list[torch.Tensor]]  # "question" / "context" (/ "all") -> per layer (1, Hq, w, d)
    context_window: tuple[int, int]  # the question-agnostic scorer's window [lo, hi) (last context tokens)
    scale: float
    last_logits: torch.Tensor  # (1, V): the full cache's first answer token
    layer_windows: list[int | None]  # each layer's sliding window (None: full attention)
    _scores: dict = field(default_factory=dict)  # scorer -> scores, shared by the policies of one compress()
    _oracle_prefix: dict = field(default_factory=dict)  # (prefix length, layers) -> stacked (K^T, V) in fp32, shared

    @classmethod
    @torch.no_grad()
    def record(
        cls,
        model,
        prompt,
        *,
        context_window: int = 32,
        example_id: str | None = None,
        capture_queries: bool = False,
    ) -> Prefill:
        """`prompt` has `input_ids` and `question_start` (e.g. kvcert.tasks.Rendered). Context and question are
        read as two chunks, so the context's keys never depend on the question. capture_queries: also keep every
        prompt query ("all"), which the scorers ported from kvpress read (kvcert.hf.scorer_inputs)."""
        ids_list = list(prompt.input_ids)
        n, qs = len(ids_list), int(prompt.question_start)
        if not 0 < qs < n:
            raise ValueError(f"question_start must be inside the prompt (0 < {qs} < {n})")
        ctx_lo = qs - min(context_window, qs - 1)
        capture = {"question": slice(qs, n), "context": slice(ctx_lo, qs)}
        if capture_queries:
            capture["all"] = slice(0, n)
        state = RecordState(model.config.num_hidden_layers, capture=capture)
        ids = torch.tensor([ids_list], device=model.device)
        with kvcert_attention_on(model):
            forward_with_state(model, ids[:, :qs], 0, state)
            logits = forward_with_state(model, ids[:, qs:], qs, state)
        return cls(
            model=model,
            input_ids=ids_list,
            question_start=qs,
            example_id=example_id if example_id is not None else _example_id(prompt),
            full_keys=state.full_keys,
            full_values=state.full_values,
            window_queries=state.captured,
            context_window=(ctx_lo, qs),
            scale=attention_scale(model),
            last_logits=logits,
            layer_windows=layer_windows(model),
        )

    def oracle_prefix(self, n: int, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n prompt tokens of `layers` in the oracle's matmul layout, stacked: K^T (layers, Hkv, d, n) and
        V (layers, Hkv, n, d), fp32; built once per (n, layers) and shared by every bucket."""
        key = (n, tuple(layers))
        if key not in self._oracle_prefix:
            self._oracle_prefix[key] = (
                torch.stack([self.full_keys[i][0, :, :n].float().transpose(-1, -2) for i in layers]),
                torch.stack([self.full_values[i][0, :, :n].float() for i in layers]),
            )
        return self._oracle_prefix[key]

    # ---------------------------------------------------------------------------------------------- compress
    def _kept(self, comps: dict[int, Compressed], rows: list[int]) -> KeptTokens:
        def kept(row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = comps[rows[row]].indices[layer]
            keys, values = (_take_tokens(x[layer][0], idx) for x in (self.full_keys, self.full_values))
            return keys.transpose(-1, -2), values

        return kept

    def _compress_one(self, policy: Policy, pool_kernel: int) -> Compressed:
        n, qs = len(self.input_ids), self.question_start
        region = n if policy.compress_after == "prompt" else qs
        forced, read = forced_tokens(policy, n, qs, self.context_window[0])
        queries = None if read is None else self.window_queries[policy.scorer_window]
        generator = torch.Generator().manual_seed(policy.generator_seed(self.example_id))
        inputs = None
        if not policy.is_full and SCORERS[policy.scorer].reads_inputs:
            layers = list(range(len(self.full_keys)))
            every = self.window_queries.get("all")
            inputs = ModelTensors.of(self.model).inputs(
                layers,
                torch.stack([k[0, :, :region] for k in self.full_keys]),
                torch.stack([v[0, :, :region] for v in self.full_values]),
                None if every is None else torch.stack([q[0, :, :region] for q in every]),
            )
        return compress(
            policy,
            self.full_keys,
            region=region,
            forced=forced,
            window_queries=queries,
            scale=self.scale,
            generator=generator,
            pool_kernel=pool_kernel,
            layer_windows=self.layer_windows,
            score_cache=self._scores,
            inputs=inputs,
        )

    @torch.no_grad()
    def compress(self, policies: list[Policy], options: DecodeOptions) -> CompressedBatch:
        """Every policy's compressed cache; variants compressed after the context read the question now.

        Rows of similar width share a bucket (attention, certificate and oracle run per bucket, so a 25% variant
        never pays for the full cache's width), and every bucket of both compression times decodes in one forward:
        after the question, all sit at the same next position."""
        n, qs = len(self.input_ids), self.question_start
        backend = resolve_backend(options.backend, self.full_keys[0], self.model.config)
        parts = []
        for when, rows in _by_time(policies):
            comps = {i: self._compress_one(policies[i], options.pool_kernel) for i in rows}
            region = n if when == "prompt" else qs
            oracle = (lambda group, region=region: self.oracle_prefix(region, group)) if options.oracle else None
            first = self.last_logits if when == "prompt" else None
            parts.append(
                _buckets(
                    self.model,
                    self.input_ids,
                    qs,
                    rows,
                    policies,
                    comps,
                    self._kept,
                    options,
                    oracle,
                    first,
                    example_id=self.example_id,
                )  # fmt: skip
            )
        return _batch(self.model, policies, parts, backend, n)


def forced_tokens(
    policy: Policy, n: int, qs: int, ctx_lo: int
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(always-kept positions, positions whose queries the scorer reads) of a policy over a prompt of n tokens whose
    question starts at qs: the observation window is both (the question, or the last context tokens [ctx_lo, qs));
    a protected question is only kept, and so is the last token of the cache for window "last" (TOVA; inside a
    protected question when there is one); None where there is none."""
    window = None if policy.is_full else policy.scorer_window
    if window == "question":
        return (qs, n), (qs, n)
    if window == "context":
        return (ctx_lo, qs), (ctx_lo, qs)
    if window == "last" and not (policy.compress_after == "prompt" and policy.protect_question):
        region = n if policy.compress_after == "prompt" else qs
        return (region - 1, region), None  # the scorer reads the last query from its ScorerInputs
    if policy.compress_after == "prompt" and policy.protect_question and not policy.is_full:
        return (qs, n), None
    return None, None
