"""One example's flow in three stages:

    prefill = Prefill.record(model, prompt)           # exact attention; full keys/values kept as the oracle
    batch = prefill.compress(policies, options)        # every variant's compressed cache, from that one prefill
    results = batch.decode(options, tokenizer)         # all variants decoded together, certificate + oracle

Variants compressed after the prompt take their first token from the full prefill (compression happens after the
prefill, as in kvpress' `compress after prefill`); variants compressed after the context read the question, chat
suffix and answer prefix through their compressed caches first. Both then sit at the same next position and decode
as one batch (`DecodeOptions.one_batch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcert.hf.attention import (
    Bucket,
    CompressedState,
    LayerBuffers,
    RecordState,
    forward_with_state,
    kvcert_attention_on,
)
from kvcert.hf.compress import Compressed, compress
from kvcert.hf.decode import DecodeOptions, VariantResult, decode_batch
from kvcert.policy import Policy


def attention_scale(model) -> float:
    """The softmax scale every attention layer of the model uses (Gemma's query_pre_attn_scalar included)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(getattr(model.model.layers[0].self_attn, "scaling", head_dim**-0.5))


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt as token ids with the context/question boundary (kvcert.tasks.Rendered is another)."""

    input_ids: list[int]
    question_start: int
    example_id: str = ""


def layer_windows(model) -> list[int | None]:
    """Each decoder layer's sliding window as its attention module declares it (None: full attention)."""
    return [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]


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
    window_queries: dict[str, list[torch.Tensor]]  # "question" / "context" -> per layer (1, Hq, w, d)
    context_window: tuple[int, int]  # the question-agnostic scorer's window [lo, hi) (last context tokens)
    scale: float
    last_logits: torch.Tensor  # (1, V): the full cache's first answer token
    layer_windows: list[int | None]  # each layer's sliding window (None: full attention)
    _scores: dict = field(default_factory=dict)  # scorer -> scores, shared by the policies of one compress()
    _oracle_layout: dict = field(default_factory=dict)  # prefix length -> per-layer (K^T, V) in fp32, shared
    _oracle_stacked: dict = field(default_factory=dict)  # prefix length -> (K^T, V) of all layers stacked, shared

    @classmethod
    @torch.no_grad()
    def record(cls, model, prompt, *, context_window: int = 32, example_id: str | None = None) -> Prefill:
        """`prompt` has `input_ids` and `question_start` (e.g. kvcert.tasks.Rendered). Context and question are
        read as two chunks, so the context's keys never depend on the question."""
        ids_list = list(prompt.input_ids)
        n, qs = len(ids_list), int(prompt.question_start)
        if not 0 < qs < n:
            raise ValueError(f"question_start must be inside the prompt (0 < {qs} < {n})")
        ctx_lo = qs - min(context_window, qs - 1)
        state = RecordState(
            model.config.num_hidden_layers, capture={"question": slice(qs, n), "context": slice(ctx_lo, qs)}
        )
        ids = torch.tensor([ids_list], device=model.device)
        pos = torch.arange(n, device=model.device)[None]
        with kvcert_attention_on(model):
            forward_with_state(model, ids[:, :qs], pos[:, :qs], state)
            logits = forward_with_state(model, ids[:, qs:], pos[:, qs:], state)
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

    def oracle_prefix(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The first n prompt tokens of every layer in the oracle's matmul layout (K^T, V), fp32; built once."""
        if n not in self._oracle_layout:
            self._oracle_layout[n] = (
                [k[0, :, :n].float().transpose(-1, -2).contiguous() for k in self.full_keys],
                [v[0, :, :n].float().contiguous() for v in self.full_values],
            )
        return self._oracle_layout[n]

    def oracle_prefix_stacked(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`oracle_prefix` with the layers stacked, (layers, Hkv, d, n) and (layers, Hkv, n, d), for the oracle of
        DecodeOptions.stats_after_forward (one matmul for every layer); built once."""
        if n not in self._oracle_stacked:
            self._oracle_stacked[n] = (
                torch.stack([k[0, :, :n].float().transpose(-1, -2) for k in self.full_keys]),
                torch.stack([v[0, :, :n].float() for v in self.full_values]),
            )
        return self._oracle_stacked[n]

    # ---------------------------------------------------------------------------------------------- compress
    def _compress_one(self, policy: Policy, pool_kernel: int) -> Compressed:
        n, qs = len(self.input_ids), self.question_start
        region = n if policy.compress_after == "prompt" else qs
        window = None if policy.is_full else policy.scorer_window
        forced, queries = None, None
        if window == "question":
            forced, queries = (qs, n), self.window_queries["question"]
        elif window == "context":
            forced, queries = self.context_window, self.window_queries["context"]
        elif policy.compress_after == "prompt" and policy.protect_question and not policy.is_full:
            forced = (qs, n)
        generator = torch.Generator().manual_seed(policy.generator_seed(self.example_id))
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
        )

    @torch.no_grad()
    def compress(self, policies: list[Policy], options: DecodeOptions) -> CompressedBatch:
        """Every policy's compressed cache; variants compressed after the context read the question now.

        With `options.one_batch`, rows of similar width share a bucket (attention, certificate and oracle run per
        bucket, so a 25% variant never pays for the full cache's width) and every bucket decodes in one forward.
        Without it, each compression time is one bucket decoded on its own (the earlier, slower path)."""
        n, qs = len(self.input_ids), self.question_start
        parts = []
        for when in ("prompt", "context"):
            rows = [i for i, p in enumerate(policies) if p.compress_after == when]
            if not rows:
                continue
            comps = {i: self._compress_one(policies[i], options.pool_kernel) for i in rows}
            region = n if when == "prompt" else qs
            certified = {i: policies[i].has_certificate for i in rows}
            groups = _by_width(rows, comps, certified) if options.one_batch else [rows]
            rows = [i for g in groups for i in g]
            state = CompressedState(
                [
                    _build_bucket(
                        [comps[i] for i in g],
                        [policies[i] for i in g],
                        self,
                        region=region,
                        capacity=(n - region) + options.max_new_tokens + 1,
                        oracle=options.oracle,
                        stats_after_forward=options.stats_after_forward,
                        keys_transposed=options.keys_transposed,
                    )
                    for g in groups
                ]
            )
            if when == "prompt":
                first = self.last_logits.expand(len(rows), -1)
            else:
                ids = torch.tensor([self.input_ids[qs:]], device=self.model.device).expand(len(rows), -1)
                pos = torch.arange(qs, n, device=self.model.device)[None].expand(len(rows), -1)
                with kvcert_attention_on(self.model):
                    first = forward_with_state(self.model, ids, pos, state)
            parts.append(_Part(rows=rows, state=state, comps=[comps[i] for i in rows], first_logits=first))
        if options.one_batch and len(parts) > 1:  # both sit at position n now: one batch, the buckets side by side
            parts = [
                _Part(
                    rows=[i for p in parts for i in p.rows],
                    state=CompressedState([b for p in parts for b in p.state.buckets]),
                    comps=[c for p in parts for c in p.comps],
                    first_logits=torch.cat([p.first_logits for p in parts]),
                )
            ]
        return CompressedBatch(model=self.model, policies=list(policies), parts=parts, start=n)


def _by_width(
    rows: list[int], comps: dict[int, Compressed], certified: dict[int, bool], ratio: float = 0.6
) -> list[list[int]]:
    """Rows with and without a certificate apart (top-k and full-cache rows then cost no certificate work), each
    sorted by kept width, widest first, and cut into buckets whose narrowest row keeps at least `ratio` of the widest
    one's tokens (padding inside a bucket stays under 1 / ratio)."""
    width = {i: max(ix.shape[-1] for ix in comps[i].indices) for i in rows}
    groups: list[list[int]] = []
    for i in sorted(rows, key=lambda r: (not certified[r], -width[r])):
        if groups and certified[i] == certified[groups[-1][0]] and width[i] >= ratio * width[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(kw_only=True)
class _Part:
    rows: list[int]  # positions in the policy list
    state: CompressedState
    comps: list[Compressed]
    first_logits: torch.Tensor  # (B, V)


@dataclass(kw_only=True)
class CompressedBatch:
    """Every variant's compressed cache, ready to decode (one part, or one per compression time)."""

    model: object
    policies: list[Policy]
    parts: list[_Part]
    start: int  # position of the first generated token

    @torch.no_grad()
    def decode(
        self, options: DecodeOptions, tokenizer=None, *, on_step: Callable[[int], None] | None = None
    ) -> list[VariantResult]:
        """Greedy-decode every variant; results in the order of the policies."""
        out: dict[int, VariantResult] = {}
        with kvcert_attention_on(self.model):
            for part in self.parts:
                rows = decode_batch(
                    self.model, tokenizer, part.state, part.first_logits, self.start, options, on_step=on_step
                )
                for i, comp, (tokens, logprobs, stats, n_ans, answer) in zip(part.rows, part.comps, rows):
                    out[i] = VariantResult(
                        policy=self.policies[i],
                        tokens=tokens,
                        logprobs=logprobs,
                        n_answer=n_ans,
                        answer=answer,
                        kept_tokens=comp.kept_tokens,
                        stats=stats,
                        compressed_layers=tuple(b.compressed for b in part.state.layers),
                    )
        return [out[i] for i in range(len(self.policies))]


# ------------------------------------------------------------------------------------------------ the buffers
def _take_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`core.hajek.gather_tokens` for one (Hkv, n, d) tensor and (Hkv, m) indices, as one row copy (index_select
    over the flattened heads): the same values, several times faster than an elementwise gather."""
    n_kv, n, d = x.shape
    flat = (indices + torch.arange(n_kv, device=indices.device)[:, None] * n).reshape(-1)
    return x.reshape(n_kv * n, d).index_select(0, flat).view(n_kv, -1, d)


def _build_bucket(
    comps: list[Compressed],
    policies: list[Policy],
    prefill: Prefill,
    *,
    region: int,
    capacity: int,
    oracle: bool,
    stats_after_forward: bool = False,
    keys_transposed: bool = False,
) -> Bucket:
    """Gather every variant's kept tokens into float32 buffers (offsets and 1 - pi stay fp32: exact under bf16).
    The oracle's shared prefix is the prompt at compression time; tokens read later are the variant's own."""
    layers = []
    n_layers = len(prefill.full_keys)
    own_all = None  # stats_after_forward: every layer's own oracle part in one tensor (one matmul per step)
    if oracle and stats_after_forward:
        _, n_kv, _, d = prefill.full_keys[0].shape
        own_all = [
            torch.zeros(
                n_layers, len(comps), n_kv, capacity, d, dtype=torch.float32, device=prefill.full_keys[0].device
            )
            for _ in range(2)
        ]
    for layer in range(n_layers):
        k_full, v_full = prefill.full_keys[layer][0], prefill.full_values[layer][0]  # (Hkv, n, d)
        n_kv, _, d = k_full.shape
        width = max(c.indices[layer].shape[-1] for c in comps)
        slots = max(c.tail_slots[layer] for c in comps)
        b = len(comps)
        values = torch.zeros(b, n_kv, width + capacity, d, dtype=torch.float32, device=k_full.device)
        # (B, Hkv, d, slots) with keys_transposed: q K^T without a transposed operand
        keys = torch.zeros_like(values) if not keys_transposed else values.new_zeros(b, n_kv, d, width + capacity)
        offset = torch.full((b, n_kv, width + capacity), float("-inf"), dtype=torch.float32, device=k_full.device)
        omp = torch.zeros(b, n_kv, slots, dtype=torch.float32, device=k_full.device)
        for row, c in enumerate(comps):
            idx = c.indices[layer]
            m = idx.shape[-1]
            if keys_transposed:
                keys[row, :, :, :m] = _take_tokens(k_full, idx).transpose(-1, -2)
            else:
                keys[row, :, :m] = _take_tokens(k_full, idx)
            values[row, :, :m] = _take_tokens(v_full, idx)
            offset[row, :, :m] = c.offset[layer]
            omp[row, :, : c.tail_slots[layer]] = c.one_minus_pi[layer]
        own_k = own_v = None  # the oracle's own part: views into own_all, or this layer's buffers
        if own_all is not None:
            own_k, own_v = own_all[0][layer], own_all[1][layer]
        elif oracle:
            own_k = torch.zeros(b, n_kv, capacity, d, dtype=torch.float32, device=k_full.device)
            own_v = own_k.clone()
        window = prefill.layer_windows[layer]
        positions = None
        if window is not None:  # slot positions, for the window mask (padding never enters: offset -inf)
            positions = torch.full((b, width + capacity), -1, dtype=torch.long, device=k_full.device)
            for row, c in enumerate(comps):
                positions[row, : c.indices[layer].shape[-1]] = c.indices[layer][0]
        layers.append(
            LayerBuffers(
                keys=keys,
                values=values,
                offset=offset,
                one_minus_pi=omp,
                value_sq_norms=values[:, :, :slots].square().sum(-1),
                tail_slots=slots,
                length=width,
                oracle_keys=own_k,
                oracle_values=own_v,
                compressed=window is None,
                window=window,
                positions=positions,
                prefix=width,
                keys_transposed=keys_transposed,
            )
        )
    rows = torch.tensor([p.has_certificate for p in policies], device=prefill.full_keys[0].device)
    prefix, stacked = None, None
    if own_all is not None:  # the stacked prefix, and per-layer views of it for the per-layer code
        kt_all, v_all = prefill.oracle_prefix_stacked(region)
        prefix, stacked = (list(kt_all.unbind(0)), list(v_all.unbind(0))), (kt_all, v_all, *own_all)
    elif oracle:
        prefix = prefill.oracle_prefix(region)
    return Bucket(
        layers,
        certificate_rows=rows,
        oracle_prefix=prefix,
        stats_after_forward=stats_after_forward,
        oracle_stacked=stacked,
    )
