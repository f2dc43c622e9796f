"""Tiny random-init models for fast tests (no downloads): Llama / Qwen2 / Mistral and a Gemma-3-style hybrid.

``tiny_random_model`` moved here from ``kvcert.hf.loading`` (which still re-exports it).
"""

from __future__ import annotations

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel

_TINY_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)

# Gemma 3 270M in miniature: the same layer pattern (5 sliding : 1 full, here 2 sliding : 1 full over 6 layers), one
# KV head, q/k RMSNorms, query_pre_attn_scalar != head_dim (so the scaling is not 1/sqrt(head_dim)), distinct
# rope bases per layer type, tied embeddings scaled by sqrt(hidden), a window smaller than a test prompt.
_TINY_GEMMA3 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=16,
    sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    max_position_embeddings=1024,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    tie_word_embeddings=True,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def _build(config, seed: int, attn: str) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model


def tiny_random_model(arch: str = "llama", seed: int = 0, **overrides) -> tuple[PreTrainedModel, None]:
    """A small random-init causal LM (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128, float32)
    for fast unit tests. ``arch`` is llama, qwen2 or mistral (``gemma3``: see :func:`tiny_gemma3_model`);
    ``overrides`` go into the config (plus ``attn_implementation``). The global torch RNG is left untouched. No
    tokenizer: returns (model, None)."""
    from kvcert.hf.loading import ModelLoadError, _check_config

    if arch == "gemma3":
        return tiny_gemma3_model(seed, **overrides)
    attn = overrides.pop("attn_implementation", "sdpa")
    params = {**_TINY_BASE, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**params)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{"use_sliding_window": False, **params})
    elif arch == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **params})
    else:
        raise ModelLoadError(f"tiny_random_model: unknown arch '{arch}' (use llama, qwen2, mistral or gemma3)")
    _check_config(f"tiny-{arch}", config)
    return _build(config, seed, attn), None


def tiny_gemma3_config(**overrides) -> transformers.Gemma3TextConfig:
    """The config of :func:`tiny_gemma3_model` (hybrid sliding/full layers, window 8, 1 KV head, head_dim 32,
    query_pre_attn_scalar 16, q/k norms)."""
    return transformers.Gemma3TextConfig(**{**_TINY_GEMMA3, **overrides})


def tiny_gemma3_model(seed: int = 0, **overrides) -> tuple[PreTrainedModel, None]:
    """A tiny random-init Gemma-3-style causal LM (``Gemma3ForCausalLM``), float32, global RNG untouched.

    Its RMSNorm weights are randomized too (Gemma initialises them to zero, i.e. scale 1, which would hide a missing
    q/k norm), so a reimplementation that skips the q/k norms or uses the wrong scaling disagrees visibly. It has
    sliding-window layers, so kvcert's eviction path refuses it until SUPPORTED_HYBRID lists gemma3_text; plain
    transformers generation (the reference) runs it."""
    from kvcert.hf.loading import _check_config

    attn = overrides.pop("attn_implementation", "sdpa")
    config = tiny_gemma3_config(**overrides)
    _check_config("tiny-gemma3", config, allow_sliding_window=True)
    model = _build(config, seed, attn)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)
    return model, None
