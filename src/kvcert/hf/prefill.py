"""One example's flow in three stages:

    prefill = Prefill.record(model, prompt)           # exact attention; full keys/values kept as the oracle
    batch = prefill.compress(policies, options)        # every variant's compressed cache, from that one prefill
    results = batch.decode(options, tokenizer)         # all variants decoded together, certificate + oracle

Variants compressed after the prompt take their first token from the full prefill (compression happens after the
prefill, as in kvpress' `compress after prefill`); variants compressed after the context read the question, chat
suffix and answer prefix through their compressed caches first. Both then sit at the same next position and decode
as one batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch

from kvcert.hf.attention import (
    Bucket,
    CompressedState,
    CompressingState,
    LayerBuffers,
    RecordState,
    chunked_feed_forward,
    forward_with_state,
    kvcert_attention_on,
    layer_groups,
)
from kvcert.hf.compress import Compressed, Plan, PolicyDraws, assemble_layers, compress, select_layers
from kvcert.hf.decode import DecodeOptions, VariantResult, decode_batch
from kvcert.policy import Policy


def attention_scale(model) -> float:
    """The softmax scale every attention layer of the model uses (Gemma's query_pre_attn_scalar included). The
    engine applies one scale to every layer, so a model whose layers declare different scales is refused."""
    from kvcert.hf.loading import ModelLoadError

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scales = [float(getattr(layer.self_attn, "scaling", head_dim**-0.5)) for layer in model.model.layers]
    if len(set(scales)) > 1:
        raise ModelLoadError(
            f"{type(model).__name__}'s attention layers use different softmax scales ({sorted(set(scales))}); "
            "kvcert applies one scale to every layer and does not support this model yet"
        )
    return scales[0]


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
    _oracle_prefix: dict = field(default_factory=dict)  # (prefix length, layers) -> stacked (K^T, V) in fp32, shared

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
            return _take_tokens(self.full_keys[layer][0], idx), _take_tokens(self.full_values[layer][0], idx)

        return kept

    def _compress_one(self, policy: Policy, pool_kernel: int) -> Compressed:
        n, qs = len(self.input_ids), self.question_start
        region = n if policy.compress_after == "prompt" else qs
        forced, read = forced_tokens(policy, n, qs, self.context_window[0])
        queries = None if read is None else self.window_queries[policy.scorer_window]
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
                _buckets(self.model, self.input_ids, qs, rows, policies, comps, self._kept, options, oracle, first)
            )
        return _batch(self.model, policies, parts, backend, n)


def forced_tokens(
    policy: Policy, n: int, qs: int, ctx_lo: int
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(always-kept positions, positions whose queries the scorer reads) of a policy over a prompt of n tokens whose
    question starts at qs: the observation window is both (the question, or the last context tokens [ctx_lo, qs));
    a protected question is only kept; None where there is none."""
    window = None if policy.is_full else policy.scorer_window
    if window == "question":
        return (qs, n), (qs, n)
    if window == "context":
        return (ctx_lo, qs), (ctx_lo, qs)
    if policy.compress_after == "prompt" and policy.protect_question and not policy.is_full:
        return (qs, n), None
    return None, None


def _by_time(policies: list[Policy]) -> list[tuple[str, list[int]]]:
    """The policies' rows per compression time: after the prompt, then after the context."""
    out = [(when, [i for i, p in enumerate(policies) if p.compress_after == when]) for when in ("prompt", "context")]
    return [(when, rows) for when, rows in out if rows]


def _buckets(
    model,
    input_ids: list[int],
    qs: int,
    rows: list[int],
    policies: list[Policy],
    comps: dict[int, Compressed],
    kept: Callable[[dict[int, Compressed], list[int]], KeptTokens],
    options: DecodeOptions,
    oracle,
    first: torch.Tensor | None,
) -> tuple[list[int], list[Bucket], list[Compressed], torch.Tensor]:
    """One compression time's rows in buckets of similar width; `first`: the full prefill's last logits (after the
    prompt), or None: the rows read the question, chat suffix and answer prefix through their caches now."""
    n = len(input_ids)
    region = n if first is not None else qs
    certified = {i: policies[i].has_certificate for i in rows}
    groups = _by_width(rows, comps, certified)
    rows = [i for g in groups for i in g]
    capacity = (n - region) + options.max_new_tokens + 1
    windows = layer_windows(model)
    buckets = [
        _build_bucket([comps[i] for i in g], [policies[i] for i in g], kept(comps, g), windows, capacity, oracle)
        for g in groups
    ]
    if first is not None:
        first = first.expand(len(rows), -1)
    else:
        ids = torch.tensor([input_ids[qs:]], device=model.device).expand(len(rows), -1)
        with kvcert_attention_on(model):
            first = forward_with_state(model, ids, qs, CompressedState(buckets, "torch"))
    return rows, buckets, [comps[i] for i in rows], first


def _batch(model, policies: list[Policy], parts: list[tuple], backend: str, start: int) -> CompressedBatch:
    return CompressedBatch(
        model=model,
        policies=list(policies),
        rows=[i for p in parts for i in p[0]],
        state=CompressedState([b for p in parts for b in p[1]], backend),
        comps=[c for p in parts for c in p[2]],
        first_logits=torch.cat([p[3] for p in parts]),
        start=start,
    )


class _LayerCompressor:
    """Serving mode's per-layer step for the policies of one compression time: called with each layer's query, keys
    and values inside the prefill forward, it keeps every policy's kept tokens of that layer (copied out of the
    layer's keys/values, which are then dropped) until the buckets are built."""

    def __init__(self, policies, rows, *, region, qs, ctx_lo, n, shape, example_id, scale, windows, pool_kernel):
        self.policies, self.rows = policies, rows
        self.scale, self.windows, self.pool_kernel = scale, windows, pool_kernel
        self.plans, self.draws, self.reads = {}, {}, {}
        for i in rows:
            policy = policies[i]
            forced, read = forced_tokens(policy, n, qs, ctx_lo)
            self.plans[i] = Plan.of(policy, region=region, forced=forced)
            generator = torch.Generator().manual_seed(policy.generator_seed(example_id))
            self.draws[i] = PolicyDraws.draw(policy, generator, (*shape, self.plans[i].lo))
            self.reads[i] = read  # the window whose queries the scorer reads (None: keys only)
        self.layers = {i: [None] * shape[0] for i in rows}  # LayerKept per layer
        self.tokens = {i: [None] * shape[0] for i in rows}  # (kept keys, kept values) per layer

    def __call__(self, layer: int, query, key, value) -> None:
        scores: dict = {}  # this layer's scores per scorer, shared by its policies
        for i in self.rows:
            read = self.reads[i]
            (kept,) = select_layers(
                self.policies[i],
                key,
                layers=[layer],
                plan=self.plans[i],
                window_queries=None if read is None else query[:, :, read[0] : read[1]],
                scale=self.scale,
                draws=self.draws[i].take([layer]),
                pool_kernel=self.pool_kernel,
                layer_windows=self.windows,
                score_cache=scores,
            )
            self.layers[i][layer] = kept
            self.tokens[i][layer] = (_take_tokens(key[0], kept.indices), _take_tokens(value[0], kept.indices))

    def kept(self, comps: dict[int, Compressed], group: list[int]) -> KeptTokens:
        def take(row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            out, self.tokens[group[row]][layer] = self.tokens[group[row]][layer], None  # copied once, then freed
            return out

        return take


@torch.no_grad()
def compress_while_reading(
    model, prompt, policies: list[Policy], options: DecodeOptions, *, example_id: str | None = None
) -> CompressedBatch:
    """Serving mode (no oracle): what `Prefill.record(...).compress(...)` returns, without ever holding the full
    cache of all layers. The prompt is read once, and inside that forward each layer, as soon as its attention ran, is
    compressed for every policy (the policies compressed after the context, as kvpress does, take the layer's context
    part, which causal attention computed exactly as a read of the context alone would): its kept tokens are copied
    out, in the model's dtype, and its full keys/values are dropped before the next layer. The question is then read
    through the context-time policies' compressed caches. The policies' random draws are made
    up front for all layers (`PolicyDraws`), so each policy keeps what verification mode keeps for the same keys;
    the keys themselves differ from verification mode's in the last float digits, because the prompt is read in one
    chunk here (two there: context, then question)."""
    ids_list = list(prompt.input_ids)
    n, qs = len(ids_list), int(prompt.question_start)
    if not 0 < qs < n:
        raise ValueError(f"question_start must be inside the prompt (0 < {qs} < {n})")
    ctx_lo = qs - min(options.context_window, qs - 1)
    cfg = model.config
    n_layers, n_kv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    scale, windows = attention_scale(model), layer_windows(model)
    example = example_id if example_id is not None else _example_id(prompt)
    param = next(model.parameters())
    backend = resolve_backend(options.backend, torch.empty(0, dtype=param.dtype, device=param.device), cfg)
    ids = torch.tensor([ids_list], device=model.device)
    readers = []  # (compression time, rows, prompt tokens it compresses, its per-layer compressor)
    for when, rows in _by_time(policies):
        region = n if when == "prompt" else qs
        reader = _LayerCompressor(
            policies,
            rows,
            region=region,
            qs=qs,
            ctx_lo=ctx_lo,
            n=n,
            shape=(n_layers, n_kv),
            example_id=example,
            scale=scale,
            windows=windows,
            pool_kernel=options.pool_kernel,
        )
        readers.append((when, rows, region, reader))

    def on_layer(layer: int, query, key, value) -> None:
        # causal attention: the context part of a longer read is what a read of the context alone computes
        for _, _, region, reader in readers:
            reader(layer, query[:, :, :region], key[:, :, :region], value[:, :, :region])

    end = max(region for _, _, region, _ in readers)
    with kvcert_attention_on(model), chunked_feed_forward(model):
        logits = forward_with_state(model, ids[:, :end], 0, CompressingState(on_layer))
    parts = []
    for when, rows, _, reader in readers:
        comps = {i: assemble_layers(policies[i], reader.plans[i], reader.layers[i]) for i in rows}
        first = logits if when == "prompt" else None
        parts.append(_buckets(model, ids_list, qs, rows, policies, comps, reader.kept, options, None, first))
    return _batch(model, policies, parts, backend, n)


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
class CompressedBatch:
    """Every variant's compressed cache, ready to decode as one batch."""

    model: object
    policies: list[Policy]
    rows: list[int]  # the batch's rows as positions in the policy list
    state: CompressedState
    comps: list[Compressed]
    first_logits: torch.Tensor  # (B, V): each row's first answer token
    start: int  # position of the first generated token

    @torch.no_grad()
    def decode(
        self,
        options: DecodeOptions,
        tokenizer=None,
        *,
        on_step: Callable[[int], None] | None = None,
        watch: Callable[[int, list[int], list[float], dict[str, torch.Tensor]], bool] | None = None,
    ) -> list[VariantResult]:
        """Greedy-decode every variant; results in the order of the policies (`watch`: see `decode_batch`)."""
        compressed_layers = tuple(b.compressed for b in self.state.layers)
        with kvcert_attention_on(self.model):
            rows = decode_batch(
                self.model, tokenizer, self.state, self.first_logits, self.start, options, on_step=on_step, watch=watch
            )
        out: dict[int, VariantResult] = {}
        for i, comp, (tokens, logprobs, stats, n_ans, answer) in zip(self.rows, self.comps, rows):
            out[i] = VariantResult(
                policy=self.policies[i],
                tokens=tokens,
                logprobs=logprobs,
                n_answer=n_ans,
                answer=answer,
                kept_tokens=comp.kept_tokens,
                stats=stats,
                compressed_layers=compressed_layers,
            )
        return [out[i] for i in range(len(self.policies))]


# ------------------------------------------------------------------------------------------------ the buffers
def _take_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`core.hajek.gather_tokens` for one (Hkv, n, d) tensor and (Hkv, m) indices, as one row copy (index_select
    over the flattened heads): the same values, several times faster than an elementwise gather."""
    n_kv, n, d = x.shape
    flat = (indices + torch.arange(n_kv, device=indices.device)[:, None] * n).reshape(-1)
    return x.reshape(n_kv * n, d).index_select(0, flat).view(n_kv, -1, d)


KeptTokens = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (row, layer) -> kept keys, values (Hkv, m, d)


def _build_bucket(
    comps: list[Compressed],
    policies: list[Policy],
    kept: KeptTokens,
    layer_windows: list[int | None],
    capacity: int,
    oracle: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]] | None,
) -> Bucket:
    """Every variant's kept tokens in one set of buffers per layer, in the model's dtype (offsets and 1 - pi in
    float32), keys stored (d, slots). The compressed layers share one width and one tail length (the widest row's),
    so that they form one layer group. oracle(layers): the shared prefix (the prompt at compression time) of a layer
    group; tokens read later are the variant's own, in one tensor per layer group."""
    layers = []
    n_layers = len(layer_windows)
    compressed = [i for i, w in enumerate(layer_windows) if w is None]
    shared_width = max((c.indices[i].shape[-1] for c in comps for i in compressed), default=0)
    shared_slots = max((c.tail_slots[i] for c in comps for i in compressed), default=0)
    for layer in range(n_layers):
        window = layer_windows[layer]
        b = len(comps)
        width = shared_width if window is None else max(c.indices[layer].shape[-1] for c in comps)
        slots = shared_slots if window is None else max(c.tail_slots[layer] for c in comps)
        keys = values = offset = omp = None
        for row, c in enumerate(comps):
            k_row, v_row = kept(row, layer)  # (Hkv, m, d)
            if keys is None:
                n_kv, _, d = k_row.shape
                device, dtype = k_row.device, k_row.dtype
                values = torch.zeros(b, n_kv, width + capacity, d, dtype=dtype, device=device)
                keys = values.new_zeros(b, n_kv, d, width + capacity)
                offset = torch.full((b, n_kv, width + capacity), float("-inf"), dtype=torch.float32, device=device)
                omp = torch.zeros(b, n_kv, slots, dtype=torch.float32, device=device)
            m = k_row.shape[1]
            keys[row, :, :, :m] = k_row.transpose(-1, -2)
            values[row, :, :m] = v_row
            offset[row, :, :m] = c.offset[layer]
            omp[row, :, : c.tail_slots[layer]] = c.one_minus_pi[layer]
        positions = None
        if window is not None:  # slot positions, for the window mask (padding never enters: offset -inf)
            positions = torch.full((b, width + capacity), -1, dtype=torch.long, device=device)
            for row, c in enumerate(comps):
                positions[row, : c.indices[layer].shape[-1]] = c.indices[layer][0]
        layers.append(
            LayerBuffers(
                keys=keys,
                values=values,
                offset=offset,
                one_minus_pi=omp,
                tail_slots=slots,
                length=width,
                compressed=window is None,
                window=window,
                positions=positions,
                prefix=width,
            )
        )
    oracle_parts = None
    if oracle is not None:  # per layer group: the shared prefix and the rows' own parts, viewed by each layer's buffers
        oracle_parts = []
        for group in layer_groups(layers):
            n_kv, d = layers[group[0]].values.shape[1], layers[group[0]].values.shape[-1]
            own = [torch.zeros(len(group), len(comps), n_kv, capacity, d, device=device) for _ in range(2)]
            for local, layer in enumerate(group):
                layers[layer].oracle_keys, layers[layer].oracle_values = own[0][local], own[1][local]
            oracle_parts.append((*oracle(group), *own))
    return Bucket(layers, certificate_rows=[p.has_certificate for p in policies], oracle=oracle_parts)


def resolve_backend(backend: str, like: torch.Tensor, config) -> str:
    """ "torch" or "compiled" for DecodeOptions.backend: "auto" takes the compiled kernel for a float32 CPU cache
    when it builds here and fits the model's heads, and says once which it took and why."""
    if backend == "torch":
        return "torch"
    reason = None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // getattr(config, "num_key_value_heads", config.num_attention_heads)
    if like.device.type != "cpu":
        reason = f"the model runs on {like.device.type}; the kernel is a CPU kernel"
    elif like.dtype != torch.float32:
        reason = f"the cache is {str(like.dtype).removeprefix('torch.')}; the kernel reads a float32 cache"
    elif head_dim > 256 or 2 * group > 16:
        reason = f"head_dim {head_dim} / query group {group} outside the kernel's limits (256 / 8)"
    else:
        from kvcert.hf import kernel

        reason = kernel.available()
    if reason is not None and backend == "compiled":
        raise ValueError(f"decode.backend=compiled cannot run: {reason}; set decode.backend=auto or torch")
    chosen = "torch" if reason else "compiled"
    _announce(chosen, reason)
    return chosen


@cache
def _announce(chosen: str, reason: str | None) -> None:
    why = f" ({reason})" if reason else ""
    print(f"[kvcert] decode backend: {chosen}{why}", file=sys.stderr, flush=True)
