"""The compressed caches of a batch of variants, the state the attention function hands every layer to while the
variants decode (`kvcert_state=`, kvcert.hf.attention).

- `CompressedState` (batch = variants): per (variant, KV head) the kept prompt tokens, tail first, then head, then
  padding (offset -inf), then every token appended after compression (pi = 1, offset 0), in the model's dtype;
  attention, certificate and oracle compute in float32. Offset (Hajek) attention
  and, at single-token decode steps, the certificate variance and, when an oracle is attached, the exact output of
  the same query over the full prompt plus the variant's own appended tokens.
- `Bucket`: the rows whose caches share one set of buffers (similar widths); its layers' buffers and layer groups
  are in kvcert.hf.layer_buffers.
"""

from __future__ import annotations

import torch

from kvcert.core.hajek import offset_softmax
from kvcert.hf.layer_buffers import LayerBuffers, LayerGroup, layer_groups, oracle_errors


class Bucket:
    """Rows whose compressed caches share one set of buffers (similar widths), with the certificate and the oracle
    computed beside attention; its layers fall into `LayerGroup`s of one slot layout each."""

    def __init__(
        self,
        layers: list[LayerBuffers],
        *,
        certificate_rows: list[bool],
        oracle: list[tuple] | None = None,
        recompress: list | None = None,
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
        self.recompress = recompress  # per row (kvcert.hf.recompress.RowRecompress), or None: never re-compressed
        self.recent: dict[int, torch.Tensor] = {}  # layer -> its last queries (B, Hq, w, d), for a re-compression
        self.regroup(oracle)
        self.scale = 1.0

    def regroup(self, oracle: list[tuple] | None = None) -> None:
        """The layer groups of the buffers' current slot layout (again after a re-compression, which keeps each
        group's oracle parts: the full prefix and the rows' own tokens do not change)."""
        layers = self.layers
        if oracle is None and self.has_oracle:
            oracle = [grp.oracle for grp in self.groups]
        self.groups = [
            LayerGroup(idx, [layers[i] for i in idx], oracle[k] if oracle else None, self.certified)
            for k, idx in enumerate(layer_groups(layers))
        ]
        self.where = {layer: (grp, local) for grp in self.groups for local, layer in enumerate(grp.layers)}
        # the groups' layers back in model order, for the statistics of a model with several slot layouts
        layer_of_row = [layer for grp in self.groups for layer in grp.layers]
        self.layer_order = torch.tensor(layer_of_row, device=layers[0].keys.device).argsort()

    def due(self, step: int) -> bool:
        """Whether this bucket's rows re-compress before decode step `step` (every N steps, never before the first)."""
        return bool(self.recompress) and step > 0 and step % self.recompress[0].policy.recompress_every == 0

    def remember(self, layer: int, query: torch.Tensor, scale: float) -> None:
        """Keep the layer's last queries (B, Hq, t, d) for a window scorer's re-compression."""
        if not self.recompress:
            return
        w = self.recompress[0].window
        old = self.recent.get(layer)
        q = query.detach().float()
        self.recent[layer] = (q if old is None else torch.cat([old, q], dim=2))[:, :, -w:]
        self.scale = scale

    def recent_queries(self, row: int) -> torch.Tensor | None:
        """Row `row`'s recent queries of every layer (L, Hq, w, d), None before any were seen."""
        if len(self.recent) != len(self.layers):
            return None
        return torch.stack([self.recent[i][row] for i in range(len(self.layers))])

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
        if self.recompress:
            self.recompress = [self.recompress[i] for i in rows]
            self.recent = {layer: q.index_select(0, index) for layer, q in self.recent.items()}
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
        self.peak_bytes = 0  # the most the keys and values held across re-compressions (0: none happened)

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
        start = 0
        for bucket in self.buckets:  # recent queries, for the buckets that re-compress during decoding
            bucket.remember(layer, query[start : start + bucket.batch_size], scale)
            start += bucket.batch_size
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

    def held_bytes(self) -> int:
        """Bytes of the keys and values the buffers hold now (padding and reserved slots included)."""
        return sum(
            buf.keys.numel() * buf.keys.element_size() + buf.values.numel() * buf.values.element_size()
            for bucket in self.buckets
            for buf in bucket.layers
        )

    def recompress(self, step: int) -> None:
        """Before decode step `step`: re-compress the buckets whose policy's recompress_every divides it."""
        due = [b for b in self.buckets if b.due(step)]
        if not due:
            return
        from kvcert.hf.recompress import recompress_bucket

        self.peak_bytes = max(self.peak_bytes, self.held_bytes())
        for bucket in due:
            recompress_bucket(bucket)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

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
