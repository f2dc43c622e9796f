"""The prefill probe: the exact error of a compressed cache for the observation window's queries, measured while the
layer still holds its full keys and values, with the randomized certificate of the same queries beside it.

At compression time a layer has every key and value of the prompt and the queries of its last tokens (the question,
or the end of the context: the window the scorer reads). For each such query q_t at position t the probe computes

    o_t     = softmax(q_t K_{<=t}^T * scale) V_{<=t}                       (the full cache, exact)
    o_hat_t = softmax(q_t K_kept^T * scale - log pi) V_kept  (kept positions <= t: the Hajek estimate)

and returns ||o_hat_t - o_t||, ||o_t||, ||o_hat_t||, and the certificate's V_hat and tr(C^2) of o_hat_t (zero for
a deterministic design, whose tail is empty). It is deterministic given the kept set, available before any token is
decoded, and costs about 2 w n d per head (w window queries, n prompt tokens): small beside the layer's own
attention (n^2 d). Caveat: the window's queries are the ones a window scorer chose the kept set with, so the probe
measures the cache on the queries it was fitted to; decode-time queries may fare worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.core.hajek import gather_tokens, hajek_attention
from kvcert.core.sketch import sketched_trace_c2


@dataclass(frozen=True)
class ProbeResult:
    """Per (query head, window query), float32 or float64 as computed."""

    error: torch.Tensor  # ||o_hat - o||
    exact_norm: torch.Tensor  # ||o||
    out_norm: torch.Tensor  # ||o_hat||
    variance: torch.Tensor  # V_hat = tr(C_hat) (0 where the design has no random tail)
    trace_c2: torch.Tensor  # tr(C_hat^2) estimate (sketched; 0 with V_hat)

    @property
    def relative_error(self) -> torch.Tensor:
        return self.error / self.exact_norm.clamp_min(torch.finfo(self.exact_norm.dtype).tiny)


def _causal_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, dtype) -> torch.Tensor:
    """Additive mask (..., T, m): 0 where key position <= query position (and inside a sliding window), -inf else."""
    q, k = query_pos.unsqueeze(-1), key_pos.unsqueeze(-2)
    visible = k <= q
    if window is not None:
        visible = visible & (k > q - window)
    zero = torch.zeros((), dtype=dtype, device=query_pos.device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=query_pos.device))


def window_probe(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    offset: torch.Tensor,
    one_minus_pi: torch.Tensor,
    tail_slots: int,
    *,
    scale: float,
    positions: torch.Tensor,
    window: int | None = None,
    sketch: torch.Tensor | None = None,
) -> ProbeResult:
    """The probe of one layer (see the module docstring).

    queries (Hq, w, d) at absolute `positions` (w,); keys, values (Hkv, n, d): the layer's full prompt; kept (Hkv, m)
    kept positions with offset (Hkv, m) (-log pi, 0 on tokens kept for sure) and one_minus_pi (Hkv, >= tail_slots)
    for the random tail in the first tail_slots entries; window: a sliding-window layer's size; sketch (d, k): the
    value sketch behind tr(C^2) (None: tr(C^2) = V_hat^2, the rank-one bound). Query head h reads KV head
    h // (Hq / Hkv), as in grouped-query attention. Computed in the inputs' dtype."""
    n_q, w, d = queries.shape
    n_kv, n = keys.shape[0], keys.shape[1]
    g = n_q // n_kv
    q = queries.reshape(n_kv, g * w, d)  # query head h = kv * g + j: rows grouped by KV head
    q_pos = positions.to(keys.device).repeat(g)  # (g w,)
    all_pos = torch.arange(n, device=keys.device)
    exact = (
        torch.softmax((q @ keys.transpose(-1, -2)) * scale + _causal_mask(q_pos, all_pos, window, q.dtype), -1) @ values
    )
    mask = _causal_mask(q_pos, kept, window, q.dtype)  # (Hkv, g w, m)
    k_kept, v_kept = gather_tokens(keys, kept), gather_tokens(values, kept)
    omp = one_minus_pi.to(q.dtype) if tail_slots > 0 else None
    res = hajek_attention(
        q, k_kept, v_kept, offset.to(q.dtype), scale=scale, one_minus_pi=omp, mask=mask, variance_slots=tail_slots
    )
    variance = res.variance if res.variance is not None else torch.zeros(res.output.shape[:-1], dtype=q.dtype)
    if tail_slots > 0 and sketch is not None:
        vr = v_kept[..., :tail_slots, :] @ sketch.to(q.dtype)
        trace_c2 = sketched_trace_c2(res.weights, omp, vr, res.output, sketch.to(q.dtype), variance)
    else:
        trace_c2 = variance.square()

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n_q, w)

    return ProbeResult(
        error=heads((res.output - exact).norm(dim=-1)),
        exact_norm=heads(exact.norm(dim=-1)),
        out_norm=heads(res.output.norm(dim=-1)),
        variance=heads(variance),
        trace_c2=heads(trace_c2),
    )
