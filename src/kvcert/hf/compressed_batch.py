"""Every variant's compressed cache, ready to decode as one batch (`CompressedBatch`): the rows of a compression
time cut into buckets of similar width, each bucket's buffers filled with the rows' kept tokens, the rows' first
answer token, and the decode backend (`resolve_backend`). Built from a `Prefill` (kvcert.hf.prefill) or while the
prompt is read (kvcert.hf.serving_prefill).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from kvcert.core.selection import keep_count
from kvcert.hf.attention import forward_with_state, kvcert_attention_on, layer_windows
from kvcert.hf.compress import Compressed
from kvcert.hf.compressed_state import Bucket, CompressedState
from kvcert.hf.decode import DecodeOptions, VariantResult, decode_batch
from kvcert.hf.huge_pages import empty_on_huge_pages
from kvcert.hf.layer_buffers import LayerBuffers, layer_groups
from kvcert.hf.recompress import RowRecompress
from kvcert.policy import Policy


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
    example_id: str = "",
) -> tuple[list[int], list[Bucket], list[Compressed], torch.Tensor]:
    """One compression time's rows in buckets of similar width; `first`: the full prefill's last logits (after the
    prompt), or None: the rows read the question, chat suffix and answer prefix through their caches now."""
    n = len(input_ids)
    region = n if first is not None else qs
    certified = {i: policies[i].has_certificate for i in rows}
    groups = _by_width(rows, comps, certified, {i: policies[i].recompress_every for i in rows})
    rows = [i for g in groups for i in g]
    capacity = (n - region) + options.max_new_tokens + 1
    windows = layer_windows(model)
    recompress = {i: _recompress_row(policies[i], region, example_id, options) for i in rows}
    if any(recompress.values()) and any(w is not None for w in windows):
        raise ValueError("recompress_every on a model with sliding-window layers is not supported")
    buckets = [
        _build_bucket(
            [comps[i] for i in g],
            [policies[i] for i in g],
            kept(comps, g),
            windows,
            capacity,
            oracle,
            [recompress[i] for i in g] if recompress[g[0]] is not None else None,
        )  # fmt: skip
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


def _by_width(
    rows: list[int],
    comps: dict[int, Compressed],
    certified: dict[int, bool],
    every: dict[int, int | None] | None = None,
    ratio: float = 0.6,
) -> list[list[int]]:
    """Rows with and without a certificate apart (top-k and full-cache rows then cost no certificate work), and
    rows of different `recompress_every` apart (a bucket re-compresses all its rows at once), each sorted by kept
    width, widest first, and cut into buckets whose narrowest row keeps at least `ratio` of the widest one's tokens
    (padding inside a bucket stays under 1 / ratio)."""
    width = {i: max(ix.shape[-1] for ix in comps[i].indices) for i in rows}
    every = every or {}
    kind = {i: (certified[i], every.get(i) or 0) for i in rows}
    groups: list[list[int]] = []
    for i in sorted(rows, key=lambda r: (not certified[r], every.get(r) or 0, -width[r])):
        if groups and kind[i] == kind[groups[-1][0]] and width[i] >= ratio * width[groups[-1][0]]:
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
    probes: dict | None = None  # policy index -> per-layer kvcert.core.probe.ProbeResult (compress_while_reading)

    @torch.no_grad()
    def decode(
        self,
        options: DecodeOptions,
        tokenizer=None,
        *,
        on_step: Callable[[int], None] | None = None,
        watch: Callable[[int, list[int], list[float], dict[str, torch.Tensor]], bool] | None = None,
        follow: dict[int, int] | None = None,
    ) -> list[VariantResult]:
        """Greedy-decode every variant; results in the order of the policies (`watch`: see `decode_batch`; follow:
        policy index -> the policy index whose tokens it is fed, teacher forcing)."""
        compressed_layers = tuple(b.compressed for b in self.state.layers)
        at = {i: b for b, i in enumerate(self.rows)}  # policy index -> batch row
        by_row = {at[i]: at[lead] for i, lead in (follow or {}).items()}
        with kvcert_attention_on(self.model):
            rows = decode_batch(
                self.model,
                tokenizer,
                self.state,
                self.first_logits,
                self.start,
                options,
                on_step=on_step,
                watch=watch,
                follow=by_row,
            )
        out: dict[int, VariantResult] = {}
        for i, comp, (tokens, logprobs, stats, n_ans, answer, own) in zip(self.rows, self.comps, rows):
            out[i] = VariantResult(
                policy=self.policies[i],
                tokens=tokens,
                logprobs=logprobs,
                n_answer=n_ans,
                answer=answer,
                kept_tokens=comp.kept_tokens,
                stats=stats,
                compressed_layers=compressed_layers,
                own_tokens=own,
                follows=(follow or {}).get(i),
            )
        return [out[i] for i in range(len(self.policies))]


# ------------------------------------------------------------------------------------------------ the buffers
def _take_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`core.hajek.gather_tokens` for one (Hkv, n, d) tensor and (Hkv, m) indices, as one row copy (index_select
    over the flattened heads): the same values, several times faster than an elementwise gather."""
    n_kv, n, d = x.shape
    flat = (indices + torch.arange(n_kv, device=indices.device)[:, None] * n).reshape(-1)
    return x.reshape(n_kv * n, d).index_select(0, flat).view(n_kv, -1, d)


# (row, layer) -> its kept keys transposed (Hkv, d, m), as the buffers hold them, and its kept values (Hkv, m, d)
KeptTokens = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
# or, per layer, the layer's keys transposed (Hkv, d, R + 1) and values (Hkv, R + 1, d), whole, token R zero: every
# slot of a bucket's buffers is then gathered from them by position (padding slots take the zero token), each buffer
# written once (serving mode's read of many policies, kvcert.hf.serving_prefill.keeps_whole)
WholeLayers = list[tuple[torch.Tensor, torch.Tensor]]


def _build_bucket(
    comps: list[Compressed],
    policies: list[Policy],
    kept: KeptTokens | WholeLayers,
    layer_windows: list[int | None],
    capacity: int,
    oracle: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]] | None,
    recompress: list[RowRecompress] | None = None,
) -> Bucket:
    """Every variant's kept tokens in one set of buffers per layer, in the model's dtype (offsets and 1 - pi in
    float32), keys stored (d, slots), the large ones on huge pages where the system allows (kvcert.hf.huge_pages).
    The compressed layers share one width and one tail length (the widest row's), so that they form one layer group.
    oracle(layers): the shared prefix (the prompt at compression time) of a layer group; tokens read later are the
    variant's own, in one tensor per layer group."""
    layers = []
    n_layers = len(layer_windows)
    compressed = [i for i, w in enumerate(layer_windows) if w is None]
    shared_width = max((c.indices[i].shape[-1] for c in comps for i in compressed), default=0)
    shared_slots = max((c.tail_slots[i] for c in comps for i in compressed), default=0)
    b = len(comps)
    slabs = None  # whole layers: the full-attention layers' keys and values, one allocation each (huge pages)
    if isinstance(kept, list) and compressed:
        keys_t, values_all = kept[compressed[0]]
        (n_kv, d, _), n_slots = keys_t.shape, shared_width + capacity
        slabs = (empty_on_huge_pages(len(compressed), b, n_kv, d, n_slots, like=keys_t),
                 empty_on_huge_pages(len(compressed), b, n_kv, n_slots, d, like=values_all))  # fmt: skip
    for layer in range(n_layers):
        window = layer_windows[layer]
        width = shared_width if window is None else max(c.indices[layer].shape[-1] for c in comps)
        slots = shared_slots if window is None else max(c.tail_slots[layer] for c in comps)
        if isinstance(kept, list):
            out = None if window is not None else tuple(slab[compressed.index(layer)] for slab in slabs)
            keys, values = _gather_slots(kept[layer], [c.indices[layer] for c in comps], width + capacity, out)
        else:
            keys, values = _write_rows(lambda row, layer=layer: kept(row, layer), b, width + capacity)
        device = keys.device
        offset = torch.full((b, keys.shape[1], width + capacity), float("-inf"), dtype=torch.float32, device=device)
        omp = torch.zeros(b, keys.shape[1], slots, dtype=torch.float32, device=device)
        for row, c in enumerate(comps):
            offset[row, :, : c.indices[layer].shape[-1]] = c.offset[layer]
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
    return Bucket(
        layers, certificate_rows=[p.has_certificate for p in policies], oracle=oracle_parts, recompress=recompress
    )


def _write_rows(
    kept_row: Callable[[int], tuple[torch.Tensor, torch.Tensor]], b: int, n_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (B, Hkv, d, n_slots) and values (B, Hkv, n_slots, d) from each row's kept keys (Hkv, d, m) and values
    (Hkv, m, d), taken one row at a time: every slot written once, the row's kept tokens, then zeros (padding and the
    answer's slots)."""
    keys = values = None
    for row in range(b):
        k_row, v_row = kept_row(row)
        if keys is None:
            n_kv, d, _ = k_row.shape
            values = empty_on_huge_pages(b, n_kv, n_slots, d, like=v_row)
            keys = empty_on_huge_pages(b, n_kv, d, n_slots, like=k_row)
        m = k_row.shape[-1]
        keys[row, :, :, :m] = k_row
        keys[row, :, :, m:] = 0
        values[row, :, :m] = v_row
        values[row, :, m:] = 0
    return keys, values


def _gather_slots(
    layer: tuple[torch.Tensor, torch.Tensor],
    indices: list[torch.Tensor],
    n_slots: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_write_rows` writes, gathered from a whole layer (`WholeLayers`: keys (Hkv, d, R + 1), values
    (Hkv, R + 1, d), token R zero) by each row's kept positions (Hkv, m): every slot names its token, the padding the
    zero one, so each buffer is written once, in one pass, with no copy in between. out: contiguous (keys, values)
    of the buffers' shapes to write into (else new memory)."""
    keys_t, values_all = layer
    n_kv, d, n_tokens = keys_t.shape
    b = len(indices)
    slot_tokens = torch.full((b, n_kv, n_slots), n_tokens - 1, dtype=torch.long, device=keys_t.device)
    for row, idx in enumerate(indices):
        slot_tokens[row, :, : idx.shape[-1]] = idx
    if out is None:
        out = (empty_on_huge_pages(b, n_kv, d, n_slots, like=keys_t),
               empty_on_huge_pages(b, n_kv, n_slots, d, like=values_all))  # fmt: skip
    keys, values = out
    # a (d, n_slots) block of the buffer per row and head: columns of the layer's K^T (views made once, by unbind)
    heads = keys_t.unbind(0)
    blocks = zip(keys.view(b * n_kv, d, n_slots).unbind(0), slot_tokens.view(b * n_kv, n_slots).unbind(0))
    for i, (block, tokens) in enumerate(blocks):
        torch.index_select(heads[i % n_kv], 1, tokens, out=block)
    flat = (slot_tokens + torch.arange(n_kv, device=keys_t.device)[:, None] * n_tokens).view(-1)
    torch.index_select(values_all.reshape(n_kv * n_tokens, d), 0, flat, out=values.view(-1, d))
    return keys, values


def _recompress_row(policy: Policy, region: int, example_id: str, options: DecodeOptions) -> RowRecompress | None:
    """A row's re-compression during decoding (kvcert.hf.recompress), None when its policy has none: back to the
    prompt compression's size per head, keep_count(budget, region), always-kept tokens included."""
    if policy.recompress_every is None:
        return None
    target = keep_count(policy.budget, region)
    return RowRecompress.of(policy, target, example_id, window=options.context_window, pool_kernel=options.pool_kernel)


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
