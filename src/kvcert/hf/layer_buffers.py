"""One layer's compressed cache (`LayerBuffers`) and the layers of a bucket that share one slot layout
(`LayerGroup`): attention writes each layer's weights and outputs into the group's stacked work buffers, and after
the forward the group computes every statistic of all its layers at once (the certificate variance, the tail
diagnostics, tr(C^2) through the fixed value sketch, and the oracle's error, `oracle_errors`). The buckets and the
batch state that hold them are in kvcert.hf.compressed_state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core.certificate import tail_diagnostics
from kvcert.core.hajek import variance_from_sums
from kvcert.core.sketch import make_sketch, tail_features, trace_c2_from_features
from kvcert.hf.huge_pages import empty_on_huge_pages

CERTIFICATE_STATS = ("trace_c2", "ess_tail", "n_tail", "tail_max", "head_mass")
SKETCH_K = 8  # columns of the fixed Gaussian sketch behind tr(C^2) (core/sketch.py: cost and accuracy)
SKETCH_SEED = 0  # drawn once per head_dim from this seed, so records are reproducible
_SKETCHES: dict[tuple[int, str], torch.Tensor] = {}


def value_sketch(d: int, device) -> torch.Tensor:
    key = (d, str(device))
    if key not in _SKETCHES:
        _SKETCHES[key] = make_sketch(d, SKETCH_K, generator=torch.Generator().manual_seed(SKETCH_SEED), device=device)
    return _SKETCHES[key]


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
            k = sketch.shape[-1]
            shape = (len(buffers), *first.values.shape[:2], s, k * (k + 1) // 2 + 2 * k + 3)
            self.features = empty_on_huge_pages(*shape, like=first.values, dtype=torch.float32)  # written per layer
            for local, b in enumerate(buffers):
                tail_features(b.values[:, :, :s].float(), sketch, packed=True, out=self.features[local])
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


def layer_groups(layers: list[LayerBuffers]) -> list[list[int]]:
    """Layer indices grouped by slot layout, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, buf in enumerate(layers):
        groups.setdefault(buf.layout, []).append(i)
    return list(groups.values())
