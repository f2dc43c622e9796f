"""The support matrix (docs/models.md): a model folder of each architecture either decodes keep-all (every budget-1.0
design and the full cache) token for token as transformers' own greedy decoding does, or load_model refuses it in
one line naming the architecture, the reason and the nearest supported alternative, before any weight is read.
Nothing in between: no AttributeError or RuntimeError from inside decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from conftest import hf_greedy
from kvcert.hf import DecodeOptions, Prompt, generate_variants, load_model
from kvcert.hf.model_support import ModelLoadError, check_supported
from kvcert.policy import FULL, Policy
from kvcert.testing import save_tiny_model, tiny_config

N, QS, STEPS = 96, 70, 6

RUNS = {
    "llama": ("llama", {}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),  # Mistral 7B v0.2+, Ministral-style configs
    # a window that never masks (>= max_position_embeddings, as Phi-3 128k's 262144 of 131072): dropped at load
    "mistral-window-never-masks": ("mistral", {"sliding_window": 1024}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "phi3-no-window": ("phi3", {}),
    "phi3-128k-style": ("phi3", {"sliding_window": 2048}),
    "gemma3": (  # hybrid: sliding layers (window 24 < the prompt) and full layers
        "gemma3",
        {"num_hidden_layers": 4, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
}


def _gemma3_multimodal() -> transformers.PretrainedConfig:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    return transformers.Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision)


REFUSED = {  # name: (config, what the line must say: the reason, the alternative)
    "mistral-v0.1-window": (
        lambda: tiny_config("mistral", sliding_window=4096, max_position_embeddings=32768),
        ("sliding attention window of 4096 tokens", "Mistral 7B v0.2"),
    ),
    "phi3-4k-window": (  # Phi-3-mini-4k: a window of 2047 in 4096 positions
        lambda: tiny_config("phi3", sliding_window=511),
        ("sliding attention window of 511 tokens", "Phi-3-mini-128k"),
    ),
    "gemma2": (lambda: tiny_config("gemma2"), ("soft-capping", "Gemma 3")),
    "gemma2-no-softcap": (
        lambda: tiny_config("gemma2", attn_logit_softcapping=None),
        ("mix attention types", "Gemma 3"),
    ),
    "gemma3-multimodal": (_gemma3_multimodal, ("not at model.model.layers", "text-only Gemma 3")),
    "gpt_neox": (lambda: tiny_config("gpt_neox"), ("not at model.model.layers", "Llama-architecture")),
    "falcon": (lambda: tiny_config("falcon"), ("not at model.model.layers", "Falcon3")),
}


def _prompt() -> Prompt:
    ids = torch.randint(3, 128, (N,), generator=torch.Generator().manual_seed(0)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="m")


@pytest.mark.parametrize("name", list(RUNS))
def test_supported_architectures_decode_keep_all_as_transformers_does(tmp_path: Path, name: str) -> None:
    arch, overrides = RUNS[name]
    folder = save_tiny_model(tmp_path, tiny_config(arch, **overrides))
    model, _ = load_model(str(folder))
    check_supported(model, name)
    # the reference: transformers' own greedy decoding of the folder as saved (its config untouched)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = _prompt()
    ref_tokens, ref_lp = hf_greedy(reference, prompt.input_ids, STEPS)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=1.0) for s in ("window_question", "streaming") for d in ("topk", "randomized")
    ]
    results = generate_variants(model, None, prompt, policies, DecodeOptions(max_new_tokens=STEPS))
    for r in results:
        assert r.tokens == ref_tokens, (name, r.policy.label)
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref_lp)) < 1e-5, (name, r.policy.label)


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_architectures_are_refused_at_load_in_one_line(tmp_path: Path, name: str) -> None:
    build, needles = REFUSED[name]
    config = build()
    config.save_pretrained(tmp_path)  # no weights, no tokenizer: the refusal comes before either is read
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert "\n" not in msg and f"({config.model_type}) is not supported" in msg, msg
    assert "; nearest supported: " in msg, msg
    for needle in needles:
        assert needle in msg, msg


def test_a_window_that_never_masks_is_refused_when_the_model_is_built_by_hand() -> None:
    """check_supported on a model built without load_model names the window and the fix instead of letting decoding
    fail on it."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("phi3", sliding_window=2048))
    with pytest.raises(ModelLoadError, match=r"config.sliding_window=2048 .* kvcert.hf.load_model"):
        check_supported(model, "phi3-by-hand")
    model.config.sliding_window = None
    check_supported(model, "phi3-by-hand")
