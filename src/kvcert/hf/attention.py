"""kvcert's attention function, registered with transformers' AttentionInterface under the name "kvcert".

It is a pass-through to SDPA unless the forward call carries `kvcert_state=KVState(...)`; then the state owns the
keys/values (the model runs with use_cache=False) and computes exact attention (record mode) or offset attention
with certificate and oracle (compressed mode). Positions are whatever `position_ids` the caller passes: the
runner passes the uncompressed positions, so a compressed cache never shifts RoPE.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "kvcert"


def kvcert_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    state = kwargs.pop("kvcert_state", None)
    if state is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if state.mode == "record":
        out = state.record(module.layer_idx, query, key, value, scale)
    else:
        out = state.attend(module.layer_idx, query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, kvcert_attention)


def use_kvcert_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch a loaded model to the kvcert attention function (idempotent)."""
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):  # older 5.x: set the config field directly
        model.config._attn_implementation = NAME
    return model


@torch.no_grad()
def forward_with_state(model: PreTrainedModel, input_ids: torch.Tensor, positions: torch.Tensor, state) -> torch.Tensor:
    """One forward pass through kvcert's buffers; returns the logits of the last position per sequence (B, V)."""
    out = model(input_ids=input_ids, position_ids=positions, use_cache=False, kvcert_state=state, logits_to_keep=1)
    return out.logits[:, -1, :]
