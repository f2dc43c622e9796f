"""The per-layer KV buffers kvcert keeps itself, and what the attention function does with them.

kvcert runs the model with `use_cache=False` and passes a `KVState` through the forward kwargs; its attention
function (`kvcert.hf.attention`) hands every layer's new keys/values to the state. Owning the buffers (instead of a
transformers Cache) keeps the layout under our control: per (variant, KV head) the kept prompt tokens (tail first,
then head, then padding with offset -inf), then every token appended after compression (pi = 1, offset 0).

Modes:
- `record`: batch 1, exact causal attention; keeps the full keys/values (the oracle) and captures window queries.
- `compressed`: batch = variants; offset (Hajek) attention over the buffers; at single-token steps also the
  certificate variance and, when an oracle prefix is attached, the exact full-cache output of the same query.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvcert.core.hajek import hajek_attention


@dataclass
class LayerBuffers:
    keys: torch.Tensor  # (B, Hkv, capacity, d)
    values: torch.Tensor  # (B, Hkv, capacity, d)
    offset: torch.Tensor  # (B, Hkv, capacity): -log pi on kept tokens, 0 after compression, -inf on padding
    one_minus_pi: torch.Tensor  # (B, Hkv, tail_slots)
    value_sq_norms: torch.Tensor  # (B, Hkv, tail_slots)
    tail_slots: int
    length: int  # filled entries
    prefix: int  # entries [0, prefix) are the compressed prompt; later entries were appended (pi = 1)


@dataclass
class StepStats:
    """One decode step, per layer: tensors (B, Hq)."""

    variance: list[torch.Tensor] = field(default_factory=list)
    error: list[torch.Tensor] = field(default_factory=list)
    out_norm: list[torch.Tensor] = field(default_factory=list)
    tail_mass: list[torch.Tensor] = field(default_factory=list)
    p_max: list[torch.Tensor] = field(default_factory=list)


class KVState:
    """Keys/values of every layer for one batch of sequences, plus what the certificate and oracle need."""

    def __init__(self, n_layers: int, mode: str = "record", capture: dict[str, slice] | None = None):
        if mode not in ("record", "compressed"):
            raise ValueError(f"mode must be 'record' or 'compressed', got {mode!r}")
        self.mode = mode
        self.n_layers = n_layers
        # record mode
        self.full_keys: list[torch.Tensor | None] = [None] * n_layers
        self.full_values: list[torch.Tensor | None] = [None] * n_layers
        self.capture = capture or {}  # name -> slice of absolute positions whose queries to keep
        self.captured: dict[str, list[torch.Tensor | None]] = {k: [None] * n_layers for k in self.capture}
        self.position = 0  # absolute position of the next token in record mode
        # compressed mode
        self.layers: list[LayerBuffers | None] = [None] * n_layers
        self.oracle_keys: list[torch.Tensor] | None = None  # per layer (1, Hkv, n_prefix, d)
        self.oracle_values: list[torch.Tensor] | None = None
        self.certificate_rows: torch.Tensor | None = None  # (B,) bool: False -> variance NaN (topk)
        self.compute_certificate = True
        self.stats: StepStats | None = None
        # per-layer caches built on the first compressed step (the hot path must not rebuild them every step)
        self._prepared: list[LayerBuffers | None] = [None] * n_layers  # the buffers the caches below belong to
        self._tail: list[torch.Tensor | None] = [None] * n_layers  # (B, Hkv, tail_slots, 1) 1.0 on real tail slots
        self._oracle_kt: list[torch.Tensor | None] = [None] * n_layers  # (Hkv, d, n) shared prefix keys, transposed
        self._oracle_v: list[torch.Tensor | None] = [None] * n_layers  # (Hkv, n, d) shared prefix values

    # ----------------------------------------------------------------------------------------------- record mode
    def record(self, layer: int, query, key, value, scale: float) -> torch.Tensor:
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
        # exact causal attention: the new tokens see every earlier token and each other causally
        mask = None
        if start > 0:
            mask = torch.ones(t, k.shape[-2], dtype=torch.bool, device=k.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )

    # ------------------------------------------------------------------------------------------- compressed mode
    def _prepare(self, layer: int) -> LayerBuffers:
        """Once per layer: float32 buffers (a bf16/fp16 model still gets an fp32 offset attention, certificate and
        oracle), the tail indicator of the tail-mass statistic, and the shared oracle prefix in a matmul layout."""
        buf = self.layers[layer]
        if self._prepared[layer] is buf:
            return buf
        if buf.keys.dtype != torch.float32:
            buf.keys, buf.values = buf.keys.float(), buf.values.float()
            buf.offset, buf.one_minus_pi = buf.offset.float(), buf.one_minus_pi.float()
            # exact in fp32 from the (upcast) stored values rather than the low-precision cached norms
            buf.value_sq_norms = buf.values[:, :, : buf.tail_slots].square().sum(-1)
        self._tail[layer] = (buf.one_minus_pi > 0).float().unsqueeze(-1)
        if self.oracle_keys is not None:
            fk = self.oracle_keys[layer][0].float()  # (Hkv, n, d); a batch-1 prefix shared by every variant
            self._oracle_kt[layer] = fk.transpose(-1, -2).contiguous()
            self._oracle_v[layer] = self.oracle_values[layer][0].float().contiguous()
        self._prepared[layer] = buf
        return buf

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
        buf = self._prepare(layer)
        bsz, n_q, t, d = query.shape
        n_kv = key.shape[1]
        group = n_q // n_kv
        lo, hi = buf.length, buf.length + t
        if hi > buf.keys.shape[-2]:
            raise RuntimeError(f"KV buffer of layer {layer} is full ({buf.keys.shape[-2]} slots)")
        buf.keys[:, :, lo:hi] = key
        buf.values[:, :, lo:hi] = value
        buf.offset[:, :, lo:hi] = 0.0
        buf.length = hi
        keys, values, offset = buf.keys[:, :, :hi], buf.values[:, :, :hi], buf.offset[:, :, :hi]
        q = query.reshape(bsz, n_kv, group * t, d).to(keys.dtype)
        mask = None
        if t > 1:  # new tokens see the cache and each other causally; rows are (group, t) flattened
            cols = torch.arange(hi, device=q.device)
            rows = torch.arange(t, device=q.device).repeat(group)
            mask = torch.zeros(group * t, hi, device=q.device, dtype=q.dtype)
            mask.masked_fill_(cols[None, :] > (lo + rows)[:, None], float("-inf"))
        certify = self.stats is not None and t == 1
        res = hajek_attention(
            q, keys, values, offset, scale=scale, mask=mask,
            one_minus_pi=buf.one_minus_pi if certify and self.compute_certificate else None,
            variance_slots=buf.tail_slots, value_sq_norms=buf.value_sq_norms,
        )
        if certify:
            self._record_step(layer, q, res, buf, scale, bsz, n_q)
        return res.output.reshape(bsz, n_q, t, d).to(query.dtype)

    def _record_step(self, layer, q, res, buf, scale, bsz, n_q):
        stats = self.stats
        p = res.weights  # (B, Hkv, group, L)
        out = res.output
        stats.out_norm.append(out.norm(dim=-1).reshape(bsz, n_q))
        stats.p_max.append(p.amax(-1).reshape(bsz, n_q))
        s = buf.tail_slots
        stats.tail_mass.append((p[..., :s] @ self._tail[layer]).reshape(bsz, n_q))  # sum of p over real tail slots
        if res.variance is not None:
            var = res.variance.reshape(bsz, n_q)
            if self.certificate_rows is not None:
                var = var.masked_fill(~self.certificate_rows[:, None], float("nan"))
            stats.variance.append(var)
        if self.oracle_keys is not None:
            exact = self._oracle(layer, q, buf, scale)
            stats.error.append((out - exact).norm(dim=-1).reshape(bsz, n_q))

    def _oracle(self, layer, q, buf, scale) -> torch.Tensor:
        """Exact attention of the same query over the full prompt (shared) + this variant's appended tokens.

        The shared prefix is one (Hkv, B*group, d) @ (Hkv, d, n) matmul (a broadcast matmul would copy the prefix
        once per variant), and the softmax over [prefix, appended] is done in two parts without concatenating."""
        bsz, n_kv, g, d = q.shape
        kt, fv = self._oracle_kt[layer], self._oracle_v[layer]
        app_k = buf.keys[:, :, buf.prefix : buf.length]
        app_v = buf.values[:, :, buf.prefix : buf.length]
        qh = q.transpose(0, 1).reshape(n_kv, bsz * g, d)
        lf = torch.matmul(qh, kt).mul_(scale).view(n_kv, bsz, g, -1)  # (Hkv, B, g, n)
        la = (q @ app_k.transpose(-1, -2)).mul_(scale).transpose(0, 1)  # (Hkv, B, g, a)
        m = torch.maximum(lf.amax(-1, keepdim=True), la.amax(-1, keepdim=True))
        ef, ea = lf.sub_(m).exp_(), (la - m).exp_()
        z = ef.sum(-1, keepdim=True) + ea.sum(-1, keepdim=True)
        num = torch.matmul(ef.view(n_kv, bsz * g, -1), fv).view(n_kv, bsz, g, d) + ea @ app_v.transpose(0, 1)
        return (num / z).transpose(0, 1)  # (B, Hkv, g, d)
