"""Serving mode's prompt read (no oracle): `compress_while_reading` reads the prompt once and compresses every layer
for every policy as soon as that layer's attention ran (`_LayerCompressor`), so the full cache of all layers never
exists; the result is the `CompressedBatch` (kvcert.hf.compressed_batch) that verification mode builds from a
`Prefill` (kvcert.hf.prefill). The one exception holds less, not more: when the policies of a compression time
together keep at least as many tokens as the prompt (a grid of budgets), each layer's keys and values are kept
whole, once, instead of a copy per policy, and each group of policies selects for all layers in one design call
after the read (`keeps_whole`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcert.core.probe import ProbeResult, window_probe
from kvcert.core.selection import descending_order
from kvcert.hf.attention import (
    CompressingState,
    attention_scale,
    chunked_feed_forward,
    forward_with_state,
    kvcert_attention_on,
    layer_windows,
)
from kvcert.hf.compress import (
    Compressed,
    Plan,
    PolicyDraws,
    _scores,
    assemble_layers,
    group_key,
    select_layers,
    select_layers_together,
    select_together,
)
from kvcert.hf.compressed_batch import (
    CompressedBatch,
    KeptTokens,
    WholeLayers,
    _batch,
    _buckets,
    _by_time,
    _take_tokens,
    resolve_backend,
)
from kvcert.hf.decode import DecodeOptions
from kvcert.hf.layer_buffers import value_sketch
from kvcert.hf.prefill import _example_id, forced_tokens
from kvcert.hf.scorer_inputs import ModelTensors, reads_inputs
from kvcert.policy import Policy

PROBE_QUERIES = 32  # the probe's queries when a policy's scorer reads no window: the region's last tokens


class _LayerCompressor:
    """Serving mode's per-layer step for the policies of one compression time: called with each layer's query, keys
    and values inside the prefill forward, it keeps every policy's kept tokens of that layer (copied out of the
    layer's keys/values, which are then dropped) until the buckets are built."""

    def __init__(
        self,
        policies,
        rows,
        *,
        region,
        qs,
        ctx_lo,
        n,
        shape,
        example_id,
        scale,
        windows,
        pool_kernel,
        probe=False,
        keep=True,
        model_tensors: ModelTensors | None = None,
    ):
        self.keep = keep  # False: a probe-only read keeps no tokens
        self.model_tensors = model_tensors  # set when a policy's scorer reads ScorerInputs (ported kvpress scorers)
        self.policies, self.rows, self.region = policies, rows, region
        self.probes = {i: [None] * shape[0] for i in rows} if probe else None  # ProbeResult per compressed layer
        self.scale, self.windows, self.pool_kernel = scale, windows, pool_kernel
        self.plans, self.draws, self.reads = {}, {}, {}
        for i in rows:
            policy = policies[i]
            forced, read = forced_tokens(policy, n, qs, ctx_lo)
            self.plans[i] = Plan.of(policy, region=region, forced=forced)
            generator = torch.Generator().manual_seed(policy.generator_seed(example_id))
            self.draws[i] = PolicyDraws.draw(policy, generator, (*shape, self.plans[i].lo))
            self.reads[i] = read  # the window whose queries the scorer reads (None: keys only)
        self.groups = _groups(rows, {i: group_key(policies[i], self.plans[i], self.reads[i]) for i in rows})
        self.layers = {i: [None] * shape[0] for i in rows}  # LayerKept per layer
        self.tokens = {i: [None] * shape[0] for i in rows}  # (kept keys, kept values) per layer
        # Policies that together keep at least the region's tokens: each layer's keys and values are kept whole
        # (less memory than a copy per policy), each row's tokens are taken from them straight into its buffers, and
        # the groups select after the read, for all layers in one design call (`finish`).
        self.whole = keep and not probe and keeps_whole([self.plans[i] for i in rows], region)
        self.full: WholeLayers = [None] * shape[0]  # each layer's keys and values, whole
        self.group_scores: dict[int, list[torch.Tensor | None]] = {}  # group index -> its scores per layer

    def __call__(self, layer: int, query, key, value) -> None:
        scores: dict = {}  # this layer's scores per scorer, shared by its policies
        inputs = None if self.model_tensors is None else self.model_tensors.inputs([layer], key, value, query)
        if self.whole:  # copied once, as `WholeLayers` holds them (a zero token after the region's)
            n_kv, region, d = key.shape[1:]
            keys_t, values = key.new_empty(n_kv, d, region + 1), value.new_empty(n_kv, region + 1, d)
            keys_t[..., :region], values[:, :region] = key[0].transpose(-1, -2), value[0]
            keys_t[..., region], values[:, region] = 0, 0
            self.full[layer] = (keys_t, values)
        for g, group in enumerate(self.groups):
            read = self.reads[group[0]]
            common = dict(layers=[layer], window_queries=None if read is None else query[:, :, read[0] : read[1]],
                          scale=self.scale, pool_kernel=self.pool_kernel, layer_windows=self.windows,
                          score_cache=scores, inputs=inputs)  # fmt: skip
            if self.whole and len(group) > 1:  # only the scores now; the design call for all layers in `finish`
                i = group[0]
                layer_scores = _scores(self.policies[i], key, self.plans[i], common["window_queries"], self.scale,
                                       self.draws[i], self.pool_kernel, scores, inputs, [layer])  # fmt: skip
                self.group_scores.setdefault(g, [None] * len(self.full))[layer] = layer_scores
                continue
            if len(group) == 1:
                (i,) = group
                found = {i: select_layers(self.policies[i], key, plan=self.plans[i],
                                          draws=self.draws[i].take([layer]), **common)[0]}  # fmt: skip
            else:  # one design call for the group (kvcert.hf.compress.select_layers_together: the same kept sets)
                members = [self.policies[i] for i in group]
                plans, draws = [self.plans[i] for i in group], [self.draws[i].take([layer]) for i in group]
                together = select_layers_together(members, plans, key, draws=draws, **common)
                found = {i: kept for i, (kept,) in zip(group, together)}
            if self.whole:  # the tokens are taken from the whole layer when the buffers are built
                for i, kept in found.items():
                    self.layers[i][layer] = kept
            elif self.keep:  # the group's kept tokens in one copy per tensor, split per policy
                indices = [kept.indices for kept in found.values()]
                both = [_take_tokens(x[0], torch.cat(indices, dim=-1)) for x in (key, value)]
                widths = [ix.shape[-1] for ix in indices]
                for (i, kept), k_part, v_part in zip(found.items(), *(x.split(widths, dim=1) for x in both)):
                    self.layers[i][layer] = kept
                    self.tokens[i][layer] = (k_part, v_part)
            for i, kept in found.items():
                if self.probes is not None and kept.drawn is not None and not self.policies[i].is_full:
                    self.probes[i][layer] = self._probe(layer, read, query, key, value, kept)

    def _probe(self, layer: int, read, query, key, value, kept) -> ProbeResult:
        """The layer's exact error for the window's queries (kvcert.core.probe), in float32."""
        lo, hi = read if read is not None else (max(0, self.region - PROBE_QUERIES), self.region)
        f32 = torch.float32
        return window_probe(
            query[0, :, lo:hi].to(f32),
            key[0].to(f32),
            value[0].to(f32),
            kept.indices,
            kept.offset.to(f32),
            kept.one_minus_pi.to(f32),
            kept.tail_slots,
            scale=self.scale,
            positions=torch.arange(lo, hi, device=key.device),
            window=self.windows[layer],
            sketch=value_sketch(key.shape[-1], key.device),
        )

    def finish(self) -> None:
        """After the read: the deferred groups select for all layers in one design call each."""
        all_layers = list(range(len(self.full)))
        orders: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scores, their order): groups of one scorer sort once
        for g, per_layer in self.group_scores.items():
            group, scores = self.groups[g], torch.cat(per_layer)
            order = next((o for s, o in orders if s.shape == scores.shape and torch.equal(s, scores)), None)
            if order is None:
                order = descending_order(scores)
                orders.append((scores, order))
            found = select_together([self.policies[i] for i in group], [self.plans[i] for i in group], scores,
                                    draws=[self.draws[i] for i in group], layers=all_layers,
                                    layer_windows=self.windows, order=order)  # fmt: skip
            for i, kept in zip(group, found):
                self.layers[i] = kept
        self.group_scores = {}

    def kept(self, comps: dict[int, Compressed], group: list[int]) -> KeptTokens | WholeLayers:
        if self.whole:  # the buffers are gathered from the whole layers, by the rows' kept positions
            return self.full

        def take(row: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            (k_part, v_part), self.tokens[group[row]][layer] = self.tokens[group[row]][layer], None  # once, then freed
            return k_part.transpose(-1, -2), v_part

        return take


def keeps_whole(plans: list[Plan], region: int) -> bool:
    """Whether a read keeps each layer whole until the buffers are built: when the policies together keep at least
    the region's tokens (always-kept ones included), one whole copy holds less than a copy per policy."""
    return sum(plan.n_keep + plan.hi - plan.lo for plan in plans) >= region


def _groups(rows: list[int], keys: dict[int, tuple | None]) -> list[list[int]]:
    """Rows with equal group keys together (in row order), each row with a None key alone."""
    groups: dict = {}
    for i in rows:
        groups.setdefault(keys[i] if keys[i] is not None else ("alone", i), []).append(i)
    return list(groups.values())


@torch.no_grad()
def compress_while_reading(
    model,
    prompt,
    policies: list[Policy],
    options: DecodeOptions,
    *,
    example_id: str | None = None,
    probe: bool = False,
    choose: Callable[[list[list[ProbeResult | None]]], int | None] | None = None,
) -> CompressedBatch | None:
    """Serving mode (no oracle): what `Prefill.record(...).compress(...)` returns, without ever holding the full
    cache of all layers. The prompt is read once, and inside that forward each layer, as soon as its attention ran, is
    compressed for every policy (the policies compressed after the context, as kvpress does, take the layer's context
    part, which causal attention computed exactly as a read of the context alone would): its kept tokens are copied
    out, in the model's dtype, and its full keys/values are dropped before the next layer (unless the policies together
    keep at least the prompt's tokens: then the layer is kept whole once, see the module). The question is then read
    through the context-time policies' compressed caches. The policies' random draws are made
    up front for all layers (`PolicyDraws`), so each policy keeps what verification mode keeps for the same keys;
    the keys themselves differ from verification mode's in the last float digits, because the prompt is read in one
    chunk here (two there: context, then question). probe: also measure each compressed layer's exact error for the
    observation window's queries while the layer still holds its full keys and values (kvcert.core.probe):
    `CompressedBatch.probes[i]` is policy i's list of ProbeResult per layer (None on layers not compressed).
    choose: read the prompt once for every policy with the probe on, then `choose(probes)` (each policy's list of
    ProbeResult per layer) names the one policy to keep: the batch holds that policy alone (its probes as
    `probes[0]`), built from the same read; None from choose: no policy is kept and None is returned (the caller
    reads again with another cache). `generate(tolerance=...)` picks its rung this way, reading the prompt once."""
    ids_list = list(prompt.input_ids)
    n, qs = len(ids_list), int(prompt.question_start)
    param = next(model.parameters())
    backend = resolve_backend(options.backend, torch.empty(0, dtype=param.dtype, device=param.device), model.config)
    ids = torch.tensor([ids_list], device=model.device)
    probe = probe or choose is not None
    readers = _readers(model, prompt, policies, options, example_id, probe=probe, keep=True)
    logits = _read(model, ids, readers)
    for _, _, _, reader in readers:
        reader.finish()
    chosen = None
    if choose is not None:
        found = {i: r.probes[i] for _, rows, _, r in readers for i in rows}
        chosen = choose([found[i] for i in range(len(policies))])
        if chosen is None:
            return None
    parts = []
    for when, rows, _, reader in readers:
        rows = rows if chosen is None else [i for i in rows if i == chosen]
        if not rows:
            continue
        comps = {i: assemble_layers(policies[i], reader.plans[i], reader.layers[i]) for i in rows}
        first = logits if when == "prompt" else None
        example = example_id if example_id is not None else _example_id(prompt)
        parts.append(
            _buckets(model, ids_list, qs, rows, policies, comps, reader.kept, options, None, first, example_id=example)
        )
    batch = _batch(model, policies, parts, backend, n)
    if probe:
        batch.probes = {i: r.probes[i] for _, rows, _, r in readers for i in rows}
    if chosen is not None:  # the chosen policy alone, as if it had been read by itself
        batch.policies, batch.rows, batch.probes = [policies[chosen]], [0], {0: batch.probes[chosen]}
    return batch


def _readers(model, prompt, policies: list[Policy], options: DecodeOptions, example_id, *, probe: bool, keep: bool):
    """(compression time, rows, prompt tokens it compresses, its per-layer compressor) per compression time."""
    n, qs = len(prompt.input_ids), int(prompt.question_start)
    if not 0 < qs < n:
        raise ValueError(f"question_start must be inside the prompt (0 < {qs} < {n})")
    ctx_lo = qs - min(options.context_window, qs - 1)
    cfg = model.config
    n_layers, n_kv = cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    scale, windows = attention_scale(model), layer_windows(model)
    example = example_id if example_id is not None else _example_id(prompt)
    tensors = ModelTensors.of(model) if reads_inputs(policies) else None
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
            probe=probe,
            keep=keep,
            model_tensors=tensors,
        )
        readers.append((when, rows, region, reader))
    return readers


def _read(model, ids: torch.Tensor, readers) -> torch.Tensor:
    """Read the prompt once, every layer handed to every reader as soon as its attention ran; the logits."""

    def on_layer(layer: int, query, key, value) -> None:
        # causal attention: the context part of a longer read is what a read of the context alone computes
        for _, _, region, reader in readers:
            reader(layer, query[:, :, :region], key[:, :, :region], value[:, :, :region])

    end = max(region for _, _, region, _ in readers)
    with kvcert_attention_on(model), chunked_feed_forward(model):
        return forward_with_state(model, ids[:, :end], 0, CompressingState(on_layer))


@torch.no_grad()
def probe_prompt(
    model, prompt, policies: list[Policy], options: DecodeOptions, *, example_id: str | None = None
) -> list[list[ProbeResult | None]]:
    """A probe-only read: each policy's per-layer ProbeResult (None on layers not compressed), keeping no tokens
    and building no cache (the budget-from-a-tolerance choice reads the prompt once for every candidate budget).
    The draws and kept sets are those `compress_while_reading` makes for the same policies and example id."""
    ids = torch.tensor([list(prompt.input_ids)], device=model.device)
    readers = _readers(model, prompt, policies, options, example_id, probe=True, keep=False)
    _read(model, ids, readers)
    found = {i: r.probes[i] for _, rows, _, r in readers for i in rows}
    return [found[i] for i in range(len(policies))]
