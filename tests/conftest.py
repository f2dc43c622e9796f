"""Shared fixtures: the packaged tokenizer (read straight from the GGUF, ~3 s, no model conversion) and a tiny
random-init Llama with the same vocabulary, so runner tests exercise real prompts in seconds."""

import os
import shutil
from pathlib import Path

import pytest
import torch

CONF = Path(__file__).resolve().parents[1] / "conf"


# ------------------------------------------------------------------------------ optional toolchains, thread count
def fused_kernel_toolchain() -> str | None:
    """Why the compiled decode kernel (kvcert.hf.kernel, built by torch's cpp_extension) cannot be built here, or None:
    it needs the C++ compiler torch calls ($CXX, default c++) and ninja on the PATH."""
    missing = [tool for tool in (os.environ.get("CXX", "c++"), "ninja") if shutil.which(tool) is None]
    return f"the fused decode kernel needs a C++ compiler and ninja; missing: {', '.join(missing)}" if missing else None


needs_cxx = pytest.mark.skipif(fused_kernel_toolchain() is not None, reason=str(fused_kernel_toolchain()))


@pytest.fixture
def torch_threads():
    """torch_threads(n) sets torch's intra-op thread count for the rest of the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Code under test may set the thread count (run_cell pins cfg.threads, the benchmark tries several): no test
    leaves its count to the next one."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


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
    out = model(torch.tensor([ids], device=model.device), cache=cache, use_cache=True)
    tokens, logprobs = [], []
    for _ in range(steps):
        lp = out.logits[0, -1].float().log_softmax(-1)
        t = int(lp.argmax())
        tokens.append(t)
        logprobs.append(float(lp[t]))
        out = model(torch.tensor([[t]], device=model.device), cache=cache, use_cache=True)
    return tokens, logprobs


def compose(overrides: list[str] | None = None):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import kvcert.run  # noqa: F401  registers the structured-config schema

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides=overrides or [])
