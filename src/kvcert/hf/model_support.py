"""Which models kvcert's attention path runs, and the one-line refusal (``ModelLoadError``) of the others.

kvcert's eviction assumes full attention in every layer, so configs with sliding-window or mixed attention layers
actually enabled are refused (architectures listed in ``SUPPORTED_HYBRID`` excepted: Gemma 3), as are configs that
are not causal language models and models whose decoder layers are not at ``model.model.layers[i].self_attn`` or
whose attention bypasses transformers' attention interface (GPT-NeoX, Falcon, GPT-2, multimodal wrappers: checked
on a meta-device copy before any weight is read). A ``sliding_window`` that can never mask (at least
``max_position_embeddings``: Phi-3 128k, Phi-3.5, Phi-4-mini) is dropped from the loaded config, which changes no
output at any length the model accepts. Every refusal names the architecture, the reason and the nearest supported
alternative (``NEAREST_SUPPORTED``; the matrix is docs/models.md). ``load_model(..., allow_sliding_window=True)``
loads full/sliding hybrids anyway for plain transformers generation (calibration, reference decoding), never for
kvcert's eviction path. Attention
kvcert cannot compute at all (linear / recurrent / state-space mixers, attention sinks, logit soft-capping,
cross-layer KV sharing) is refused always, in one line naming the layer type.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Architectures (config.model_type) whose sliding-window layers kvcert's own attention/eviction path handles (each
# layer's window applied in the record pass, the compressed decode and the oracle; sliding layers kept exactly):
# tested against transformers' own decoding (tests/test_hf_hybrid.py, tests/test_gemma.py). Others with sliding
# windows load only with allow_sliding_window=True, for plain transformers generation.
SUPPORTED_HYBRID: frozenset[str] = frozenset({"gemma3_text"})
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class ModelLoadError(RuntimeError):
    """A model cannot be loaded. The message is one line: what is missing and the exact fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# What to use instead, named in the one-line refusal of an architecture (config.model_type); docs/models.md.
NEAREST_SUPPORTED: dict[str, str] = {
    "mistral": "Mistral 7B v0.2 or later (sliding_window: null)",
    "mixtral": "a Mixtral config with sliding_window: null",
    "phi3": "Phi-3-mini-128k, Phi-3.5-mini or Phi-4-mini (their window never masks)",
    "qwen2": "the same model with use_sliding_window: false (as Qwen2 / Qwen2.5 ship)",
    "qwen3": "the same model with use_sliding_window: false (as Qwen3 ships)",
    "gemma2": "Gemma 3 (the embedded gemma3-270m, or google/gemma-3-1b-it)",
    "gemma3": "a text-only Gemma 3 (model_type gemma3_text: the embedded gemma3-270m, google/gemma-3-1b-it)",
    "gpt_neox": "a Llama-architecture model of similar size (the embedded smollm2-135m-instruct, SmolLM2-360M)",
    "falcon": "Falcon3 (Llama architecture, e.g. tiiuae/Falcon3-1B-Instruct)",
}
_ANY_SUPPORTED = "a Llama, Mistral (no window), Qwen2 / Qwen3, Phi-3 or Gemma 3 model (docs/models.md)"


def nearest_supported(model_type: str) -> str:
    """The nearest supported alternative to an architecture kvcert refuses."""
    return NEAREST_SUPPORTED.get(model_type, _ANY_SUPPORTED)


_SINK_MODEL_TYPES = frozenset({"gpt_oss"})  # learned per-head attention sinks (an extra softmax logit)
_MIXER_WORDS = ("mamba", "linearattention", "gateddeltanet", "shortconv", "recurrent", "rglru", "mixer", "ssm")


def _sliding_problem(config: PretrainedConfig) -> str | None:
    """Why a config is not full attention in every layer (sliding-window layers), or None if it is."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            window = getattr(config, "sliding_window", None)
            return f"its layers mix attention types ({', '.join(other)}{f', window {window}' if window else ''})"
    window = getattr(config, "sliding_window", None)
    enabled = getattr(config, "use_sliding_window", True)  # Mistral has no switch: a window set means enabled
    max_pos = getattr(config, "max_position_embeddings", None) or 0
    if enabled and window is not None and (not max_pos or window < max_pos):
        return f"it uses a sliding attention window of {window} tokens"
    return None


def _attention_problem(config: PretrainedConfig) -> str | None:
    """Sliding-window layers, the only non-full attention a later kvcert can support (see SUPPORTED_HYBRID)."""
    return _sliding_problem(config)


def _unsupported_attention(config: PretrainedConfig) -> str | None:
    """Attention kvcert cannot compute at all (whatever the eviction): the layer type and where, or None."""
    for attr in ("layer_types", "layers_block_type", "block_types"):
        kinds = getattr(config, attr, None)
        if not kinds or isinstance(kinds, str):
            continue
        ok = SUPPORTED_LAYER_TYPES if attr == "layer_types" else ("attention", *SUPPORTED_LAYER_TYPES)
        bad = [(i, k) for i, k in enumerate(kinds) if k not in ok]
        if bad:
            where = ", ".join(str(i) for i, _ in bad[:4]) + (", ..." if len(bad) > 4 else "")
            return f"layer type '{bad[0][1]}' ({attr}[{where}])"
    pattern = getattr(config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and set(pattern) - {"*"}:
        return f"layer type pattern '{pattern}' (hybrid_override_pattern; only '*' is attention)"
    if config.model_type in _SINK_MODEL_TYPES:
        return f"attention sinks ({config.model_type} attention has a learned 'sinks' logit per head)"
    if getattr(config, "attn_logit_softcapping", None):
        return f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping})"
    if getattr(config, "num_kv_shared_layers", 0):
        return f"cross-layer KV sharing (num_kv_shared_layers={config.num_kv_shared_layers})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention=True)"
    return None


def _module_problem(model: torch.nn.Module) -> str | None:
    """The same refusal from the built modules (a backstop for configs that do not declare their mixers)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if any(word in kind.lower() for word in _MIXER_WORDS):
            return f"layer type '{kind}' ({name})"
        if any(p == "sinks" or p.endswith("_sinks") for p, _ in module.named_parameters(recurse=False)):
            return f"attention sinks ('{name}.sinks' in {kind})"
    return None


def _layout_problem(model: torch.nn.Module) -> str | None:
    """Why kvcert's attention cannot hook into this model's decoder layers, or None. kvcert reads
    ``model.model.layers[i].self_attn`` (its layer_idx, scaling and sliding_window) and runs the layers' attention
    through transformers' attention interface."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not layers:
        return f"its decoder layers are not at model.model.layers ({type(model).__name__}), where kvcert hooks in"
    if not all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in layers):
        return f"its decoder layers have no self_attn with a layer_idx ({type(layers[0]).__name__})"
    if not getattr(model, "_supports_attention_backend", False):
        return f"its attention bypasses transformers' attention interface ({type(model).__name__})"
    return None


def _window_problem(model: torch.nn.Module) -> str | None:
    """A sliding window the attention passes to every layer from the config (Mistral, Phi-3) while its modules
    declare none: kvcert's buffers would be built without it, so decoding would stop with a window mismatch."""
    window = getattr(model.config, "sliding_window", None)
    layers = model.model.layers
    if window is None or all(hasattr(layer.self_attn, "sliding_window") for layer in layers):
        return None
    return f"config.sliding_window={window} reaches every layer's attention but no layer declares it"


def _meta_copy(config: PretrainedConfig) -> torch.nn.Module | None:
    """The model built on the meta device (no memory, no weights), or None if transformers cannot build it here."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # from_pretrained reports whatever this is, in its own one line
        return None


def _drop_inert_window(config: PretrainedConfig) -> None:
    """Remove a sliding window that can never mask (>= max_position_embeddings, e.g. Phi-3 128k's 262144): the
    attention sees every earlier token at every length the model accepts, with or without it."""
    window = getattr(config, "sliding_window", None)
    max_pos = getattr(config, "max_position_embeddings", None) or 0
    layer_types = getattr(config, "layer_types", None) or ()
    if window is not None and max_pos and window >= max_pos and "sliding_attention" not in layer_types:
        config.sliding_window = None


def _unsupported_message(label: str, problem: str, model_type: str = "") -> str:
    return (
        f"model '{label}'{f' ({model_type})' if model_type else ''} is not supported: {problem}; kvcert computes"
        f" softmax attention only, in {' / '.join(SUPPORTED_LAYER_TYPES)} layers; nearest supported:"
        f" {nearest_supported(model_type)}"
    )


def _check_config(label: str, config: PretrainedConfig, *, allow_sliding_window: bool = False) -> None:
    if getattr(config, "is_encoder_decoder", False) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"model '{label}' ({config.model_type}) is not a causal language model; kvcert needs one, e.g."
            f" {_ANY_SUPPORTED}"
        )
    unsupported = _unsupported_attention(config)
    if unsupported:
        raise ModelLoadError(_unsupported_message(label, unsupported, config.model_type))
    problem = _attention_problem(config)
    if problem and not allow_sliding_window and config.model_type not in SUPPORTED_HYBRID:
        hint = (
            f" (hybrid support for {config.model_type} is planned; load_model(..., allow_sliding_window=True) loads it"
            " for plain transformers generation only)"
            if config.model_type in _PLANNED_HYBRID
            else ""
        )
        raise ModelLoadError(
            f"model '{label}' ({config.model_type}) is not supported: {problem}; kvcert's eviction assumes full"
            f" attention in every layer{hint}; nearest supported: {nearest_supported(config.model_type)}"
        )


_PLANNED_HYBRID = frozenset({"gemma3_text"})


def _check_layout(label: str, model: torch.nn.Module) -> None:
    problem = _layout_problem(model)
    if problem:
        model_type = model.config.model_type
        raise ModelLoadError(
            f"model '{label}' ({model_type}) is not supported: {problem}; nearest supported:"
            f" {nearest_supported(model_type)}"
        )


def _check_modules(label: str, model: torch.nn.Module, *, allow_sliding_window: bool = False) -> None:
    problem = _module_problem(model)
    if problem:
        raise ModelLoadError(_unsupported_message(label, problem, model.config.model_type))
    _check_layout(label, model)
    window = None if allow_sliding_window else _window_problem(model)
    if window:
        raise ModelLoadError(
            f"model '{label}' ({model.config.model_type}) is not supported as built: {window}; load it with"
            " kvcert.hf.load_model (which drops a window that never masks) or set model.config.sliding_window=None"
            " if the window is at least the longest prompt plus answer"
        )


def check_supported(model: PreTrainedModel, label: str | None = None) -> None:
    """Raise the one-line ModelLoadError if kvcert's eviction path cannot run this model (for the runner)."""
    label = label or getattr(model.config, "name_or_path", "") or model.config.model_type
    _check_config(label, model.config)
    _check_modules(label, model)
