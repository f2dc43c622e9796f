"""Head-wise budgets (AdaKV) and compression during decoding through the HF engine: ragged per-head counts in the
buffers, the memory held, the cache size across re-compressions, and the kept set against an independent top-k."""

import math

import numpy as np
import pytest
import torch

from kvcert.core.selection import keep_count
from kvcert.hf import DecodeOptions, Prompt
from kvcert.hf.prefill import Prefill
from kvcert.policy import Policy

N, QS = 160, 130


@pytest.fixture(scope="module", params=["llama", "qwen2.5"])
def tiny_model(request, smol_tokenizer):
    """conftest's tiny_smol (a tiny Llama over SmolLM2's vocabulary), and the tiny Qwen2.5 (7 query heads per KV
    head, q/k/v biases) over the same vocabulary."""
    from kvcert.testing import tiny_random_model

    model, _ = tiny_random_model(request.param, vocab_size=len(smol_tokenizer), max_position_embeddings=4096)
    return model, smol_tokenizer


def _prompt(seed: int = 5) -> Prompt:
    ids = torch.randint(100, 5000, (N,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="x")


def test_policy_fields_validate_and_label():
    with pytest.raises(ValueError, match="allocation must be one of"):
        Policy(scorer="key_norm", design="topk", budget=0.5, allocation="pyramid")
    with pytest.raises(ValueError, match="recompress_every must be None or an integer >= 1"):
        Policy(scorer="key_norm", design="topk", budget=0.5, recompress_every=0)
    with pytest.raises(ValueError, match="streaming reads positions"):
        Policy(scorer="streaming", design="topk", budget=0.5, recompress_every=4)
    p = Policy(scorer="key_norm", design="topk", budget=0.5, allocation="adakv", recompress_every=4)
    assert p.label == "key_norm/topk/b0.5/adakv/re4"
    assert Policy(scorer="key_norm", design="topk", budget=0.5).label == "key_norm/topk/b0.5"


@torch.no_grad()
def test_adakv_heads_keep_different_counts_padded_with_minus_inf(tiny_model):
    model, tok = tiny_model
    policy = Policy(scorer="window_question", design="topk", budget=0.3, allocation="adakv")
    batch = Prefill.record(model, _prompt()).compress([policy], DecodeOptions(max_new_tokens=4, backend="torch"))
    counts = torch.stack([torch.isfinite(buf.offset[0, :, : buf.prefix]).sum(-1) for buf in batch.state.layers])
    target = keep_count(0.3, N)
    assert (counts.sum(-1) == counts.shape[1] * target).all()  # the layer's budget, shared
    assert (counts != target).any()  # ...unevenly across heads
    width = batch.state.layers[0].prefix
    assert width == int(counts.max())  # padded to the widest head of any layer, no wider
    assert batch.comps[0].kept_tokens == pytest.approx(target)


@torch.no_grad()
def test_generate_with_adakv_reports_the_memory_held_and_finite_certificates():
    from kvcert import generate
    from kvcert.hf import load_model

    model, tok = load_model("smollm2-135m-instruct")
    context = " ".join(f"The code of box {i} is {(i * 7919) % 1000}." for i in range(40))
    policy = Policy(scorer="window_question", design="randomized", budget=0.3, tail_fraction=0.75, allocation="adakv")
    out = generate(model, tok, context=context, question="What is the code of box 17?", policy=policy,
                   max_new_tokens=8, calibration=None, probe=False)  # fmt: skip
    cfg = model.config
    n_kv, d, n_layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, cfg.num_hidden_layers
    # independent: the cache is the widest head's kept tokens plus max_new_tokens + 1 reserved slots, every layer
    from kvcert.hf.serving_prefill import compress_while_reading
    from kvcert.serve.generate import build_prompt

    ids, qs, _ = build_prompt(tok, context=context, question="What is the code of box 17?", messages=None,
                              prompt_format="chat")  # fmt: skip
    prompt = Prompt(input_ids=ids, question_start=qs, example_id="kvcert-generate-0")
    batch = compress_while_reading(model, prompt, [policy], DecodeOptions(max_new_tokens=8, oracle=False))
    widest = max(int(torch.isfinite(buf.offset[0]).sum(-1).max()) for buf in batch.state.layers)
    assert out.kv_bytes == 2 * n_layers * n_kv * d * 4 * (widest + 8 + 1)
    assert out.kv_bytes < out.full_kv_bytes
    assert all(math.isfinite(c) for c in out.certificate[1:]) and len(out.certificate) > 1


def _sizes(model, tok, policy, steps, oracle=True):
    """Per decode step (after its forward), the filled entries of every (layer, head) of the one row."""
    batch = Prefill.record(model, _prompt()).compress([policy], DecodeOptions(max_new_tokens=steps, backend="torch"))
    sizes, snapshots = [], {}

    def on_step(step):
        sizes.append(torch.stack([torch.isfinite(b.offset[0, :, : b.length]).sum(-1) for b in batch.state.layers]))
        snapshots[step] = [(b.keys[0, :, :, : b.prefix].clone(), b.oracle_keys[0].clone()) for b in batch.state.layers]

    opts = DecodeOptions(max_new_tokens=steps, backend="torch", stop_strings=())
    result = batch.decode(opts, None, on_step=on_step)[0]
    return sizes, snapshots, batch, result


@torch.no_grad()
def test_recompression_holds_the_budget_and_keeps_the_global_top_k(tiny_model):
    """key_norm x topk, re-compressed every 8 steps of 40: after step s the cache holds the budget plus the
    s % 8 + 1 tokens appended since the last re-compression; and since a token's key-norm score never changes, the
    iterated top-k is the top-k of every token ever seen, which the oracle's full keys give independently."""
    model, tok = tiny_model
    every, steps, target = 8, 40, keep_count(0.3, N)
    policy = Policy(scorer="key_norm", design="topk", budget=0.3, recompress_every=every)
    sizes, snaps, batch, result = _sizes(model, tok, policy, steps)
    assert len(sizes) == steps
    for s, size in enumerate(sizes):
        assert (size == target + s % every + 1).all(), (s, size.unique())
    prefix_kt = batch.state.buckets[0].groups[0].oracle[0]  # (L, Hkv, d, N): the full prompt's keys
    for layer, (kept_t, own) in enumerate(snaps[32]):  # the last re-compression, before step 32's forward
        seen = torch.cat([prefix_kt[layer].transpose(-1, -2), own[:, :32]], dim=1)  # (Hkv, N + 32, d)
        expected = seen.float().norm(dim=-1).sort(-1).values[:, :target]  # top by 1 / ||k||: the smallest norms
        got = kept_t.float().norm(dim=-2).sort(-1).values
        assert torch.allclose(got, expected, atol=1e-6), layer
    assert result.stats["error"].shape[0] == result.n_answer and np.isfinite(result.stats["error"]).all()


@torch.no_grad()
def test_randomized_recompression_composes_pi_and_keeps_finite_certificates(tiny_model):
    model, tok = tiny_model
    policy = Policy(scorer="window_question", design="randomized", budget=0.3, tail_fraction=0.75, recompress_every=6,
                    allocation="adakv")  # fmt: skip
    sizes, _, batch, result = _sizes(model, tok, policy, 20)
    target = keep_count(0.3, N)
    layers = len(sizes[0])
    for s in (6, 12, 18):  # right after a re-compression: about the budget per head (Poisson tail), layer sums
        total = sizes[s].sum(-1).double().mean() - 1 * sizes[s].shape[1]
        assert abs(float(total) - target * sizes[s].shape[1]) < 0.25 * target * sizes[s].shape[1]
    buf = batch.state.layers[0]
    offset, omp = buf.offset[0, :, : buf.tail_slots], buf.one_minus_pi[0]
    tail = omp > 0
    # the offset is -log of the product pi, and 1 - pi is its complement
    assert torch.allclose(omp[tail], -torch.expm1(-offset[tail]), atol=1e-6)
    assert np.isfinite(result.stats["variance"]).all() and (result.stats["variance"] >= 0).all()
    assert layers == model.config.num_hidden_layers


@torch.no_grad()
def test_recompression_later_than_the_answer_changes_nothing(tiny_model):
    model, tok = tiny_model
    base = dict(scorer="window_question", design="randomized", budget=0.3, seed=2)
    opts = DecodeOptions(max_new_tokens=10, backend="torch")
    from kvcert.hf import generate_variants

    a, b = generate_variants(model, tok, _prompt(), [Policy(**base), Policy(**base, recompress_every=50)], opts)
    # two rows of one batch: the same kept sets and tokens; their statistics agree to float rounding only (a row's
    # place in the batch may change the kernels' summation order on some CPUs: seen with ATen's scalar kernels)
    assert a.tokens == b.tokens and a.kept_tokens == b.kept_tokens
    np.testing.assert_allclose(a.stats["variance"], b.stats["variance"], rtol=1e-5, atol=1e-9)
