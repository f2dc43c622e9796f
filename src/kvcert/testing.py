"""Tiny random-init models for fast tests (no downloads): Llama / Qwen2 / Mistral, a Qwen2.5-style model (7 query heads
per KV head, q/k/v biases) and a Gemma-3-style hybrid, plus
tiny configs of every architecture of the support matrix (docs/models.md) and a word-level tokenizer, so a test can
write a model folder and load it the way a user does (``save_tiny_model``).

``kvcert.hf`` re-exports ``tiny_random_model``; this module imports ``kvcert.hf.model_support`` only inside functions.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

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

# Qwen2.5-Coder-0.5B in miniature: 14 query / 2 KV heads (7 per KV head, the kernel's query group near its limit of 8),
# head_dim 16, q/k/v biases (randomized below: transformers initialises them to zero, which would hide a path that
# drops them), rope theta 1e6, tied embeddings, no sliding window.
_TINY_QWEN25 = dict(
    vocab_size=128,
    hidden_size=224,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True,
    use_sliding_window=False,
)


def _build(config, seed: int, attn: str) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model


def tiny_random_model(arch: str = "llama", seed: int = 0, **overrides) -> tuple[PreTrainedModel, None]:
    """A small random-init causal LM (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128, float32)
    for fast unit tests. ``arch`` is llama, qwen2 or mistral (``gemma3``: see :func:`tiny_gemma3_model`; ``qwen2.5``:
    see :func:`tiny_qwen25_model`); ``overrides`` go into the config (plus ``attn_implementation``). The global torch
    RNG is left untouched. No tokenizer: returns (model, None)."""
    from kvcert.hf.model_support import ModelLoadError, _check_config

    if arch == "gemma3":
        return tiny_gemma3_model(seed, **overrides)
    if arch == "qwen2.5":
        return tiny_qwen25_model(seed, **overrides)
    attn = overrides.pop("attn_implementation", "sdpa")
    params = {**_TINY_BASE, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**params)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{"use_sliding_window": False, **params})
    elif arch == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **params})
    else:
        raise ModelLoadError(f"tiny_random_model: unknown arch '{arch}' (use llama, qwen2, qwen2.5, mistral or gemma3)")
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
    from kvcert.hf.model_support import _check_config

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


def tiny_qwen25_config(**overrides) -> transformers.Qwen2Config:
    """The config of :func:`tiny_qwen25_model` (qwen2: 14 query / 2 KV heads, head_dim 16, hidden 224, rope theta
    1e6, tied embeddings)."""
    return transformers.Qwen2Config(**{**_TINY_QWEN25, **overrides})


def tiny_qwen25_model(seed: int = 0, **overrides) -> tuple[PreTrainedModel, None]:
    """A tiny random-init Qwen2.5-style causal LM (``Qwen2ForCausalLM``, 7 query heads per KV head), float32, global
    RNG untouched. Its q/k/v biases are randomized (scale comparable to the projections' outputs), so a path that
    recomputes a projection without its bias, or mixes up the grouping of 7 query heads per KV head, disagrees with
    transformers visibly."""
    from kvcert.hf.model_support import _check_config

    attn = overrides.pop("attn_implementation", "sdpa")
    config = tiny_qwen25_config(**overrides)
    _check_config("tiny-qwen2.5", config)
    model = _build(config, seed, attn)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.uniform_(-0.5, 0.5)
    return model, None


# Vocabulary 128 with pad 0, eos 1, bos 2 (configs whose defaults point outside it are moved inside).
_SPECIAL = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
_NO_HEAD_DIM = {k: v for k, v in _TINY_BASE.items() if k != "head_dim"}  # head_dim = hidden / heads = 16 anyway
MATRIX_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_neox", "falcon")


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    """The config of a tiny model of an architecture in MATRIX_ARCHS (2 layers, hidden 64, vocabulary 128; gemma3:
    :func:`tiny_gemma3_config`), with ``overrides``. No support check: the loader decides (tests/test_model_matrix)."""
    if arch == "gemma3":
        return tiny_gemma3_config(**overrides)
    neox = {k: _NO_HEAD_DIM[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    known = {
        "llama": (transformers.LlamaConfig, _TINY_BASE),
        "mistral": (transformers.MistralConfig, {"sliding_window": None, **_TINY_BASE}),
        "qwen2": (transformers.Qwen2Config, {"use_sliding_window": False, **_TINY_BASE}),
        "qwen3": (transformers.Qwen3Config, {"use_sliding_window": False, **_TINY_BASE}),
        "phi3": (transformers.Phi3Config, {**_NO_HEAD_DIM, **_SPECIAL}),
        "gemma2": (transformers.Gemma2Config, {**_TINY_BASE, **_SPECIAL}),
        "gpt_neox": (transformers.GPTNeoXConfig, {**neox, "num_attention_heads": 4, "max_position_embeddings": 1024}),
        "falcon": (
            transformers.FalconConfig,
            {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, **_SPECIAL},
        ),
    }
    if arch not in known:
        raise ValueError(f"tiny_config: unknown arch '{arch}' (use one of {', '.join(MATRIX_ARCHS)})")
    cls, params = known[arch]
    return cls(**{**params, **overrides})


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 128 ids ("w0".."w124"; [PAD] 0, </s> 1, <s> 2)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i + 3 for i in range(125)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[PAD]"))
    backend.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[PAD]", pad_token="[PAD]", eos_token="</s>", bos_token="<s>"
    )


def save_tiny_model(folder: str | Path, config: PretrainedConfig, seed: int = 0) -> Path:
    """Write a random-init model of ``config`` and :func:`tiny_tokenizer` to ``folder`` (a model folder as a user
    has one, for ``load_model``); the global torch RNG is left untouched."""
    folder = Path(folder)
    _build(config, seed, "sdpa").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
