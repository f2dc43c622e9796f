"""Eviction inside transformers models: keep-all is exact, positions are kept, batching is invisible, the layer
output is the Hajek formula over the oracle cache."""

import pytest
import torch
from transformers import DynamicCache

from conftest import hf_greedy
from kvcert.core import gather_tokens
from kvcert.hf import DecodeOptions, Prefill, Prompt, generate_variants, tiny_random_model
from kvcert.hf.compressed_state import Bucket
from kvcert.policy import FULL, Policy

DESIGNS = ["topk", "randomized", "randomized_no_offset", "uniform"]
SCORERS = ["window_question", "window_context", "streaming", "key_norm", "random"]
N, QS, STEPS = 160, 130, 6


def _prompt(seed=0):
    ids = torch.randint(0, 128, (N,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Prompt(input_ids=ids, question_start=QS, example_id="e")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2.5"])
def test_keep_all_through_every_design_reproduces_full_cache_decoding(arch):
    model, _ = tiny_random_model(arch)
    ids = _prompt()
    ref_tokens, ref_lp = hf_greedy(model, ids.input_ids, STEPS)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=1.0)
        for s in ["window_question", "window_context", "streaming"]
        for d in DESIGNS
    ]
    results = generate_variants(model, None, ids, policies, DecodeOptions(max_new_tokens=STEPS))
    for r in results:
        assert r.tokens == ref_tokens, r.policy.label
        assert max(abs(a - b) for a, b in zip(r.logprobs, ref_lp)) < 1e-5, r.policy.label
        assert r.stats["error"].max() < 1e-5  # the oracle agrees with a keep-all cache
        if r.policy.has_certificate:
            assert r.stats["variance"].max() == 0.0  # every pi is 1


def _kept_cache(model, ids, policy):
    """HF DynamicCache holding exactly the kept keys/values of a top-k policy (equal counts per head)."""
    prefill = Prefill.record(model, ids)
    comp = prefill._compress_one(policy, pool_kernel=5)
    cache = DynamicCache(config=model.config)
    for layer, idx in enumerate(comp.indices):
        cache.update(
            gather_tokens(prefill.full_keys[layer][0], idx)[None],
            gather_tokens(prefill.full_values[layer][0], idx)[None],
            layer,
        )
    return cache


def test_compressed_cache_keeps_original_positions():
    model, _ = tiny_random_model("llama")
    ids = _prompt(1)
    policy = Policy(scorer="window_question", design="topk", budget=0.4)
    ours = generate_variants(model, None, ids, [policy], DecodeOptions(max_new_tokens=3))[0]
    first = ours.tokens[0]

    @torch.no_grad()
    def step_logprob(position):
        cache = _kept_cache(model, ids, policy)
        model.set_attn_implementation("sdpa")
        out = model(torch.tensor([[first]]), cache=cache, use_cache=True, position_ids=torch.tensor([[position]]))
        lp = out.logits[0, -1].float().log_softmax(-1)
        return int(lp.argmax()), float(lp.max())

    kept = round(0.4 * N)
    tok_true, lp_true = step_logprob(N)  # the uncompressed position of the first generated token
    tok_shift, lp_shift = step_logprob(kept)  # what a runner that follows the compressed length would use
    assert ours.tokens[1] == tok_true and abs(ours.logprobs[1] - lp_true) < 1e-5
    assert abs(lp_shift - lp_true) > 1e-4  # the test can tell the two apart


def test_batched_variants_equal_each_variant_alone():
    model, _ = tiny_random_model("qwen2")
    ids = _prompt(2)
    policies = [FULL] + [
        Policy(scorer=s, design=d, budget=b, seed=3)
        for s in SCORERS
        for d in ["topk", "randomized"]
        for b in (0.3, 0.6)
    ]
    together = generate_variants(model, None, ids, policies, DecodeOptions(max_new_tokens=5))
    for p, r in zip(policies, together):
        alone = generate_variants(model, None, ids, [p], DecodeOptions(max_new_tokens=5))[0]
        assert alone.tokens == r.tokens, p.label
        assert max(abs(a - b) for a, b in zip(alone.logprobs, r.logprobs)) < 1e-5
        assert alone.kept_tokens == r.kept_tokens
        for name, arr in r.stats.items():
            assert torch.allclose(
                torch.from_numpy(arr), torch.from_numpy(alone.stats[name]), atol=1e-5, equal_nan=True
            ), (p.label, name)


def test_layer0_output_is_the_hajek_formula_over_the_oracle_cache(monkeypatch):
    model, _ = tiny_random_model("llama")
    ids = _prompt(3)
    seen = {}
    original = Bucket.attend

    def spy(self, layer, query, key, value, scale, **kwargs):
        out = original(self, layer, query, key, value, scale, **kwargs)
        if layer == 0 and query.shape[-2] == 1 and "q" not in seen:
            buf = self.layers[0]
            seen.update(
                q=query.clone(),
                out=out.clone(),
                keys=buf.key_slots(buf.length).clone(),
                values=buf.values[:, :, : buf.length].clone(),
                offset=buf.offset[:, :, : buf.length].clone(),
                oracle_k=self.groups[0].oracle[0][0].transpose(-1, -2)[None].clone(),
            )
        return out

    monkeypatch.setattr(Bucket, "attend", spy)
    policy = Policy(scorer="window_question", design="randomized", budget=0.4, seed=1)
    generate_variants(model, None, ids, [policy], DecodeOptions(max_new_tokens=2, backend="torch"))
    # direct float64 Hajek ratio: sum (w/pi) v / sum (w/pi) over the kept tokens, the kept (k, v) being rows of
    # the oracle (full-prefill) cache, pi = exp(-offset)
    q = seen["q"][0].double()  # (Hq, 1, d)
    group = q.shape[0] // seen["keys"].shape[1]
    for h in range(q.shape[0]):
        kv = h // group
        k, v, off = seen["keys"][0, kv].double(), seen["values"][0, kv].double(), seen["offset"][0, kv].double()
        ok = torch.isfinite(off)
        w = (k[ok] @ q[h, 0] * model.model.layers[0].self_attn.scaling).exp() * (off[ok]).exp()  # w / pi
        expected = (w[:, None] * v[ok]).sum(0) / w.sum()
        assert torch.allclose(seen["out"][0, h, 0].double(), expected, atol=1e-6)
        # every kept prompt key is a row of the oracle cache
        prompt_rows = k[ok][:-1]  # the last entry is the token appended at this step
        full = seen["oracle_k"][0, kv].double()
        dist = torch.cdist(prompt_rows, full).min(-1).values
        assert dist.max() < 1e-6
