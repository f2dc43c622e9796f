"""What kvcert does inside attention: the attention function registered with transformers, and the two states it
hands every layer's queries, keys and values to.

kvcert runs the model with `use_cache=False` and passes a state through the forward kwargs (`kvcert_state=`); the
state owns the keys/values, so the layout stays under our control. Positions are whatever `position_ids` the caller
passes: the runner passes the uncompressed positions, so a compressed cache never shifts RoPE.

- `RecordState` (batch 1): exact causal attention over the prompt; keeps the full keys/values (the oracle) and the
  queries of the observation windows the scorers read.
- `CompressedState` (batch = variants): per (variant, KV head) the kept prompt tokens, tail first, then head, then
  padding (offset -inf), then every token appended after compression (pi = 1, offset 0). Offset (Hajek) attention
  and, at single-token decode steps, the certificate variance and, when an oracle is attached, the exact output of
  the same query over the full prompt plus the variant's own appended tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.core.certificate import make_sketch, tail_diagnostics, tail_features, trace_c2_from_features
from kvcert.core.hajek import hajek_attention

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


@torch.no_grad()
def forward_with_state(model: PreTrainedModel, input_ids: torch.Tensor, positions: torch.Tensor, state) -> torch.Tensor:
    """One forward pass through a kvcert state; returns the logits of the last position per sequence (B, V).
    Every sequence of the batch is at the same positions (the uncompressed ones)."""
    state.position = int(positions[0, 0])
    out = model(input_ids=input_ids, position_ids=positions, use_cache=False, kvcert_state=state, logits_to_keep=1)
    finish = getattr(state, "finish_step", None)  # statistics deferred to after the forward (stats_after_forward)
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
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )


# ------------------------------------------------------------------------------------------------ compressed
@dataclass(kw_only=True)
class LayerBuffers:
    """One layer's compressed cache for a batch of variants (float32 from construction on)."""

    keys: torch.Tensor  # (B, Hkv, capacity, d), or (B, Hkv, d, capacity) when keys_transposed
    values: torch.Tensor  # (B, Hkv, capacity, d)
    offset: torch.Tensor  # (B, Hkv, capacity): -log pi on kept tokens, 0 after compression, -inf on padding
    one_minus_pi: torch.Tensor  # (B, Hkv, tail_slots)
    value_sq_norms: torch.Tensor  # (B, Hkv, tail_slots), ||v||^2 of the tail slots (the certificate reuses it)
    tail_slots: int
    length: int  # filled entries
    oracle_keys: torch.Tensor | None = None  # (B, Hkv, capacity, d): the oracle's per-variant part (see below)
    oracle_values: torch.Tensor | None = None
    oracle_length: int = 0
    compressed: bool = True  # False: a sliding-window layer kept exactly (no certificate: variance NaN)
    prefix: int = 0  # entries [0, prefix) are the compressed prompt (tail, head, padding); later ones were appended
    window: int | None = None  # sliding window (tokens, the query included); None = full attention
    positions: torch.Tensor | None = None  # (B, capacity) absolute positions of the slots (window layers only)
    keys_transposed: bool = False  # DecodeOptions.keys_transposed: q K^T is then a plain GEMM (faster on CPU)

    @property
    def capacity(self) -> int:
        return self.keys.shape[-1] if self.keys_transposed else self.keys.shape[-2]

    def key_slots(self, hi: int) -> torch.Tensor:
        """The first `hi` keys as (B, Hkv, hi, d), a view whatever the storage layout."""
        return self.keys[..., :hi].transpose(-1, -2) if self.keys_transposed else self.keys[:, :, :hi]

    def keep_rows(self, rows: torch.Tensor) -> None:
        for name in (
            "keys",
            "values",
            "offset",
            "one_minus_pi",
            "value_sq_norms",
            "oracle_keys",
            "oracle_values",
            "positions",
        ):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, rows))


@dataclass
class StepStats:
    """One decode step, per layer: tensors (B, Hq)."""

    variance: list[torch.Tensor] = field(default_factory=list)
    error: list[torch.Tensor] = field(default_factory=list)
    out_norm: list[torch.Tensor] = field(default_factory=list)
    tail_mass: list[torch.Tensor] = field(default_factory=list)
    p_max: list[torch.Tensor] = field(default_factory=list)
    # with the certificate (NaN where it is undefined): kvcert.core.certificate
    trace_c2: list[torch.Tensor] = field(default_factory=list)  # sketched, debiased tr(C_hat^2)
    ess_tail: list[torch.Tensor] = field(default_factory=list)  # Kish effective sample size of the tail weights
    n_tail: list[torch.Tensor] = field(default_factory=list)  # sampled tail tokens
    tail_max: list[torch.Tensor] = field(default_factory=list)  # largest tail weight
    head_mass: list[torch.Tensor] = field(default_factory=list)  # mass of the retained prompt head (pi = 1)


class Bucket:
    """Rows whose compressed caches share one set of buffers (similar widths), with the certificate and the oracle
    computed beside attention.

    The oracle of a variant is exact attention of its query over `oracle_prefix` (the first tokens of the full
    prefill, shared by the bucket) followed by the variant's own part `LayerBuffers.oracle_keys[:oracle_length]`,
    which starts with whatever the caller put there and receives every token the variant appends.
    """

    def __init__(
        self,
        layers: list[LayerBuffers],
        *,
        certificate_rows: torch.Tensor,
        oracle_prefix: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        stats_after_forward: bool = False,
        oracle_stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        """oracle_prefix: per layer (K^T (Hkv, d, n), V (Hkv, n, d)) of the first n prefill tokens, fp32: the shared
        prefix in a matmul layout (a broadcast matmul would copy it once per variant); None = no oracle.
        stats_after_forward: the bucket will decode with DecodeOptions.stats_after_forward, so its tr(C^2) features
        are built stacked and packed (`_stacked_buffers`), not per layer (either is built on demand if needed).
        oracle_stacked: (K^T, V) of the shared prefix (layers, Hkv, d, n) / (layers, Hkv, n, d) and the own parts'
        keys and values (layers, B, Hkv, capacity, d), whose per-layer views the LayerBuffers hold: with them the
        deferred path computes the oracle's error for every layer in one pass after the forward too."""
        self.layers = layers
        self.certificate_rows = certificate_rows  # (B,) bool: False -> variance NaN (top-k, full cache)
        self.position = 0  # absolute position of the next token (set by the state)
        self.has_oracle = oracle_prefix is not None
        self._oracle_kt, self._oracle_v = oracle_prefix if oracle_prefix is not None else ([], [])
        self.oracle_prefix = self._oracle_kt[0].shape[-1] if self._oracle_kt else 0
        self._tail = [(b.one_minus_pi > 0).float().unsqueeze(-1) for b in layers]  # 1.0 on real tail slots
        # a bucket of top-k / full-cache rows only has no certificate work at all (NaN statistics)
        self.certified = bool(certificate_rows.any())
        # V_tail R and its per-token features once per compression (values are fixed then): the per-step tr(C^2)
        # estimate is then one GEMM over the tail (kvcert.core.certificate.trace_c2_from_features)
        self._sketch = value_sketch(layers[0].values.shape[-1], layers[0].values.device)
        self._features = [
            tail_features(b.values[:, :, : b.tail_slots], self._sketch)
            if self.certified and not stats_after_forward
            else None
            for b in layers
        ]
        # tr(C^2) / V_hat^2 per (row, kv head, query) at the last step that computed tr(C^2): carried between
        # refreshes when DecodeOptions.tight_radius_every > 1 (None until a refresh stores it)
        self._psi: list[torch.Tensor | None] = [None] * len(layers)
        # DecodeOptions.stats_after_forward: each layer leaves (weights, output, V_hat) here during the forward and
        # `flush_stats` reduces them for all layers at once; it needs every layer to share one slot layout
        self.uniform_layers = all(b.window is None and b.compressed for b in layers) and (
            len({(b.tail_slots, b.prefix) for b in layers}) == 1
        )
        # the deferred path's work buffers, written in place by every layer and read once by `flush_stats`:
        # rows (layers, B, Hkv, 3 group, slots) = [p; a; (1 - pi) a^2] with a = (1 - pi) p^2 on the tail slots
        # (zero beyond them) and out (layers, B, Hkv, 2 group, d) = [o_hat; sum a v]: [p; a] @ V is one matmul
        self._rows: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._pending: list[int] = []  # layers written since the last flush
        self._oracle_stacked = oracle_stacked
        self._queries: list[torch.Tensor] = []  # each layer's query, for the stacked oracle
        self._scale = 1.0
        self._pending_variance = False
        self._stacked: dict[str, torch.Tensor] | None = None  # per-layer tensors stacked on dim 0 (lazily)
        self._psi_all: torch.Tensor | None = None  # _psi of the stacked path: (layers, B, Hkv, group)
        if stats_after_forward and self.uniform_layers:
            self._stacked_buffers()  # at compression time, not in the first decode step

    @property
    def batch_size(self) -> int:
        return self.layers[0].keys.shape[0]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (finished variants leave the batch)."""
        if self._oracle_stacked is not None:  # the own parts are views into one tensor: select it once
            kt, v, own_k, own_v = self._oracle_stacked
            own_k, own_v = own_k.index_select(1, rows), own_v.index_select(1, rows)
            self._oracle_stacked = (kt, v, own_k, own_v)
            for buf in self.layers:
                buf.oracle_keys, buf.oracle_values = None, None
        for layer, buf in enumerate(self.layers):
            buf.keep_rows(rows)
            if self._oracle_stacked is not None:
                buf.oracle_keys, buf.oracle_values = self._oracle_stacked[2][layer], self._oracle_stacked[3][layer]
            self._tail[layer] = self._tail[layer].index_select(0, rows)
            if self._features[layer] is not None:
                self._features[layer] = self._features[layer].index_select(0, rows)
            if self._psi[layer] is not None:
                self._psi[layer] = self._psi[layer].index_select(0, rows)
        if self._stacked is not None:
            self._stacked = {k: v.index_select(1, rows) for k, v in self._stacked.items()}
        if self._psi_all is not None:
            self._psi_all = self._psi_all.index_select(1, rows)
        if self._rows is not None:
            self._rows, self._out = self._rows.index_select(1, rows), self._out.index_select(1, rows)
        self.certificate_rows = self.certificate_rows.index_select(0, rows)
        self.certified = bool(self.certificate_rows.any())

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None,
        *,
        stats: bool,
        certificate: bool,
        trace_c2: bool = True,
        trace_c2_refresh: bool | None = None,
        defer: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        """(output (B, Hq, t, d), this step's statistics per name (B, Hq) when asked for at a single-token step).

        trace_c2_refresh: None computes tr(C^2) at this step (the default: every step); True computes it and keeps
        its ratio to V_hat^2 for later steps; False carries that ratio (tr(C^2) = ratio * V_hat^2 of this step).
        defer: keep what the statistics need and return only the oracle's error; `flush_stats` computes the rest
        for every layer after the forward (uniform layers only)."""
        buf = self.layers[layer]
        if window != buf.window:
            raise RuntimeError(
                f"layer {layer}: the model's sliding window ({window}) is not the buffer's ({buf.window})"
            )
        bsz, n_q, t, d = query.shape
        n_kv = key.shape[1]
        group = n_q // n_kv
        lo, hi = buf.length, buf.length + t
        if hi > buf.capacity:
            raise RuntimeError(f"KV buffer of layer {layer} is full ({buf.capacity} slots)")
        if buf.keys_transposed:
            buf.keys[..., lo:hi] = key.transpose(-1, -2)
        else:
            buf.keys[:, :, lo:hi] = key
        buf.values[:, :, lo:hi] = value
        buf.offset[:, :, lo:hi] = 0.0
        buf.length = hi
        if buf.oracle_keys is not None:
            o_lo, o_hi = buf.oracle_length, buf.oracle_length + t
            buf.oracle_keys[:, :, o_lo:o_hi] = key
            buf.oracle_values[:, :, o_lo:o_hi] = value
            buf.oracle_length = o_hi
        keys, values, offset = buf.key_slots(hi), buf.values[:, :, :hi], buf.offset[:, :, :hi]
        q = query.reshape(bsz, n_kv, group * t, d).to(keys.dtype)
        mask = None
        if t > 1:  # new tokens see the cache and each other causally; rows are (group, t) flattened
            cols = torch.arange(hi, device=q.device)
            rows = torch.arange(t, device=q.device).repeat(group)
            mask = torch.zeros(group * t, hi, device=q.device, dtype=q.dtype)
            mask.masked_fill_(cols[None, :] > (lo + rows)[:, None], float("-inf"))
        if window is not None:  # slots that left the window: position <= query position - window
            buf.positions[:, lo:hi] = torch.arange(self.position, self.position + t, device=q.device)
            q_pos = (self.position + torch.arange(t, device=q.device)).repeat(group)  # rows are (group, t)
            stale = buf.positions[:, None, None, :hi] <= (q_pos - window)[None, None, :, None]
            window_mask = torch.zeros(stale.shape, device=q.device, dtype=q.dtype).masked_fill_(stale, float("-inf"))
            mask = window_mask if mask is None else mask + window_mask
        certify = stats and t == 1
        if certify and defer:
            variance = certificate and self.certified
            out = self._attend_deferred(layer, q, keys, values, offset, scale, mask, variance, buf)
            return out.reshape(bsz, n_q, t, d).to(query.dtype), self.deferred_done(layer, q, scale, variance)
        res = hajek_attention(
            q,
            keys,
            values,
            offset,
            scale=scale,
            mask=mask,
            one_minus_pi=buf.one_minus_pi if certify and certificate and self.certified else None,
            variance_slots=buf.tail_slots,
            value_sq_norms=buf.value_sq_norms,
        )
        step = (
            self._step_stats(layer, q, res, buf, scale, bsz, n_q, certificate, trace_c2, trace_c2_refresh)
            if certify
            else None
        )
        return res.output.reshape(bsz, n_q, t, d).to(query.dtype), step

    def _attend_deferred(self, layer, q, keys, values, offset, scale, mask, variance: bool, buf) -> torch.Tensor:
        """`hajek_attention` for `attend(defer=True)`: the same output, written into the work buffers; the
        certificate's one pass over the values, sum_tail a v with a = (1 - pi) p^2, rides in the output's matmul as
        extra rows (the values are read once), and everything else is left to `flush_stats`."""
        bsz, n_kv, g, d = q.shape
        length, s = keys.shape[-2], buf.tail_slots
        rows, out = (work[layer] for work in self.work_buffers(n_kv, g, values.shape[-1]))
        logits = (q @ keys.transpose(-1, -2)) * scale + offset.unsqueeze(-2)
        if mask is not None:
            logits = logits + mask
        p = rows[..., :g, :length]
        torch.softmax(logits, -1, out=p)
        if variance:  # a = (1 - pi) p^2 in place (no temporary)
            a = rows[..., g : 2 * g, :s]
            torch.mul(p[..., :s], p[..., :s], out=a).mul_(buf.one_minus_pi.unsqueeze(-2))
            torch.matmul(rows[..., : 2 * g, :length], values, out=out)
        else:
            torch.matmul(p, values, out=out[..., :g, :])
        return out[..., :g, :]

    def work_buffers(self, n_kv: int, g: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The deferred path's work buffers, allocated at the first decode step: rows (layers, B, Hkv, 3g, slots)
        = [p; a; (1 - pi) a^2] and out (layers, B, Hkv, 2g, d) = [o_hat; sum a v]."""
        if self._rows is None:  # zeros: a stays 0 beyond the tail slots, which are never written
            buf = self.layers[0]
            self._rows = buf.values.new_zeros(len(self.layers), self.batch_size, n_kv, 3 * g, buf.capacity)
            self._out = buf.values.new_empty(len(self.layers), self.batch_size, n_kv, 2 * g, d)
        return self._rows, self._out

    def deferred_done(self, layer: int, q: torch.Tensor, scale: float, variance: bool) -> dict[str, torch.Tensor]:
        """After this bucket's work buffers for `layer` were filled (`_attend_deferred`, or `hf.fused` for every
        bucket at once): what flush_stats and the oracle need, and the step statistics due now (the per-layer
        oracle's error where the oracle prefix is not stacked; the stacked one runs after the forward)."""
        self._pending.append(layer)
        self._pending_variance = variance
        if self.has_oracle and self._oracle_stacked is None:
            return {"error": self._error(layer, q, self._out[layer][..., : q.shape[2], :], self.layers[layer], scale)}
        if self.has_oracle:
            self._queries.append(q)
            self._scale = scale
        return {}

    def _error(self, layer, q, out, buf, scale) -> torch.Tensor:
        """||o_hat - o|| per (row, query head): the estimate against the oracle's exact attention."""
        return (out - self._oracle(layer, q, buf, scale)).norm(dim=-1).reshape(out.shape[0], -1)

    def _stacked_buffers(self) -> dict[str, torch.Tensor]:
        """1 - pi, ||v||^2, the real-tail indicator and the packed tr(C^2) features of the tail slots of every layer,
        stacked once per compression."""
        if self._stacked is None:
            omp = torch.stack([b.one_minus_pi for b in self.layers])  # (layers, B, Hkv, s)
            value_sq_norms = torch.stack([b.value_sq_norms for b in self.layers])
            tail = torch.stack(self._tail)  # (layers, B, Hkv, s, 1)
            inverse_omp = torch.where(omp > 0, 1 / omp.clamp_min(torch.finfo(omp.dtype).tiny), torch.zeros_like(omp))
            self._stacked = {
                "omp": omp,
                # [tail indicator, ||v||^2, 1 / (1 - pi) on the tail]: the columns of flush_stats' one tail matmul
                "tail_columns": torch.cat([tail, value_sq_norms.unsqueeze(-1), inverse_omp.unsqueeze(-1)], -1),
            }
            if self.certified:  # packed (55 floats per tail token at k = 8, not 83): a third less to read per step
                s = self.layers[0].tail_slots
                self._stacked["features"] = torch.stack(
                    [tail_features(b.values[:, :, :s], self._sketch, packed=True) for b in self.layers]
                )
        return self._stacked

    def flush_stats(
        self, certificate: bool, trace_c2: bool, refresh: bool | None, error: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The statistics `_step_stats` computes per layer, for all layers at once from what `attend(defer=True)`
        kept: name -> (layers, B, Hq). Same formulas on stacked tensors, so equal to float rounding. error: this
        bucket's part of `oracle_errors` (computed for all buckets of one oracle prefix together)."""
        if self._pending != list(range(len(self.layers))):
            raise RuntimeError(f"deferred statistics of layers {self._pending}, expected every layer once")
        buf = self.layers[0]
        s, length = buf.tail_slots, buf.length
        g = self._out.shape[-2] // 2
        p = self._rows[..., :g, :length]  # (layers, B, Hkv, group, L)
        out = self._out[..., :g, :]  # (layers, B, Hkv, group, d)
        self._pending = []
        shape = (p.shape[0], p.shape[1], p.shape[2] * p.shape[3])  # (layers, B, Hq)
        stk = self._stacked_buffers()
        step = {"out_norm": out.norm(dim=-1).reshape(shape), "p_max": p.amax(-1).reshape(shape)}
        if error is None and self._queries:
            error = oracle_errors([self])[0]
        if error is not None:
            step["error"] = error.reshape(shape)
        if self._pending_variance:
            # every tail sum in one matmul over [p; a] (a = (1 - pi) p^2): p @ tail = tail mass, a @ ||v||^2,
            # a @ tail = sum a, a @ (1 / (1 - pi) on the tail) = sum of p^2 over the tail (Kish's denominator)
            sums = self._rows[..., : 2 * g, :s] @ stk["tail_columns"]  # (layers, B, Hkv, 2 group, 3)
            mass, a_sq_norms, a_sum, p_sq = sums[..., :g, 0], sums[..., g:, 1], sums[..., g:, 0], sums[..., g:, 2]
            a_v = self._out[..., g:, :]
            # V_hat = sum a ||v||^2 - 2 o . (sum a v) + ||o||^2 sum a, as in hajek_attention
            variance = (a_sq_norms - 2 * (out * a_v).sum(-1) + out.square().sum(-1) * a_sum).clamp_min(0)
            step["tail_mass"] = mass.reshape(shape)
            undefined = ~self.certificate_rows[None, :, None]
            step["variance"] = variance.reshape(shape).masked_fill(undefined, float("nan"))
            diag = tail_diagnostics(p, stk["omp"], tail_slots=s, prefix=buf.prefix, tail_sums=(mass, p_sq))
            diag["trace_c2"] = torch.zeros_like(variance) if trace_c2 else torch.full_like(variance, torch.nan)
            if s and trace_c2:
                diag["trace_c2"] = self._trace_c2_stacked(p, out, variance, refresh, g, s)
            for name in CERTIFICATE_STATS:
                step[name] = diag[name].reshape(shape).masked_fill(undefined, float("nan"))
            return step
        step["tail_mass"] = (p[..., :s] @ stk["tail_columns"][..., :1]).reshape(shape)
        if certificate:  # a bucket without certificate rows: undefined, never zero
            nan = torch.full(shape, float("nan"), device=p.device)
            step.update({name: nan for name in ("variance", *CERTIFICATE_STATS)})
        return step

    def _trace_c2_stacked(self, p, out, variance, refresh, g: int, s: int) -> torch.Tensor:
        """`_trace_c2` for all layers at once: one GEMM [a; (1 - pi) a^2] @ features over every layer's tail, with
        both row blocks already in the work buffer."""
        if refresh is False and self._psi_all is not None:
            return self._psi_all * variance.square()
        stk = self._stacked_buffers()
        a, b = self._rows[..., g : 2 * g, :s], self._rows[..., 2 * g :, :s]
        torch.mul(a, a, out=b).mul_(stk["omp"].unsqueeze(-2))  # (1 - pi) a^2 in place
        rows = self._rows[..., g:, :s]
        tc2 = trace_c2_from_features(p, stk["omp"], stk["features"], out, self._sketch, variance, tail_rows=rows)
        if refresh:
            v2 = variance.square()
            self._psi_all = torch.where(v2 > 0, tc2 / v2.clamp_min(torch.finfo(v2.dtype).tiny), torch.ones_like(v2))
        return tc2

    def _step_stats(
        self, layer, q, res, buf, scale, bsz, n_q, certificate, trace_c2, refresh=None
    ) -> dict[str, torch.Tensor]:
        p = res.weights  # (B, Hkv, group, L)
        out = res.output
        step = {"out_norm": out.norm(dim=-1).reshape(bsz, n_q), "p_max": p.amax(-1).reshape(bsz, n_q)}
        s = buf.tail_slots
        step["tail_mass"] = (p[..., :s] @ self._tail[layer]).reshape(bsz, n_q)  # sum of p over real tail slots
        if res.variance is not None:
            undefined = (
                ~self.certificate_rows[:, None] if buf.compressed else torch.ones_like(self.certificate_rows[:, None])
            )
            step["variance"] = res.variance.reshape(bsz, n_q).masked_fill(undefined, float("nan"))
            diag = tail_diagnostics(p, buf.one_minus_pi, tail_slots=s, prefix=buf.prefix)
            diag["trace_c2"] = torch.zeros_like(res.variance) if trace_c2 else torch.full_like(res.variance, torch.nan)
            if s and trace_c2:
                diag["trace_c2"] = self._trace_c2(layer, p, buf, out, res.variance, refresh)
            for name in CERTIFICATE_STATS:
                step[name] = diag[name].reshape(bsz, n_q).masked_fill(undefined, float("nan"))
        elif certificate:  # a bucket without certificate rows: undefined, never zero
            nan = torch.full((bsz, n_q), float("nan"), device=q.device)
            step.update({name: nan for name in ("variance", *CERTIFICATE_STATS)})
        if self.has_oracle:
            exact = self._oracle(layer, q, buf, scale)
            step["error"] = (out - exact).norm(dim=-1).reshape(bsz, n_q)
        return step

    def _trace_c2(self, layer, p, buf, out, variance, refresh) -> torch.Tensor:
        """The sketched tr(C^2) of this step, or (refresh False, after a refresh) the last refresh's tr(C^2) / V_hat^2
        times this step's V_hat^2: the effective dimension h = V_hat^2 / tr(C^2) is carried, V_hat is not."""
        if refresh is False and self._psi[layer] is not None:
            return self._psi[layer] * variance.square()
        if self._features[layer] is None:  # built for stats_after_forward, decoded without it
            self._features[layer] = tail_features(buf.values[:, :, : buf.tail_slots], self._sketch)
        tc2 = trace_c2_from_features(p, buf.one_minus_pi, self._features[layer], out, self._sketch, variance)
        if refresh:  # V_hat = 0 carries h = 1 (psi = 1): the radius is 0 until V_hat grows, then Gaussian-like
            v2 = variance.square()
            self._psi[layer] = torch.where(v2 > 0, tc2 / v2.clamp_min(torch.finfo(v2.dtype).tiny), torch.ones_like(v2))
        return tc2

    def _oracle(self, layer, q, buf, scale) -> torch.Tensor:
        """Exact attention of the query over [shared prefix, own part]: one (Hkv, B*group, d) @ (Hkv, d, n) matmul
        for the prefix, and the softmax over the two parts done without concatenating them."""
        bsz, n_kv, g, d = q.shape
        kt, fv = self._oracle_kt[layer], self._oracle_v[layer]
        app_k = buf.oracle_keys[:, :, : buf.oracle_length]
        app_v = buf.oracle_values[:, :, : buf.oracle_length]
        if buf.window is not None:  # positions are [0, prefix) then the own part: keep the last `window` of them
            first = max(0, self.position - buf.window + 1)
            kt, fv = kt[..., min(first, self.oracle_prefix) :], fv[:, min(first, self.oracle_prefix) :]
            own_first = max(0, first - self.oracle_prefix)
            app_k, app_v = app_k[:, :, own_first:], app_v[:, :, own_first:]
        qh = q.transpose(0, 1).reshape(n_kv, bsz * g, d)
        lf = torch.matmul(qh, kt).mul_(scale).view(n_kv, bsz, g, -1)  # (Hkv, B, g, n)
        la = (q @ app_k.transpose(-1, -2)).mul_(scale).transpose(0, 1)  # (Hkv, B, g, a)
        m = la.amax(-1, keepdim=True)  # the own part holds at least the query's token
        if lf.shape[-1]:
            m = torch.maximum(lf.amax(-1, keepdim=True), m)
        ef, ea = lf.sub_(m).exp_(), (la - m).exp_()
        z = ef.sum(-1, keepdim=True) + ea.sum(-1, keepdim=True)
        num = torch.matmul(ef.view(n_kv, bsz * g, -1), fv).view(n_kv, bsz, g, d) + ea @ app_v.transpose(0, 1)
        return (num / z).transpose(0, 1)  # (B, Hkv, g, d)


def oracle_errors(buckets: list[Bucket]) -> list[torch.Tensor]:
    """The deferred oracle error ||o_hat - o|| (layers, B, Hkv, group) of buckets that share one oracle prefix (one
    compression time): `Bucket._oracle` for every layer and every row at once -- the shared prefix's K^T and V are
    read once per step, not once per bucket -- with the same two-part softmax (prefix, then the own tokens)."""
    kt, fv = buckets[0]._oracle_stacked[:2]
    own = buckets[0].layers[0].oracle_length
    if any(b.layers[0].oracle_length != own for b in buckets):
        raise RuntimeError("buckets of one oracle prefix hold own parts of different lengths")
    q = torch.cat([torch.stack(b._queries) for b in buckets], dim=1)  # (layers, B, Hkv, g, d)
    g = q.shape[3]
    out = torch.cat([b._out[..., :g, :] for b in buckets], dim=1)
    app_k = torch.cat([b._oracle_stacked[2][..., :own, :] for b in buckets], dim=1)  # (layers, B, Hkv, a, d)
    app_v = torch.cat([b._oracle_stacked[3][..., :own, :] for b in buckets], dim=1)
    scale = buckets[0]._scale
    for b in buckets:
        b._queries = []
    n_layers, bsz, n_kv, g, d = q.shape
    qh = q.transpose(1, 2).reshape(n_layers, n_kv, bsz * g, d)
    lf = torch.matmul(qh, kt).mul_(scale).view(n_layers, n_kv, bsz, g, -1)  # (layers, Hkv, B, g, n)
    la = (q @ app_k.transpose(-1, -2)).mul_(scale).transpose(1, 2)  # (layers, Hkv, B, g, a)
    m = la.amax(-1, keepdim=True)  # the own part holds at least the query's token
    if lf.shape[-1]:
        m = torch.maximum(lf.amax(-1, keepdim=True), m)
    ef, ea = lf.sub_(m).exp_(), (la - m).exp_()
    z = ef.sum(-1, keepdim=True) + ea.sum(-1, keepdim=True)
    num = torch.matmul(ef.view(n_layers, n_kv, bsz * g, -1), fv).view(n_layers, n_kv, bsz, g, d)
    num = num + ea @ app_v.transpose(1, 2)
    error = (out - (num / z).transpose(1, 2)).norm(dim=-1)
    return list(error.split([b.batch_size for b in buckets], dim=1))


class CompressedState:
    """The compressed caches of a batch of variants: buckets of rows (one per compression time and width range),
    decoded in one forward; attention, certificate and oracle run per bucket, so no row pays for another's width."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        self.compute_certificate = True
        self.compute_trace_c2 = True  # the tight radius' tr(C^2) (DecodeOptions.tight_radius)
        self.trace_c2_refresh: bool | None = None  # None: tr(C^2) every step; True / False: refresh / carry
        self.stats: StepStats | None = None  # set by the decoder around a step it wants statistics of
        self.position = 0  # absolute position of the next token (set by forward_with_state)
        self._defer = False  # DecodeOptions.stats_after_forward, where every bucket's layers allow it
        self._fused = False  # DecodeOptions.fused_attention, where the deferred path and the key layout allow it

    @property
    def stats_after_forward(self) -> bool:
        return self._defer

    @stats_after_forward.setter
    def stats_after_forward(self, on: bool) -> None:
        """Per-step statistics for all layers at once after the forward (`finish_step`), not inside each layer;
        silently per layer on a model whose layers differ in slot layout (sliding-window layers)."""
        self._defer = bool(on) and all(b.uniform_layers for b in self.buckets)

    @property
    def fused_attention(self) -> bool:
        return self._fused

    @fused_attention.setter
    def fused_attention(self, on: bool) -> None:
        """Single-token steps with statistics through one compiled kernel per layer (`kvcert.hf.fused`); silently
        the per-bucket path where the deferred statistics are off or the keys are not stored (d, slots)."""
        layers = [buf for b in self.buckets for buf in b.layers]
        self._fused = (
            bool(on)
            and self._defer
            and all(
                buf.keys_transposed and buf.keys.dtype == torch.float32 and buf.keys.device.type == "cpu"
                for buf in layers
            )
        )

    @property
    def batch_size(self) -> int:
        return sum(b.batch_size for b in self.buckets)

    @property
    def layers(self) -> list[LayerBuffers]:
        """The first bucket's buffers (every bucket has the same layer structure)."""
        return self.buckets[0].layers

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (sorted indices into the batch) and drop the others."""
        kept, start = [], 0
        for bucket in self.buckets:
            n = bucket.batch_size
            local = rows[(rows >= start) & (rows < start + n)] - start
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
        want = self.stats is not None
        if self._fused and want and query.shape[-2] == 1 and window is None:
            return self._attend_fused(layer, query, key, value, scale)
        outs, steps, start = [], [], 0
        for bucket in self.buckets:
            n = bucket.batch_size
            bucket.position = self.position
            rows = slice(start, start + n) if len(self.buckets) > 1 else slice(None)
            out, step = bucket.attend(
                layer,
                query[rows],
                key[rows],
                value[rows],
                scale,
                window,
                stats=want,
                certificate=self.compute_certificate,
                trace_c2=self.compute_trace_c2,
                trace_c2_refresh=self.trace_c2_refresh,
                defer=self._defer,
            )
            outs.append(out)
            steps.append(step)
            start += n
        if want and steps[0] is not None:
            for name in steps[0]:
                getattr(self.stats, name).append(
                    steps[0][name] if len(steps) == 1 else torch.cat([st[name] for st in steps])
                )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_fused(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
        """`attend` at a single-token step with deferred statistics, every bucket in one kernel call."""
        from kvcert.hf import fused  # builds the C++ kernel on first use

        bsz, n_q, _, d = query.shape
        n_kv = key.shape[1]
        q = query.reshape(bsz, n_kv, n_q // n_kv, d).float().contiguous()
        variance = [self.compute_certificate and b.certified for b in self.buckets]
        out = fused.decode_attention(
            q,
            key.reshape(bsz, n_kv, d).float().contiguous(),
            value.reshape(bsz, n_kv, d).float().contiguous(),
            self.buckets,
            layer,
            scale,
            variance,
        )
        steps, start = [], 0
        for bucket, var in zip(self.buckets, variance):
            steps.append(bucket.deferred_done(layer, q[start : start + bucket.batch_size], scale, var))
            start += bucket.batch_size
        for name in steps[0]:
            getattr(self.stats, name).append(torch.cat([st[name] for st in steps]))
        return out.reshape(bsz, n_q, 1, d).to(query.dtype)

    def finish_step(self) -> None:
        """After a forward with deferred statistics: every bucket's statistics of all layers, appended per layer to
        `stats` (rows of the buckets side by side, as `attend` does)."""
        if self.stats is None or not self._defer or not any(b._pending for b in self.buckets):
            return
        errors: dict[int, torch.Tensor] = {}
        groups: dict[int, list[Bucket]] = {}  # buckets by oracle prefix (compression time)
        for b in self.buckets:
            if b._queries:
                groups.setdefault(id(b._oracle_stacked[0]), []).append(b)
        for group in groups.values():
            errors.update({id(b): e for b, e in zip(group, oracle_errors(group))})
        steps = [
            b.flush_stats(self.compute_certificate, self.compute_trace_c2, self.trace_c2_refresh, errors.get(id(b)))
            for b in self.buckets
        ]
        for name in steps[0]:
            stacked = steps[0][name] if len(steps) == 1 else torch.cat([st[name] for st in steps], dim=1)
            getattr(self.stats, name).extend(stacked.unbind(0))
