"""What kvcert does inside attention: the attention function registered with transformers, the hooks that run a
model through it, what kvcert reads of the model's attention layers, and the two exact-attention states of the
prompt read.

kvcert runs the model with `use_cache=False` and passes a state through the forward kwargs (`kvcert_state=`); the
state owns the keys/values, so the layout stays under our control. Positions are whatever `position_ids` the caller
passes: the runner passes the uncompressed positions, so a compressed cache never shifts RoPE.

- `RecordState` (batch 1): exact causal attention over the prompt; keeps the full keys/values (the oracle) and the
  queries of the observation windows the scorers read (verification mode).
- `CompressingState` (batch 1): exact causal attention over the prompt, and each layer handed to a callback that
  keeps what it needs (serving mode: the layer's compressed caches) before the next layer runs; no full keys/values
  are kept, so the full cache of all layers never coexists.

The variants' compressed caches are the third state, `CompressedState` (kvcert.hf.compressed_state).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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


# ---------------------------------------------------------------------------------- the model's attention layers
def attention_scale(model) -> float:
    """The softmax scale every attention layer of the model uses (Gemma's query_pre_attn_scalar included). The
    engine applies one scale to every layer, so a model whose layers declare different scales is refused."""
    from kvcert.hf.model_support import ModelLoadError

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    scales = [float(getattr(layer.self_attn, "scaling", head_dim**-0.5)) for layer in model.model.layers]
    if len(set(scales)) > 1:
        raise ModelLoadError(
            f"{type(model).__name__}'s attention layers use different softmax scales ({sorted(set(scales))}); "
            "kvcert applies one scale to every layer and does not support this model yet"
        )
    return scales[0]


def layer_windows(model) -> list[int | None]:
    """Each decoder layer's sliding window as its attention module declares it (None: full attention)."""
    return [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]


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


LONG_PROMPT = 8192  # a sliding-window layer of a longer prompt attends READ_CHUNK queries at a time
READ_CHUNK = 2048


def causal_attention(query, key, value, scale: float, window: int | None) -> torch.Tensor:
    """Exact causal attention of a whole chunk read from position 0 (a sliding-window layer sees the last `window`
    tokens including itself). Past LONG_PROMPT tokens a sliding-window layer attends READ_CHUNK queries at a time over
    the keys their window reaches, so its mask is chunk x (chunk + window), not tokens x tokens (1 GiB at 32k)."""
    t = query.shape[-2]
    if window is not None and t > LONG_PROMPT:
        return torch.cat([_window_chunk(query, key, value, scale, window, a, min(t, a + READ_CHUNK))
                          for a in range(0, t, READ_CHUNK)], dim=-2)  # fmt: skip
    mask = None
    if window is not None:
        mask = torch.ones(t, t, dtype=torch.bool, device=key.device).tril()
        mask &= ~torch.ones_like(mask).tril(diagonal=-window)
    return sdpa(query, key, value, mask=mask, scale=scale)


def _window_chunk(query, key, value, scale: float, window: int, a: int, b: int) -> torch.Tensor:
    """Queries [a, b) of a sliding-window layer over keys [a - window + 1, b): j <= i and j > i - window."""
    lo = max(0, a - window + 1)
    i = torch.arange(a, b, device=key.device)[:, None]
    j = torch.arange(lo, b, device=key.device)[None, :]
    mask = (j <= i) & (j > i - window)
    return sdpa(query[..., a:b, :], key[..., lo:b, :], value[..., lo:b, :], mask=mask, scale=scale)


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
