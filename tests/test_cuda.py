"""The decode engine on a CUDA device (skipped without one; `make gpu-check` runs these)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hf_greedy
from kvcert.bench.common import no_eos
from kvcert.hf import DecodeOptions, Prompt, generate_variants
from kvcert.policy import FULL, Policy
from kvcert.testing import tiny_random_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
STEPS = 6


def _prompt(n: int = 300, qs: int = 280) -> Prompt:
    ids = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return Prompt(input_ids=ids, question_start=qs, example_id="cuda")


def test_keep_all_on_cuda_reproduces_transformers_greedy():
    model, _ = tiny_random_model("llama")
    model = model.to("cuda")
    prompt = _prompt()
    ref_tokens, _ = hf_greedy(model, prompt.input_ids, STEPS)
    with no_eos(model):
        (res,) = generate_variants(model, None, prompt, [FULL], DecodeOptions(max_new_tokens=STEPS))
    assert res.tokens == ref_tokens


def test_cuda_statistics_equal_the_cpu_ones_to_float_rounding():
    """Same draws (the designs use a CPU generator on every device), same tokens, statistics to float32 rounding."""
    policies = [FULL] + [
        Policy(scorer="window_question", design=d, budget=0.25, seed=1) for d in ("topk", "randomized")
    ]
    runs = {}
    for device in ("cpu", "cuda"):
        model, _ = tiny_random_model("llama")
        model = model.to(device)
        with no_eos(model):
            opts = DecodeOptions(max_new_tokens=STEPS, backend="torch")
            runs[device] = generate_variants(model, None, _prompt(), policies, opts)
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert a.tokens == b.tokens, a.policy.label
        for name, arr in a.stats.items():
            assert np.allclose(arr, b.stats[name], rtol=1e-3, atol=1e-5, equal_nan=True), (a.policy.label, name)


def test_bf16_on_cuda_runs_with_float32_statistics():
    model, _ = tiny_random_model("llama")
    model = model.to("cuda", torch.bfloat16)
    policy = Policy(scorer="window_question", design="randomized", budget=0.25, seed=1)
    with no_eos(model):
        (res,) = generate_variants(model, None, _prompt(), [policy], DecodeOptions(max_new_tokens=STEPS))
    assert res.stats["variance"].dtype == np.float32 and np.isfinite(res.stats["variance"]).all()


def test_serving_on_cuda_keeps_and_decodes_what_cpu_serving_does():
    """Serving mode (oracle off, each layer compressed inside the prefill forward) on the device: the same tokens
    and certificate as on the CPU, and the caches on the device in the model's dtype."""
    from kvcert.hf import compress_while_reading

    policies = [FULL] + [Policy(scorer="key_norm", design=d, budget=0.5, seed=2) for d in ("topk", "randomized")]
    opts = DecodeOptions(max_new_tokens=STEPS, oracle=False, backend="torch")
    runs = {}
    for device in ("cpu", "cuda"):
        model, _ = tiny_random_model("llama")
        model = model.to(device)
        with no_eos(model):
            batch = compress_while_reading(model, _prompt(), policies, opts)
            assert all(buf.keys.device.type == device for b in batch.state.buckets for buf in b.layers)
            runs[device] = batch.decode(opts)
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert a.tokens == b.tokens, a.policy.label
        assert np.allclose(a.stats["variance"], b.stats["variance"], rtol=1e-3, atol=1e-5, equal_nan=True)


def test_the_decode_waits_for_the_device_once_per_new_token():
    """CUDA's sync debug mode counts every call that makes the host wait: one per new token (the end-of-answer
    checks) and one for the statistics at the end, none inside the layer loop."""
    from kvcert.bench.gpu_check import count_syncs
    from kvcert.hf import Prefill

    model, _ = tiny_random_model("llama")
    model = model.to("cuda")
    policies = [FULL] + [
        Policy(scorer="streaming", design=d, budget=b, seed=1, compress_after="context")
        for d, b in (("topk", 0.1), ("randomized", 0.2), ("randomized", 0.4))
    ]
    opts = DecodeOptions(max_new_tokens=STEPS)
    with no_eos(model):
        batch = Prefill.record(model, _prompt()).compress(policies, opts)
        torch.cuda.synchronize()
        res, sites = count_syncs(lambda: batch.decode(opts))
    assert len(res[0].tokens) == STEPS
    assert len(sites) <= STEPS + 1, sites
