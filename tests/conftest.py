"""Shared fixtures: the packaged tokenizer (read straight from the GGUF, ~3 s, no model conversion) and a tiny
random-init Llama with the same vocabulary, so runner tests exercise real prompts in seconds."""

from pathlib import Path

import pytest
import torch

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="session")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from kvcert.hf.loading import resolve_embedded_gguf

    gguf = resolve_embedded_gguf("smollm2-135m-instruct")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session")
def tiny_smol(smol_tokenizer):
    from kvcert.hf import tiny_random_model

    model, _ = tiny_random_model("llama", vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    return model, smol_tokenizer


@torch.no_grad()
def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Reference decoding: plain transformers with its own DynamicCache and SDPA (tokens, their log-probs)."""
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([ids]), cache=cache, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = out.logits[0, -1].float().log_softmax(-1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
    return tokens, logprobs


def compose(overrides: list[str] | None = None):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import kvcert.run  # noqa: F401  registers the structured-config schema

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=overrides or [])
