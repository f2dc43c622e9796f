"""What kvcert does inside attention: the attention function registered with transformers, and the two states it
hands every layer's queries, keys and values to.

kvcert runs the model with `use_cache=False` and passes a state through the forward kwargs (`kvcert_state=`); the
state owns the keys/values, so the layout stays under our control. Positions are whatever `position_ids` the caller
passes: the runner passes the uncompressed positions, so a compressed cache never shifts RoPE.

- `RecordState` (batch 1): exact causal attention over the prompt; keeps the full keys/values (the oracle) and the
  queries of the observation windows the scorers read (verification mode).
- `CompressingState` (batch 1): exact causal attention over the prompt, and each layer handed to a callback that
  keeps what it needs (serving mode: the layer's compressed caches) before the next layer runs; no full keys/values
  are kept, so the full cache of all layers never coexists.
- `CompressedState` (batch = variants): per (variant, KV head) the kept prompt tokens, tail first, then head, then
  padding (offset -inf), then every token appended after compression (pi = 1, offset 0), in the model's dtype;
  attention, certificate and oracle compute in float32. Offset (Hajek) attention
  and, at single-token decode steps, the certificate variance and, when an oracle is attached, the exact output of
  the same query over the full prompt plus the variant's own appended tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.core.certificate import make_sketch, tail_diagnostics, tail_features, trace_c2_from_features
from kvcert.core.hajek import offset_softmax, variance_from_sums

CERTIFICATE_STATS = ("trace_c2", "ess_tail", "n_tail", "tail_max", "head_mass")
SKETCH_K = 8  # columns of the fixed Gaussian sketch behind tr(C^2) (core/certificate.py: cost and accuracy)
SKETCH_SEED = 0  # drawn once per head_dim from this seed, so records are reproducible
_SKETCHES: dict[tuple[int, str], torch.Tensor] = {}


def value_sketch(d: int, device) -> torch.Tensor:
    key = (d, str(device))
    if key not in _SKETCHES:
        _SKETCHES[key] = make_sketch(d, SKETCH_K, generator=torch.Generator().manual_seed(SKETCH_SEED), device=device)
    return _SKETCHES[key]


NAME = "kvcert"


# ------------------------------------------------------------------------------------------------ the function
def kvcert_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA unless the forward call carries `kvcert_state`; then the state attends (and owns the keys/values)."""
    state = kwargs.pop("kvcert_state", None)
    if state is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    for unsupported in ("softcap", "s_aux"):  # logit soft-capping, attention sinks: refused at load, never ignored
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(
                f"kvcert's attention does not implement {unsupported!r} ({type(module).__name__})"
            )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = state.attend(module.layer_idx, query, key, value, scale, window=kwargs.get("sliding_window"))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, kvcert_attention)


def _set_attention(model: PreTrainedModel, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError):  # older 5.x: set the config field directly
        model.config._attn_implementation = name


@contextmanager
def kvcert_attention_on(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run the model with kvcert's attention function inside the block; restore its previous implementation."""
    previous = model.config._attn_implementation
    _set_attention(model, NAME)
    try:
        yield model
    finally:
        if previous and previous != NAME:
            _set_attention(model, previous)


@contextmanager
def chunked_feed_forward(model: PreTrainedModel, chunk: int = 1024) -> Iterator[PreTrainedModel]:
    """Inside the block, each decoder layer's MLP reads a long sequence `chunk` tokens at a time. An MLP (or a
    mixture of experts) acts on each token alone, so the output is the same, and a long prompt's MLP activations
    (about 3 x tokens x intermediate size) never exist at once: serving mode's prefill peak is then the compressed
    caches plus a few hidden states, not the MLP of the whole prompt (as `chunk_size_feed_forward` once did)."""
    patched = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None:
            continue
        forward = mlp.forward

        def chunked(x, *args, _forward=forward, **kwargs):
            if args or kwargs or x.dim() < 2 or x.shape[-2] <= chunk:
                return _forward(x, *args, **kwargs)
            parts = [_forward(part) for part in x.split(chunk, dim=-2)]
            if all(isinstance(part, torch.Tensor) for part in parts):
                return torch.cat(parts, dim=-2)
            return _forward(x)  # an MLP that returns more than the hidden states (router logits): whole

        mlp.forward = chunked
        patched.append(mlp)
    try:
        yield model
    finally:
        for mlp in patched:
            del mlp.forward  # the class's forward again


@torch.no_grad()
def forward_with_state(model: PreTrainedModel, input_ids: torch.Tensor, position: int, state) -> torch.Tensor:
    """One forward pass through a kvcert state; returns the logits of the last position per sequence (B, V).
    Every sequence of the batch reads its tokens at positions position, position + 1, ... (the uncompressed ones:
    a compressed cache never shifts RoPE); the position is a host integer, so no layer waits on the device."""
    state.position = position
    positions = torch.arange(position, position + input_ids.shape[1], device=input_ids.device)
    positions = positions[None].expand(input_ids.shape[0], -1)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=False, kvcert_state=state, logits_to_keep=1)
    finish = getattr(state, "finish_step", None)  # the statistics of every layer, after the forward
    if finish is not None:
        finish()
    return out.logits[:, -1, :]


# ---------------------------------------------------------------------------------------------------- record
class RecordState:
    """Batch 1, exact causal attention; keeps every layer's full keys/values and the captured window queries."""

    def __init__(self, n_layers: int, capture: dict[str, slice] | None = None):
        self.full_keys: list[torch.Tensor | None] = [None] * n_layers  # (1, Hkv, n, d)
        self.full_values: list[torch.Tensor | None] = [None] * n_layers
        self.capture = capture or {}  # name -> slice of absolute positions whose queries to keep
        self.captured: dict[str, list[torch.Tensor | None]] = {k: [None] * n_layers for k in self.capture}
        self.position = 0

    def attend(self, layer: int, query, key, value, scale: float, window: int | None = None) -> torch.Tensor:
        t = query.shape[-2]
        past_k, past_v = self.full_keys[layer], self.full_values[layer]
        k = key if past_k is None else torch.cat([past_k, key], dim=-2)
        v = value if past_v is None else torch.cat([past_v, value], dim=-2)
        self.full_keys[layer], self.full_values[layer] = k, v
        start = k.shape[-2] - t
        for name, where in self.capture.items():
            lo, hi = max(where.start, start), min(where.stop, start + t)
            if lo < hi:
                q = query[..., lo - start : hi - start, :]
                prev = self.captured[name][layer]
                self.captured[name][layer] = q if prev is None else torch.cat([prev, q], dim=-2)
        # the new tokens see every earlier token and each other causally (and, on a sliding-window layer, only the
        # last `window` tokens including themselves, as transformers' sliding_window_overlay: j > i - window)
        mask = None
        if start > 0 or window is not None:
            mask = torch.ones(t, k.shape[-2], dtype=torch.bool, device=k.device).tril(diagonal=start)
            if window is not None:
                mask &= ~torch.ones_like(mask).tril(diagonal=start - window)
        return sdpa(query, k, v, mask=mask, scale=scale)


def sdpa(query, key, value, *, mask, scale: float) -> torch.Tensor:
    """Exact attention of the query heads over grouped key/value heads (causal when mask is None). On CUDA the
    key/value heads are expanded first: the fused kernels that take float32 do not take grouped heads, and
    without one the whole (heads, tokens, tokens) score matrix would be materialized (4.8 GiB at 8k tokens on
    SmolLM2); on the CPU the flash kernel takes grouped heads as they are."""
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.device.type == "cuda":
        group = query.shape[1] // key.shape[1]
        key, value, gqa = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), False
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )


def causal_attention(query, key, value, scale: float, window: int | None) -> torch.Tensor:
    """Exact causal attention of a whole chunk read from position 0 (a sliding-window layer sees the last `window`
    tokens including itself)."""
    mask = None
    if window is not None:
        t = query.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=key.device).tril()
        mask &= ~torch.ones_like(mask).tril(diagonal=-window)
    return sdpa(query, key, value, mask=mask, scale=scale)


class CompressingState:
    """Batch 1, one chunk from position 0, exact causal attention; after each layer's attention,
    `on_layer(layer, query, key, value)` keeps what it needs, and the state keeps nothing."""

    def __init__(self, on_layer):
        self.on_layer = on_layer
        self.position = 0

    def attend(self, layer: int, query, key, value, scale: float, window: int | None = None) -> torch.Tensor:
        if self.position != 0:
            raise RuntimeError("CompressingState reads one chunk from position 0")
        out = causal_attention(query, key, value, scale, window)
        self.on_layer(layer, query, key, value)
        return out


# ------------------------------------------------------------------------------------------------ compressed
@dataclass(kw_only=True)
class LayerBuffers:
    """One layer's compressed cache for a batch of variants: keys and values in the model's dtype (keys stored
    transposed, (d, slots), so q K^T is a plain GEMM), offsets and 1 - pi in float32."""

    keys: torch.Tensor  # (B, Hkv, d, capacity)
    values: torch.Tensor  # (B, Hkv, capacity, d)
    offset: torch.Tensor  # (B, Hkv, capacity): -log pi on kept tokens, 0 after compression, -inf on padding
    one_minus_pi: torch.Tensor  # (B, Hkv, tail_slots)
    tail_slots: int
    length: int  # filled entries
    oracle_keys: torch.Tensor | None = None  # (B, Hkv, capacity, d): the oracle's own part (a view, see LayerGroup)
    oracle_values: torch.Tensor | None = None
    oracle_length: int = 0
    compressed: bool = True  # False: a sliding-window layer kept exactly (no certificate: variance NaN)
    prefix: int = 0  # entries [0, prefix) are the compressed prompt (tail, head, padding); later ones were appended
    window: int | None = None  # sliding window (tokens, the query included); None = full attention
    positions: torch.Tensor | None = None  # (B, capacity) absolute positions of the slots (window layers only)

    @property
    def capacity(self) -> int:
        return self.keys.shape[-1]

    @property
    def layout(self) -> tuple:
        """Layers with the same layout share one set of stacked work buffers and one statistics pass."""
        return (self.window, self.compressed, self.tail_slots, self.prefix, self.capacity)

    def key_slots(self, hi: int) -> torch.Tensor:
        """The first `hi` keys as (B, Hkv, hi, d), a view of the transposed storage."""
        return self.keys[..., :hi].transpose(-1, -2)

    def keep_rows(self, rows: torch.Tensor) -> None:
        for name in ("keys", "values", "offset", "one_minus_pi", "positions"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))


class LayerGroup:
    """The layers of a bucket that share one slot layout (all of them on a full-attention model; on a hybrid model
    the full-attention layers and the sliding-window layers). Attention writes each layer's weights and outputs into
    stacked work buffers; after the forward, `flush` computes every statistic of all the group's layers at once.

    Work buffers: rows (n, B, Hkv, 3g, capacity) = [p; a; (1 - pi) a^2] with a = (1 - pi) p^2 on the tail slots
    (zero beyond them) and out (n, B, Hkv, 2g, d) = [o_hat; sum a v], so that [p; a] @ V is one matmul. The oracle
    of a row is exact attention over the group's shared prefix (the first `region` prompt tokens, stacked
    (n, Hkv, d, P) / (n, Hkv, P, d)) followed by its own part (n, B, Hkv, capacity, d), which receives every token
    the row appends."""

    def __init__(self, layers: list[int], buffers: list[LayerBuffers], oracle: tuple | None, certified: bool):
        self.layers = layers
        first = buffers[0]
        self.window, self.compressed, self.tail_slots, self.prefix = (
            first.window,
            first.compressed,
            first.tail_slots,
            first.prefix,
        )
        self.oracle = oracle  # (prefix K^T, prefix V, own keys, own values) or None
        s = self.tail_slots
        omp = torch.stack([b.one_minus_pi for b in buffers])  # (n, B, Hkv, s)
        tail = (omp > 0).to(omp.dtype)
        value_sq_norms = torch.stack([b.values[:, :, :s].float().square().sum(-1) for b in buffers])
        inverse_omp = torch.where(omp > 0, 1 / omp.clamp_min(torch.finfo(omp.dtype).tiny), torch.zeros_like(omp))
        self.omp = omp
        # [tail indicator, ||v||^2, 1 / (1 - pi) on the tail]: the columns of the one tail matmul in `flush`
        self.tail_columns = torch.stack([tail, value_sq_norms, inverse_omp], -1)
        self.features = None  # tr(C^2)'s packed sketch features of the tail tokens (values are fixed after compression)
        if certified and self.compressed and s:
            sketch = value_sketch(first.values.shape[-1], first.values.device)
            self.features = torch.stack(
                [tail_features(b.values[:, :, :s].float(), sketch, packed=True) for b in buffers]
            )
        self.psi: torch.Tensor | None = None  # tr(C^2) / V_hat^2 of the last refresh (tight_radius_every > 1)
        self.rows: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.pending: list[int] = []  # local indices written since the last flush
        self.queries: list[torch.Tensor] = []  # each layer's query, for the oracle
        self.variance = False  # whether this step's rows hold the certificate's a = (1 - pi) p^2

    def work(self, local: int, n_kv: int, g: int, d: int, capacity: int, like: torch.Tensor):
        """This layer's views of the work buffers, allocated at the first decode step (zeros: a stays 0 beyond
        the tail slots, which are never written)."""
        if self.rows is None:
            n, b = len(self.layers), like.shape[0]
            self.rows = like.new_zeros(n, b, n_kv, 3 * g, capacity)
            self.out = like.new_empty(n, b, n_kv, 2 * g, d)
        return self.rows[local], self.out[local]

    def keep_rows(self, rows: torch.Tensor, buffers: list[LayerBuffers]) -> None:
        self.omp, self.tail_columns = self.omp.index_select(1, rows), self.tail_columns.index_select(1, rows)
        for name in ("features", "psi", "rows", "out"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(1, rows))
        if self.oracle is not None:
            kt, v, own_k, own_v = self.oracle
            self.oracle = (kt, v, own_k.index_select(1, rows), own_v.index_select(1, rows))
            for local, buf in enumerate(buffers):
                buf.oracle_keys, buf.oracle_values = self.oracle[2][local], self.oracle[3][local]

    def flush(
        self,
        certificate_rows: torch.Tensor,
        length: int,
        *,
        certificate: bool,
        trace_c2: bool,
        refresh: bool | None,
        error: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Every statistic of this step for all the group's layers: name -> (n, B, Hq)."""
        if self.pending != list(range(len(self.layers))):
            raise RuntimeError(f"deferred statistics of layers {self.pending}, expected each of {self.layers} once")
        self.pending = []
        g, s = self.out.shape[-2] // 2, self.tail_slots
        p = self.rows[..., :g, :length]  # (n, B, Hkv, g, L)
        out = self.out[..., :g, :]
        shape = (p.shape[0], p.shape[1], p.shape[2] * g)
        step = {"out_norm": out.norm(dim=-1).reshape(shape), "p_max": p.amax(-1).reshape(shape)}
        if error is not None:
            step["error"] = error.reshape(shape)
        if not self.variance:
            step["tail_mass"] = (p[..., :s] @ self.tail_columns[..., :1]).reshape(shape)
            if certificate:  # undefined, never zero: rows without a certificate, layers kept exactly
                nan = torch.full(shape, float("nan"), device=p.device)
                step.update({name: nan for name in ("variance", *CERTIFICATE_STATS)})
            return step
        # every tail sum in one matmul over [p; a]: p @ tail = tail mass, a @ ||v||^2, a @ tail = sum a,
        # a @ (1 / (1 - pi) on the tail) = sum of p^2 over the tail (Kish's denominator)
        sums = self.rows[..., : 2 * g, :s] @ self.tail_columns  # (n, B, Hkv, 2g, 3)
        mass, a_sq_norms, a_sum, p_sq = sums[..., :g, 0], sums[..., g:, 1], sums[..., g:, 0], sums[..., g:, 2]
        variance = variance_from_sums(a_sq_norms, self.out[..., g:, :], out, a_sum)
        undefined = ~certificate_rows[None, :, None]
        step["tail_mass"] = mass.reshape(shape)
        step["variance"] = variance.reshape(shape).masked_fill(undefined, float("nan"))
        diag = tail_diagnostics(p, self.omp, tail_slots=s, prefix=self.prefix, tail_sums=(mass, p_sq))
        diag["trace_c2"] = torch.zeros_like(variance) if trace_c2 else torch.full_like(variance, torch.nan)
        if s and trace_c2:
            diag["trace_c2"] = self._trace_c2(p, out, variance, refresh, g, s)
        for name in CERTIFICATE_STATS:
            step[name] = diag[name].reshape(shape).masked_fill(undefined, float("nan"))
        return step

    def _trace_c2(self, p, out, variance, refresh: bool | None, g: int, s: int) -> torch.Tensor:
        """The sketched tr(C^2) of this step: one GEMM [a; (1 - pi) a^2] @ features over the tail of every layer; or
        (refresh False, after a refresh) the last refresh's tr(C^2) / V_hat^2 times this step's V_hat^2: the
        effective dimension h = V_hat^2 / tr(C^2) is carried, V_hat is not."""
        if refresh is False and self.psi is not None:
            return self.psi * variance.square()
        a, b = self.rows[..., g : 2 * g, :s], self.rows[..., 2 * g :, :s]
        torch.mul(a, a, out=b).mul_(self.omp.unsqueeze(-2))  # (1 - pi) a^2 in place
        sketch = value_sketch(out.shape[-1], out.device)
        tc2 = trace_c2_from_features(
            p, self.omp, self.features, out, sketch, variance, tail_rows=self.rows[..., g:, :s]
        )
        if refresh:  # V_hat = 0 carries h = 1 (psi = 1): the radius is 0 until V_hat grows, then Gaussian-like
            v2 = variance.square()
            self.psi = torch.where(v2 > 0, tc2 / v2.clamp_min(torch.finfo(v2.dtype).tiny), torch.ones_like(v2))
        return tc2


def oracle_errors(parts: list[tuple[LayerGroup, int]], scale: float, position: int) -> list[torch.Tensor]:
    """||o_hat - o|| (n, B, Hkv, g) of groups that share one oracle prefix (same layers, one compression time),
    for every layer and row at once: the shared prefix's K^T and V are read once per step. The softmax runs over
    the two parts without concatenating them (prefix, then the row's own tokens); on a sliding-window group only
    the last `window` positions count. parts: (group, length of its rows' own parts); position: the query's."""
    groups = [grp for grp, _ in parts]
    group0, own = parts[0]
    if any(length != own for _, length in parts):
        raise RuntimeError("groups of one oracle prefix hold own parts of different lengths")
    kt, fv = group0.oracle[:2]
    q = torch.cat([torch.stack(grp.queries) for grp in groups], dim=1)  # (n, B, Hkv, g, d)
    g = q.shape[3]
    out = torch.cat([grp.out[..., :g, :] for grp in groups], dim=1)
    app_k = torch.cat([grp.oracle[2][..., :own, :] for grp in groups], dim=1)  # (n, B, Hkv, a, d)
    app_v = torch.cat([grp.oracle[3][..., :own, :] for grp in groups], dim=1)
    for grp in groups:
        grp.queries = []
    if group0.window is not None:  # positions are [0, prefix) then the own part: keep the last `window`
        n_prefix = kt.shape[-1]
        first = max(0, position - group0.window + 1)
        kt, fv = kt[..., min(first, n_prefix) :], fv[..., min(first, n_prefix) :, :]
        own_first = max(0, first - n_prefix)
        app_k, app_v = app_k[..., own_first:, :], app_v[..., own_first:, :]
    n_layers, bsz, n_kv, g, d = q.shape
    qh = q.transpose(1, 2).reshape(n_layers, n_kv, bsz * g, d)
    lf = torch.matmul(qh, kt).mul_(scale).view(n_layers, n_kv, bsz, g, -1)  # (n, Hkv, B, g, P)
    la = (q @ app_k.transpose(-1, -2)).mul_(scale).transpose(1, 2)  # (n, Hkv, B, g, a)
    m = la.amax(-1, keepdim=True)  # the own part holds at least the query's token
    if lf.shape[-1]:
        m = torch.maximum(lf.amax(-1, keepdim=True), m)
    ef, ea = lf.sub_(m).exp_(), (la - m).exp_()
    z = ef.sum(-1, keepdim=True) + ea.sum(-1, keepdim=True)
    num = torch.matmul(ef.view(n_layers, n_kv, bsz * g, -1), fv).view(n_layers, n_kv, bsz, g, d)
    num = num + ea @ app_v.transpose(1, 2)
    error = (out - (num / z).transpose(1, 2)).norm(dim=-1)
    return list(error.split([grp.out.shape[1] for grp in groups], dim=1))


class Bucket:
    """Rows whose compressed caches share one set of buffers (similar widths), with the certificate and the oracle
    computed beside attention; its layers fall into `LayerGroup`s of one slot layout each."""

    def __init__(
        self,
        layers: list[LayerBuffers],
        *,
        certificate_rows: list[bool],
        oracle: list[tuple] | None = None,
    ):
        """certificate_rows: per row, whether its policy has a certificate (False: variance NaN, as for top-k and
        the full cache); oracle: per layer group (in `layer_groups(layers)` order) the (prefix K^T, prefix V, own
        keys, own values) that LayerGroup describes, the own parts already viewed by the LayerBuffers; None = no
        oracle."""
        self.layers = layers
        self.certificate_flags = list(certificate_rows)  # on the host: which work a step does is decided there
        self.certificate_rows = torch.tensor(self.certificate_flags, device=layers[0].keys.device)
        self.certified = any(self.certificate_flags)  # a bucket of top-k / full-cache rows has no certificate work
        self.has_oracle = oracle is not None
        self.position = 0  # absolute position of the next token (set by the state)
        self.groups = [
            LayerGroup(idx, [layers[i] for i in idx], oracle[k] if oracle else None, self.certified)
            for k, idx in enumerate(layer_groups(layers))
        ]
        self.where = {layer: (grp, local) for grp in self.groups for local, layer in enumerate(grp.layers)}
        # the groups' layers back in model order, for the statistics of a model with several slot layouts
        layer_of_row = [layer for grp in self.groups for layer in grp.layers]
        self.layer_order = torch.tensor(layer_of_row, device=layers[0].keys.device).argsort()
        self.scale = 1.0

    @property
    def batch_size(self) -> int:
        return self.layers[0].keys.shape[0]

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished variants leave the batch); the indices go to the device without
        waiting for it (no host synchronisation)."""
        index = device_index(rows, self.layers[0].keys.device)
        for buf in self.layers:
            buf.keep_rows(index)
        for grp in self.groups:
            grp.keep_rows(index, [self.layers[i] for i in grp.layers])
        self.certificate_flags = [self.certificate_flags[i] for i in rows]
        self.certificate_rows = self.certificate_rows.index_select(0, index)
        self.certified = any(self.certificate_flags)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[int, int]:
        """Write the new tokens' keys and values (offset 0, pi = 1) into the cache and the oracle's own part."""
        buf = self.layers[layer]
        t = key.shape[-2]
        lo, hi = buf.length, buf.length + t
        if hi > buf.capacity:
            raise RuntimeError(f"KV buffer of layer {layer} is full ({buf.capacity} slots)")
        buf.keys[..., lo:hi] = key.transpose(-1, -2)
        buf.values[:, :, lo:hi] = value
        buf.offset[:, :, lo:hi] = 0.0
        buf.length = hi
        if buf.oracle_keys is not None:
            o_lo, o_hi = buf.oracle_length, buf.oracle_length + t
            buf.oracle_keys[:, :, o_lo:o_hi] = key
            buf.oracle_values[:, :, o_lo:o_hi] = value
            buf.oracle_length = o_hi
        return lo, hi

    def window_mask(self, layer: int, lo: int, hi: int, group: int, t: int, dtype) -> torch.Tensor:
        """Additive mask (B, 1, group * t, hi) hiding slots that left the window: position <= query - window."""
        buf = self.layers[layer]
        device = buf.keys.device
        buf.positions[:, lo:hi] = torch.arange(self.position, self.position + t, device=device)
        q_pos = (self.position + torch.arange(t, device=device)).repeat(group)  # rows are (group, t)
        stale = buf.positions[:, None, None, :hi] <= (q_pos - buf.window)[None, None, :, None]
        return torch.zeros(stale.shape, device=device, dtype=dtype).masked_fill_(stale, float("-inf"))

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        *,
        stats: bool,
        certificate: bool,
    ) -> torch.Tensor:
        """Offset attention of the new tokens over the cache, output (B, Hq, t, d). At a single-token step with
        statistics, the weights, the certificate's rows and the outputs go to the layer group's work buffers, and
        the statistics follow for all layers at once after the forward (`flush`)."""
        buf = self.layers[layer]
        bsz, n_q, t, d = query.shape
        n_kv = key.shape[1]
        g = n_q // n_kv
        lo, hi = self.append(layer, key, value)
        q = query.reshape(bsz, n_kv, g * t, d).float()
        mask = None
        if t > 1:  # new tokens see the cache and each other causally; rows are (group, t) flattened
            cols = torch.arange(hi, device=q.device)
            rows = torch.arange(t, device=q.device).repeat(g)
            mask = torch.zeros(g * t, hi, device=q.device, dtype=q.dtype)
            mask.masked_fill_(cols[None, :] > (lo + rows)[:, None], float("-inf"))
        if buf.window is not None:
            window_mask = self.window_mask(layer, lo, hi, g, t, q.dtype)
            mask = window_mask if mask is None else mask + window_mask
        keys_t, values, offset = buf.keys[..., :hi], buf.values[:, :, :hi], buf.offset[:, :, :hi]
        if keys_t.dtype != torch.float32:  # a bf16 / fp16 cache: the math runs in float32 on a per-layer copy
            keys_t, values = keys_t.float(), values.float()
        if not (stats and t == 1):
            out = offset_softmax(q, keys_t, offset, scale=scale, mask=mask) @ values
            return out.reshape(bsz, n_q, t, d).to(query.dtype)
        grp, local = self.where[layer]
        rows_buf, out_buf = grp.work(local, n_kv, g, values.shape[-1], buf.capacity, buf.offset)
        p = rows_buf[..., :g, :hi]
        offset_softmax(q, keys_t, offset, scale=scale, mask=mask, out=p)
        variance = certificate and self.certified and grp.compressed
        if variance:  # a = (1 - pi) p^2 in place; [p; a] @ V: o_hat and sum a v in one pass over the values
            s = buf.tail_slots
            a = rows_buf[..., g : 2 * g, :s]
            torch.mul(p[..., :s], p[..., :s], out=a).mul_(buf.one_minus_pi.unsqueeze(-2))
            torch.matmul(rows_buf[..., : 2 * g, :hi], values, out=out_buf)
        else:
            torch.matmul(p, values, out=out_buf[..., :g, :])
        self.written(layer, q, scale, variance)
        return out_buf[..., :g, :].reshape(bsz, n_q, t, d).to(query.dtype)

    def written(self, layer: int, q: torch.Tensor, scale: float, variance: bool) -> None:
        """After a layer's work buffers were filled (by `attend`, or by the compiled kernel for every bucket)."""
        grp, local = self.where[layer]
        grp.pending.append(local)
        grp.variance = variance
        self.scale = scale
        if self.has_oracle:
            grp.queries.append(q)

    def flush(self, certificate: bool, trace_c2: bool, refresh: bool | None, errors: dict) -> dict[str, torch.Tensor]:
        """This step's statistics of every layer: name -> (layers, B, Hq); errors: id(group) -> its oracle error."""
        parts = [
            grp.flush(
                self.certificate_rows,
                self.layers[grp.layers[0]].length,
                certificate=certificate,
                trace_c2=trace_c2,
                refresh=refresh,
                error=errors.get(id(grp)),
            )
            for grp in self.groups
        ]
        if len(parts) == 1:
            return parts[0]
        return {name: torch.cat([pt[name] for pt in parts]).index_select(0, self.layer_order) for name in parts[0]}


def device_index(rows: list[int], device) -> torch.Tensor:
    """Host indices as a long tensor on `device`; on CUDA through pinned memory and a non-blocking copy, so the
    host does not wait for the queued work (a plain copy from pageable memory synchronises the stream)."""
    index = torch.tensor(rows, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def layer_groups(layers: list[LayerBuffers]) -> list[list[int]]:
    """Layer indices grouped by slot layout, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, buf in enumerate(layers):
        groups.setdefault(buf.layout, []).append(i)
    return list(groups.values())


class CompressedState:
    """The compressed caches of a batch of variants: buckets of rows (one per compression time and width range),
    decoded in one forward; attention, certificate and oracle run per bucket, so no row pays for another's width.
    `backend`: "torch" (torch ops) or "compiled" (the C++ kernel of `kvcert.hf.kernel` for single-token steps of
    full-attention layers on a float32 CPU cache)."""

    def __init__(self, buckets: list[Bucket], backend: str = "torch"):
        self.buckets = buckets
        self.backend = backend
        self.compute_certificate = True
        self.compute_trace_c2 = True  # the tight radius' tr(C^2) (DecodeOptions.tight_radius)
        self.trace_c2_refresh: bool | None = None  # None: tr(C^2) every step; True / False: refresh / carry
        self.stats: dict[str, torch.Tensor] | None = None  # this step's statistics (layers, B, Hq), after a forward
        self.want_stats = False  # set by the decoder around a step it wants statistics of
        self.position = 0  # absolute position of the first new token (set by forward_with_state)

    @property
    def batch_size(self) -> int:
        return sum(b.batch_size for b in self.buckets)

    @property
    def layers(self) -> list[LayerBuffers]:
        """The first bucket's buffers (every bucket has the same layer structure)."""
        return self.buckets[0].layers

    def keep_rows(self, rows: list[int]) -> None:
        """Keep the rows `rows` (sorted indices into the batch) and drop the others."""
        kept, start = [], 0
        for bucket in self.buckets:
            n = bucket.batch_size
            local = [r - start for r in rows if start <= r < start + n]
            if len(local) == n:
                kept.append(bucket)
            elif len(local):
                bucket.keep_rows(local)
                kept.append(bucket)
            start += n
        self.buckets = kept

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        if window != self.layers[layer].window:
            raise RuntimeError(
                f"layer {layer}: the model's sliding window ({window}) is not the cache's ({self.layers[layer].window})"
            )
        single = self.want_stats and query.shape[-2] == 1
        if single and self.backend == "compiled" and window is None:
            return self._attend_compiled(layer, query, key, value, scale)
        outs, start = [], 0
        for bucket in self.buckets:
            n = bucket.batch_size
            bucket.position = self.position
            rows = slice(start, start + n)
            outs.append(
                bucket.attend(
                    layer,
                    query[rows],
                    key[rows],
                    value[rows],
                    scale,
                    stats=self.want_stats,
                    certificate=self.compute_certificate,
                )
            )
            start += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_compiled(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
        """`attend` at a single-token step, every bucket in one call of the compiled kernel."""
        from kvcert.hf import kernel

        bsz, n_q, _, d = query.shape
        n_kv = key.shape[1]
        q = query.reshape(bsz, n_kv, n_q // n_kv, d).float().contiguous()
        variance = [self.compute_certificate and b.certified and b.where[layer][0].compressed for b in self.buckets]
        out = kernel.decode_attention(
            q,
            key.reshape(bsz, n_kv, d).float().contiguous(),
            value.reshape(bsz, n_kv, d).float().contiguous(),
            self.buckets,
            layer,
            scale,
            variance,
        )
        start = 0
        for bucket, var in zip(self.buckets, variance):
            bucket.position = self.position
            bucket.written(layer, q[start : start + bucket.batch_size], scale, var)
            start += bucket.batch_size
        return out.reshape(bsz, n_q, 1, d).to(query.dtype)

    def finish_step(self) -> None:
        """After a forward with statistics: every bucket's statistics of all layers -> `stats` (layers, B, Hq),
        the rows of the buckets side by side."""
        if not self.want_stats or not any(grp.pending for b in self.buckets for grp in b.groups):
            self.stats = None
            return
        errors: dict[int, torch.Tensor] = {}
        shared: dict[int, list] = {}  # groups by oracle prefix (one compression time, the same layers)
        scale = self.buckets[0].scale
        for b in self.buckets:
            for grp in b.groups:
                if grp.queries:
                    shared.setdefault(id(grp.oracle[0]), []).append((grp, b.layers[grp.layers[0]].oracle_length))
        for parts in shared.values():
            errors.update({id(grp): e for (grp, _), e in zip(parts, oracle_errors(parts, scale, self.position))})
        steps = [
            b.flush(self.compute_certificate, self.compute_trace_c2, self.trace_c2_refresh, errors)
            for b in self.buckets
        ]
        self.stats = {name: torch.cat([st[name] for st in steps], dim=1) for name in steps[0]}
